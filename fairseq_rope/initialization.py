"""Starting a model from another's weights (fairseq-train ``--finetune-from-model``): a sinusoidal
fairseq Transformer -- fairseq's own ``transformer*`` trained without the plugin, a model in
fairseq's pretrained-model layout, an average -- into RoPE, or one plugin model into another.

Every tensor of the starting model must map one to one onto the new model, or fairseq-train stops
before loading it, in one line that lists every difference (:func:`initialization_problems`:
dimensions, layers, heads, FFN, pre/post norm, shared embeddings, dictionaries, a model whose
attention has no counterpart). What has no counterpart in a RoPE model -- the sinusoidal positions'
buffer, learned position embeddings -- is dropped and named once in the log
(:func:`drop_token_positions`). The new model records where it came from (:data:`ORIGIN`: the
path, sha256 and architecture of the start), in every checkpoint of its training, resumes
included, and fairseq-rope-export copies it into export_info.json.
"""

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from fairseq_rope_base.files import file_fingerprint

from .config_values import config_value
from .plugin_options import option_flag

logger = logging.getLogger(__name__)

#: the recorded model option that says where a fine-tuned model started (a PLUGIN_OPTIONS entry)
ORIGIN = "rope_init_from"

#: the options that shape a Transformer's tensors or what they compute: equal, or no start
ARCHITECTURE = (
    "encoder_embed_dim", "decoder_embed_dim", "encoder_ffn_embed_dim", "decoder_ffn_embed_dim",
    "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
    "encoder_normalize_before", "decoder_normalize_before", "share_all_embeddings",
    "share_decoder_input_output_embed", "layernorm_embedding", "no_scale_embedding", "activation_fn",
    "attention_kind",
)
#: the values an option has where a configuration lacks it (fairseq's defaults)
DEFAULTS = {"attention_kind": "softmax", "layernorm_embedding": False, "no_scale_embedding": False,
            "activation_fn": "relu", "share_all_embeddings": False, "share_decoder_input_output_embed": False}


def architecture_problems(saved, model_cfg, registered_model) -> List[str]:
    """Why the model of ``saved`` (its configuration) cannot start the one of ``model_cfg``: each
    option of :data:`ARCHITECTURE` that differs, and a start with relative-position tables."""
    problems = []
    saved_arch = config_value(saved, "arch") or config_value(saved, "_name")
    if registered_model(saved_arch) == "transformer_rpe":
        problems.append(f"it is a relative-position model ({saved_arch}): its distance tables have no counterpart")
    for name in ARCHITECTURE:
        old, new = (config_value(cfg, name, DEFAULTS.get(name)) for cfg in (saved, model_cfg))
        if old != new:
            problems.append(f"{option_flag(name)} {old} in it, {new} here")
    return problems


def dictionary_problems(side: str, symbols: Optional[list], fingerprint: Optional[str], recorded: Optional[str],
                        beside: Optional[list], rows: Optional[int]) -> List[str]:
    """Why the start's ``side`` dictionary is not the task's (its ``symbols`` and ``fingerprint``):
    by the start's file beside its checkpoint (``beside``: its symbols), its recorded fingerprint,
    or else the rows of its embedding (the size alone)."""
    if symbols is None:
        return []
    if beside is not None:
        if len(beside) != len(symbols):
            return [f"the {side} dictionary has {len(beside)} types in it, {len(symbols)} here"]
        first = next((i for i, (a, b) in enumerate(zip(beside, symbols)) if a != b), None)
        return [] if first is None else [f"the {side} dictionary has its {len(symbols)} types in another order "
                                         f"(first at index {first}: {beside[first]!r} in it, {symbols[first]!r} here)"]
    if recorded is not None:
        return [] if recorded == fingerprint else [
            f"the {side} dictionary is another one (its sha256 is not the data-bin's)"]
    if rows is not None and rows != len(symbols):
        return [f"the {side} embeddings have {rows} rows in it, {len(symbols)} types in the {side} dictionary here"]
    return []


def dictionary_beside(checkpoint: str, language: Optional[str]) -> Optional[list]:
    """The symbols of ``dict.LANG.txt`` beside ``checkpoint`` (fairseq's pretrained-model layout),
    as fairseq's Dictionary reads them; None without one."""
    if not language:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), f"dict.{language}.txt")
    if not os.path.isfile(path):
        return None
    from fairseq.data import Dictionary

    return list(Dictionary.load(path).symbols)


@dataclass
class Start:
    """The checkpoint a training starts from: its path, model configuration, weights and the
    dictionaries' fingerprints it records (None: saved without them)."""

    path: str
    saved: Any
    weights: dict
    dictionaries: Optional[dict]


def initialization_problems(start: Start, model_cfg, task, fingerprint: Callable, registered_model) -> List[str]:
    """Every reason ``start`` cannot start the model of ``model_cfg`` trained on ``task``'s
    dictionaries (``fingerprint``: a dictionary's, as checkpoints record them)."""
    problems = architecture_problems(start.saved, model_cfg, registered_model)
    recorded = start.dictionaries or {}
    for side, key in (("source", "encoder.embed_tokens.weight"), ("target", "decoder.embed_tokens.weight")):
        dictionary = getattr(task, f"{side}_dictionary", None)
        rows = start.weights[key].shape[0] if key in start.weights else None
        language = getattr(getattr(task, "cfg", None), f"{side}_lang", None)
        problems += dictionary_problems(side, None if dictionary is None else list(dictionary.symbols),
                                        fingerprint(dictionary), recorded.get(side),
                                        dictionary_beside(start.path, language), rows)
    return problems


def origin_record(start: Start) -> dict:
    """What :data:`ORIGIN` records of ``start``: its path, sha256 and architecture (and, for a
    start that was itself fine-tuned, its own origin)."""
    record = {"path": os.path.abspath(start.path), "sha256": file_fingerprint(start.path)[1],
              "arch": config_value(start.saved, "arch") or config_value(start.saved, "_name")}
    earlier = config_value(start.saved, ORIGIN)
    if earlier:
        record["init_from"] = earlier
    return record


#: the token-position entries a RoPE or RPE model has no counterpart for, by what they are
TOKEN_POSITIONS = {"_float_tensor": "the sinusoidal positions' buffer", "weights": "the sinusoidal positions",
                   "weight": "learned positions"}


def drop_token_positions(state_dict: dict, prefix: str, sides) -> None:
    """Remove from ``state_dict`` the token-position entries of each side (``encoder``,
    ``decoder``) whose model has none, naming them in one log line."""
    dropped = [key for side in sides for key in list(state_dict)
               if key.startswith(f"{prefix}{side}.embed_positions.")]
    if not dropped:
        return
    kinds = sorted({TOKEN_POSITIONS.get(key.rsplit(".", 1)[-1], "position entries") for key in dropped})
    for key in dropped:
        del state_dict[key]
    logger.info(f"starting weights: dropped {', '.join(dropped)} ({' and '.join(kinds)}: no counterpart in "
                "this model, whose positions rotate)")
