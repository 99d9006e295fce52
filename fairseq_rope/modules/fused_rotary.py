"""A fused Triton rotation of queries and keys for CUDA.

The rotation is orthogonal, so its backward pass is the rotation by the opposite angle
(R(m theta)^T = R(-m theta)): only the fp32 table and the positions are kept for backward, never
a copy of the activations.

* :func:`fused_rotate` -- CUDA with Triton: one kernel launch rotates one tensor of fairseq's
  time-first layout (time, batch, heads, head_dim), or two of the same shape (q and k of
  self-attention) together, reading cos and sin straight from the fp32 table by position (shared
  ``(T,)`` or per sentence ``(B, T)``); the backward pass is the same kernel with the sign of sin
  flipped. Arithmetic is fp32 whatever the storage dtype and the result is cast back, as in the
  reference.

Triton is imported lazily, the first time a CUDA tensor asks for it; without CUDA or Triton,
:func:`fused_available` is False and ``RotaryEmbedding.rotate`` uses another backend.

Under Triton's interpreter (``TRITON_INTERPRET=1``, read by Triton when it is imported) the same
kernel runs on CPU tensors, element for element in numpy: slow, but it computes what the compiled
kernel computes, so the kernel and every model path through it are tested on machines without a
GPU (:func:`fused_runs_on`).
"""

import os
from typing import Dict, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .rotary import check_layout, next_power_of_two

_KERNEL = None  # None: not tried yet; False: unavailable; otherwise the jitted kernel


# --------------------------------------------------------------------------------------------
# Triton


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rotary_kernel(
        x_ptr, ox_ptr, y_ptr, oy_ptr, cos_ptr, sin_ptr, pos_ptr,
        batch,
        sx_t, sx_b, sx_h,  # strides of x (elements); the last dimension is contiguous
        sox_t, sox_b, sox_h,  # strides of its output
        sy_t, sy_b, sy_h,  # strides of y
        soy_t, soy_b, soy_h,  # strides of its output
        sp_t, sp_b,  # position strides: (T,) positions have sp_b == 0
        heads, head_dim, table_stride,
        SIGN: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    ):
        # program (row, which): all heads of token ``row`` = (t, b) of x (which == 0) or y (1)
        row = tl.program_id(0)
        t = row // batch
        b = row % batch
        if tl.program_id(1) == 0:
            x_row = x_ptr + t * sx_t + b * sx_b
            o_row = ox_ptr + t * sox_t + b * sox_b
            s_h = sx_h
            so_h = sox_h
        else:
            x_row = y_ptr + t * sy_t + b * sy_b
            o_row = oy_ptr + t * soy_t + b * soy_b
            s_h = sy_h
            so_h = soy_h
        pos = tl.load(pos_ptr + t * sp_t + b * sp_b)

        i = tl.arange(0, BLOCK_HALF)
        i_ok = i < HALF
        cos = tl.load(cos_ptr + pos * table_stride + i, mask=i_ok, other=0.0)
        sin = tl.load(sin_ptr + pos * table_stride + i, mask=i_ok, other=0.0) * SIGN
        h = tl.arange(0, BLOCK_H)[:, None]
        h_ok = h < heads
        if INTERLEAVED:  # pairs (2i, 2i + 1)
            first = 2 * i[None, :]
            second = first + 1
        else:  # pairs (i, i + rotary_dim / 2)
            first = i[None, :]
            second = first + HALF
        mask = h_ok & i_ok[None, :]
        x_h = x_row + h * s_h
        o_h = o_row + h * so_h
        x1 = tl.load(x_h + first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_h + second, mask=mask, other=0.0).to(tl.float32)
        c = cos[None, :]
        s = sin[None, :]
        tl.store(o_h + first, (x1 * c - x2 * s).to(o_h.dtype.element_ty), mask=mask)
        tl.store(o_h + second, (x2 * c + x1 * s).to(o_h.dtype.element_ty), mask=mask)
        if BLOCK_REST > 0:  # channels beyond rotary_dim pass through unchanged
            j = 2 * HALF + tl.arange(0, BLOCK_REST)[None, :]
            rest_mask = h_ok & (j < head_dim)
            tl.store(o_h + j, tl.load(x_h + j, mask=rest_mask), mask=rest_mask)

    return rotary_kernel


