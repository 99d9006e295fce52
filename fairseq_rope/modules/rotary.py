"""Rotary Position Embedding as small pure functions.

Equation numbers refer to Su et al., "RoFormer: Enhanced Transformer with Rotary Position
Embedding" (arXiv:2104.09864v5):

* eq. (14): f_{q,k}(x_m, m) = R^d_{Theta,m} W_{q,k} x_m -- rotate *after* the projection;
* eq. (15): R^d_{Theta,m} is block diagonal with 2x2 rotations by m*theta_i,
  theta_i = base^(-2(i-1)/d), i = 1..d/2;
* eq. (16): q_m^T k_n = x_m^T W_q R^d_{Theta,n-m} W_k x_n -- scores depend only on n - m;
* eq. (34): R^d_{Theta,m} x = x (*) cos(m theta) + rotate(x) (*) sin(m theta).

Layouts of the rotated pairs inside one head:

* ``interleaved``: pairs are (x_0, x_1), (x_2, x_3), ... -- exactly the block diagonal of eq. (15);
* ``half``: pairs are (x_i, x_{i + r/2}) -- GPT-NeoX ``rotate_half``; the same function of the
  input after a fixed permutation of the projection rows.

Only the first ``rotary_dim`` channels of each head rotate (``--rope-fraction``); the rest pass
through untouched. Angles are always computed in fp32 (positions up to 2^24 are exact there):
fp16 cannot even represent position 2049, bf16 not 257.
"""

import math
from typing import Tuple

import torch
from torch import Tensor

from ..model_options import OptionError

LAYOUTS = ("interleaved", "half")


def rotary_dim_for(head_dim: int, fraction: float) -> int:
    """Number of channels of each head that rotate; must be a positive even integer."""
    rotary = head_dim * fraction
    if not (0.0 < fraction <= 1.0):
        raise OptionError(
            f"--rope-fraction must be in (0, 1], got {fraction}"
        )
    if abs(rotary - round(rotary)) > 1e-6 or int(round(rotary)) % 2 != 0 or round(rotary) == 0:
        raise OptionError(
            f"--rope-fraction {fraction} rotates {rotary:g} of the {head_dim} dimensions of each "
            f"attention head; RoPE rotates pairs of dimensions, so head_dim x fraction must be a "
            f"positive even integer (for example --rope-fraction {2 * max(1, head_dim // 4) / head_dim:g})"
        )
    return int(round(rotary))


