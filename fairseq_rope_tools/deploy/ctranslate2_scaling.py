"""``--rope-scaling`` in CTranslate2: what each kind of the plugin's registry
(``fairseq_rope.modules.rope_scaling.ROPE_SCALINGS``) becomes in an exported model, or why
CTranslate2 cannot compute it, keyed by kind (:data:`EXPRESSIONS`, :data:`REFUSALS`).

A kind's frequencies become attributes of CTranslate2's self-attention spec. The multiplier of the
attention logits that the plugin applies with them (YaRN's temperature, (0.1 ln s + 1)^2) becomes
part of the weights: the plugin multiplies the whole query by it after the rotation, and the
rotation is linear, so W_q, b_q, W_k and b_k of every rotary attention times sqrt(multiplier) give
every q.k logit times the multiplier -- exactly, for every factor, rotated channels or not
(:func:`fold_logit_multiplier`).

Loaded by fairseq-rope-export only (it imports torch and the plugin).
"""

import math
from dataclasses import dataclass
from typing import Callable, Dict

import torch
from torch import Tensor

from fairseq_rope.modules.rope_scaling import one_of, rope_frequencies, scaling_spec
from fairseq_rope.modules.rotary import inverse_frequencies, yarn_frequencies
from fairseq_rope_tools.cli import UserError


def _unscaled(rotary_dim: int, theta: float, s: float, length: int) -> dict:
    return {}


def _linear(rotary_dim: int, theta: float, s: float, length: int) -> dict:
    return {"rotary_scaling_type": "Linear", "rotary_scaling_factor": s} if s != 1.0 else {}


# CTranslate2's ``Su`` scaling (src/layers/attention_layer.cc, RotaryEmbeddings::initialize):
# theta_i' = theta_i / f_i, one factor f_i per frequency (rotary_scaling_long_factor, or _short_factor
# for a table no longer than original_max_position_embeddings: both are set alike). Its own sin/cos
# multiplier (set by original_max_position_embeddings and max_position_embeddings) is left unset:
# the logit multiplier is in the weights.
def yarn_divisors(rotary_dim: int, theta: float, s: float, length: int) -> Tensor:
    """f_i with theta_i / f_i = YaRN's theta_i (fp64): 1 / ((1 - gamma_i) / s + gamma_i)."""
    return inverse_frequencies(rotary_dim, theta, torch.float64) / yarn_frequencies(rotary_dim, theta, s, length)[0]


def _yarn(rotary_dim: int, theta: float, s: float, length: int) -> dict:
    if s == 1.0:
        return {}
    divisors = yarn_divisors(rotary_dim, theta, s, length).tolist()
    return {"rotary_scaling_type": "Su", "rotary_scaling_long_factor": divisors,
            "rotary_scaling_short_factor": divisors}


#: kind -> (rotary_dim, theta, s, L) -> the attributes of CTranslate2's self-attention spec that
#: give the kind's frequencies (``rotary_scaling_type``: the name of a
#: ``ctranslate2.specs.attention_spec.RotaryScalingType`` member)
EXPRESSIONS: Dict[str, Callable[[int, float, float, int], dict]] = {
    "none": _unscaled,
    "linear": _linear,
    "yarn": _yarn,
}

NOT_IN_CTRANSLATE2 = "CTranslate2's rotary scalings do not include it"
PER_SENTENCE = ("the factor is chosen per sentence, and CTranslate2 has one rotary scaling for every sentence: "
                "export one static yarn per length bucket with --length-buckets")
#: kind -> why CTranslate2 cannot compute it; a kind in neither table is refused as not included
REFUSALS: Dict[str, str] = {
    "ntk": NOT_IN_CTRANSLATE2,
    "dynamic-ntk": PER_SENTENCE,
    "dynamic-yarn": PER_SENTENCE,
}


@dataclass(frozen=True)
class ExportedScaling:
    """A ``--rope-scaling`` as the exported model computes it."""

    #: set on every self-attention spec (:func:`set_rotary_scaling`), e.g.
    #: ``{"rotary_scaling_type": "Linear", "rotary_scaling_factor": 4.0}``
    attributes: dict
    #: the multiplier of the attention logits, folded into the weights (:func:`fold_logit_multiplier`)
    logit_multiplier: float = 1.0


def ctranslate2_rotary_scaling(scaling: str, scaling_factor: float, rotary_dim: int, theta: float = 10000.0,
                               original_length: int = 0) -> ExportedScaling:
    """``--rope-scaling scaling`` with factor s of a model with ``rotary_dim`` rotated channels and
    base ``theta`` (L ``original_length``), as CTranslate2 computes it; UserError naming the flag
    where it cannot (a bad (s, L): the plugin's own one-line error)."""
    scaling_spec(scaling)
    expression = EXPRESSIONS.get(scaling)
    if expression is None:
        raise UserError(f"--rope-scaling {scaling}: {REFUSALS.get(scaling, NOT_IN_CTRANSLATE2)} "
                        f"(export with {one_of(list(EXPRESSIONS))})")
    numbers = (int(rotary_dim), float(theta), float(scaling_factor), int(original_length))
    _, multiplier = rope_frequencies(numbers[0], numbers[1], scaling, numbers[2], numbers[3])
    return ExportedScaling(expression(*numbers), float(multiplier))


def set_rotary_scaling(spec, scaling: ExportedScaling) -> None:
    """Write ``scaling`` into the self-attention of every layer of a TransformerSpec whose weights
    are set: its attributes, in the types CTranslate2's own specs use, and its logit multiplier
    folded into the query and key projections. The attributes are set
    past the specs' frozen attribute list: the encoder's constructor declares no Su factors, though
    CTranslate2 reads them in any attention layer (one AttentionLayer class serves both sides)."""
    import numpy as np
    from ctranslate2.specs import attention_spec

    def typed(name, value):
        if name == "rotary_scaling_type":
            return np.dtype("int8").type(getattr(attention_spec.RotaryScalingType, value))
        if isinstance(value, list):
            return np.asarray(value, dtype=np.float32)
        return np.dtype("int32" if isinstance(value, int) else "float32").type(value)

    for side in (spec.encoder, spec.decoder):
        for layer in side.layer:
            for name, value in scaling.attributes.items():
                object.__setattr__(layer.self_attention, name, typed(name, value))
            fold_logit_multiplier(layer.self_attention, scaling.logit_multiplier)


def fold_logit_multiplier(attention, multiplier: float) -> None:
    """Multiply the q and k rows of a self-attention spec's fused [W_q; W_k; W_v] projection (the
    first two thirds) and of its bias by sqrt(``multiplier``), so that every q.k logit is multiplied
    by ``multiplier``: R_m (a W x) . R_n (a W' y) = a^2 (R_m W x . R_n W' y). Computed in float64,
    stored in the weights' own type; new arrays, the model's tensors untouched."""
    if multiplier == 1.0:
        return
    import numpy as np

    root = math.sqrt(multiplier)
    linear = attention.linear[0]
    q_and_k = 2 * (np.shape(linear.weight)[0] // 3)
    for name in ("weight", "bias") if linear.has_bias() else ("weight",):
        values = np.asarray(getattr(linear, name))
        folded = values.copy()
        folded[:q_and_k] = (values[:q_and_k].astype(np.float64) * root).astype(values.dtype)
        setattr(linear, name, folded)
