"""Every position-encoding variant: incremental decoding equals the full pass (also across a beam
reorder), left/right padding changes nothing, relative-only encodings are shift invariant, and
the attention modules equal their paper formulas written out naively."""

import math

import pytest
import torch
from support.models import model_with_dictionary

from fairseq_rope.modules import (
    LinearRotaryAttention,
    RelativePositionMultiheadAttention,
    RotaryMultiheadAttention,
)
from fairseq_rope.modules.linear_rotary_attention import causal_linear_attention, feature_map, linear_attention
from fairseq_rope.modules.relative_position_attention import relative_position_index
from fairseq_rope.modules.rotary_embedding import RotaryEmbedding

VARIANTS = {
    "rope": ("transformer_rope_tiny", []),
    "roper": ("transformer_rope_tiny", ["--rope-values"]),
    "roper_half_partial": ("transformer_rope_tiny", ["--rope-values", "--rope-layout", "half", "--rope-fraction", "0.5"]),
    "rope_linear": ("transformer_rope_tiny", ["--attention-kind", "linear"]),
    "rope_yarn": ("transformer_rope_tiny", ["--rope-values", "--rope-scaling", "yarn", "--rope-scaling-factor", "4",
                                            "--rope-scaling-original-length", "4"]),
    "rpe": ("transformer_rpe_tiny", ["--rpe-max-distance", "3"]),
    "sinusoidal": ("transformer_tiny", []),
    "learned": ("transformer_tiny", ["--encoder-learned-pos", "--decoder-learned-pos"]),
    "nopos": ("transformer_tiny", ["--no-token-positional-embeddings"]),
}
RELATIVE = ["rope", "roper", "roper_half_partial", "rope_linear", "rope_yarn", "rpe"]
ATOL = 2e-5


def make(name):
    arch, extra = VARIANTS[name]
    model, dictionary, _ = model_with_dictionary(arch, *extra, "--dropout", "0.1")
    model.eval()
    return model, dictionary


def tokens(dictionary, rows, left_pad):
    """Batch of token rows (lists of ints >= 4), padded left or right."""
    width = max(map(len, rows))
    batch = torch.full((len(rows), width), dictionary.pad(), dtype=torch.long)
    for i, row in enumerate(rows):
        if left_pad:
            batch[i, width - len(row):] = torch.tensor(row)
        else:
            batch[i, : len(row)] = torch.tensor(row)
    return batch


def encode(model, src, dictionary):
    lengths = src.ne(dictionary.pad()).sum(1)
    return model.encoder(src, src_lengths=lengths)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_incremental_decoding_equals_full_pass_across_beam_reorder(name):
    model, d = make(name)
    g = torch.Generator().manual_seed(1)
    # one source sentence and three beams: beam search only ever reorders the hypotheses of a
    # sentence among themselves (fairseq's cached encoder-decoder keys rely on this)
    src = torch.randint(4, 30, (1, 9), generator=g).expand(3, 9)
    prev = torch.randint(4, 30, (3, 8), generator=g)
    prev[:, 0] = d.eos()
    new_order = torch.tensor([2, 0, 0])
    split = 3
    with torch.no_grad():
        enc = encode(model, src, d)
        full = model.decoder(prev, encoder_out=enc)[0]
        # the same hypotheses after beam search reorders them at step `split`
        reordered_prev = torch.cat([prev[new_order, :split], prev[:, split:]], dim=1)
        full_reordered = model.decoder(reordered_prev, encoder_out=model.encoder.reorder_encoder_out(enc, new_order))[0]

        state = {}
        steps = []
        for t in range(split):
            steps.append(model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)[0])
        incremental = torch.cat(steps, dim=1)
        torch.testing.assert_close(incremental, full[:, :split], atol=ATOL, rtol=1e-4)

        model.decoder.reorder_incremental_state_scripting(state, new_order)
        enc = model.encoder.reorder_encoder_out(enc, new_order)
        for t in range(split, prev.size(1)):
            steps.append(model.decoder(reordered_prev[:, : t + 1], encoder_out=enc, incremental_state=state)[0])
        after = torch.cat(steps[split:], dim=1)
        torch.testing.assert_close(after, full_reordered[:, split:], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_padding_invariance(name):
    model, d = make(name)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(4, 30, (n,), generator=g).tolist() for n in (4, 9)]
    targets = [[d.eos()] + torch.randint(4, 30, (n,), generator=g).tolist() for n in (3, 7)]
    with torch.no_grad():
        src = tokens(d, rows, left_pad=True)  # fairseq left-pads sources ...
        prev = tokens(d, targets, left_pad=False)  # ... and right-pads targets
        enc = encode(model, src, d)
        out = model.decoder(prev, encoder_out=enc)[0]
        for i, (row, target) in enumerate(zip(rows, targets)):
            alone_src = tokens(d, [row], left_pad=True)
            alone_enc = encode(model, alone_src, d)
            torch.testing.assert_close(
                enc["encoder_out"][0][-len(row):, i], alone_enc["encoder_out"][0][:, 0], atol=ATOL, rtol=1e-4
            )
            alone = model.decoder(tokens(d, [target], left_pad=False), encoder_out=alone_enc)[0]
            torch.testing.assert_close(out[i, : len(target)], alone[0], atol=ATOL, rtol=1e-4)


