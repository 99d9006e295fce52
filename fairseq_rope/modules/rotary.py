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
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..config_values import OptionError

LAYOUTS = ("interleaved", "half")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise OptionError(f"--rope-layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")


def rotary_dim_for(head_dim: int, fraction: float) -> int:
    """Number of channels of each head that rotate; must be a positive even integer."""
    rotary = head_dim * fraction
    if not (0.0 < fraction <= 1.0):
        raise OptionError(f"--rope-fraction must be in (0, 1], got {fraction}")
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


# --rope-scaling: frequencies for inputs ``scaling_factor`` (s) times longer than in training.
# Each maps (rotary_dim, theta, s, training length L) to fp64 theta_i and the multiplier of the
# attention logits; with s == 1 each returns the unscaled frequencies and 1. The registry of the
# scalings, what each needs and how it is checked is in ``rope_scaling``.


def unscaled_frequencies(rotary_dim, theta, s, length):
    return inverse_frequencies(rotary_dim, theta, torch.float64), 1.0


def linear_frequencies(rotary_dim, theta, s, length):
    """Position interpolation: angle (m / s) theta_i."""
    return inverse_frequencies(rotary_dim, theta, torch.float64) / s, 1.0


def ntk_frequencies(rotary_dim, theta, s, length):
    """"NTK-aware": base -> base * s^(d / (d - 2)); the lowest frequency is interpolated by
    exactly s, the highest unchanged."""
    if rotary_dim > 2:
        theta = theta * s ** (rotary_dim / (rotary_dim - 2))
    return inverse_frequencies(rotary_dim, theta, torch.float64), 1.0


def yarn_frequencies(rotary_dim, theta, s, length):
    """YaRN (Peng et al. 2023, arXiv:2309.00071, "NTK-by-parts"): with wavelength
    lambda_i = 2 pi / theta_i and r_i = L / lambda_i, dimensions with r_i < 1 are interpolated
    (theta_i / s), those with r_i > 32 kept, a linear ramp between; logits are multiplied by
    1/t with sqrt(1/t) = 0.1 ln(s) + 1."""
    alpha, beta = 1.0, 32.0
    inv_freq = inverse_frequencies(rotary_dim, theta, torch.float64)
    ratio = length * inv_freq / (2 * math.pi)  # r_i = L / lambda_i
    keep = ((ratio - alpha) / (beta - alpha)).clamp(0.0, 1.0)  # gamma(r_i)
    logit_scale = (0.1 * math.log(s) + 1.0) ** 2 if s > 1.0 else 1.0
    return (1.0 - keep) * inv_freq / s + keep * inv_freq, logit_scale


def dynamic_factors(source_lengths: Tensor, original_length: int) -> Tensor:
    """s = max(1, n / L) (fp64) for each sentence of n source tokens, L the training length: a
    sentence no longer than in training keeps plain RoPE, a longer one is scaled just enough."""
    return (source_lengths.to(torch.float64) / original_length).clamp(min=1.0)


def rotation_angles(positions: Tensor, inv_freq: Tensor) -> Tensor:
    """m * theta_i for every position m (eq. 15), in the precision of ``inv_freq`` but never
    below fp32, whatever the model dtype."""
    dtype = torch.promote_types(inv_freq.dtype, torch.float32)
    return positions.to(dtype).unsqueeze(-1) * inv_freq.to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "interleaved") -> Tensor:
    """R^d_{Theta,m} x (eq. 34) on the first ``2 * cos.size(-1)`` channels of ``x``: the reference.

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
        rotated = torch.view_as_real(torch.view_as_complex(pairs) * torch.complex(cos, sin)).flatten(-2)
    else:
        check_layout(layout)
        x1, x2 = x_rot[..., :half], x_rot[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    rotated = rotated.to(x.dtype)
    if rotary_dim == x.size(-1):
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def apply_rotary_(x: Tensor, rotations: Tensor, layout: str = "interleaved") -> Tensor:
    """:func:`apply_rotary` written into ``x`` itself, which is returned.

    ``rotations`` are the unit complex numbers e^{i m theta} = cos + i sin (eq. 12), broadcasting
    against ``x[..., :rotary_dim // 2]``. fp32/fp64 interleaved pairs are multiplied by them in
    place, so no new activation-sized tensor is made; other dtypes and layouts rotate in fp32 and
    copy back.
    """
    rotary_dim = 2 * rotations.size(-1)
    x_rot = x if rotary_dim == x.size(-1) else x[..., :rotary_dim]
    in_place = (
        layout == "interleaved"
        and x_rot.stride(-1) == 1
        # the product must fit x's own precision: fp64 takes any rotation, fp32 a complex64 one
        and (x.dtype == torch.float64 or (x.dtype == torch.float32 and rotations.dtype == torch.complex64))
    )
    if in_place:
        pairs = x_rot.view(x_rot.shape[:-1] + (-1, 2))
        if _complex_viewable(pairs):
            torch.view_as_complex(pairs).mul_(rotations)
            return x
    x_rot.copy_(apply_rotary(x_rot, rotations.real, rotations.imag, layout))
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


def sequence_lengths(padding_mask: Optional[Tensor], length: int, batch: int, device) -> Tensor:
    """Tokens of each sentence (batch,), pads excluded; ``length`` each without a mask."""
    if padding_mask is None or padding_mask.dim() < 2:
        return torch.full((batch,), length, device=device)
    return length - padding_mask.bool().sum(dim=1)


def positions_from_padding_mask(key_padding_mask: Tensor) -> Tensor:
    """Position of every token within its own sentence (batch x time), pads excluded.

    fairseq left-pads sources: counting only real tokens gives a padded sentence exactly the
    positions it has when it stands alone. Needed where a query and a key come from different
    sequences (rotary cross-attention); within one sequence, counting from the first column of
    the batch is exact, since padding shifts every position by the same amount and scores
    depend on n - m only (eq. 16).
    """
    not_pad = (~key_padding_mask.bool()).long()
    return (torch.cumsum(not_pad, dim=1) - 1).clamp_(min=0)


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


class RotateInPlace(torch.autograd.Function):
    """R_m written over tensors nothing else reads; backward rotates the incoming gradient in place
    by -m (R_m^T = R_{-m}), so it too must be a tensor nothing else reads, as every gradient
    attention hands it is (the backward of ``chunk`` and of SDPA make new ones).

    Each input is a linear layer's output -- not a view, so autograd needs no copy to track the
    in-place change -- whose ``heads`` of ``heads_shape`` rotate (q and k of a fused q/k/v
    projection: v is neither copied nor written). ``rotate_(views, inverse)`` rotates the heads'
    views in place, by m or by -m: the reference rotation or the fused kernel. A projection output is
    not kept for backward, and the rotated tensors and their gradients live only inside one
    attention call: no activation-sized tensor is made in either direction.
    """

    @staticmethod
    def forward(ctx, rotate_: Callable[[List[Tensor], bool], None], heads_shape: Tuple[int, ...], heads: slice,
                *xs: Tensor):
        rotate_([x.view(heads_shape)[:, :, heads] for x in xs], False)
        ctx.mark_dirty(*xs)
        ctx.rotate_, ctx.heads_shape, ctx.heads = rotate_, heads_shape, heads
        return xs if len(xs) > 1 else xs[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Tensor):
        grads = [grad.contiguous() for grad in grads]  # a no-op for the dense gradients attention produces
        ctx.rotate_([grad.view(ctx.heads_shape)[:, :, ctx.heads] for grad in grads], True)
        return (None, None, None, *grads)
