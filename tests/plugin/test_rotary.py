"""Properties of the RoPE functions (fairseq_rope/modules/rotary.py)."""

import math

import pytest
import torch
from support.models import table_cos_sin

from fairseq_rope.modules.rotary import (
    apply_rotary,
    apply_rotary_,
    interleaved_to_half_permutation,
    inverse_frequencies,
    positions_from_padding_mask,
    rotary_dim_for,
    rotation_angles,
)
from fairseq_rope.modules.rotary_embedding import RotaryEmbedding

LAYOUTS = ["interleaved", "half"]


def rotate_at(x, positions, rotary_dim, layout, theta=10000.0):
    """Rotate x (..., len(positions), d) by per-row positions through the model's cos/sin table."""
    positions = torch.as_tensor(positions)
    cos, sin = table_cos_sin(RotaryEmbedding(rotary_dim, theta), positions, int(positions.max()) + 1)
    return apply_rotary(x, cos, sin, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_score_depends_only_on_relative_position(layout, rotary_dim):
    # eq. (16): <R_m q, R_n k> = q^T R_{n-m} k -- the same for every shift of (m, n).
    torch.manual_seed(0)
    q, k = torch.randn(1, 64), torch.randn(1, 64)
    for m, n in [(0, 5), (3, 0), (7, 7), (10, 2)]:
        scores = []
        for shift in [0, 1, 17, 250, 1000]:
            rq = rotate_at(q, [m + shift], rotary_dim, layout)
            rk = rotate_at(k, [n + shift], rotary_dim, layout)
            scores.append((rq * rk).sum())
        scores = torch.stack(scores)
        assert torch.allclose(scores, scores[0].expand_as(scores), atol=1e-5, rtol=1e-5), (m, n, scores)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_different_relative_positions_give_different_scores(layout):
    # the invariance above is not vacuous: the score does change with n - m
    torch.manual_seed(0)
    q, k = torch.randn(1, 64), torch.randn(1, 64)
    s = [(rotate_at(q, [0], 64, layout) * rotate_at(k, [d], 64, layout)).sum() for d in range(4)]
    assert len({round(float(v), 4) for v in s}) == 4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotation_preserves_norm(layout):
    torch.manual_seed(0)
    x = torch.randn(50, 64)
    rotated = rotate_at(x, torch.arange(50) * 37, 64, layout)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert not torch.allclose(rotated[1:], x[1:], atol=1e-3)  # and it does rotate


def test_position_zero_is_identity():
    x = torch.randn(3, 64)
    for layout in LAYOUTS:
        assert torch.allclose(rotate_at(x, [0, 0, 0], 64, layout), x)


@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_interleaved_equals_half_after_permutation(rotary_dim):
    torch.manual_seed(0)
    x = torch.randn(10, 64)
    positions = torch.arange(10) * 3
    perm = interleaved_to_half_permutation(64, rotary_dim)
    interleaved = rotate_at(x, positions, rotary_dim, "interleaved")
    half = rotate_at(x[:, perm], positions, rotary_dim, "half")
    assert torch.allclose(half, interleaved[:, perm], atol=1e-6)
    assert not torch.allclose(rotate_at(x, positions, rotary_dim, "half"), interleaved, atol=1e-3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_rotation_leaves_other_dims_untouched(layout):
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    out = rotate_at(x, torch.arange(8) + 5, 16, layout)
    assert torch.equal(out[:, 16:], x[:, 16:])
    assert not torch.allclose(out[:, :16], x[:, :16], atol=1e-3)
    assert torch.allclose(out[:, :16].norm(dim=-1), x[:, :16].norm(dim=-1), rtol=1e-5)


def test_matches_block_diagonal_matrix_of_eq_15():
    # build R^d_{Theta,m} explicitly as a matrix and compare
    d, m, theta = 8, 11, 10000.0
    x = torch.randn(d, dtype=torch.float64)
    R = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d // 2):
        a = m * theta ** (-2 * i / d)
        R[2 * i:2 * i + 2, 2 * i:2 * i + 2] = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
    expected = R @ x
    got = rotate_at(x.float()[None], [m], d, "interleaved")[0].double()
    assert torch.allclose(got, expected, atol=1e-6)


def test_table_angles_are_fp64_accurate():
    positions = torch.tensor([0, 1, 4095, 8191, 8192, 20000])
    cos, sin = table_cos_sin(RotaryEmbedding(64, 10000.0), positions, 20001)
    assert cos.dtype == sin.dtype == torch.float32
    exact = rotation_angles(positions, inverse_frequencies(64, 10000.0, dtype=torch.float64))
    assert torch.allclose(cos.double(), exact.cos(), atol=1e-7)
    assert torch.allclose(sin.double(), exact.sin(), atol=1e-7)


def test_positions_from_left_padding_mask():
    mask = torch.tensor([[True, True, False, False, False], [False, False, False, False, False]])
    assert positions_from_padding_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("head_dim,fraction,expected", [(64, 1.0, 64), (64, 0.5, 32), (64, 0.25, 16)])
def test_rotary_dim(head_dim, fraction, expected):
    assert rotary_dim_for(head_dim, fraction) == expected


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, 0.3, 1 / 64])
def test_rotary_dim_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match="--rope-fraction"):
        rotary_dim_for(64, fraction)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotary_dim", [16, 8])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_in_place_rotation_equals_out_of_place(layout, dtype, rotary_dim, strided):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 2, 16, generator=g).to(dtype)
    if strided:  # a time-first view of batch-first heads, as attention sees them
        x = x.permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3)
    positions = torch.arange(6) + 1000
    cos, sin = table_cos_sin(RotaryEmbedding(rotary_dim, 10000.0), positions, 1006)
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]
    expected = apply_rotary(x, cos, sin, layout)
    y = x.clone()
    assert apply_rotary_(y, torch.complex(cos, sin), layout) is y
    assert torch.equal(y, expected) if dtype in (torch.float16, torch.bfloat16) else torch.allclose(
        y, expected, rtol=0, atol=1e-6
    )
    assert torch.equal(y[..., rotary_dim:], x[..., rotary_dim:])
