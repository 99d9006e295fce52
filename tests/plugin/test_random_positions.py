"""Randomized positions in training (``--rope-random-positions R``,
fairseq_rope/modules/random_positions.py): each sentence's positions are an ordered random sample
from a range R times its length, with left or right padding; R = 1 is the contiguous model;
inference (eval mode, beam search) is unchanged; the attention depends only on the differences of
the drawn positions; the fused kernel's (batch, time) positions give the reference's numbers."""

import math

import pytest
import torch
from support.models import model_with_dictionary
from test_rotary_attention import random_batch

from fairseq_rope.config_values import OptionError
from fairseq_rope.modules.random_positions import sample_positions
from fairseq_rope.modules.rotary_multihead_attention import RotaryMultiheadAttention

pytestmark = pytest.mark.usefixtures("one_thread")


def padding_masks(seed, batch=6, width=11):
    """A left-padded and a right-padded mask of the same random lengths (one of them 1)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    lengths[0], lengths[1] = width, 1
    columns = torch.arange(width)
    right = columns[None, :] >= lengths[:, None]
    return lengths, right.flip(1), right


@pytest.mark.parametrize("range_factor", [1.0, 1.3, 2.0, 4.0, 16.0])
def test_each_sentence_takes_an_ordered_sample_from_r_times_its_length(range_factor):
    for seed in range(40):
        lengths, *masks = padding_masks(seed)
        for mask in masks:
            positions, end = sample_positions(mask, range_factor, torch.Generator().manual_seed(seed))
            assert positions.shape == mask.shape and end == math.ceil(mask.size(1) * range_factor)
            assert positions.min() >= 0 and positions.max() < end
            for row, n in enumerate(lengths.tolist()):
                drawn = positions[row][~mask[row]]
                assert len(drawn) == n
                assert (drawn.diff() > 0).all()  # ordered, distinct
                assert drawn.max() < math.ceil(n * range_factor)
                if range_factor == 1.0:  # the contiguous positions themselves
                    assert drawn.tolist() == list(range(n))


def test_the_sample_is_uniform_over_the_range_and_its_gaps_vary():
    """Every position of 0 .. ceil(R n) - 1 is drawn with probability n / ceil(R n): the longer
    distances are seen as often as the sample allows, and the gaps are not a constant stretch."""
    n, range_factor, draws = 5, 4.0, 4000
    mask = torch.zeros(draws, n, dtype=torch.bool)
    positions, _ = sample_positions(mask, range_factor, torch.Generator().manual_seed(0))
    counts = torch.bincount(positions.flatten(), minlength=20).double()
    expected = draws * n / 20
    assert counts.numel() == 20 and ((counts - expected).abs() < 5 * math.sqrt(expected)).all()
    spans = positions[:, -1] - positions[:, 0]
    assert spans.max() == 19 and spans.min() <= 5  # distances up to R n - 1 are seen, and short ones still
    assert len({tuple(row.diff().tolist()) for row in positions}) > 1000


def model_pair(*flags):
    """A plain RoPE model and one with ``flags``, with the same weights and no dropout."""
    plain, d, _ = model_with_dictionary("transformer_rope_tiny", "--dropout", "0", seed=3)
    other, _, args = model_with_dictionary("transformer_rope_tiny", "--dropout", "0", *flags, seed=3)
    other.load_state_dict(plain.state_dict())
    return plain, other, d


def test_the_option_is_checked_when_the_command_line_is_parsed():
    _, model, _ = model_pair("--rope-random-positions", "4")
    assert model.random_positions_range == 4.0
    with pytest.raises(OptionError, match="--rope-random-positions must be a finite number R >= 1"):
        model_with_dictionary("transformer_rope_tiny", "--rope-random-positions", "0.5")
    with pytest.raises(OptionError, match="applies to softmax attention"):
        model_with_dictionary("transformer_rope_tiny", "--rope-random-positions", "4", "--attention-kind", "linear")


def test_inference_is_unchanged_in_eval_mode_and_beam_search():
    from fairseq.sequence_generator import SequenceGenerator

    plain, randomized, d = model_pair("--rope-random-positions", "4")
    src, lengths, prev = random_batch(d, bsz=3, src_len=7, tgt_len=6)  # left-padded sources
    randomized.train()
    randomized(src, lengths, prev)  # a training step drew positions; eval mode must not use them
    for model in (plain, randomized):
        model.eval()
    with torch.no_grad():
        assert torch.equal(plain(src, lengths, prev)[0], randomized(src, lengths, prev)[0])
    beams = [SequenceGenerator([model], d, beam_size=4, max_len_a=0, max_len_b=6).forward(
        {"net_input": {"src_tokens": src, "src_lengths": lengths}}) for model in (plain, randomized)]
    for plain_beams, randomized_beams in zip(*beams):
        assert [h["tokens"].tolist() for h in plain_beams] == [h["tokens"].tolist() for h in randomized_beams]
        for a, b in zip(plain_beams, randomized_beams):
            assert torch.equal(a["positional_scores"], b["positional_scores"])


def test_r_equal_to_1_is_the_contiguous_model():
    plain, sampled, d = model_pair()
    sampled.random_positions_range = 1.0  # the sampler runs, with R = 1
    for model in (plain, sampled):
        model.train()
    src, lengths, prev = random_batch(d, bsz=3, src_len=7, tgt_len=6)
    prev[1, 4:] = d.pad()  # a right-padded target too
    real = prev.ne(d.pad())  # a pad's own output is not used (its position is another's)
    torch.testing.assert_close(sampled(src, lengths, prev)[0][real], plain(src, lengths, prev)[0][real],
                               rtol=1e-5, atol=1e-5)
    drawn = next(m for m in sampled.decoder.modules() if isinstance(m, RotaryMultiheadAttention)).positions.sampled
    assert drawn[0][1, :4].tolist() == [0, 1, 2, 3]


def self_attentions(side):
    return [m for m in side.modules() if isinstance(m, RotaryMultiheadAttention) and m.self_attention]


def forward_at(model, src, lengths, prev, source_positions, target_positions):
    """The training-mode output with these (batch, time) self-attention positions."""
    for side, positions in ((model.encoder, source_positions), (model.decoder, target_positions)):
        for attention in self_attentions(side):
            attention.positions.sampled = (positions, int(positions.max()) + 1)
    encoded = model.encoder(src, src_lengths=lengths)
    return model.decoder(prev, encoder_out=encoded)[0]


@pytest.mark.parametrize("flags", [[], ["--rope-values", "--rope-cross-attention"]], ids=["rope", "roper-cross"])
def test_the_attention_depends_only_on_the_differences_of_the_drawn_positions(flags):
    _, model, d = model_pair("--rope-random-positions", "4", *flags)
    model.train()
    src, lengths, prev = random_batch(d, bsz=3, src_len=7, tgt_len=6)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        source, _ = sample_positions(src.eq(d.pad()), 4.0, g)
        target, _ = sample_positions(prev.eq(d.pad()), 4.0, g)
        out = forward_at(model, src, lengths, prev, source, target)
        shift = torch.randint(0, 500, (3, 1), generator=g)  # a constant per sentence
        shifted = forward_at(model, src, lengths, prev, source + shift, target + shift.flip(0))
        torch.testing.assert_close(shifted, out, rtol=1e-4, atol=1e-4)
        stretched = forward_at(model, src, lengths, prev, source * 2, target * 3)  # other gaps
        assert (stretched - out).abs().max() > 1e-2


def test_a_training_forward_draws_the_positions_it_rotates_by():
    _, model, d = model_pair("--rope-random-positions", "4")
    model.train()
    src, lengths, prev = random_batch(d, bsz=3, src_len=7, tgt_len=6)
    torch.manual_seed(11)
    out = model(src, lengths, prev)[0]
    encoder, decoder = self_attentions(model.encoder), self_attentions(model.decoder)
    source, target = encoder[0].positions.sampled[0], decoder[0].positions.sampled[0]
    assert all(a.positions.sampled[0] is source for a in encoder) and all(a.positions.sampled[0] is target
                                                                          for a in decoder)
    assert source.shape == src.shape and target.shape == prev.shape
    torch.testing.assert_close(forward_at(model, src, lengths, prev, source, target), out)
    contiguous = forward_at(model, src, lengths, prev, torch.arange(7).expand(3, 7), torch.arange(6).expand(3, 6))
    assert (contiguous - out).abs().max() > 1e-2
    torch.manual_seed(11)  # fairseq seeds torch at every update: the same draw again
    torch.testing.assert_close(model(src, lengths, prev)[0], out)


def test_a_training_step_through_the_fused_kernel_equals_the_reference(kernel_launches):
    from test_fused_rotary_models import forward_and_backward, reference_rotation

    _, model, d = model_pair("--rope-random-positions", "4", "--rope-values")
    model.train()
    src, lengths, prev = random_batch(d, bsz=2, src_len=5, tgt_len=4)  # left-padded sources
    fused_out, fused_grads = forward_and_backward(model, src, lengths, prev)
    assert kernel_launches and (5, 2, 3 * 2, 32) in [shape for launch in kernel_launches for shape in launch]
    with reference_rotation():
        ref_out, ref_grads = forward_and_backward(model, src, lengths, prev)
    torch.testing.assert_close(fused_out, ref_out, rtol=1e-5, atol=1e-5)
    for name in ref_grads:
        torch.testing.assert_close(fused_grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
