"""Dynamic --rope-scaling (dynamic-ntk, dynamic-yarn): each sentence gets s = max(1, n / L), n its
source length, L the training length, for its encoder and its whole decoding.

Sentences no longer than L are decoded with plain RoPE bit for bit, whatever else is in their
batch; a long sentence gets the same output alone and in a mixed batch; incremental decoding
(with a beam reorder) equals the full forward; factor 1 everywhere is plain RoPE."""

import pytest
import torch
from support.models import model_with_dictionary

from fairseq_rope.config_values import OptionError
from fairseq_rope.modules.rotary import dynamic_factors
from fairseq_rope.modules.rotary_embedding import RotaryEmbedding

L = 8
DYNAMIC = ("dynamic-ntk", "dynamic-yarn")
VARIANTS = ([], ["--rope-cross-attention", "--rope-values"])


def models(scaling, *flags, original_length=L):
    """The same weights without scaling and with ``scaling`` (L = ``original_length``), in eval mode."""
    plain, dictionary, _ = model_with_dictionary("transformer_rope_tiny", *flags)
    scaled, _, _ = model_with_dictionary("transformer_rope_tiny", *flags, "--rope-scaling", scaling,
                                         "--rope-scaling-original-length", original_length)
    assert scaled.state_dict().keys() == plain.state_dict().keys()
    scaled.load_state_dict(plain.state_dict())
    return plain.eval(), scaled.eval(), dictionary