def inverse_frequencies(rotary_dim: int, theta: float, dtype=torch.float32) -> Tensor:
    """theta_i = base^(-2(i-1)/d) for i = 1..d/2 (eq. 15)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return (theta ** -exponents).to(dtype)


SCALINGS = ("none", "linear", "ntk", "yarn")


def check_scaling(scaling: str, factor: float, original_length: int = 0) -> None:
    if scaling not in SCALINGS:
        raise OptionError(f"--rope-scaling must be one of {', '.join(SCALINGS)}; got {scaling!r}")
    if not (math.isfinite(factor) and factor >= 1.0):
        raise OptionError(f"--rope-scaling-factor must be a finite number >= 1, got {factor}")
    if scaling == "none" and factor != 1.0:
        raise OptionError(
            f"--rope-scaling-factor {factor:g} has no effect with --rope-scaling none: "
            "choose --rope-scaling linear, ntk or yarn, or drop the factor"
        )
    if int(original_length) != original_length or original_length < 0:
        raise OptionError(f"--rope-scaling-original-length must be a whole number of tokens >= 0, got {original_length}")
    if scaling == "yarn" and not original_length > 0:
        raise OptionError(
            "--rope-scaling yarn needs --rope-scaling-original-length (the longest sequence, "
            f"in tokens, seen in training), got {original_length}"
        )


def scaled_inverse_frequencies(
    rotary_dim: int,
    theta: float,
    scaling: str = "none",
    factor: float = 1.0,
    original_length: int = 0,
    dtype=torch.float32,
) -> Tensor:
    """theta_i of eq. (15), modified to run a model on ``factor`` x longer inputs than trained.

    * ``linear`` (position interpolation): angle (m / s) theta_i, i.e. theta_i / s;
    * ``ntk`` ("NTK-aware"): base -> base * s^(d / (d - 2)), so the lowest frequency is
      interpolated by exactly s while the highest is unchanged;
    * ``yarn`` (Peng et al. 2023, arXiv:2309.00071, "NTK-by-parts"): with wavelength
      lambda_i = 2 pi / theta_i and r_i = L / lambda_i for training length L, dimensions with
      r_i < 1 are interpolated (theta_i / s), those with r_i > 32 kept, a linear ramp between.

    With ``factor == 1`` every scaling returns the unscaled frequencies.
    """
    check_scaling(scaling, factor, original_length)
    if scaling == "ntk":
        theta = theta * factor ** (rotary_dim / (rotary_dim - 2)) if rotary_dim > 2 else theta
    inv_freq = inverse_frequencies(rotary_dim, theta, dtype=torch.float64)
    if scaling == "linear":
        inv_freq = inv_freq / factor
    elif scaling == "yarn":
        alpha, beta = 1.0, 32.0
        ratio = original_length * inv_freq / (2 * math.pi)  # r_i = L / lambda_i
        keep = ((ratio - alpha) / (beta - alpha)).clamp(0.0, 1.0)  # gamma(r_i)
        inv_freq = (1.0 - keep) * inv_freq / factor + keep * inv_freq
    return inv_freq.to(dtype)


def attention_temperature(scaling: str, factor: float) -> float:
    """Multiplier of the attention logits: YaRN's 1/t with sqrt(1/t) = 0.1 ln(s) + 1; else 1."""
    if scaling != "yarn" or factor <= 1.0:
        return 1.0
    return (0.1 * math.log(factor) + 1.0) ** 2


def rotation_angles(positions: Tensor, inv_freq: Tensor) -> Tensor:
    """m * theta_i for every position m (eq. 15), in the precision of ``inv_freq`` but never
    below fp32, whatever the model dtype."""
    dtype = torch.promote_types(inv_freq.dtype, torch.float32)
    return positions.to(dtype).unsqueeze(-1) * inv_freq.to(dtype)


