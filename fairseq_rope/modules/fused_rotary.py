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
:func:`fused_available` is False and ``RotaryEmbedding.rotate`` uses another backend. So does
``FAIRSEQ_ROPE_FUSED=0`` (:func:`fused_switched_on`): the same model with the reference rotation,
to time the kernel against it or to rule it out when a result looks wrong.

Under Triton's interpreter (``TRITON_INTERPRET=1``, read by Triton when it is imported) the same
kernel runs on CPU tensors, element for element in numpy: slow, but it computes what the compiled
kernel computes, so the kernel and every model path through it are tested on machines without a
GPU (:func:`fused_runs_on`).
"""

import logging
import os
import re
from typing import Dict, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..config_values import OptionError
from .rotary import RotateInPlace, check_layout, next_power_of_two

logger = logging.getLogger(__name__)
_KERNEL = None  # None: not tried yet; False: unavailable; otherwise the jitted kernel
FUSED_SWITCH = "FAIRSEQ_ROPE_FUSED"
# (elements per program, warps) of a launch, by layout and element size in bytes: the fastest of
# an H200 sweep of tiles 1024-16384 and 1-8 warps (docs/gpu.md has the figures)
TILES = {("interleaved", 2): (1024, 1), ("half", 2): (2048, 8), ("interleaved", 4): (2048, 4)}
DEFAULT_TILE = (4096, 4)  # combinations the sweep did not measure
# the kernel's integer arguments that vary with the batch: its size, the token count, the position
# strides (a (B, T) table's row stride is T)
UNSPECIALIZED = ("batch", "rows", "sp_t", "sp_b")


# --------------------------------------------------------------------------------------------
# Triton


def _build_kernel():
    import triton
    import triton.language as tl

    # Triton compiles a variant per value class (== 1, a multiple of 16, other) of each integer
    # argument: the ones that change with every batch and decoding step are left out, or a GPU
    # compiles anew in the middle of generation (docs/gpu.md: what that cost)
    @triton.jit(do_not_specialize=UNSPECIALIZED)
    def rotary_kernel(
        x_ptr, ox_ptr, y_ptr, oy_ptr, cos_ptr, sin_ptr, pos_ptr,
        batch, rows,
        sx_t, sx_b, sx_h,  # strides of x (elements); the last dimension is contiguous
        sox_t, sox_b, sox_h,  # strides of its output
        sy_t, sy_b, sy_h,  # strides of y
        soy_t, soy_b, soy_h,  # strides of its output
        sp_t, sp_b,  # position strides: (T,) positions have sp_b == 0
        heads, head_dim, table_stride,
        SIGN: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
    ):
        # program (block, which): every head of tokens ``row`` = (t, b) in ROWS consecutive rows
        # of x (which == 0) or y (1); a tile (ROWS, BLOCK_H, BLOCK_D) read and written whole and
        # in order, so that each row of a head is one contiguous access
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = row < rows
        t = row // batch
        b = row % batch
        if tl.program_id(1) == 0:
            x_base = x_ptr
            o_base = ox_ptr
            x_row = t * sx_t + b * sx_b
            o_row = t * sox_t + b * sox_b
            s_h = sx_h
            so_h = sox_h
        else:
            x_base = y_ptr
            o_base = oy_ptr
            x_row = t * sy_t + b * sy_b
            o_row = t * soy_t + b * soy_b
            s_h = sy_h
            so_h = soy_h
        pos = tl.load(pos_ptr + t * sp_t + b * sp_b, mask=row_ok, other=0)

        j = tl.arange(0, BLOCK_D)
        h = tl.arange(0, BLOCK_H)
        mask = row_ok[:, None, None] & (h < heads)[None, :, None] & (j < head_dim)[None, None, :]
        x_at = x_base + x_row[:, None, None] + h[None, :, None] * s_h + j[None, None, :]
        o_at = o_base + o_row[:, None, None] + h[None, :, None] * so_h + j[None, None, :]
        # the whole tile read once, in order (vectorised loads), the pairs taken apart in registers
        x = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
        if INTERLEAVED:  # pairs (2i, 2i + 1): the last dimension seen as (BLOCK_D / 2, 2)
            i = tl.arange(0, BLOCK_D // 2)
            rotated = (i < HALF)[None, None, :]  # pairs beyond rotary_dim / 2 pass through unchanged
            table = pos[:, None] * table_stride + i[None, :]
            table_ok = row_ok[:, None] & (i < HALF)[None, :]
            cos = tl.load(cos_ptr + table, mask=table_ok, other=1.0)[:, None, :]
            sin = (tl.load(sin_ptr + table, mask=table_ok, other=0.0) * SIGN)[:, None, :]
            x1, x2 = tl.split(tl.reshape(x, (ROWS, BLOCK_H, BLOCK_D // 2, 2)))
            out1 = tl.where(rotated, x1 * cos - x2 * sin, x1)
            out2 = tl.where(rotated, x2 * cos + x1 * sin, x2)
            out = tl.reshape(tl.join(out1, out2), (ROWS, BLOCK_H, BLOCK_D))
        else:  # pairs (i, i + HALF): channel j meets its partner j +- HALF, read again (from cache)
            first = j < HALF
            rotated = (j < 2 * HALF)[None, None, :]  # channels beyond rotary_dim pass through unchanged
            pair = tl.where(first, j, j - HALF)
            table = pos[:, None] * table_stride + pair[None, :]
            table_ok = row_ok[:, None] & (j < 2 * HALF)[None, :]
            cos = tl.load(cos_ptr + table, mask=table_ok, other=1.0)[:, None, :]
            # out_j = x_j cos - x_{j+HALF} sin in the first half, x_j cos + x_{j-HALF} sin in the second
            signs = tl.where(first, -SIGN, SIGN)[None, :]
            sin = (tl.load(sin_ptr + table, mask=table_ok, other=0.0) * signs)[:, None, :]
            # the partners as two shifted reads, each contiguous (vectorised), each masked to its half
            x_plus = tl.load(x_at + HALF, mask=mask & first[None, None, :], other=0.0)
            x_minus = tl.load(x_at - HALF, mask=mask & (rotated & ~first[None, None, :]), other=0.0)
            x_partner = tl.where(first[None, None, :], x_plus, x_minus).to(tl.float32)
            out = tl.where(rotated, x * cos + x_partner * sin, x)
        tl.store(o_at, out.to(o_base.dtype.element_ty), mask=mask)

    return rotary_kernel


def interpreting() -> bool:
    """True when Triton's interpreter runs kernels on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fused_switched_on() -> bool:
    """``FAIRSEQ_ROPE_FUSED``: 1 (the default) uses the kernel wherever it runs, 0 never. Read at
    every call, so that one process can time both."""
    value = os.environ.get(FUSED_SWITCH, "1")
    if value not in ("0", "1"):
        raise OptionError(f"{FUSED_SWITCH}={value!r}: set it to 1 (the fused kernel, the default) or 0 "
                          "(the reference rotation), or unset it")
    return value == "1"