def batch(dictionary, lengths, target_length=12, seed=0):
    """Left-padded sources of ``lengths`` tokens (fairseq's layout) and decoder inputs."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    src = torch.full((len(lengths), width), dictionary.pad())
    for row, n in enumerate(lengths):
        src[row, width - n:] = torch.randint(4, len(dictionary), (n,), generator=g)
    prev = torch.randint(4, len(dictionary), (len(lengths), target_length), generator=g)
    return src, torch.tensor(lengths), prev


def forward(model, src, lengths, prev):
    with torch.no_grad():
        return model(src, lengths, prev)[0]


def test_the_factor_of_each_sentence():
    factors = dynamic_factors(torch.tensor([3, 8, 12, 24]), 8)
    assert factors.tolist() == [1.0, 1.0, 1.5, 3.0] and factors.dtype == torch.float64


@pytest.mark.parametrize("flags", VARIANTS)
@pytest.mark.parametrize("scaling", DYNAMIC)
def test_short_sentences_decode_as_without_scaling_alone_and_in_a_mixed_batch(scaling, flags):
    plain, scaled, d = models(scaling, *flags)
    short = batch(d, [5, 8, 3])
    torch.testing.assert_close(forward(scaled, *short), forward(plain, *short), atol=0, rtol=0)
    mixed = batch(d, [5, 20, 8, 13, 3])
    plain_out, scaled_out = forward(plain, *mixed), forward(scaled, *mixed)
    for row in (0, 2, 4):  # the sentences of at most L tokens: bit for bit
        torch.testing.assert_close(scaled_out[row], plain_out[row], atol=0, rtol=0)
    for row in (1, 3):  # the long ones are scaled
        assert not torch.allclose(scaled_out[row], plain_out[row], atol=1e-4)


@pytest.mark.parametrize("flags", VARIANTS)
@pytest.mark.parametrize("scaling", DYNAMIC)
def test_each_sentence_of_a_mixed_batch_gets_its_output_alone(scaling, flags):
    _, scaled, d = models(scaling, *flags)
    src, lengths, prev = batch(d, [5, 20, 8, 13, 3])
    together = forward(scaled, src, lengths, prev)
    for row, n in enumerate(lengths.tolist()):
        alone = forward(scaled, src[row:row + 1, -n:], lengths[row:row + 1], prev[row:row + 1])
        torch.testing.assert_close(together[row], alone[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("scaling, static", [("dynamic-ntk", "ntk"), ("dynamic-yarn", "yarn")])
def test_a_long_sentence_is_scaled_by_its_length_over_L(scaling, static):
    """Alone, a sentence of n > L tokens runs exactly as the static scaling with s = n / L."""
    _, scaled, d = models(scaling)
    fixed, _, _ = model_with_dictionary("transformer_rope_tiny", "--rope-scaling", static, "--rope-scaling-factor", 2.5,
                                        "--rope-scaling-original-length", L)
    fixed.load_state_dict(scaled.state_dict())
    fixed.eval()
    long = batch(d, [20])
    torch.testing.assert_close(forward(scaled, *long), forward(fixed, *long), atol=0, rtol=0)


@pytest.mark.parametrize("flags", VARIANTS)
@pytest.mark.parametrize("scaling", DYNAMIC)
def test_factor_one_everywhere_equals_plain_rope(scaling, flags):
    plain, scaled, d = models(scaling, *flags, original_length=64)  # L above every length
    mixed = batch(d, [5, 20, 8, 13, 3], target_length=30)
    torch.testing.assert_close(forward(scaled, *mixed), forward(plain, *mixed), atol=0, rtol=0)


def test_rows_with_factor_one_use_the_plain_tables():
    plain = RotaryEmbedding(16)
    dynamic = RotaryEmbedding(16, scaling="dynamic-yarn", original_length=8)
    positions = torch.arange(20)
    rows = dynamic.rotations(positions, 20, dynamic.row_factors(torch.tensor([4, 8, 16])))
    assert rows.shape == (20, 3, 1, 8)
    expected = plain.rotations(positions, 20)[:, 0]
    assert torch.equal(rows[:, 0], expected) and torch.equal(rows[:, 1], expected)
    stretched = RotaryEmbedding(16, scaling="yarn", scaling_factor=2.0, original_length=8)
    assert torch.equal(rows[:, 2], stretched.rotations(positions, 20)[:, 0])
    assert dynamic.row_factors(torch.tensor([4, 8])) is None  # nothing to scale: the plain path
    assert dynamic.row_logit_scales(torch.tensor([1.0, 2.0])).tolist() == [1.0, stretched.logit_scale]


def test_one_table_per_factor_and_only_the_most_recent_kept():
    dynamic = RotaryEmbedding(16, scaling="dynamic-ntk", original_length=8)
    dynamic.scaled_tables_kept = 2
    positions = torch.arange(30).expand(6, -1)  # per-sentence positions (batch, time)
    rows = dynamic.rotations(positions, 30, dynamic.row_factors(torch.tensor([16, 8, 16, 24, 16, 24])))
    assert list(dynamic._scaled_tables) == [(2.0, torch.device("cpu")), (3.0, torch.device("cpu"))]
    for row, factor in ((0, 2.0), (3, 3.0), (4, 2.0)):
        static = RotaryEmbedding(16, scaling="ntk", scaling_factor=factor)
        assert torch.equal(rows[:, row], static.rotations(torch.arange(30), 30)[:, 0])
    dynamic.rotations(positions, 30, dynamic.row_factors(torch.full((6,), 40)))
    assert list(dynamic._scaled_tables) == [(3.0, torch.device("cpu")), (5.0, torch.device("cpu"))]


@pytest.mark.parametrize("flags", VARIANTS + (["--attention-kind", "linear"],))
@pytest.mark.parametrize("scaling", DYNAMIC)
def test_incremental_decoding_with_a_beam_reorder_equals_the_full_forward(scaling, flags):
    _, model, d = models(scaling, *flags)
    beam = 2
    src, lengths, _ = batch(d, [5, 20, 8, 13])
    src, lengths = src.repeat_interleave(beam, dim=0), lengths.repeat_interleave(beam)  # as beam search does
    prev = torch.randint(4, len(d), (src.size(0), 10), generator=torch.Generator().manual_seed(1))
    order = torch.tensor([1, 1, 2, 3, 5, 4, 6, 6])  # beams take over another beam's history halfway
    steps_before = 4
    model.decoder.set_beam_size(beam)  # beams share one copy of the encoder keys
    with torch.no_grad():
        encoder_out = model.encoder(src, lengths)
        state, outputs = {}, []
        for step in range(prev.size(1)):
            if step == steps_before:
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, order)
                model.decoder.reorder_incremental_state_scripting(state, order)
                prev = torch.cat((prev[order, :step], prev[:, step:]), dim=1)
            out = model.decoder(prev[:, : step + 1], encoder_out=encoder_out, incremental_state=state)[0]
            outputs.append(out[:, -1])
        full = model(src[order], lengths[order], prev)[0]
    incremental = torch.stack(outputs[steps_before:], dim=1)
    torch.testing.assert_close(incremental, full[:, steps_before:], atol=2e-5, rtol=1e-5)


def test_dynamic_scaling_without_a_training_length_names_the_flag():
    with pytest.raises(OptionError, match="pass --rope-scaling-original-length L"):
        model_with_dictionary("transformer_rope_tiny", "--rope-scaling", "dynamic-yarn")
    with pytest.raises(OptionError, match="--rope-scaling-factor 2 has no effect with --rope-scaling dynamic-ntk"):
        model_with_dictionary("transformer_rope_tiny", "--rope-scaling", "dynamic-ntk", "--rope-scaling-factor", 2,
                              "--rope-scaling-original-length", L)


def test_the_recorded_training_length_sets_L_and_the_flag_wins():
    _, _, args = model_with_dictionary("transformer_rope_tiny")
    args.rope_trained_length, args.rope_scaling = 12, "dynamic-yarn"
    model, _, _ = model_with_dictionary("transformer_rope_tiny")
    rotary = type(model).attention_factory(args).rotary_embedding(64, 2)
    assert rotary.original_length == 12
    args.rope_scaling_original_length = 30
    assert type(model).attention_factory(args).rotary_embedding(64, 2).original_length == 30