def cos_sin(angles: Tensor) -> Tuple[Tensor, Tensor]:
    return torch.cos(angles), torch.sin(angles)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "interleaved") -> Tensor:
    """R^d_{Theta,m} x (eq. 34) on the first ``2 * cos.size(-1)`` channels of ``x``.

    ``cos``/``sin`` (fp32) broadcast against ``x[..., :rotary_dim // 2]``. The rotation is done
    in fp32 (fp64 for fp64 input) and the result cast back to ``x.dtype``, so half-precision
    models keep exact angles.
    """
    half = cos.size(-1)
    rotary_dim = 2 * half
    x_rot = x[..., :rotary_dim].to(torch.promote_types(x.dtype, torch.float32))
    if layout == "interleaved":
        # The pairs of eq. (15) are adjacent channels: a complex multiply by e^{i m theta}
        # (eq. 12 generalised) is the block-diagonal rotation in a single kernel.
        pairs = x_rot.reshape(*x_rot.shape[:-1], half, 2)
        if not _complex_viewable(pairs):
            pairs = pairs.contiguous()
        pairs = torch.view_as_complex(pairs)
        rotated = torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2)
    elif layout == "half":
        x1, x2 = x_rot[..., :half], x_rot[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        raise ValueError(f"--rope-layout must be one of {LAYOUTS}, got {layout!r}")
    rotated = rotated.to(x.dtype)
    if rotary_dim == x.size(-1):
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def apply_rotary_(x: Tensor, factor: Tensor, layout: str = "interleaved") -> Tensor:
    """:func:`apply_rotary` written into ``x`` itself, which is returned.

    ``factor`` is e^{i m theta} = cos + i sin as complex numbers (eq. 12), broadcasting against
    ``x[..., :rotary_dim // 2]``. fp32/fp64 interleaved pairs are multiplied by it in place, so no
    new activation-sized tensor is made; other dtypes and layouts rotate in fp32 and copy back.
    """
    rotary_dim = 2 * factor.size(-1)
    x_rot = x if rotary_dim == x.size(-1) else x[..., :rotary_dim]
    in_place = (
        layout == "interleaved"
        and x_rot.stride(-1) == 1
        # the product must fit x's own precision: fp64 takes any factor, fp32 a complex64 one
        and (x.dtype == torch.float64 or (x.dtype == torch.float32 and factor.dtype == torch.complex64))
    )
    if in_place:
        pairs = x_rot.view(x_rot.shape[:-1] + (-1, 2))
        if _complex_viewable(pairs):
            torch.view_as_complex(pairs).mul_(factor)
            return x
    x_rot.copy_(apply_rotary(x_rot, factor.real, factor.imag, layout))
    return x


def _complex_viewable(pairs: Tensor) -> bool:
    """``view_as_complex`` needs a contiguous last pair and even other strides and offset."""
    return (
        pairs.stride(-1) == 1
        and pairs.storage_offset() % 2 == 0
        and all(s % 2 == 0 for s in pairs.stride()[:-1])
    )


def interleaved_to_half_permutation(head_dim: int, rotary_dim: int) -> Tensor:
    """Channel order that turns an ``interleaved`` head into a ``half`` head.

    ``apply_rotary(x[..., perm], layout="half") == apply_rotary(x, layout="interleaved")[..., perm]``:
    permuting the rows of W_q and W_k (and their biases) head by head converts a model between
    layouts without changing a single attention score.
    """
    even = torch.arange(0, rotary_dim, 2)
    odd = torch.arange(1, rotary_dim, 2)
    rest = torch.arange(rotary_dim, head_dim)
    return torch.cat((even, odd, rest))


def positions_from_padding_mask(key_padding_mask: Tensor) -> Tensor:
    """Position of every token within its own sentence (batch x time), pads excluded.

    fairseq left-pads sources: counting only real tokens gives a padded sentence exactly the
    positions it has when it stands alone. Needed where a query and a key come from different
    sequences (rotary cross-attention); within one sequence see :func:`new_token_positions`.
    """
    not_pad = (~key_padding_mask.bool()).long()
    return (torch.cumsum(not_pad, dim=1) - 1).clamp_(min=0)


def new_token_positions(offset: int, length: int, device) -> Tensor:
    """Positions (time,) of the ``length`` new tokens of a self-attention call, shared by the
    batch: offset .. offset + length - 1, ``offset`` being the tokens already cached.

    Counting from the first column even with left padding is exact: padding shifts every
    position of a sentence by the same amount, and scores depend on n - m only (eq. 16).
    """
    return torch.arange(offset, offset + length, device=device)


def relative_upper_bound(relative_distance: Tensor, rotary_dim: int, theta: float = 10000.0) -> Tensor:
    """(1/(d/2)) sum_{j=1}^{d/2} |S_j| with S_j = sum_{k<j} e^{i (m-n) theta_k}: the long-term
    decay bound of Section 3.4.3 (eqs. 35-37, Fig. 2), as a function of the relative distance."""
    inv_freq = inverse_frequencies(rotary_dim, theta).double()
    phases = relative_distance.double().unsqueeze(-1) * inv_freq
    partial_sums = torch.cumsum(torch.polar(torch.ones_like(phases), phases), dim=-1)
    return partial_sums.abs().mean(dim=-1)


__all__ = [
    "LAYOUTS",
    "rotary_dim_for",
    "inverse_frequencies",
    "rotation_angles",
    "cos_sin",
    "apply_rotary",
    "apply_rotary_",
    "interleaved_to_half_permutation",
    "positions_from_padding_mask",
    "new_token_positions",
    "relative_upper_bound",
    "SCALINGS",
    "check_scaling",
    "scaled_inverse_frequencies",
    "attention_temperature",
]
