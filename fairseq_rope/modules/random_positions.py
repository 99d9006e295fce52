"""Randomized positions in training (``--rope-random-positions R``; Ruoss et al., ACL 2023,
"Randomized Positional Encodings Boost Length Generalization of Transformers").

A model trained on sequences of at most n tokens sees relative distances below n only, and RoPE
gives the longer distances of a longer input angles it never met. Here each training sequence of
n tokens takes, in the encoder's and the decoder's self-attention, the positions of an ordered
random sample of n distinct integers from 0 .. ceil(R n) - 1 instead of 0 .. n - 1: the same
tokens, in the same order, at gaps that vary, so that distances up to R n are seen without
longer data. Under RoPE only the differences of positions matter (eq. 16): a constant offset
would change nothing, the gaps must vary.

Inference is unchanged: a model in eval mode uses 0 .. n - 1, with every ``--rope-scaling``.
With R = 1 the sample is 0 .. n - 1 itself.
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..config_values import OptionError
from .rotary import positions_from_padding_mask


def check_range_factor(range_factor) -> None:
    if not (isinstance(range_factor, (int, float)) and math.isfinite(range_factor) and range_factor >= 1.0):
        raise OptionError(f"--rope-random-positions must be a finite number R >= 1 (1: off), got {range_factor}")


def sample_positions(padding_mask: Tensor, range_factor: float,
                     generator: Optional[torch.Generator] = None) -> Tuple[Tensor, int]:
    """Positions (batch, time) of a padded batch, each sentence of n tokens (``padding_mask``
    False) at an ordered random sample of n distinct positions from 0 .. ceil(R n) - 1, and a
    bound every position is below (ceil(R x time), known without reading the device).

    Padding on the left (fairseq's sources) or on the right (its targets) alike: a sentence's
    k-th token takes the k-th smallest of its sample; a pad takes a position of its sentence
    (it is masked as a key, and its output is not used)."""
    batch, width = padding_mask.shape
    device = padding_mask.device
    lengths = width - padding_mask.sum(dim=1)  # (batch,)
    end = max(1, math.ceil(width * range_factor))
    ranges = torch.ceil(lengths.double() * range_factor).long()  # ceil(R n) <= end
    # a uniform random subset of n of a sentence's range: the n smallest of uniform keys, the
    # keys beyond its range made larger than any inside it
    keys = torch.rand(batch, end, device=device, generator=generator)
    slots = torch.arange(end, device=device)
    keys = keys.masked_fill(slots >= ranges[:, None], 2.0)
    drawn = keys.argsort(dim=1)[:, :width]
    drawn = drawn.masked_fill(torch.arange(width, device=device) >= lengths[:, None], end).sort(dim=1).values
    positions = drawn.gather(1, positions_from_padding_mask(padding_mask))
    return positions.clamp_(max=end - 1), end