def interpreting() -> bool:
    """True when Triton's interpreter runs kernels on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fused_available() -> bool:
    """True when Triton imports and CUDA is up or its interpreter is on (checked once, lazily)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = False
        if torch.cuda.is_available() or interpreting():
            try:
                _KERNEL = _build_kernel()
            except Exception:  # no Triton, or one that does not work here: reference path
                _KERNEL = False
    return _KERNEL is not False


def fused_runs_on(device) -> bool:
    """Whether tensors on ``device`` go through the kernel: CUDA ones, or CPU ones under the
    interpreter. Without ``TRITON_INTERPRET=1`` nothing on the CPU changes."""
    device_type = torch.device(device).type
    on_device = device_type == "cuda" or (device_type == "cpu" and interpreting())
    return on_device and fused_available()


def kernel_constexprs(heads: int, head_dim: int, rotary_dim: int, layout: str,
                      sign: float) -> Dict[str, Union[bool, float, int]]:
    """The compile-time arguments of one launch on (time, batch, ``heads``, ``head_dim``) tensors
    rotating ``rotary_dim`` channels: each distinct value is a separate compilation of the kernel
    (the ahead-of-time compile tests build every one a model can ask for from this function)."""
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    return dict(
        SIGN=sign,
        HALF=half,
        INTERLEAVED=layout == "interleaved",
        BLOCK_H=next_power_of_two(heads),
        BLOCK_HALF=next_power_of_two(half),
        BLOCK_REST=next_power_of_two(rest) if rest > 0 else 0,
    )


def _launch(xs: Sequence[Tensor], cos_table: Tensor, sin_table: Tensor, positions: Tensor,
            layout: str, sign: float) -> Tuple[Tensor, ...]:
    """One launch for one tensor or for two of the same shape and dtype (q and k)."""
    assert len(xs) in (1, 2), "one or two tensors per launch"
    xs = [x if x.stride(-1) == 1 else x.contiguous() for x in xs]
    if len(xs) == 2 and (xs[0].shape != xs[1].shape or xs[0].dtype != xs[1].dtype):
        return _launch(xs[:1], cos_table, sin_table, positions, layout, sign) + _launch(
            xs[1:], cos_table, sin_table, positions, layout, sign
        )
    outs = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    x, ox = xs[0], outs[0]
    y, oy = (xs[1], outs[1]) if len(xs) == 2 else (x, ox)
    if positions.dim() == 1:
        sp_t, sp_b = positions.stride(0), 0
    else:
        sp_b, sp_t = positions.stride(0), positions.stride(1)
    T, B, H, D = x.shape
    half = cos_table.size(-1)
    if T * B > 0:
        _KERNEL[(T * B, len(xs))](
            x, ox, y, oy, cos_table, sin_table, positions,
            B,
            x.stride(0), x.stride(1), x.stride(2),
            ox.stride(0), ox.stride(1), ox.stride(2),
            y.stride(0), y.stride(1), y.stride(2),
            oy.stride(0), oy.stride(1), oy.stride(2),
            sp_t, sp_b,
            H, D, cos_table.stride(0),
            **kernel_constexprs(H, D, 2 * half, layout, sign),
        )
    return tuple(outs)


class FusedRotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cos_table, sin_table, positions, layout, *xs):
        ctx.save_for_backward(cos_table, sin_table, positions)
        ctx.layout = layout
        outs = _launch(xs, cos_table, sin_table, positions, layout, 1.0)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        cos_table, sin_table, positions = ctx.saved_tensors
        grads_in = _launch(grads, cos_table, sin_table, positions, ctx.layout, -1.0)
        return (None, None, None, None, *grads_in)


def fused_rotate(xs: Sequence[Tensor], cos_table: Tensor, sin_table: Tensor, positions: Tensor,
                 layout: str = "interleaved"):
    """Rotate time-first tensors ``xs`` (each (T, B, H, D)) by ``positions`` ((T,) or (B, T)),
    reading fp32 ``cos_table``/``sin_table`` ((L, rotary_dim // 2), L > max position)."""
    check_layout(layout)
    if not fused_runs_on(xs[0].device):
        raise RuntimeError("fused rotary needs Triton and CUDA tensors, or CPU ones under TRITON_INTERPRET=1")
    positions = positions.to(device=xs[0].device, dtype=torch.long)
    return FusedRotaryFunction.apply(cos_table, sin_table, positions, layout, *xs)


__all__ = ["fused_available", "fused_rotate", "fused_runs_on", "interpreting", "kernel_constexprs"]
