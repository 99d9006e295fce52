"""Whole models with the fused Triton rotation (run by Triton's interpreter on CPU tensors)
against the same models with the reference rotation: same weights, same batch, same dropout.

The reference path is forced by making ``RotaryEmbedding.rotate`` see the kernel as unavailable;
``kernel_launches`` records every launch, so each test also checks that the kernel really ran
(and with the shapes the model should give it). About 10 s on one core."""

from contextlib import contextmanager

import pytest
import torch
from support.models import model_with_dictionary
from test_dynamic_scaling import batch as sources_of_lengths
from test_rotary_attention import random_batch

from fairseq_rope.modules import rotary_embedding

HEADS, HEAD_DIM = 2, 32  # transformer_rope_tiny
pytestmark = pytest.mark.usefixtures("one_thread")
VARIANTS = {
    "self-attention": [],
    "half-layout-fraction": ["--rope-layout", "half", "--rope-fraction", "0.5"],
    "cross-attention-roper": ["--rope-cross-attention", "--rope-values"],
    "linear-attention": ["--attention-kind", "linear"],
    "dynamic-yarn": ["--rope-scaling", "dynamic-yarn", "--rope-scaling-original-length", 8],
}


@contextmanager
def reference_rotation():
    """A context in which ``rotate`` takes the reference path, as it does without Triton."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rotary_embedding, "fused_runs_on", lambda device: False)
        yield


def forward_and_backward(model, src, lengths, prev, seed=0):
    """Training-mode output and the gradient of every parameter, with fixed dropout masks."""
    model.zero_grad()
    torch.manual_seed(seed)
    out, _ = model(src, lengths, prev)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * weights).sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_step_with_the_kernel_equals_the_reference(kernel_launches, variant):
    flags = VARIANTS[variant]
    model, d, _ = model_with_dictionary("transformer_rope_tiny", *flags)
    model.train()
    if variant == "dynamic-yarn":  # two sentences longer than L = 8: per-sentence factors s > 1
        src, lengths, prev = sources_of_lengths(d, [5, 11, 9], target_length=4)
    else:  # left-padded sources: per-sentence positions where queries and keys differ
        src, lengths, prev = random_batch(d, bsz=2, src_len=5, tgt_len=4)
    fused_out, fused_grads = forward_and_backward(model, src, lengths, prev)
    launched = [shape for launch in kernel_launches for shape in launch]
    with reference_rotation():
        ref_out, ref_grads = forward_and_backward(model, src, lengths, prev)
    assert len(kernel_launches) > 0 and len(kernel_launches) % 2 == 0  # forward and backward

    T, B = src.size(1), src.size(0)
    rotated_heads = 3 * HEADS if "--rope-values" in flags else 2 * HEADS
    if variant == "linear-attention":  # q and k features in one pair launch
        assert [(T, B, HEADS, HEAD_DIM)] * 2 in kernel_launches
    else:  # the encoder's self-attention: the rotated heads of the fused q/k/v projection
        assert (T, B, rotated_heads, HEAD_DIM) in launched
    if "--rope-cross-attention" in flags:  # encoder keys rotate alone, by their own positions
        assert (T, B, HEADS, HEAD_DIM) in launched

    torch.testing.assert_close(fused_out, ref_out, rtol=1e-5, atol=1e-5)
    assert fused_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(fused_grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("variant", ["self-attention", "dynamic-yarn"])
def test_beam_search_with_the_kernel_gives_the_reference_hypotheses(kernel_launches, variant):
    """Beam 4 with incremental decoding (cached rotated keys, one new position per step) and beam
    reorders: the same hypotheses, scores equal to rounding."""
    from fairseq.sequence_generator import SequenceGenerator

    model, d, _ = model_with_dictionary("transformer_rope_tiny", *VARIANTS[variant])
    model.eval()
    if variant == "dynamic-yarn":
        src, lengths, _ = sources_of_lengths(d, [5, 10])
    else:
        src, lengths, _ = random_batch(d, bsz=2, src_len=6)
    generator = SequenceGenerator([model], d, beam_size=4, max_len_a=0, max_len_b=5, len_penalty=0.6)

    def decode():
        with torch.no_grad():
            return generator.forward({"net_input": {"src_tokens": src, "src_lengths": lengths}})

    fused = decode()
    steps = [launch for launch in kernel_launches if launch[0][0] == 1]  # one new token per beam
    assert steps and steps[0] == [(1, 4 * len(lengths), 2 * HEADS, HEAD_DIM)]
    with reference_rotation():
        reference = decode()
    for fused_beams, reference_beams in zip(fused, reference):
        assert [h["tokens"].tolist() for h in fused_beams] == [h["tokens"].tolist() for h in reference_beams]
        for got, expected in zip(fused_beams, reference_beams):
            torch.testing.assert_close(got["positional_scores"], expected["positional_scores"], rtol=1e-5, atol=1e-5)
