"""What training records about sequence lengths, for the L of ``--rope-scaling`` (yarn, dynamic-*).

Training counts the sources and targets of every batch by length (tokens, EOS included) and
saves the counts in the checkpoint's model configuration with the longest length
(``rope_trained_length_counts``, ``rope_trained_length``). L is the length that 99 % of those
sequences do not exceed: a translation corpus has a few outliers much longer than the rest (in
docs/position_encodings.md the longest of 50,202 training sequences has 26 tokens, and 99 % have
at most 15), and a model extrapolates from the lengths it saw often, not from one sentence.
Checkpoints saved before the counts were recorded give the longest length; a resume from one says
that the counts start there (checkpoints.py). In distributed training the first rank's counts are
saved: a sample of the same lengths.
"""

from typing import List, Optional

import torch
from torch import Tensor

from .config_values import config_value

COUNTS = "rope_trained_length_counts"
LONGEST = "rope_trained_length"
COVERED_PERCENT = 99


def _set(model_cfg, name, value) -> None:
    if isinstance(model_cfg, dict):
        model_cfg[name] = value
    else:
        setattr(model_cfg, name, value)


def covering_length(counts: List[int], percent: float = COVERED_PERCENT) -> int:
    """The smallest n such that ``percent`` % of the counted sequences have at most n tokens
    (``counts[n]`` sequences have n tokens); 0 if none were counted."""
    total, covered = sum(counts), 0
    for length, count in enumerate(counts):
        covered += count
        if total and covered * 100 >= percent * total:
            return length
    return 0


def training_length(args) -> int:
    """L of the scalings that need one: --rope-scaling-original-length, else what training recorded."""
    return args.rope_scaling_original_length or recorded_training_length(args)


def recorded_training_length(model_cfg) -> int:
    """L of a saved model configuration: the 99 % length of its counts, else its longest; 0 if
    training recorded neither."""
    counts = config_value(model_cfg, COUNTS)
    return covering_length(counts) if counts else int(config_value(model_cfg, LONGEST) or 0)


def _padded(counts: Tensor, size: int) -> Tensor:
    return torch.nn.functional.pad(counts, (0, size - counts.numel())) if counts.numel() < size else counts


class TrainingLengths:
    """Counts of the sequence lengths a model is trained on, kept on the batches' device (no
    device sync per batch), continued from what a checkpoint recorded."""

    def __init__(self, model_cfg=None):
        recorded = config_value(model_cfg, COUNTS)
        self.longest = int(config_value(model_cfg, LONGEST) or 0)
        self.counts: Optional[Tensor] = torch.tensor(list(recorded), dtype=torch.long) if recorded else None

    def count(self, lengths: Tensor, width: int) -> None:
        """Add ``lengths`` (each at most ``width``, a size known without reading the device)."""
        if self.counts is None:
            self.counts = torch.zeros(width + 1, dtype=torch.long, device=lengths.device)
        else:
            self.counts = _padded(self.counts.to(lengths.device), width + 1)
        self.counts.scatter_add_(0, lengths.long(), torch.ones_like(lengths, dtype=torch.long))
        self.longest = max(self.longest, width)

    def count_at_least(self, counts: Tensor) -> None:
        """Raise the count of each length to at least that of ``counts``."""
        if self.counts is None:
            self.counts = counts.clone()
        else:
            size = max(self.counts.numel(), counts.numel())
            self.counts = torch.maximum(_padded(self.counts, size), _padded(counts.to(self.counts.device), size))

    def as_list(self) -> List[int]:
        counts = self.counts.tolist() if self.counts is not None else []
        while counts and counts[-1] == 0:
            counts.pop()
        return counts

    def record_in(self, model_cfg) -> None:
        """Write the counts and the longest length into a model configuration (saved with it)."""
        counts = self.as_list()
        if counts:
            _set(model_cfg, COUNTS, counts)
        if self.longest:
            _set(model_cfg, LONGEST, self.longest)

    @classmethod
    def merged(cls, model_cfgs) -> "TrainingLengths":
        """What several checkpoints recorded, as one record: the longest of them and, per length,
        the largest count (the checkpoints of one run count cumulatively: the latest has them all)."""
        merged = cls()
        for model_cfg in model_cfgs:
            other = cls(model_cfg)
            merged.longest = max(merged.longest, other.longest)
            if other.counts is not None:
                merged.count_at_least(other.counts)
        return merged
