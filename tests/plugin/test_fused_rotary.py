"""The rotation used by ``RotaryMultiheadAttention.rotate``: the fused CUDA kernel gives the
reference ``apply_rotary`` numbers, forward and backward.

The CUDA tests are skipped without a GPU and Triton; the CPU tests check the fallback. The kernel
itself also runs on the CPU, under Triton's interpreter: test_fused_rotary_interpreter.py,
test_fused_rotary_models.py; test_fused_rotary_compile.py compiles it for sm_80 and sm_90."""

import pytest
import torch
from support.models import rotate, table_cos_sin

from fairseq_rope.modules import fused_rotary
from fairseq_rope.modules.fused_rotary import fused_available, fused_rotate
from fairseq_rope.modules.rotary import LAYOUTS, apply_rotary
from fairseq_rope.modules.rotary_embedding import RotaryEmbedding
from fairseq_rope.modules.rotary_multihead_attention import RotaryMultiheadAttention

needs_fused = pytest.mark.skipif(
    not (torch.cuda.is_available() and fused_available()), reason="needs CUDA and Triton"
)


def reference(x, table, positions, layout, max_position):
    """The reference rotation of time-first ``x`` with autograd through ``apply_rotary``."""
    cos, sin = table_cos_sin(table, positions, max_position)
    if positions.dim() == 1:
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]
    else:
        cos, sin = cos.transpose(0, 1)[:, :, None, :], sin.transpose(0, 1)[:, :, None, :]
    return apply_rotary(x, cos, sin, layout)


def positions_for(kind, T, B, device):
    if kind == "shared":
        return torch.arange(3, 3 + T, device=device)
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, T + 3, (B, T), generator=g).to(device)


def test_non_contiguous_input_gives_the_same_rotation():
    """Permuted views (as gradients arrive from batch-first attention) are rotated without a copy
    and give the numbers of their contiguous copy (up to the rounding of the vectorised loop)."""
    torch.manual_seed(0)
    table = RotaryEmbedding(8, 10000.0)
    cos, sin = table_cos_sin(table, torch.arange(4), 4)
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]
    x = torch.randn(2, 3, 4, 8).permute(2, 0, 1, 3)  # (T, B, H, D) view of a batch-first tensor
    for layout in LAYOUTS:
        torch.testing.assert_close(
            apply_rotary(x, cos, sin, layout), apply_rotary(x.contiguous(), cos, sin, layout), rtol=0, atol=1e-6
        )
    odd = torch.randn(4, 2, 3, 9)[..., 1:]  # odd storage offset: view_as_complex cannot view it
    torch.testing.assert_close(apply_rotary(odd, cos, sin), apply_rotary(odd.contiguous(), cos, sin), rtol=0, atol=1e-6)


def test_rotate_falls_back_to_reference_on_cpu():
    torch.manual_seed(0)
    attn = RotaryMultiheadAttention(32, 4, self_attention=True)
    x = torch.randn(6, 2, 4, 8)
    assert not (x.is_cuda and fused_available())
    for positions in (torch.arange(6), torch.randint(0, 6, (2, 6))):
        expected = reference(x, attn.rotary, positions, attn.rotary.layout, 6)
        assert torch.equal(rotate(attn, x, positions, 6), expected)


def test_rotate_backward_is_the_inverse_rotation_on_cpu():
    """The gradient through ``rotate`` is the inverse rotation of the incoming gradient."""
    torch.manual_seed(0)
    attn = RotaryMultiheadAttention(32, 4, self_attention=True)
    positions = torch.arange(6)
    x = torch.randn(6, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    out = rotate(attn, x, positions, 6)
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, x, grad)
    rotations = attn.rotary.rotations(positions, 6)
    cos, sin = rotations.real, rotations.imag
    inverse = apply_rotary(grad, cos.double(), -sin.double(), attn.rotary.layout)
    torch.testing.assert_close(got, inverse, rtol=0, atol=1e-12)


