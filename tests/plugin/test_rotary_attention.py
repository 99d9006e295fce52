"""RotaryMultiheadAttention and transformer_rope through the whole model."""

import math

import pytest
import torch
from support.models import model_with_dictionary, rotate, table_cos_sin

from fairseq_rope.modules import RotaryMultiheadAttention
from fairseq_rope.modules.rotary import LAYOUTS, RotateInPlace, apply_rotary, interleaved_to_half_permutation
from fairseq_rope.modules.rotary_embedding import reference_rotation_

CROSS = [[], ["--rope-cross-attention"]]
CROSS_IDS = ["self-only", "cross-too"]


def random_batch(dictionary, bsz=3, src_len=7, tgt_len=6, seed=1, left_pad=True):
    """Source batch left-padded as fairseq does, targets starting with EOS."""
    g = torch.Generator().manual_seed(seed)
    nspecial = dictionary.nspecial
    lengths = torch.tensor([src_len] + [max(2, src_len - 2 * i) for i in range(1, bsz)])
    src = torch.full((bsz, src_len), dictionary.pad())
    for i, n in enumerate(lengths.tolist()):
        tokens = torch.randint(nspecial, len(dictionary), (n,), generator=g)
        tokens[-1] = dictionary.eos()
        if left_pad:
            src[i, src_len - n:] = tokens
        else:
            src[i, :n] = tokens
    prev = torch.randint(nspecial, len(dictionary), (bsz, tgt_len), generator=g)
    prev[:, 0] = dictionary.eos()
    return src, lengths, prev


@pytest.mark.parametrize("extra", CROSS, ids=CROSS_IDS)
def test_incremental_decoding_equals_full_forward(extra):
    model, d, _ = model_with_dictionary("transformer_rope_tiny", *extra)
    model.eval()
    src, lengths, prev = random_batch(d)
    with torch.no_grad():
        full, _ = model(src, lengths, prev)
        encoder_out = model.encoder(src, src_lengths=lengths)
        state = {}
        steps = [model.decoder(prev[:, : t + 1], encoder_out, incremental_state=state)[0]
                 for t in range(prev.size(1))]
    incremental = torch.cat(steps, dim=1)
    assert torch.allclose(incremental, full, atol=1e-5), (incremental - full).abs().max()


@pytest.mark.parametrize("beam", [1, 2])
@pytest.mark.parametrize("extra", CROSS, ids=CROSS_IDS)
def test_reorder_then_continue_equals_full_forward_of_reordered_prefixes(extra, beam):
    model, d, _ = model_with_dictionary("transformer_rope_tiny", *extra)
    model.eval()
    sentences, total = 2, 6
    src, lengths, _ = random_batch(d, bsz=sentences)
    # beam search layout: every sentence repeated `beam` times, consecutive
    src, lengths = src.repeat_interleave(beam, 0), lengths.repeat_interleave(beam, 0)
    bsz = src.size(0)
    g = torch.Generator().manual_seed(3)
    prev = torch.randint(d.nspecial, len(d), (bsz, total), generator=g)
    prev[:, 0] = d.eos()
    if beam > 1:
        model.decoder.set_beam_size(beam)
    # reorder within each sentence's beams (beam search never mixes sentences)
    new_order = torch.arange(bsz).view(sentences, beam).flip(1).reshape(-1)
    if beam == 1:
        new_order = torch.tensor([1])  # the first sentence finished and leaves the batch
    split = 3
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=lengths)
        state = {}
        for t in range(split):
            model.decoder(prev[:, : t + 1], encoder_out, incremental_state=state)
        model.decoder.reorder_incremental_state_scripting(state, new_order)
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
        reordered = torch.cat([prev[new_order, :split], prev[: len(new_order), split:]], dim=1)
        steps = [model.decoder(reordered[:, : t + 1], encoder_out, incremental_state=state)[0]
                 for t in range(split, total)]
        model.decoder.set_beam_size(1)
        full, _ = model(src[new_order], lengths[new_order], reordered)
    incremental = torch.cat(steps, dim=1)
    assert torch.allclose(incremental, full[:, split:], atol=1e-5), (incremental - full[:, split:]).abs().max()


