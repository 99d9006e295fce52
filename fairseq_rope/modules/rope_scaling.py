"""``--rope-scaling``: one :class:`ScalingSpec` per kind, all in :data:`ROPE_SCALINGS`.

Everything the model needs of a kind is read from its spec when it is used (the flag's choices and
help, :func:`check_scaling`, the frequencies and the logit multiplier, the models), so one new
entry is one new kind everywhere: transformers' ``ROPE_INIT_FUNCTIONS`` and
``ROPE_VALIDATION_FUNCTIONS`` in one table. What an export makes of a kind is the exporter's own
table, keyed by the same names.
"""

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

from torch import Tensor

from ..config_values import OptionError
from .rotary import linear_frequencies, ntk_frequencies, unscaled_frequencies, yarn_frequencies


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


ROPE_SCALINGS: Dict[str, ScalingSpec] = {spec.name: spec for spec in (
    ScalingSpec("none", "plain RoPE", unscaled_frequencies, takes_factor=False),
    ScalingSpec("linear", "position interpolation, angles (m / s) theta_i", linear_frequencies),
    ScalingSpec("ntk", "NTK-aware, base theta * s^(d / (d - 2))", ntk_frequencies),
    ScalingSpec("yarn", "YaRN: NTK-by-parts relative to L, and a logit temperature", yarn_frequencies,
                needs_training_length=True),
    ScalingSpec("dynamic-ntk", "ntk with s = max(1, source length / L) per sentence", ntk_frequencies,
                takes_factor=False, per_sentence=True, needs_training_length=True),
    ScalingSpec("dynamic-yarn", "yarn with s = max(1, source length / L) per sentence", yarn_frequencies,
                takes_factor=False, per_sentence=True, needs_training_length=True),
)}


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
