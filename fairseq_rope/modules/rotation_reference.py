"""How the fused rotation kernel is judged, by the tests and by ``fairseq-rope-gpu-check`` alike:
the rotation computed from its definition, and the distance from it in units in the last place.

The reference shares no code with the kernel or with :func:`~.rotary.apply_rotary`: the pairs
of the layout seen as complex numbers, multiplied by cos + i sin (eq. 13's complex form) in fp64
and rounded once to the dtype of ``x``. A correctly rounded fp16/bf16 kernel is then at most one
unit in the last place off it.
"""

import torch
from torch import Tensor

#: what the kernel must meet per output dtype: absolute error in fp32 (results near zero make fp32
#: ulps meaningless), units in the last place of the dtype in half precision
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


def ulps_off(got: Tensor, reference: Tensor) -> Tensor:
    """|got - reference| in units in the last place of ``reference.dtype`` at the reference's
    magnitude (the gap from |reference| to the next representable number above it)."""
    magnitude = reference.abs()
    ulp = torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude
    return (got.double() - reference.double()).abs() / ulp.double()


def kernel_error(got: Tensor, reference: Tensor) -> dict:
    """The largest absolute and ulp errors of ``got`` against ``reference`` and whether they meet
    :data:`KERNEL_TOLERANCE` for its dtype."""
    measure, limit = KERNEL_TOLERANCE[reference.dtype]
    got, reference = got.detach(), reference.detach()
    absolute = float((got.double() - reference.double()).abs().max()) if got.numel() else 0.0
    ulps = float(ulps_off(got, reference).max()) if got.numel() else 0.0
    return {"absolute": absolute, "ulps": ulps, "pass": (absolute if measure == "absolute" else ulps) <= limit}
