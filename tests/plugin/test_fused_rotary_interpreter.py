"""The fused Triton rotation kernel, executed by Triton's interpreter on CPU tensors, against
the rotation computed from its definition (``rotation_reference.rotation_from_definition``),
forward and backward: every path of the kernel runs in the normal suite on a machine without a
GPU.

Tolerances (``rotation_reference.KERNEL_TOLERANCE``, which gpu_check.py applies on a GPU): fp32
within 1e-6; fp16 and bf16 within one unit in the last place of the output dtype, taken at the
magnitude of the exactly rounded reference, beyond the error fp32 arithmetic may make
(``arithmetic_bound``), so an output one representable number away passes and two away fail. Shapes are small: the interpreter runs each (token, tensor) program in numpy,
a few ms each (about 10 s in all on one core)."""

import pytest
import torch

from fairseq_rope.modules.rotary import LAYOUTS
from fairseq_rope.modules.rotary_embedding import RotaryEmbedding
from fairseq_rope.modules.rotation_reference import kernel_error, time_first_rows

pytestmark = pytest.mark.usefixtures("one_thread")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def assert_close_to_reference(got, x, cos, sin, layout):
    """``got`` within ``KERNEL_TOLERANCE`` of the rotation of ``x`` from its definition: 1e-6 in
    fp32, one ulp (beyond fp32 arithmetic's bound) in fp16/bf16."""
    assert got.dtype == x.dtype and got.shape == x.shape
    error = kernel_error(got, x, cos, sin, layout)
    assert error["pass"], f"{got.dtype}: {error['absolute']:.3g} absolute, {error['ulps']:.2f} ulp off the reference"


def table_rows(rotary, positions, length):
    """cos and sin of each position of ``rotary``'s tables, time-first."""
    cos_table, sin_table, _ = rotary.tables(length, positions.device)
    return time_first_rows(cos_table, sin_table, positions)


def make_positions(kind, T, B):
    if kind == "shared":  # (T,): one sequence, the offset of an incremental step
        return torch.arange(2, 2 + T)
    g = torch.Generator().manual_seed(1)  # (B, T): per sentence (left padding, cross-attention)
    return torch.randint(0, T + 3, (B, T), generator=g)


def make_inputs(form, T, B, H, D, dtype, g):
    """One or two (T, B, H, D) tensors laid out as the model hands them to the kernel."""
    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if form == "single":  # cross-attention's query projection: (T * B, H * D) rows
        return [randn(T * B, H * D).view(T, B, H, D)]
    if form == "pair":  # q and k of the same shape, one launch
        return [randn(T, B, H, D), randn(T, B, H, D)]
    if form == "fused_qkv_heads":  # self-attention: the first 2H heads of the q/k/v projection
        return [randn(T * B, 3 * H * D).view(T, B, 3 * H, D)[:, :, : 2 * H]]
    if form == "fused_qkv_pair":  # q and k as strided views of the same q/k/v projection
        qkv = randn(T * B, 3 * H * D).view(T, B, 3, H, D)
        return [qkv[:, :, 0], qkv[:, :, 1]]
    if form == "batch_first_pair":  # permuted views, as batch-first caches and gradients arrive
        return [randn(B, H, T, D).permute(2, 0, 1, 3), randn(B, H, T, D).permute(2, 0, 1, 3)]
    raise ValueError(form)