@pytest.mark.parametrize("extra", CROSS, ids=CROSS_IDS)
def test_beam_search_scores_equal_full_forward_rescoring(extra):
    """Beam 4 with incremental decoding, reordering and finished hypotheses leaving the batch:
    every hypothesis' per-token scores equal a teacher-forced full forward pass."""
    from fairseq.sequence_generator import SequenceGenerator

    model, d, _ = model_with_dictionary("transformer_rope_tiny", *extra)
    model.eval()
    src, lengths, _ = random_batch(d, bsz=3, src_len=8)
    generator = SequenceGenerator([model], d, beam_size=4, max_len_b=10, len_penalty=0.6)
    with torch.no_grad():
        hypos = generator.forward({"net_input": {"src_tokens": src, "src_lengths": lengths}})
        for i, beams in enumerate(hypos):
            assert len(beams) == 4
            for hypo in beams:
                tokens = hypo["tokens"]
                prev = torch.cat([tokens.new_tensor([d.eos()]), tokens[:-1]])[None]
                logits, _ = model(src[i:i + 1, (src[i] != d.pad()).nonzero()[0, 0]:], lengths[i:i + 1], prev)
                lprobs = torch.log_softmax(logits.float(), dim=-1)[0]
                rescored = lprobs.gather(-1, tokens[:, None])[:, 0]
                assert torch.allclose(rescored, hypo["positional_scores"], atol=1e-4), (rescored, hypo)


@pytest.mark.parametrize("extra", CROSS, ids=CROSS_IDS)
def test_left_padding_does_not_change_outputs(extra):
    model, d, _ = model_with_dictionary("transformer_rope_tiny", *extra)
    model.eval()
    src, lengths, prev = random_batch(d, bsz=3, src_len=9)
    with torch.no_grad():
        batch_enc = model.encoder(src, src_lengths=lengths)["encoder_out"][0]
        batch_dec, _ = model(src, lengths, prev)
        for i in range(1, 3):
            n = int(lengths[i])
            alone = src[i:i + 1, -n:]
            enc = model.encoder(alone, src_lengths=lengths[i:i + 1])["encoder_out"][0]
            assert torch.allclose(enc[:, 0], batch_enc[-n:, i], atol=1e-5), (enc[:, 0] - batch_enc[-n:, i]).abs().max()
            dec, _ = model(alone, lengths[i:i + 1], prev[i:i + 1])
            assert torch.allclose(dec[0], batch_dec[i], atol=1e-5)


def test_encoder_is_relative_only():
    """Without absolute positions, encoding is unchanged when the whole sentence is shifted:
    extra left padding shifts every position if positions were counted over the padded row."""
    model, d, _ = model_with_dictionary("transformer_rope_tiny")
    model.eval()
    attn = model.encoder.layers[0].self_attn
    x = torch.randn(6, 1, attn.embed_dim)
    with torch.no_grad():
        base, _ = attn(x, x, x, need_weights=False)
        # the same attention with positions offset by 40: scores depend on m - n only
        q = attn.q_proj(x).view(6, 1, attn.num_heads, attn.head_dim)
        k = attn.k_proj(x).view(6, 1, attn.num_heads, attn.head_dim)
        v = attn.v_proj(x).view(6, 1, attn.num_heads, attn.head_dim).permute(1, 2, 0, 3)
        q = rotate(attn, q, torch.arange(6) + 40, 46).permute(1, 2, 0, 3)
        k = rotate(attn, k, torch.arange(6) + 40, 46).permute(1, 2, 0, 3)
        out, _ = attn._attend(None, q, k, v, None, None, need_weights=False)
        shifted = attn.out_proj(out.permute(2, 0, 1, 3).reshape(6, 1, -1))
    assert torch.allclose(base, shifted, atol=1e-5)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("kind", ["encoder", "decoder", "cross"])
