"""What a trained model fixes, and what may change: the rules for resumes and ``--model-overrides``.

The plugin's options are declared, with their role, in ``plugin_options``:

* Options that define a trained model (``rope_theta``, ``rope_layout``, ``rpe_max_distance``, ...)
  are fixed by training: ``--model-overrides`` may restate them but never change them, since
  the weights were learned for those values.
* Inference options (``rope_scaling*``) choose how a trained model runs on longer inputs and may
  change at generate time.
* Recorded information (``rope_trained_length`` and ``rope_trained_length_counts``, the lengths
  of the sequences seen in training: see ``training_lengths``) is written by training into the
  checkpoint, never given on the command line; an override may restate it only
  (``--rope-scaling-original-length`` sets L at inference instead). It does not change what the
  weights compute: averaging merges it.
* A bad value is an :class:`OptionError`. fairseq's argument parser meets it when it applies the
  architecture defaults, i.e. before any data is read; a fairseq command that does not catch it
  prints it as one line and exits with 2, as argparse does (so does any :class:`OneLineError`).
* A resume (``fairseq-train`` on a save dir with a checkpoint, or ``--restore-file``) keeps every
  option that defines the trained model (:func:`defines_trained_model`, the same rule as for
  ``--model-overrides``): :func:`check_resumed_model`.
"""

from .config_values import OptionError, config_value
from .plugin_options import (
    INFERENCE,
    PLUGIN_OPTIONS,
    RECORDED,
    TRAINED,
    option_flag,
    options_with_role,
    plugin_defaults,
    plugin_models,
)

# What, besides the plugin's own options, changes what a checkpoint's weights compute.
COMPUTATION_OPTIONS = (
    "arch",
    "activation_fn",
    "encoder_embed_dim", "decoder_embed_dim",
    "encoder_ffn_embed_dim", "decoder_ffn_embed_dim",
    "encoder_layers", "decoder_layers",
    "encoder_attention_heads", "decoder_attention_heads",
    "encoder_normalize_before", "decoder_normalize_before",
    "encoder_learned_pos", "decoder_learned_pos",
    "no_token_positional_embeddings", "no_scale_embedding", "layernorm_embedding",
    "share_all_embeddings", "share_decoder_input_output_embed",
    "decoder_output_dim", "cross_self_attention", "no_cross_attention",
)


def registered_model_name(arch):
    """The fairseq model an architecture belongs to ('transformer_rope' for transformer_rope_tiny)."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    return ARCH_MODEL_NAME_REGISTRY.get(arch, arch)


def plugin_model_name(arch):
    """'transformer_rope' for every transformer_rope* architecture (likewise rpe); else None."""
    name = registered_model_name(arch)
    return name if name in plugin_models() else None


def computation_options(model_cfg) -> dict:
    """Every option of a saved model configuration that changes what its weights compute."""
    arch = config_value(model_cfg, "arch") or config_value(model_cfg, "_name")
    values = {name: config_value(model_cfg, name) for name in COMPUTATION_OPTIONS}
    values["arch"] = arch
    model = plugin_model_name(arch)
    for name, default in (plugin_defaults(model) if model else {}).items():
        if PLUGIN_OPTIONS[name].role == RECORDED:
            continue
        value = config_value(model_cfg, name)
        values[name] = default if value is None else value
    return values


def defines_trained_model(name: str) -> bool:
    """Whether training fixes an option: the weights were learned for its value. Not the
    inference options, which choose how a trained model runs, nor what training records."""
    option = PLUGIN_OPTIONS.get(name)
    return option.role == TRAINED if option is not None else name in COMPUTATION_OPTIONS


def trained_model_differences(model_cfg, saved_cfg):
    """``(name, value, saved value)`` of each option that defines the trained model (see
    :func:`defines_trained_model`) and differs between ``model_cfg`` and ``saved_cfg``. Both
    come through the architecture functions, so a default left unchanged compares equal; an
    option the saved configuration lacks (a fairseq release before it existed) is not compared."""
    current, saved = computation_options(model_cfg), computation_options(saved_cfg)
    return [(name, current.get(name), value) for name, value in saved.items()
            if defines_trained_model(name) and value is not None and current.get(name) != value]


def command_line_form(name: str, value) -> str:
    """How a command line gives ``name`` the value ``value``: ``--rope-theta 500.0``, ``--rope-values``,
    or ``no --rope-values`` (a switch that is off)."""
    if isinstance(value, bool):
        return option_flag(name) if value else f"no {option_flag(name)}"
    return f"{option_flag(name)} {value}"


def check_resumed_model(model_cfg, saved_cfg, checkpoint) -> None:
    """Refuse to resume ``checkpoint`` as a model other than the one it was trained as: the
    command line (``model_cfg``) may change how training runs (lr, dropout, batch size ...), not
    what model is trained. ``--reset-*`` flags change nothing here: the weights are loaded.
    The message names the checkpoint's values to resume with, not only the flags that differ: a
    value can come from a default, e.g. a command line without the options that a fine-tuning
    (``--finetune-from-model``) or the first run gave."""
    differences = trained_model_differences(model_cfg, saved_cfg)
    if differences:
        named = "; ".join(f"{option_flag(name)} {value} (the checkpoint has {saved})"
                          for name, value, saved in differences)
        wanted = ", ".join(command_line_form(name, saved) for name, _, saved in differences)
        raise OptionError(
            f"cannot resume {checkpoint} as another model: {named}. These options define the trained "
            f"model: resume with the checkpoint's values ({wanted}), or train the changed model in a new --save-dir"
        )


def check_model_overrides(model_cfg, overrides: dict, checkpoint) -> None:
    """Refuse overrides that would run a checkpoint as a model it was not trained as.

    ``overrides`` holds only plugin options and names close to one (see ``resembles_plugin_option``). Inference options
    may take any value; an option that defines the trained model may only restate the
    checkpoint's value; a name the checkpoint's model does not have is refused, not ignored.
    """
    arch = config_value(model_cfg, "arch") or config_value(model_cfg, "_name")
    model = plugin_model_name(arch)
    known = plugin_defaults(model) if model else {}
    for name, value in overrides.items():
        if name not in known:
            raise OptionError(
                f"--model-overrides: {name!r} is not an option of {arch} checkpoints ({checkpoint}); "
                f"known: {', '.join(sorted(known)) or 'none'}"
            )
        trained = config_value(model_cfg, name)
        trained = known[name] if trained is None else trained
        if value == trained:
            continue
        if PLUGIN_OPTIONS[name].role == RECORDED:
            raise OptionError(
                f"--model-overrides: {name}={value!r} differs from what training recorded in {checkpoint} "
                f"({trained!r}); set L with --rope-scaling-original-length instead"
            )
        if defines_trained_model(name):
            raise OptionError(
                f"--model-overrides: {name}={value!r} differs from the value {checkpoint} was trained "
                f"with ({name}={trained!r}); it defines the trained model and cannot change at "
                f"inference (only {', '.join(sorted(options_with_role(INFERENCE)))} can)"
            )

