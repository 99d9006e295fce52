"""``--rope-scaling``: one :class:`ScalingSpec` per kind, all in :data:`ROPE_SCALINGS`.

Everything about a kind is read from its spec when it is used (the flag's choices and help,
:func:`check_scaling`, the frequencies, the models, the CTranslate2 export), so one new entry is
one new kind everywhere: transformers' ``ROPE_INIT_FUNCTIONS`` and ``ROPE_VALIDATION_FUNCTIONS``
in one table.
"""

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..config_values import OneLineError, OptionError
from .rotary import inverse_frequencies, linear_frequencies, ntk_frequencies, unscaled_frequencies, yarn_frequencies

PER_SENTENCE_REFUSAL = ("the factor is chosen per sentence, and CTranslate2 has one rotary scaling for every sentence: "
                        "export one static yarn per length bucket with --length-buckets")
NOT_IN_CTRANSLATE2 = "CTranslate2's rotary scalings do not include it"


@dataclass(frozen=True)
class ScalingSpec:
    name: str
    #: one line of the ``--rope-scaling`` help
    description: str
    #: (rotary_dim, theta, s, L) -> (fp64 theta_i, multiplier of the attention logits): see rotary.py
    frequencies: Callable[[int, float, float, int], Tuple[Tensor, float]]
    #: False: --rope-scaling-factor must stay 1
    takes_factor: bool = True
    #: s = max(1, source length / L) for each sentence at inference (:func:`~.rotary.dynamic_factors`)
    per_sentence: bool = False
    #: needs L, the training length (--rope-scaling-original-length or recorded by training)
    needs_training_length: bool = False
    #: a further check of (s, L) that raises OptionError
    check: Optional[Callable[[float, int], None]] = None
    #: (rotary_dim, theta, s, L) -> the attributes of CTranslate2's self-attention spec that
    #: reproduce the scaling (:func:`ctranslate2_rotary_scaling`); None where CTranslate2 cannot
    #: express it, for this reason:
    ctranslate2: Optional[Callable[[int, float, float, int], dict]] = None
    ctranslate2_refusal: str = NOT_IN_CTRANSLATE2


def _linear_in_ctranslate2(rotary_dim: int, theta: float, s: float, length: int) -> dict:
    return {"rotary_scaling_type": "Linear", "rotary_scaling_factor": s} if s != 1.0 else {}


# --- static YaRN in CTranslate2 ----------------------------------------------------------------
# CTranslate2's ``Su`` scaling (src/layers/attention_layer.cc, RotaryEmbeddings::initialize):
#   theta_i' = theta_i / f_i, one factor f_i per frequency (rotary_scaling_long_factor, or
#   _short_factor for a table no longer than original_max_position_embeddings: both are set alike);
#   and with original_max_position_embeddings L' and max_position_embeddings M set, sin and cos
#   multiplied by c = sqrt(1 + ln(M / L') / ln L'), M / L' divided as integers: q.k scaled by c^2.
# YaRN's theta_i' = ((1 - gamma_i) / s + gamma_i) theta_i gives f_i = 1 / ((1 - gamma_i) / s + gamma_i),
# and its logit multiplier 1/t = (0.1 ln s + 1)^2 is c^2 for the (L', M) whose c comes closest.
INT32_MAX = 2**31 - 1


def yarn_divisors(rotary_dim: int, theta: float, s: float, length: int) -> Tensor:
    """f_i with theta_i / f_i = YaRN's theta_i (fp64): 1 / ((1 - gamma_i) / s + gamma_i)."""
    return inverse_frequencies(rotary_dim, theta, torch.float64) / yarn_frequencies(rotary_dim, theta, s, length)[0]


def ctranslate2_sin_cos_multiplier(original: int, maximum: int) -> float:
    """c of CTranslate2's (original_max_position_embeddings, max_position_embeddings), computed as
    CTranslate2 computes it: the ratio an integer division, its log in float32, the rest in double,
    the result stored as float32."""
    ratio = maximum // original if original else 0
    if ratio <= 1:
        return 1.0
    log_ratio = float(torch.tensor(float(ratio), dtype=torch.float32).log())
    return float(torch.tensor(math.sqrt(1.0 + log_ratio / math.log(original)), dtype=torch.float32))