def test_sdpa_path_equals_explicit_path(kind, training):
    torch.manual_seed(0)
    embed, heads, T, S, B = 32, 4, 5, 7, 3
    attn = RotaryMultiheadAttention(
        embed, heads, self_attention=kind != "cross", encoder_decoder_attention=kind == "cross"
    )
    attn.train(training)  # dropout is 0: training mode must not change the result
    query = torch.randn(T if kind != "encoder" else S, B, embed)
    key = torch.randn(S, B, embed) if kind == "cross" else query
    kpm = torch.zeros(B, key.size(0), dtype=torch.bool)
    kpm[1, :2] = True
    attn_mask = None
    if kind == "decoder":
        attn_mask = torch.triu(torch.full((T, T), float("-inf")), 1)
        kpm = None
    fast, none = attn(query, key, key, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
    slow, weights = attn(query, key, key, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=True)
    assert none is None and weights is not None
    assert torch.allclose(fast, slow, atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones_like(weights.sum(-1)), atol=1e-5)
    if kpm is not None:
        assert weights[1, :, :2].abs().max() == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_in_place_projection_rotation_has_the_reference_gradient(layout, fraction):
    """The in-place rotation of projection outputs against autograd through apply_rotary."""
    torch.manual_seed(0)
    T, B, H, D = 5, 3, 2, 8
    proj = torch.nn.Linear(H * D, H * D).double()
    x = torch.randn(T * B, H * D, dtype=torch.double)
    attn = RotaryMultiheadAttention(H * D, H, self_attention=True, rope_layout=layout, rope_fraction=fraction)
    factor = attn.rotary.rotations(torch.arange(T) + 7, T + 7)
    cos, sin = factor.real, factor.imag
    table_cos, table_sin = table_cos_sin(attn.rotary, torch.arange(T) + 7, T + 7)
    torch.testing.assert_close(factor, torch.complex(table_cos, table_sin).view(T, 1, 1, -1), rtol=0, atol=0)
    upstream = torch.randn(T, B, H, D, dtype=torch.double)

    rotated = RotateInPlace.apply(reference_rotation_(factor, layout), (T, B, H, D), slice(None), proj(x))
    (rotated.view(T, B, H, D) * upstream).sum().backward()
    in_place = [p.grad.clone() for p in proj.parameters()]
    proj.zero_grad()
    reference = apply_rotary(proj(x).view(T, B, H, D), cos, sin, layout)
    (reference * upstream).sum().backward()

    torch.testing.assert_close(rotated.view(T, B, H, D), reference, rtol=0, atol=1e-6)
    for got, want in zip(in_place, [p.grad for p in proj.parameters()]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    check = lambda y: RotateInPlace.apply(reference_rotation_(factor, layout), (T, B, H, D), slice(None), y * 1.0)  # noqa: E731
    assert torch.autograd.gradcheck(check, (torch.randn(T * B, H * D, dtype=torch.double, requires_grad=True),))


@pytest.mark.parametrize(
    "kind, flags",
    [("encoder", {}), ("encoder", {"rope_values": True}), ("decoder", {}), ("cross", {})],
    ids=["encoder", "encoder-roper", "decoder", "cross"],
)
def test_attention_gradients_pass_gradcheck(kind, flags):
    """fp64 gradcheck of a whole attention call (projections, in-place rotation, SDPA)."""
    torch.manual_seed(0)
    embed, heads, T, S, B = 8, 2, 4, 5, 2
    attn = RotaryMultiheadAttention(
        embed, heads, self_attention=kind != "cross", encoder_decoder_attention=kind == "cross", **flags
    ).double()
    kpm = torch.zeros(B, S if kind == "cross" else T, dtype=torch.bool)
    kpm[1, 0] = True
    mask = torch.triu(torch.full((T, T), float("-inf"), dtype=torch.double), 1) if kind == "decoder" else None
    query = torch.randn(T, B, embed, dtype=torch.double, requires_grad=True)
    key = torch.randn(S, B, embed, dtype=torch.double, requires_grad=True) if kind == "cross" else query

    def run(query, key):
        return attn(query, key, key, key_padding_mask=None if mask is not None else kpm,
                    attn_mask=mask, need_weights=False)[0]

    assert torch.autograd.gradcheck(run, (query, key))


def test_interleaved_model_equals_half_model_after_permuting_projection_rows():
    torch.manual_seed(0)
    embed, heads = 32, 2
    head_dim = embed // heads
    inter = RotaryMultiheadAttention(embed, heads, self_attention=True, rope_layout="interleaved", rope_fraction=0.5)
    half = RotaryMultiheadAttention(embed, heads, self_attention=True, rope_layout="half", rope_fraction=0.5)
    perm = interleaved_to_half_permutation(head_dim, inter.rotary.rotary_dim)
    rows = torch.cat([h * head_dim + perm for h in range(heads)])
    state = inter.state_dict()
    for name in ("q_proj", "k_proj"):
        state[f"{name}.weight"] = state[f"{name}.weight"][rows]
        state[f"{name}.bias"] = state[f"{name}.bias"][rows]
    half.load_state_dict(state)
    x = torch.randn(9, 2, embed)
    a, wa = inter(x, x, x)
    b, wb = half(x, x, x)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(wa, wb, atol=1e-6)
    half.load_state_dict(inter.state_dict())  # without the permutation the layouts differ
    c, _ = half(x, x, x)
    assert not torch.allclose(a, c, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_angles_stay_fp32_accurate_in_half_precision_models(dtype):
    model, _, _ = model_with_dictionary("transformer_rope_tiny")
    model = model.to(dtype)
    attn = model.decoder.layers[0].self_attn
    position = torch.tensor([8189, 8190, 8191, 8192])
    cos, sin = table_cos_sin(attn.rotary, position, 8193)
    assert cos.dtype == torch.float32
    inv_freq = 10000.0 ** (-torch.arange(0, attn.rotary.rotary_dim, 2, dtype=torch.float64) / attn.rotary.rotary_dim)
    exact = position.double()[:, None] * inv_freq
    got = torch.atan2(sin.double(), cos.double())
    error = torch.remainder(got - exact + math.pi, 2 * math.pi) - math.pi
    assert error.abs().max() < 1e-3
    # the rotation of a half-precision vector is exact up to rounding its result to `dtype`
    x = torch.randn(4, 1, attn.num_heads, attn.head_dim).to(dtype)
    rotated = rotate(attn, x, position, 8193)
    assert rotated.dtype == dtype
    reference = torch.view_as_real(
        torch.view_as_complex(x.double().reshape(4, 1, attn.num_heads, -1, 2).contiguous())
        * torch.polar(torch.ones_like(exact), exact)[:, None, None, :]
    ).flatten(-2)
    eps = torch.finfo(dtype).eps
    assert (rotated.double() - reference).abs().max() <= 2 * eps * reference.abs().max()
    # and a decoder step at position 8192 runs in that dtype
    with torch.no_grad():
        y, _ = attn(x.reshape(4, 1, -1), x.reshape(4, 1, -1), x.reshape(4, 1, -1), need_weights=False)
    assert y.dtype == dtype and torch.isfinite(y).all()


def test_cos_sin_table_follows_device_and_length():
    attn = RotaryMultiheadAttention(16, 2, self_attention=True)
    c1, _ = table_cos_sin(attn.rotary, torch.arange(4), 4)
    c2, _ = table_cos_sin(attn.rotary, torch.arange(100), 100)  # grows, never stale
    assert torch.equal(c2[:4], c1)
    assert table_cos_sin(attn.rotary, torch.arange(100), 100)[0].shape == (100, attn.head_dim // 2)
    # one table per device: positions on another device get a table there
    cos_meta, _ = table_cos_sin(attn.rotary, torch.arange(5, device="meta"), 5)
    assert cos_meta.device.type == "meta" and cos_meta.dtype == torch.float32
    assert "rotary" not in " ".join(attn.state_dict())  # no persistent buffers


def test_state_dict_keys_equal_stock_transformer():
    rope, _, _ = model_with_dictionary("transformer_rope_tiny")
    stock, _, _ = model_with_dictionary("transformer_tiny", "--no-token-positional-embeddings")
    rope_keys, stock_keys = rope.state_dict().keys(), stock.state_dict().keys()
    assert list(rope_keys) == list(stock_keys)
    for key in rope_keys:
        assert rope.state_dict()[key].shape == stock.state_dict()[key].shape
    assert rope.encoder.embed_positions is None and rope.decoder.embed_positions is None


def test_architectures_dimensions():
    expected = {
        "transformer_rope": (512, 2048, 8, 6),
        "transformer_rope_wmt_en_de": (512, 2048, 8, 6),
        "transformer_rope_vaswani_wmt_en_de_big": (1024, 4096, 16, 6),
        "transformer_rope_iwslt_de_en": (512, 1024, 4, 6),
        "transformer_rope_tiny": (64, 64, 2, 2),
    }
    from fairseq import options
    for arch, (dim, ffn, heads, layers) in expected.items():
        parser = options.get_training_parser()
        args = options.parse_args_and_arch(parser, ["x", "--arch", arch, "--task", "translation"])
        assert (args.encoder_embed_dim, args.encoder_ffn_embed_dim, args.encoder_attention_heads,
                args.encoder_layers, args.decoder_layers) == (dim, ffn, heads, layers, layers), arch
        assert args.no_token_positional_embeddings and args.rope_theta == 10000.0
        assert args.rope_fraction == 1.0 and args.rope_layout == "interleaved"
        assert not args.rope_cross_attention
    assert options.parse_args_and_arch(
        options.get_training_parser(), ["x", "--arch", "transformer_rope_vaswani_wmt_en_de_big"]
    ).dropout == 0.3


def test_flags_reach_every_attention():
    model, _, _ = model_with_dictionary("transformer_rope_tiny", "--rope-theta", "500", "--rope-fraction", "0.5",
                                        "--rope-layout", "half", "--rope-cross-attention")
    layers = list(model.encoder.layers) + list(model.decoder.layers)
    attentions = [layer.self_attn for layer in layers] + [layer.encoder_attn for layer in model.decoder.layers]
    for attn in attentions:
        assert isinstance(attn, RotaryMultiheadAttention)
        assert (attn.rotary.theta, attn.rotary.rotary_dim, attn.rotary.layout) == (500.0, 16, "half")
    plain, _, _ = model_with_dictionary("transformer_rope_tiny")
    assert not isinstance(plain.decoder.layers[0].encoder_attn, RotaryMultiheadAttention)


@pytest.mark.parametrize("flags,message", [
    (["--rope-fraction", "0.3"], "--rope-fraction"),
    (["--rope-fraction", "0"], "--rope-fraction"),
    (["--rope-fraction", "1.5"], "--rope-fraction"),
    (["--rope-theta", "0"], "--rope-theta"),
    (["--rope-theta", "-3"], "--rope-theta"),
])
def test_bad_flags_fail_at_build_naming_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        model_with_dictionary("transformer_rope_tiny", *flags)


def test_unknown_layout_is_refused():
    with pytest.raises(SystemExit):  # argparse choices
        model_with_dictionary("transformer_rope_tiny", "--rope-layout", "spiral")
    with pytest.raises(ValueError, match="--rope-layout"):
        RotaryMultiheadAttention(16, 2, self_attention=True, rope_layout="spiral")