def test_fused_path_reports_unavailable_without_cuda(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert not fused_available()
    with pytest.raises(RuntimeError):
        fused_rotate([torch.zeros(1, 1, 1, 2)], torch.ones(1, 1), torch.zeros(1, 1), torch.zeros(1, dtype=torch.long))


# ------------------------------------------------------------------------------------ CUDA


@needs_fused
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (64, 32), (48, 16)])
@pytest.mark.parametrize("kind", ["shared", "per_sentence"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_matches_reference_forward_and_backward(layout, head_dim, rotary_dim, kind, dtype):
    torch.manual_seed(0)
    T, B, H = 7, 5, 6
    device = "cuda"
    table = RotaryEmbedding(rotary_dim, 10000.0)
    positions = positions_for(kind, T, B, device)
    q = torch.randn(T, B, H, head_dim, device=device, dtype=dtype, requires_grad=True)
    # k a permuted view, as fairseq's batch-first caches and gradients are
    k = torch.randn(B, H, T, head_dim, device=device, dtype=dtype).permute(2, 0, 1, 3).requires_grad_()
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    exp_q = reference(q, table, positions, layout, T + 3)
    exp_k = reference(k, table, positions, layout, T + 3)
    exp_grads = torch.autograd.grad((exp_q, exp_k), (q, k), (gq, gk))

    cos_t, sin_t, _ = table.tables(T + 3, positions.device)
    got_q, got_k = fused_rotate([q, k], cos_t, sin_t, positions, layout)  # one launch for both
    got_grads = torch.autograd.grad((got_q, got_k), (q, k), (gq, gk))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for got, exp in zip((got_q, got_k, *got_grads), (exp_q, exp_k, *exp_grads)):
        assert got.dtype == exp.dtype and got.shape == exp.shape
        torch.testing.assert_close(got, exp, rtol=tol, atol=tol)


@needs_fused
def test_rotate_dispatches_to_fused_kernel_on_cuda():
    torch.manual_seed(0)
    attn = RotaryMultiheadAttention(64, 4, self_attention=True).cuda()
    x = torch.randn(9, 3, 4, 16, device="cuda", requires_grad=True)
    assert x.is_cuda and fused_available()
    positions = torch.arange(9, device="cuda")
    out = rotate(attn, x, positions, 9)
    assert "FusedRotaryFunction" in type(out.grad_fn).__name__
    torch.testing.assert_close(out, reference(x, attn.rotary, positions, attn.rotary.layout, 9), rtol=1e-5, atol=1e-5)


@needs_fused
def test_fused_rotation_inside_the_model_matches_cpu():
    """A whole rotary attention layer on CUDA (fused) gives the CPU (reference) output."""
    torch.manual_seed(0)
    attn = RotaryMultiheadAttention(64, 4, self_attention=True).eval()
    x = torch.randn(11, 2, 64)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, :3] = True  # left padding: per-sentence positions
    expected, _ = attn(x, x, x, key_padding_mask=mask, need_weights=False)
    got, _ = attn.cuda()(x.cuda(), x.cuda(), x.cuda(), key_padding_mask=mask.cuda(), need_weights=False)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)
    assert fused_rotary._KERNEL not in (None, False)


def test_a_triton_without_tl_join_leaves_the_reference_path(monkeypatch, caplog):
    """The kernel takes pairs apart with tl.split / tl.join (Triton 3.0): torch 2.1-2.3 bring a
    Triton 2.x, which must mean the reference rotation with a warning, not a failed first step."""
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # where the kernel would run on this machine
    monkeypatch.setattr(fused_rotary, "_KERNEL", None)
    monkeypatch.setattr(triton, "__version__", "2.2.0")
    assert not fused_rotary.fused_runs_on("cpu")
    assert "Triton 2.2.0 is older than 3.0" in caplog.text
    assert fused_rotary.triton_release("3.6.0+git1a2b") == (3, 6, 0) >= fused_rotary.TRITON_FLOOR


def test_fairseq_rope_fused_switches_the_kernel_off_and_refuses_other_values(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused_rotary, "_KERNEL", None)
    if not fused_rotary.fused_runs_on("cpu"):
        pytest.skip("Triton's interpreter does not run the fused kernel here")
    monkeypatch.setenv(fused_rotary.FUSED_SWITCH, "0")
    assert not fused_rotary.fused_runs_on("cpu")  # the same model, the reference rotation
    monkeypatch.setenv(fused_rotary.FUSED_SWITCH, "yes")
    with pytest.raises(fused_rotary.OptionError, match="^FAIRSEQ_ROPE_FUSED='yes': set it to 1"):
        fused_rotary.fused_switched_on()