# the kernel takes the pairs of a tile apart with tl.split / tl.join, which Triton 3.0 brought
TRITON_FLOOR = (3, 0)


def triton_release(version: str) -> Tuple[int, ...]:
    """``3.6.0`` -> (3, 6, 0); a pre-release or local build counts as its release."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def fused_available() -> bool:
    """True when a Triton >= 3.0 imports and CUDA is up or its interpreter is on (checked once,
    lazily); an older Triton (torch 2.1-2.3 bring 2.x) leaves the reference path, with a warning."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = False
        if torch.cuda.is_available() or interpreting():
            try:
                import triton

                if triton_release(triton.__version__) < TRITON_FLOOR:
                    logger.warning(f"Triton {triton.__version__} is older than 3.0, which the fused rotation "
                                   "needs: RoPE rotates without it (pip install 'triton>=3.0' for the kernel)")
                    return False
                _KERNEL = _build_kernel()
            except Exception:  # no Triton, or one that does not work here: reference path
                _KERNEL = False
    return _KERNEL is not False


def fused_runs_on(device) -> bool:
    """Whether tensors on ``device`` go through the kernel: CUDA ones, or CPU ones under the
    interpreter, unless ``FAIRSEQ_ROPE_FUSED=0``. Without ``TRITON_INTERPRET=1`` nothing on the
    CPU changes."""
    device_type = torch.device(device).type
    on_device = device_type == "cuda" or (device_type == "cpu" and interpreting())
    return on_device and fused_switched_on() and fused_available()


def launch_tile(layout: str, element_size: int) -> Tuple[int, int]:
    """(elements per program, warps) of a launch on tensors of ``element_size`` bytes."""
    return TILES.get((layout, element_size), DEFAULT_TILE)


