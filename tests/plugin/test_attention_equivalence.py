"""With every rotation angle zero, the rotary attention is fairseq's own ``MultiheadAttention``.

R_0 is the identity (eq. 15 with m theta_i = 0), so whatever the rotary attention does besides
rotating -- projection, head reshape, left padding, causal masks, the incremental cache and its
beam reorder, beam-shared encoder keys, attention weights -- must give fairseq's numbers exactly,
with the same weights.
"""

import pytest
import torch
from fairseq.modules import MultiheadAttention

from fairseq_rope.modules import RotaryMultiheadAttention

E, H = 32, 4


def zero_angles(attn):
    """Make every m * theta_i zero: the rotation becomes the identity."""
    attn.rotary.inv_freq = torch.zeros_like(attn.rotary.inv_freq)
    attn.rotary.clear_cache()


def pair(weights, **kwargs):
    torch.manual_seed(0)
    stock = MultiheadAttention(E, H, dropout=0.0, **kwargs).eval()
    if weights.get("need_head_weights"):
        # fairseq's fused full-sequence path returns head-averaged weights even when asked for
        # each head's; its general path (the one incremental decoding takes) honours the request
        stock._set_skip_embed_dim_check()
    rotary = RotaryMultiheadAttention(E, H, dropout=0.0, **kwargs).eval()
    rotary.load_state_dict(stock.state_dict())
    zero_angles(rotary)
    return stock, rotary


def assert_same(stock_out, rotary_out):
    (a, wa), (b, wb) = stock_out, rotary_out
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    if wa is None:
        assert wb is None
    else:
        torch.testing.assert_close(wb, wa, rtol=1e-5, atol=1e-6)


def left_padding_mask(lengths, T):
    return torch.stack([torch.arange(T) < T - n for n in lengths])


def future_mask(T):
    return torch.triu(torch.full((T, T), float("-inf")), 1)


WEIGHTS = [dict(need_weights=False), dict(need_weights=True), dict(need_weights=True, need_head_weights=True)]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_encoder_self_attention_with_left_padding(weights):
    stock, rotary = pair(weights, self_attention=True)
    T, B = 7, 3
    x = torch.randn(T, B, E)
    mask = left_padding_mask([7, 4, 2], T)
    args = dict(key_padding_mask=mask, **weights)
    out_stock = stock(x, x, x, **args)
    out_rotary = rotary(x, x, x, **args)
    # pad queries attend like real ones in both; compare every position
    assert_same(out_stock, out_rotary)


@pytest.mark.parametrize("weights", WEIGHTS)
def test_causal_decoder_self_attention(weights):
    stock, rotary = pair(weights, self_attention=True)
    T, B = 6, 2
    x = torch.randn(T, B, E)
    args = dict(attn_mask=future_mask(T), **weights)
    assert_same(stock(x, x, x, **args), rotary(x, x, x, **args))


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_incremental_steps_with_beam_reorder(weights, grad):
    stock, rotary = pair(weights, self_attention=True)
    steps, B = 5, 4
    xs = torch.randn(steps, 1, B, E).unbind(0)
    # beam search keeps hypotheses 3, 3, 0, 1 after the third step
    with torch.set_grad_enabled(grad):  # the reordered cache is gathered by a different path without grad
        decode_steps(stock, rotary, [dict(query=x, key=x, value=x, **weights) for x in xs], {2: [[3, 3, 0, 1]]})


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_reorders_in_a_row_and_a_shrinking_batch(grad):
    """Two reorders before one step (the second of the reordered batch), then a reorder that drops
    finished rows, as beam search does: the rotary cache gathers them later, in one copy."""
    stock, rotary = pair(dict(need_weights=False), self_attention=True)
    xs = [torch.randn(1, n, E) for n in (4, 4, 3, 3)]
    with torch.set_grad_enabled(grad):
        decode_steps(stock, rotary, [dict(query=x, key=x, value=x) for x in xs],
                     {0: [[1, 0, 3, 3], [2, 2, 1, 0]], 1: [[3, 0, 1]]})


def decode_steps(stock, rotary, calls, reorders):
    """Incremental calls on both attentions, outputs compared at every step; after step i, the
    beam reorders ``reorders[i]``, one after the other."""
    states = {}, {}
    for step, call in enumerate(calls):
        assert_same(*[attn(incremental_state=state, **call) for attn, state in zip((stock, rotary), states)])
        for order in reorders.get(step, []):
            for attn, state in zip((stock, rotary), states):
                attn.reorder_incremental_state(state, torch.tensor(order))


