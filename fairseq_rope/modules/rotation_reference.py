"""How the fused rotation kernel is judged, by the tests and by ``fairseq-rope-gpu-check`` alike:
the rotation computed from its definition, and the distance from it in units in the last place.

The reference shares no code with the kernel or with :func:`~.rotary.apply_rotary`: the pairs
of the layout seen as complex numbers, multiplied by cos + i sin (eq. 13's complex form) in fp64
and rounded once to the dtype of ``x``. The kernel computes in fp32, as the reference path does:
x1 cos - x2 sin may cancel, and then fp32's own error, up to eps32 (|x1| + |x2|), is many
fp16/bf16 ulps of the small result (bf16 has fp32's exponent range, so its ulps near zero are tiny:
an H200 showed 32 of them). A half-precision output passes within one ulp of the reference plus
that bound (:func:`arithmetic_bound`); fp32 within 1e-6.
"""

import torch
from torch import Tensor

#: what the kernel must meet per output dtype: absolute error in fp32 (results near zero make fp32
#: ulps meaningless), units in the last place of the dtype in half precision (beyond fp32
#: arithmetic's bound)
KERNEL_TOLERANCE = {torch.float32: ("absolute", 1e-6), torch.float16: ("ulps", 1.0), torch.bfloat16: ("ulps", 1.0)}


def rotation_from_definition(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "interleaved") -> Tensor:
    """R x in fp64 rounded once to ``x.dtype``; ``cos``/``sin`` broadcast against
    (..., rotary_dim / 2), channels beyond rotary_dim pass through."""
    half = cos.size(-1)
    rotated = x[..., : 2 * half].double()
    if layout == "interleaved":  # pairs (2i, 2i + 1)
        real, imag = rotated[..., 0::2], rotated[..., 1::2]
    else:  # pairs (i, i + rotary_dim / 2)
        real, imag = rotated[..., :half], rotated[..., half:]
    product = torch.complex(real, imag) * torch.complex(cos.double(), sin.double())
    if layout == "interleaved":
        rotated = torch.stack((product.real, product.imag), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((product.real, product.imag), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def time_first_rows(cos_table: Tensor, sin_table: Tensor, positions: Tensor):
    """cos and sin of each position, broadcasting against time-first (T, B, H, rotary_dim / 2)
    pairs: positions (T,) shared by the batch, or (B, T) per sentence."""
    cos, sin = cos_table[positions], sin_table[positions]
    if positions.dim() == 1:
        return cos[:, None, None, :], sin[:, None, None, :]
    return cos.transpose(0, 1)[:, :, None, :], sin.transpose(0, 1)[:, :, None, :]


def ulp_at(reference: Tensor) -> Tensor:
    """The unit in the last place of ``reference.dtype`` at each value's magnitude (the gap from
    |reference| to the next representable number above it), in fp64."""
    magnitude = reference.abs()
    return (torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude).double()


def ulps_off(got: Tensor, reference: Tensor) -> Tensor:
    """|got - reference| in units in the last place of ``reference.dtype`` at the reference's
    magnitude."""
    return (got.double() - reference.double()).abs() / ulp_at(reference)


def arithmetic_bound(x: Tensor, half: int, layout: str = "interleaved") -> Tensor:
    """eps32 (|x1| + |x2|) per channel (fp64), 0 for channels beyond ``2 * half``: the most that
    fp32 arithmetic adds to the error of x1 cos -+ x2 sin (|cos|, |sin| <= 1: two products and a
    sum, each rounded by at most eps32 / 2 of the magnitudes)."""
    rotated = x[..., : 2 * half].double().abs()
    if layout == "interleaved":
        pair_sum = rotated[..., 0::2] + rotated[..., 1::2]
        bound = torch.stack((pair_sum, pair_sum), dim=-1).flatten(-2)
    else:
        pair_sum = rotated[..., :half] + rotated[..., half:]
        bound = torch.cat((pair_sum, pair_sum), dim=-1)
    rest = torch.zeros_like(x[..., 2 * half:], dtype=torch.float64)
    return torch.cat((bound * torch.finfo(torch.float32).eps, rest), dim=-1)


def kernel_error(got: Tensor, x: Tensor, cos: Tensor, sin: Tensor, layout: str = "interleaved") -> dict:
    """How far ``got``, the kernel's rotation of ``x``, is from :func:`rotation_from_definition`:
    the largest absolute error, the largest error in ulps of the dtype beyond
    :func:`arithmetic_bound`, and whether they meet :data:`KERNEL_TOLERANCE`."""
    x = x.detach()
    reference = rotation_from_definition(x, cos, sin, layout)
    measure, limit = KERNEL_TOLERANCE[reference.dtype]
    if not got.numel():
        return {"absolute": 0.0, "ulps": 0.0, "pass": True}
    error = (got.detach().double() - reference.double()).abs()
    beyond = (error - arithmetic_bound(x, cos.size(-1), layout)).clamp(min=0) / ulp_at(reference)
    absolute, ulps = float(error.max()), float(beyond.max())
    return {"absolute": absolute, "ulps": ulps, "pass": (absolute if measure == "absolute" else ulps) <= limit}