def kernel_constexprs(heads: int, head_dim: int, rotary_dim: int, layout: str,
                      sign: float, element_size: int) -> Dict[str, Union[bool, float, int]]:
    """The compile-time arguments of one launch on (time, batch, ``heads``, ``head_dim``) tensors
    of ``element_size`` bytes rotating ``rotary_dim`` channels: each distinct value is a separate
    compilation of the kernel (the ahead-of-time compile tests build every one a model can ask
    for from this function)."""
    block_h, block_d = next_power_of_two(heads), next_power_of_two(head_dim)
    tile_elements, _ = launch_tile(layout, element_size)
    return dict(
        SIGN=sign,
        HALF=rotary_dim // 2,
        INTERLEAVED=layout == "interleaved",
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        # rows per program: tiles of about tile_elements, so that small heads still make work
        # enough per program to keep the memory system busy
        ROWS=max(1, tile_elements // (block_h * block_d)),
    )


def launch_arguments(xs: Sequence[Tensor], outs: Sequence[Tensor], cos_table: Tensor, sin_table: Tensor,
                     positions: Tensor, layout: str, sign: float):
    """(grid, arguments, keyword arguments) of the kernel launch that rotates ``xs`` (one tensor,
    or two of the same shape and dtype, the last dimension contiguous) into ``outs``."""
    x, ox = xs[0], outs[0]
    y, oy = (xs[1], outs[1]) if len(xs) == 2 else (x, ox)
    if positions.dim() == 1:
        sp_t, sp_b = positions.stride(0), 0
    else:
        sp_b, sp_t = positions.stride(0), positions.stride(1)
    T, B, H, D = x.shape
    constexprs = kernel_constexprs(H, D, 2 * cos_table.size(-1), layout, sign, x.element_size())
    arguments = (
        x, ox, y, oy, cos_table, sin_table, positions,
        B, T * B,
        x.stride(0), x.stride(1), x.stride(2),
        ox.stride(0), ox.stride(1), ox.stride(2),
        y.stride(0), y.stride(1), y.stride(2),
        oy.stride(0), oy.stride(1), oy.stride(2),
        sp_t, sp_b,
        H, D, cos_table.stride(0),
    )
    num_warps = launch_tile(layout, x.element_size())[1]
    return (-(-T * B // constexprs["ROWS"]), len(xs)), arguments, dict(num_warps=num_warps, **constexprs)


def _launch(xs: Sequence[Tensor], cos_table: Tensor, sin_table: Tensor, positions: Tensor,
            layout: str, sign: float, in_place: bool = False) -> Tuple[Tensor, ...]:
    """One launch for one tensor or for two of the same shape and dtype (q and k), into new
    tensors or, ``in_place``, over ``xs`` (each program reads its whole tile before it writes it,
    and no two programs touch the same element)."""
    assert len(xs) in (1, 2), "one or two tensors per launch"
    if in_place:
        assert all(x.stride(-1) == 1 for x in xs), "an in-place rotation needs a contiguous last dimension"
    xs = [x if x.stride(-1) == 1 else x.contiguous() for x in xs]
    if len(xs) == 2 and (xs[0].shape != xs[1].shape or xs[0].dtype != xs[1].dtype):
        return _launch(xs[:1], cos_table, sin_table, positions, layout, sign, in_place) + _launch(
            xs[1:], cos_table, sin_table, positions, layout, sign, in_place
        )
    outs = xs if in_place else [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    if xs[0].shape[0] * xs[0].shape[1] > 0:
        grid, arguments, options = launch_arguments(xs, outs, cos_table, sin_table, positions, layout, sign)
        _KERNEL[grid](*arguments, **options)
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


def _kernel_positions(xs: Sequence[Tensor], layout: str, positions: Tensor) -> Tensor:
    check_layout(layout)
    if not fused_runs_on(xs[0].device):
        raise RuntimeError("fused rotary needs Triton and CUDA tensors, or CPU ones under TRITON_INTERPRET=1, "
                           f"and {FUSED_SWITCH} unset or 1")
    return positions.to(device=xs[0].device, dtype=torch.long)


def fused_rotate(xs: Sequence[Tensor], cos_table: Tensor, sin_table: Tensor, positions: Tensor,
                 layout: str = "interleaved"):
    """Rotate time-first tensors ``xs`` (each (T, B, H, D)) by ``positions`` ((T,) or (B, T)),
    reading fp32 ``cos_table``/``sin_table`` ((L, rotary_dim // 2), L > max position)."""
    positions = _kernel_positions(xs, layout, positions)
    return FusedRotaryFunction.apply(cos_table, sin_table, positions, layout, *xs)


def fused_rotate_(xs: Sequence[Tensor], cos_table: Tensor, sin_table: Tensor, positions: Tensor,
                  layout: str, heads_shape: Tuple[int, int, int, int], heads: slice = slice(None)):
    """:func:`fused_rotate` in place (:class:`~.rotary.RotateInPlace`): ``heads`` of each of ``xs``
    (tensors nothing else reads, not views) seen as time-first ``heads_shape``; returns ``xs``.
    Joining rotated q and k to v again, as the kernel's first use in attention did, took 4.4 % of an
    H200's time in a base model's fp16 training step (docs/gpu.md)."""
    positions = _kernel_positions(xs, layout, positions)

    def rotate_(views, inverse):
        _launch(views, cos_table, sin_table, positions, layout, -1.0 if inverse else 1.0, in_place=True)

    rotated = RotateInPlace.apply(rotate_, heads_shape, heads, *xs)
    return list(rotated) if len(xs) > 1 else [rotated]


__all__ = ["FUSED_SWITCH", "fused_available", "fused_rotate", "fused_rotate_", "fused_runs_on", "fused_switched_on",
           "interpreting", "kernel_constexprs", "launch_arguments", "launch_tile"]