def ctranslate2_logit_scale_positions(logit_scale: float, largest_ratio: int = 64) -> Tuple[int, int]:
    """The (original_max_position_embeddings, max_position_embeddings) whose c^2 is closest to
    ``logit_scale``: for each integer ratio k = M / L', the L' with ln k / ln L' = logit_scale - 1,
    rounded, within int32; (0, 0), no multiplier, where none comes closer than c = 1 (a scale
    below about 1.034, YaRN's for s below about 1.18, would need L' beyond int32)."""
    target = math.sqrt(logit_scale)
    best = (abs(1.0 - target), 0, 0)
    excess = logit_scale - 1.0
    for ratio in range(2, largest_ratio + 1) if excess > 0.0 else ():
        exponent = math.log(ratio) / excess  # ln L'
        if exponent > math.log(INT32_MAX // ratio):
            continue
        for original in {max(2, math.floor(math.exp(exponent))), max(2, math.ceil(math.exp(exponent)))}:
            error = abs(ctranslate2_sin_cos_multiplier(original, original * ratio) - target)
            if error < best[0]:
                best = (error, original, original * ratio)
    return best[1], best[2]


def _yarn_in_ctranslate2(rotary_dim: int, theta: float, s: float, length: int) -> dict:
    if s == 1.0:
        return {}
    divisors = yarn_divisors(rotary_dim, theta, s, length).tolist()
    original, maximum = ctranslate2_logit_scale_positions(yarn_frequencies(rotary_dim, theta, s, length)[1])
    temperature = {"original_max_position_embeddings": original, "max_position_embeddings": maximum} if original else {}
    return {"rotary_scaling_type": "Su", "rotary_scaling_long_factor": divisors,
            "rotary_scaling_short_factor": divisors, **temperature}


ROPE_SCALINGS: Dict[str, ScalingSpec] = {spec.name: spec for spec in (
    ScalingSpec("none", "plain RoPE", unscaled_frequencies, takes_factor=False,
                ctranslate2=lambda rotary_dim, theta, s, length: {}),
    ScalingSpec("linear", "position interpolation, angles (m / s) theta_i", linear_frequencies,
                ctranslate2=_linear_in_ctranslate2),
    ScalingSpec("ntk", "NTK-aware, base theta * s^(d / (d - 2))", ntk_frequencies),
    ScalingSpec("yarn", "YaRN: NTK-by-parts relative to L, and a logit temperature", yarn_frequencies,
                needs_training_length=True, ctranslate2=_yarn_in_ctranslate2),
    ScalingSpec("dynamic-ntk", "ntk with s = max(1, source length / L) per sentence", ntk_frequencies,
                takes_factor=False, per_sentence=True, needs_training_length=True,
                ctranslate2_refusal=PER_SENTENCE_REFUSAL),
    ScalingSpec("dynamic-yarn", "yarn with s = max(1, source length / L) per sentence", yarn_frequencies,
                takes_factor=False, per_sentence=True, needs_training_length=True,
                ctranslate2_refusal=PER_SENTENCE_REFUSAL),
)}


class NotExportable(OneLineError, ValueError):
    """CTranslate2 cannot express a scaling; the message names ``--rope-scaling X`` and why."""


def scaling_names() -> Tuple[str, ...]:
    return tuple(ROPE_SCALINGS)


def per_sentence_scalings() -> Tuple[str, ...]:
    return tuple(name for name, spec in ROPE_SCALINGS.items() if spec.per_sentence)


def one_of(names: Sequence[str], conjunction: str = "or") -> str:
    """'a, b or c'."""
    return f"{', '.join(names[:-1])} {conjunction} {names[-1]}" if len(names) > 1 else "".join(names)


def scaling_spec(scaling: str) -> ScalingSpec:
    spec = ROPE_SCALINGS.get(scaling)
    if spec is None:
        raise OptionError(f"--rope-scaling must be one of {', '.join(ROPE_SCALINGS)}; got {scaling!r}")
    return spec


def scaling_help() -> str:
    kinds = "; ".join(f"{spec.name}: {spec.description}" for spec in ROPE_SCALINGS.values())
    return (f"frequency scaling to run on inputs longer than in training, usually set at generate time "
            f"with --model-overrides. {kinds}")


def check_scaling(scaling: str, scaling_factor: float, original_length: int = 0) -> None:
    spec = scaling_spec(scaling)
    if not (math.isfinite(scaling_factor) and scaling_factor >= 1.0):
        raise OptionError(f"--rope-scaling-factor must be a finite number >= 1, got {scaling_factor}")
    if not spec.takes_factor and scaling_factor != 1.0:
        instead = ("each sentence gets s = max(1, source length / L); drop the factor" if spec.per_sentence else
                   f"choose --rope-scaling {one_of([n for n, s in ROPE_SCALINGS.items() if s.takes_factor])}, "
                   "or drop the factor")
        raise OptionError(f"--rope-scaling-factor {scaling_factor:g} has no effect with --rope-scaling {scaling}: "
                          f"{instead}")
    if int(original_length) != original_length or original_length < 0:
        raise OptionError(
            f"--rope-scaling-original-length must be a whole number of tokens >= 0, got {original_length}"
        )
    if spec.needs_training_length and not original_length > 0:
        raise OptionError(
            f"--rope-scaling {scaling} needs the training length L, which the checkpoint does not record "
            "(saved by an older version, or no checkpoint yet): pass --rope-scaling-original-length L, a length "
            "in tokens that almost every training source and target does not exceed"
        )
    if spec.check is not None:
        spec.check(float(scaling_factor), int(original_length))


def rope_frequencies(
    rotary_dim: int,
    theta: float,
    scaling: str = "none",
    scaling_factor: float = 1.0,
    original_length: int = 0,
) -> Tuple[Tensor, float]:
    """theta_i of eq. (15) in fp64, scaled by ``--rope-scaling``, and the multiplier of the
    attention logits that goes with them."""
    check_scaling(scaling, scaling_factor, original_length)
    return scaling_spec(scaling).frequencies(rotary_dim, theta, float(scaling_factor), int(original_length))


def ctranslate2_rotary_scaling(scaling: str, scaling_factor: float, rotary_dim: int = 0, theta: float = 10000.0,
                               original_length: int = 0) -> dict:
    """The attributes of CTranslate2's self-attention spec that reproduce ``--rope-scaling scaling``
    with factor s, e.g. ``{"rotary_scaling_type": "Linear", "rotary_scaling_factor": 4.0}`` (the
    type: the name of a ``ctranslate2.specs.attention_spec.RotaryScalingType`` member);
    NotExportable if there are none."""
    spec = scaling_spec(scaling)
    if spec.ctranslate2 is None:
        exported = [name for name, s in ROPE_SCALINGS.items() if s.ctranslate2 is not None]
        raise NotExportable(f"--rope-scaling {scaling}: {spec.ctranslate2_refusal} (export with {one_of(exported)})")
    return spec.ctranslate2(int(rotary_dim), float(theta), float(scaling_factor), int(original_length))