def _shift_positions(monkeypatch, cls, change):
    original = cls.self_attention_positions

    def shifted(self, *args, **kwargs):
        return change(original(self, *args, **kwargs))

    monkeypatch.setattr(cls, "self_attention_positions", shifted)
    # the rotary tables are sized by the unshifted length: make room for the shifted positions
    tables = RotaryEmbedding.tables
    monkeypatch.setattr(RotaryEmbedding, "tables", lambda self, length, device: tables(self, length + 256, device))


@pytest.mark.parametrize("name", RELATIVE)
def test_relative_encodings_ignore_a_constant_position_shift(name, monkeypatch):
    model, d = make(name)
    g = torch.Generator().manual_seed(3)
    src = tokens(d, [torch.randint(4, 30, (n,), generator=g).tolist() for n in (6, 11)], left_pad=True)
    cls = type(model.encoder.layers[0].self_attn)
    assert cls in (RotaryMultiheadAttention, LinearRotaryAttention, RelativePositionMultiheadAttention)
    with torch.no_grad():
        reference = encode(model, src, d)["encoder_out"][0]
        with monkeypatch.context() as patch:
            _shift_positions(patch, cls, lambda p: p + 37)
            shifted = encode(model, src, d)["encoder_out"][0]
        with monkeypatch.context() as patch:  # control: the patch does reach the positions
            _shift_positions(patch, cls, lambda p: p * 3)
            stretched = encode(model, src, d)["encoder_out"][0]
    mask = src.ne(d.pad()).t()
    torch.testing.assert_close(shifted[mask], reference[mask], atol=1e-4, rtol=1e-4)
    assert (stretched[mask] - reference[mask]).abs().max() > 1e-3