@pytest.mark.parametrize("weights", WEIGHTS)
def test_encoder_decoder_attention_with_shared_beams(weights):
    stock, rotary = pair(weights, encoder_decoder_attention=True, kdim=24, vdim=24)
    beam, sentences, S = 3, 2, 5
    for attn in (stock, rotary):
        attn.set_beam_size(beam)
    encoder_out = torch.randn(S, sentences, 24).repeat_interleave(beam, dim=1)
    mask = left_padding_mask([5, 3], S).repeat_interleave(beam, dim=0)
    calls = [dict(query=torch.randn(1, sentences * beam, E), key=encoder_out, value=encoder_out,
                  key_padding_mask=mask, static_kv=True, **weights) for _ in range(3)]
    decode_steps(stock, rotary, calls, {1: [[2, 0, 0, 4, 5, 3]]})  # reordered within each sentence's beams


@pytest.mark.parametrize("weights", WEIGHTS)
def test_encoder_decoder_attention_full_forward(weights):
    stock, rotary = pair(weights, encoder_decoder_attention=True, kdim=24, vdim=24)
    T, S, B = 4, 6, 2
    y, encoder_out = torch.randn(T, B, E), torch.randn(S, B, 24)
    mask = left_padding_mask([6, 2], S)
    args = dict(key_padding_mask=mask, static_kv=True, **weights)
    assert_same(stock(y, encoder_out, encoder_out, **args), rotary(y, encoder_out, encoder_out, **args))


def test_quant_noise_projections_and_weight_updates():
    """With quant-noise the projections stay separate modules (its hooks must run); and the
    fused q/k/v weights kept between inference calls follow an in-place weight update."""
    stock, rotary = pair({}, self_attention=True, q_noise=0.1, qn_block_size=8)
    x = torch.randn(5, 2, E)
    assert_same(stock(x, x, x), rotary(x, x, x))
    stock, rotary = pair({}, self_attention=True)
    with torch.no_grad():
        assert_same(stock(x, x, x), rotary(x, x, x))
        for attn in (stock, rotary):
            attn.k_proj.weight.mul_(0.5)  # in place, as load_state_dict would
            attn.v_proj.bias.add_(1.0)
        assert_same(stock(x, x, x), rotary(x, x, x))
        # fairseq's optimizers update p.data in train mode, out of sight of p's version counter;
        # a validation pass after training steps must see the new weights
        for attn in (stock, rotary):
            attn.train()
            attn.q_proj.weight.data.add_(0.25)
            attn.eval()
        assert_same(stock(x, x, x), rotary(x, x, x))


def test_decoding_steps_form_scores_as_fairseq_does_not_through_sdpa(monkeypatch):
    """An incremental step -- decoder self-attention, and encoder-decoder attention whose beams
    fold into several query rows -- takes the two-matmul path of fairseq's own attention: SDPA
    picks a backend per shape, and on a Hopper GPU in fp16 its cuDNN one built a graph for every
    new key length (RoPE decoded at half sinusoidal's speed; docs/gpu.md). Full sequences keep SDPA."""
    import torch.nn.functional as F

    sdpa_calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: sdpa_calls.append(1) or sdpa(*a, **k))
    self_stock, self_rotary = pair(dict(need_weights=False), self_attention=True)
    cross_stock, cross_rotary = pair(dict(need_weights=False), encoder_decoder_attention=True, kdim=24, vdim=24)
    beam, sentences, S = 4, 2, 5
    for attn in (cross_stock, cross_rotary):
        attn.set_beam_size(beam)
    encoder_out = torch.randn(S, sentences, 24).repeat_interleave(beam, dim=1)
    xs = [torch.randn(1, sentences * beam, E) for _ in range(3)]
    decode_steps(self_stock, self_rotary, [dict(query=x, key=x, value=x, need_weights=False) for x in xs], {})
    decode_steps(cross_stock, cross_rotary, [dict(query=x, key=encoder_out, value=encoder_out, static_kv=True,
                                                  need_weights=False) for x in xs], {})
    assert sdpa_calls == []
    x = torch.randn(6, 2, E)
    self_rotary(x, x, x, need_weights=False)
    assert sdpa_calls == [1]