# (head_dim, rotary_dim, heads, positions, form): every head dim asked for, head counts that are
# not powers of two, partial rotation, both position kinds and every input form, each at least once
CASES = [
    (16, 16, 3, "shared", "pair"),
    (24, 24, 5, "per_sentence", "single"),
    (64, 32, 3, "per_sentence", "fused_qkv_heads"),
    (80, 80, 3, "shared", "fused_qkv_pair"),
    (80, 16, 1, "per_sentence", "batch_first_pair"),
    (128, 128, 2, "per_sentence", "pair"),
    (128, 96, 6, "shared", "single"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim, rotary_dim, heads, kind, form", CASES, ids=lambda v: str(v))
def test_kernel_matches_the_reference_forward_and_backward(
    kernel_launches, head_dim, rotary_dim, heads, kind, form, layout, dtype
):
    T, B = 3, 2
    g = torch.Generator().manual_seed(head_dim + rotary_dim + heads)
    rotary = RotaryEmbedding(rotary_dim, 10000.0, layout)
    positions = make_positions(kind, T, B)
    cos_table, sin_table, _ = rotary.tables(T + 3, "cpu")
    cos, sin = table_rows(rotary, positions, T + 3)
    xs = [x.requires_grad_() for x in make_inputs(form, T, B, heads, head_dim, dtype, g)]

    from fairseq_rope.modules.fused_rotary import fused_rotate

    outs = fused_rotate(xs, cos_table, sin_table, positions, layout)
    outs = [outs] if len(xs) == 1 else list(outs)
    grads_out = [torch.randn(x.shape, generator=g).to(dtype) for x in xs]
    grads_in = torch.autograd.grad(outs, xs, grads_out)
    assert len(kernel_launches) == 2 and all(len(shapes) == len(xs) for shapes in kernel_launches)

    for x, out, grad_out, grad_in in zip(xs, outs, grads_out, grads_in):
        assert_close_to_reference(out, x, cos, sin, layout)
        # d(R x)/dx applied to a gradient is R^T = the rotation by -m
        assert_close_to_reference(grad_in, grad_out, cos, -sin, layout)
        # channels beyond rotary_dim pass through bit for bit, both ways
        assert torch.equal(out[..., rotary_dim:], x.detach()[..., rotary_dim:])
        assert torch.equal(grad_in[..., rotary_dim:], grad_out[..., rotary_dim:])


@pytest.mark.parametrize("form", ["single", "pair"])
@pytest.mark.parametrize("shape", [(0, 2), (3, 0)], ids=["no-tokens", "empty-batch"])
def test_empty_inputs_give_empty_outputs_and_gradients(kernel_launches, shape, form):
    from fairseq_rope.modules.fused_rotary import fused_rotate

    T, B = shape
    rotary = RotaryEmbedding(16)
    cos_table, sin_table, _ = rotary.tables(4, "cpu")
    xs = [torch.randn(T, B, 3, 16, requires_grad=True) for _ in range(1 if form == "single" else 2)]
    for positions in (torch.arange(T), torch.zeros(B, T, dtype=torch.long)):
        outs = fused_rotate(xs, cos_table, sin_table, positions)
        outs = [outs] if len(xs) == 1 else list(outs)
        grads = torch.autograd.grad(outs, xs, [torch.ones_like(o) for o in outs])
        assert [o.shape for o in outs] == [x.shape for x in xs] == [g.shape for g in grads]
    assert len(kernel_launches) == 4  # forward and backward of each position kind, nothing launched


def test_rotate_sends_cpu_tensors_to_the_kernel(kernel_launches):
    """Under the interpreter the model's rotation goes through the kernel, forward and backward."""
    from support.models import rotate

    from fairseq_rope.modules.rotary_multihead_attention import RotaryMultiheadAttention

    attn = RotaryMultiheadAttention(32, 4, self_attention=True)
    x = torch.randn(3, 2, 4, 8, requires_grad=True)
    positions = torch.arange(3)
    out = rotate(attn, x, positions, 3)
    assert kernel_launches == [[(3, 2, 4, 8)]]
    cos, sin = table_rows(attn.rotary, positions, 3)
    assert_close_to_reference(out, x, cos, sin, attn.rotary.layout)
    out.backward(torch.ones_like(out))
    assert len(kernel_launches) == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qkv", [False, True], ids=["one-projection", "q-and-k-of-qkv"])
def test_the_in_place_rotation_writes_over_its_input_as_the_reference_rotates(kernel_launches, qkv, layout, dtype):
    """``fused_rotate_`` rotates the given heads of a projection output where it lies, forward and
    backward (by -m), and leaves the other heads (v) bit for bit."""
    from fairseq_rope.modules.fused_rotary import fused_rotate_

    T, B, H, D, rotary_dim = 3, 2, 3, 16, 12
    g = torch.Generator().manual_seed(5)
    rotary = RotaryEmbedding(rotary_dim, 10000.0, layout)
    positions = make_positions("per_sentence", T, B)
    cos_table, sin_table, _ = rotary.tables(T + 3, "cpu")
    cos, sin = table_rows(rotary, positions, T + 3)
    shape = (T, B, 3 * H if qkv else H, D)
    heads = slice(None, 2 * H) if qkv else slice(None)
    leaf = torch.randn(T * B, shape[2] * D, generator=g).to(dtype).requires_grad_()
    x = leaf * 1.0  # a projection output: not a view, nothing else reads it
    before = x.detach().clone().view(shape)

    (out,) = fused_rotate_([x], cos_table, sin_table, positions, layout, shape, heads)
    assert out is x
    grad_out = torch.randn(x.shape, generator=g).to(dtype)
    (grad_in,) = torch.autograd.grad(out, leaf, grad_out.clone())  # a gradient nothing else reads
    assert kernel_launches == [[(T, B, 2 * H if qkv else H, D)]] * 2

    assert_close_to_reference(out.detach().view(shape)[:, :, heads], before[:, :, heads], cos, sin, layout)
    assert_close_to_reference(grad_in.view(shape)[:, :, heads], grad_out.view(shape)[:, :, heads], cos, -sin, layout)
    assert torch.equal(out.detach().view(shape)[:, :, 2 * H:], before[:, :, 2 * H:])
    assert torch.equal(grad_in.view(shape)[:, :, 2 * H:], grad_out.view(shape)[:, :, 2 * H:])


def test_self_attention_rotates_q_and_k_where_the_projection_wrote_them(kernel_launches):
    """No copy of the q/k/v projection: the rotated tensor is the projection's own."""
    from fairseq_rope.modules.rotary_multihead_attention import RotaryMultiheadAttention

    T, B, H, D = 3, 2, 4, 8
    attn = RotaryMultiheadAttention(H * D, H, self_attention=True)
    qkv = torch.randn(T * B, 3 * H * D, requires_grad=True) * 1.0
    pointer = qkv.data_ptr()
    (rotated,) = attn.rotary.rotate([qkv], torch.arange(T), T, (T, B, 3 * H, D), overwrite=True, rotated_heads=2 * H)
    assert kernel_launches == [[(T, B, 2 * H, D)]]
    assert rotated.data_ptr() == pointer