def _rotation_matrix(position, rotary_dim, head_dim, theta=10000.0):
    """Explicit block-diagonal R^d_{Theta,m} of eq. (15) (interleaved), identity past rotary_dim."""
    r = torch.eye(head_dim, dtype=torch.float64)
    for i in range(rotary_dim // 2):
        angle = position * theta ** (-2 * i / rotary_dim)
        c, s = math.cos(angle), math.sin(angle)
        r[2 * i, 2 * i], r[2 * i, 2 * i + 1] = c, -s
        r[2 * i + 1, 2 * i], r[2 * i + 1, 2 * i + 1] = s, c
    return r


def _heads(module, x):
    t, b, _ = x.shape
    return lambda proj: proj(x).view(t, b, module.num_heads, module.head_dim).double()


@torch.no_grad()
def test_roper_equals_the_rotated_value_formula():
    torch.manual_seed(0)
    module = RotaryMultiheadAttention(16, 2, self_attention=True, rope_values=True).eval()
    x = torch.randn(5, 1, 16)
    out = module(x, x, x, need_weights=False)[0]
    h = _heads(module, x)
    q, k, v = h(module.q_proj), h(module.k_proj), h(module.v_proj)
    rot = [_rotation_matrix(m, 8, 8) for m in range(5)]
    expected = torch.zeros(5, 2, 8, dtype=torch.float64)
    for head in range(2):
        qr = torch.stack([rot[m] @ q[m, 0, head] for m in range(5)])
        kr = torch.stack([rot[n] @ k[n, 0, head] for n in range(5)])
        alpha = torch.softmax(qr @ kr.t() / math.sqrt(8), dim=-1)
        for i in range(5):  # value j reaches query i as R_{j-i} v_j
            expected[i, head] = sum(alpha[i, j] * (rot[j] @ v[j, 0, head]) for j in range(5))
            expected[i, head] = rot[i].t() @ expected[i, head]
            assert torch.allclose(
                expected[i, head],
                sum(alpha[i, j] * (_rotation_matrix(j - i, 8, 8) @ v[j, 0, head]) for j in range(5)),
            )
    expected = module.out_proj(expected.reshape(5, 1, 16).float())
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_shaw_attention_equals_the_paper_formula():
    torch.manual_seed(0)
    module = RelativePositionMultiheadAttention(16, 2, max_distance=2, self_attention=True).eval()
    x = torch.randn(6, 1, 16)
    out = module(x, x, x, need_weights=False)[0]
    h = _heads(module, x)
    q, k, v = h(module.q_proj), h(module.k_proj), h(module.v_proj)
    a_k, a_v = module.relative_keys.weight.double(), module.relative_values.weight.double()
    clip = lambda r: max(-2, min(2, r)) + 2  # noqa: E731
    expected = torch.zeros(6, 2, 8, dtype=torch.float64)
    for head in range(2):
        e = torch.tensor([[q[i, 0, head] @ (k[j, 0, head] + a_k[clip(j - i)]) / math.sqrt(8) for j in range(6)]
                          for i in range(6)])
        alpha = torch.softmax(e, dim=-1)
        for i in range(6):
            expected[i, head] = sum(alpha[i, j] * (v[j, 0, head] + a_v[clip(j - i)]) for j in range(6))
    expected = module.out_proj(expected.reshape(6, 1, 16).float())
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_relative_position_index_clips():
    index = relative_position_index(torch.arange(4), torch.arange(4), 2)
    assert index.tolist() == [[2, 3, 4, 4], [1, 2, 3, 4], [0, 1, 2, 3], [0, 0, 1, 2]]


def _naive_linear(q, k, v, causal):
    """eq. (19) term by term on (time, d) inputs for one head."""
    n = q.size(0)
    fq, fk = feature_map(q).double(), feature_map(k).double()
    rot = [_rotation_matrix(m, q.size(-1), q.size(-1)) for m in range(n)]
    out = torch.zeros(n, v.size(-1), dtype=torch.float64)
    for m in range(n):
        keys = range(m + 1) if causal else range(n)
        num = sum(((rot[m] @ fq[m]) @ (rot[j] @ fk[j])) * v[j].double() for j in keys)
        den = sum(fq[m] @ fk[j] for j in keys)
        out[m] = num / den
    return out


@pytest.mark.parametrize("causal", [False, True])
@torch.no_grad()
def test_linear_attention_equals_eq19(causal):
    torch.manual_seed(0)
    module = LinearRotaryAttention(8, 1, causal=causal, self_attention=True).eval()
    x = torch.randn(7, 1, 8)
    out = module(x, x, x)[0]
    q, k, v = (p(x)[:, 0] for p in (module.q_proj, module.k_proj, module.v_proj))
    expected = module.out_proj(_naive_linear(q, k, v, causal).float())[:, None]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_linear_attention_incremental_state_equals_full_causal_sums():
    torch.manual_seed(0)
    b, h, n, d = 2, 3, 9, 4
    rq, rk, fq, fk = (torch.randn(b, h, n, d).abs() for _ in range(4))
    v = torch.randn(b, h, n, d)
    full, kv_full, k_full = causal_linear_attention(rq, rk, fq, fk, v)
    # reference: explicit prefix sums of outer products, S_m = sum_{n<=m} R_n phi(k_n) v_n^T
    prefix_kv = torch.cumsum(torch.einsum("bhnd,bhne->bhnde", rk, v), dim=2)
    prefix_k = torch.cumsum(fk, dim=2)
    reference = torch.einsum("bhmd,bhmde->bhme", rq, prefix_kv) / torch.einsum("bhmd,bhmd->bhm", fq, prefix_k)[..., None]
    torch.testing.assert_close(full, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_full, prefix_kv[:, :, -1], atol=1e-5, rtol=1e-5)
    for chunk in (1, 4, 100):
        torch.testing.assert_close(causal_linear_attention(rq, rk, fq, fk, v, chunk_size=chunk)[0], reference,
                                   atol=1e-5, rtol=1e-5)
    prev_kv = prev_k = None
    outs = []
    for chunk in ((0, 1), (1, 2), (2, 6), (6, 9)):  # single steps and several tokens at once
        s = slice(*chunk)
        out, prev_kv, prev_k = causal_linear_attention(rq[:, :, s], rk[:, :, s], fq[:, :, s], fk[:, :, s], v[:, :, s],
                                                       prev_kv, prev_k)
        outs.append(out)
        assert prev_kv.shape == (b, h, d, d) and prev_k.shape == (b, h, d)  # constant size, batch-first
    torch.testing.assert_close(torch.cat(outs, dim=2), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prev_kv, kv_full)
    # the non-causal form is the last row of the causal one
    torch.testing.assert_close(linear_attention(rq, rk, fq, fk, v)[:, :, -1], full[:, :, -1], atol=1e-5, rtol=1e-5)


def test_linear_decoder_state_is_constant_size():
    model, d = make("rope_linear")
    enc = encode(model, torch.randint(4, 30, (2, 5)), d)
    prev = torch.randint(4, 30, (2, 6))
    state = {}
    sizes = []
    with torch.no_grad():
        for t in range(prev.size(1)):
            model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)
            attn = model.decoder.layers[0].self_attn
            buffer = attn._get_input_buffer(state)
            sizes.append((tuple(buffer["prev_sum_kv"].shape), tuple(buffer["prev_sum_k"].shape)))
    assert len(set(sizes)) == 1 and sizes[0][0] == (2, attn.num_heads, attn.head_dim, attn.head_dim)


@pytest.mark.parametrize(
    "arch, extra, flag",
    [
        ("transformer_rope_tiny", ["--attention-kind", "linear", "--rope-values"], "--rope-values"),
        ("transformer_rope_tiny", ["--rope-scaling", "yarn", "--rope-scaling-factor", "2"], "--rope-scaling-original-length"),
        ("transformer_rope_tiny", ["--rope-scaling", "linear", "--rope-scaling-factor", "0.5"], "--rope-scaling-factor"),
        ("transformer_rpe_tiny", ["--rpe-max-distance", "0"], "--rpe-max-distance"),
    ],
)
def test_bad_flags_raise_naming_the_flag(arch, extra, flag):
    with pytest.raises(ValueError, match=flag):
        model_with_dictionary(arch, *extra)


def test_state_dict_keys():
    rope, _ = make("rope")
    for name in ("roper", "rope_linear", "rope_yarn"):
        assert make(name)[0].state_dict().keys() == rope.state_dict().keys()
    rpe, _ = make("rpe")
    extra = set(rpe.state_dict()) - set(rope.state_dict())
    assert extra and all(k.endswith(("relative_keys.weight", "relative_values.weight")) for k in extra)
