"""Checkpoints that fairseq opens without the plugin far enough to name their architecture.

fairseq keeps the options of an architecture registered the legacy way (``transformer_rope*``, and
fairseq's own ``transformer*``) as an ``argparse.Namespace`` in the checkpoint's ``cfg.model``.
torch >= 2.6 unpickles one only once it is allow-listed, which importing the plugin does
(:mod:`.checkpoint_safe_globals`): without ``--user-dir``, such a checkpoint failed inside
``torch.load`` with an UnpicklingError that suggests ``weights_only=False`` and never names the
plugin. So the checkpoints the plugin saves hold each such Namespace as a plain dict, with the
keys it replaced under :data:`NAMESPACES`; the plugin's loads make them Namespaces again, and
fairseq builds the model as from any checkpoint. Without the plugin, fairseq reads the checkpoint
and stops where it looks the architecture up. Its message there prints the model's options, first
of them, for a plugin architecture, :data:`NEEDS_THE_PLUGIN` (fairseq 0.12 formats that message
twice, so it ends in a KeyError that quotes it).
"""

import argparse

#: the checkpoint entry that lists the keys of ``cfg`` saved as dicts instead of Namespaces
NAMESPACES = "cfg_namespaces_saved_as_dicts"
#: the first model option of a plugin architecture's checkpoint: what fairseq prints without the
#: plugin (neither ``:``, ``!``, ``.`` nor ``[``, which would end it as a format field's name)
NEEDS_THE_PLUGIN = "this checkpoint needs the fairseq-rope plugin, pass --user-dir $(fairseq-rope-user-dir)"


def namespaces_as_dicts(state: dict, needs_the_plugin=lambda model: False) -> dict:
    """``state`` (a ``Trainer.state_dict``) with each Namespace of its ``cfg`` a plain dict, and
    their keys under :data:`NAMESPACES`; the model's dict led by :data:`NEEDS_THE_PLUGIN` when
    ``needs_the_plugin(its Namespace)``. The trainer's own configuration is left as it is."""
    cfg = state.get("cfg")
    if not isinstance(cfg, dict):
        return state
    saved = [key for key, value in cfg.items() if isinstance(value, argparse.Namespace)]
    if saved:
        state["cfg"] = {key: _as_dict(value, key == "model" and needs_the_plugin(value)) if key in saved else value
                        for key, value in cfg.items()}
        state[NAMESPACES] = saved
    return state


def _as_dict(namespace, noted: bool) -> dict:
    return {**({NEEDS_THE_PLUGIN: True} if noted else {}), **vars(namespace)}


def dicts_as_namespaces(state: dict, arg_overrides=None) -> dict:
    """``state`` as fairseq's ``load_checkpoint_to_cpu`` returns it, with the entries listed under
    :data:`NAMESPACES` Namespaces again, ``arg_overrides`` set on them as fairseq sets overrides on
    a Namespace (every one, where on a config it sets only the keys it has)."""
    cfg = state.get("cfg")
    for key in state.get(NAMESPACES) or ():
        value = cfg[key] if cfg is not None and key in cfg else None
        if value is None or isinstance(value, argparse.Namespace):
            continue
        options = _plain(value)
        options.pop(NEEDS_THE_PLUGIN, None)
        namespace = argparse.Namespace(**options)
        for name, override in (arg_overrides or {}).items():
            setattr(namespace, name, override)
        _set_object(cfg, key, namespace)
    return state


def _plain(value) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=False) if OmegaConf.is_config(value) else dict(value)


def _set_object(cfg, key, value) -> None:
    """``cfg[key] = value`` for an object omegaconf would refuse, as fairseq puts a Namespace into
    a config: with the ``allow_objects`` flag (omegaconf >= 2.2, which fairseq sets on the
    configs it loads), before that with omegaconf's primitive-type check relaxed."""
    from omegaconf import OmegaConf, _utils, flag_override
    from omegaconf import __version__ as omegaconf_version

    if not OmegaConf.is_config(cfg):
        cfg[key] = value
        return
    if tuple(int(part) for part in omegaconf_version.split(".")[:2] if part.isdigit()) >= (2, 2):
        with flag_override(cfg, "allow_objects", True):
            cfg[key] = value
        return
    primitive = _utils.is_primitive_type  # fairseq's own way for these versions (checkpoint_utils)
    _utils.is_primitive_type = lambda _: True
    try:
        cfg[key] = value
    finally:
        _utils.is_primitive_type = primitive
