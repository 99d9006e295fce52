"""``--task translation_concat``: fairseq's translation task, its training pairs joined with others.

Concatenation training (Varis & Bojar, EMNLP 2021, "Sequence Length is a Domain"; Nguyen et al.,
IWSLT 2021): a model trained on single sentences translates an input of several sentences badly,
whatever its position encoding, because it has never seen one. Here each training pair is, with
probability ``--concat-prob``, joined with 1 to K - 1 other pairs drawn at random
(``--concat-max-sentences K``): their sources one after the other, their targets likewise, as a
user joins the sentences of a paragraph; from epoch ``--concat-from-epoch`` on (1: from the start),
so that a model can first learn from the pairs alone. The joins are drawn anew every epoch from ``--seed``
and the epoch, so a rerun -- or a resume in the middle of an epoch -- sees the same batches; a
join that would exceed the longest input the model and the task accept (``--max-source-positions``,
``--max-target-positions``, ``--max-tokens``) is left out. Validation and test sets are fairseq's
own, untouched. The training length the checkpoint records (``training_lengths``) is counted
from the batches the model is given, so it is that of the joined pairs.

Usable from stock ``fairseq-train --user-dir "$(fairseq-rope-user-dir)" --task translation_concat``; decoding
needs no such task (``fairseq-generate`` with ``--task translation`` reads the same data).
"""

import logging
from dataclasses import dataclass, field
from typing import List

import numpy as np
import torch
from fairseq.data import FairseqDataset, LanguagePairDataset, data_utils
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask
from omegaconf import II

from ..config_values import OptionError

logger = logging.getLogger(__name__)


class ConcatenatedPairsDataset(FairseqDataset):
    """A :class:`~fairseq.data.LanguagePairDataset` whose example i is pair i, joined, with
    probability ``prob``, with 1 to ``max_sentences`` - 1 other pairs drawn at random for the
    epoch (:meth:`set_epoch`), from epoch ``from_epoch`` on. A join drops the EOS between the
    joined sentences (fairseq's binarized sentences end with one), so its size is known without
    reading the data."""

    def __init__(self, dataset: LanguagePairDataset, max_sentences: int, prob: float, seed: int,
                 max_source_positions: int, max_target_positions: int, from_epoch: int = 1):
        if dataset.tgt is None:
            raise OptionError("--task translation_concat joins training pairs and needs their targets")
        if dataset.buckets is not None or dataset.align_dataset is not None:
            raise OptionError("--task translation_concat cannot be combined with --num-batch-buckets or "
                              "--load-alignments: drop them")
        self.dataset, self.max_sentences, self.prob, self.seed = dataset, max_sentences, prob, seed
        self.from_epoch = from_epoch
        self.limits = (max_source_positions, max_target_positions)
        self.epoch, self._planned_for = 1, None
        self.eos = dataset.src_dict.eos()

    # --- the joins of an epoch ------------------------------------------------------------------

    def limit_lengths(self, max_positions) -> None:
        """Join only within ``max_positions`` (an int, a (source, target) pair, or None: the
        task's limits), as fairseq resolves them for the training batches."""
        if max_positions is None:
            return
        if not isinstance(max_positions, (tuple, list)):
            max_positions = (max_positions, max_positions)
        self.limits = tuple(min(limit, given) if given is not None else limit
                            for limit, given in zip(self.limits, max_positions))

    def set_epoch(self, epoch):
        super().set_epoch(epoch)
        self.epoch = epoch

    def _plan(self) -> None:
        """``self.partners`` (pairs, K - 1): the pairs joined to each one this epoch (-1: none),
        and the joined sizes; drawn from (seed, epoch) alone, whatever the limits, so that the
        limits only leave joins out."""
        if self._planned_for == (self.epoch, self.limits):
            return
        base_src, base_tgt = self.dataset.src_sizes.astype(np.int64), self.dataset.tgt_sizes.astype(np.int64)
        pairs, others = len(base_src), self.max_sentences - 1
        rng = np.random.default_rng([self.seed, self.epoch])
        # drawn in every epoch, so that an epoch's joins do not depend on from_epoch
        joined = (rng.random(pairs) < self.prob) & (self.epoch >= self.from_epoch)
        wanted = rng.integers(1, max(others, 1) + 1, size=pairs)
        drawn = rng.integers(0, max(pairs - 1, 1), size=(pairs, others))
        drawn += drawn >= np.arange(pairs)[:, None]  # another pair, never the pair itself
        partners = np.full((pairs, others), -1, dtype=np.int64)
        src, tgt = base_src.copy(), base_tgt.copy()
        max_src, max_tgt = self.limits
        for slot in range(others if pairs > 1 else 0):
            other = drawn[:, slot]
            longer_src, longer_tgt = src + base_src[other] - 1, tgt + base_tgt[other] - 1  # one EOS dropped
            take = joined & (slot < wanted) & (longer_src <= max_src) & (longer_tgt <= max_tgt)
            partners[take, slot] = other[take]
            src, tgt = np.where(take, longer_src, src), np.where(take, longer_tgt, tgt)
        self.partners, self.src_sizes, self.tgt_sizes = partners, src, tgt
        self._planned_for = (self.epoch, self.limits)
        if self.epoch < self.from_epoch:
            logger.info(f"epoch {self.epoch}: the training pairs alone (joins from --concat-from-epoch "
                        f"{self.from_epoch})")
        else:
            with_others = int((partners >= 0).any(axis=1).sum())
            logger.info(f"epoch {self.epoch}: {with_others} of {pairs} training pairs joined with 1 to {others} "
                        f"others (--concat-prob {self.prob:g}, --concat-max-sentences {self.max_sentences}); "
                        f"longest source {int(src.max(initial=0))}, target {int(tgt.max(initial=0))} tokens")

    def parts(self, index) -> List[int]:
        """The pairs example ``index`` joins this epoch, in order."""
        self._plan()
        return [index] + [int(j) for j in self.partners[index] if j >= 0]

    # --- FairseqDataset -------------------------------------------------------------------------

    def _joined(self, items: List[torch.Tensor]) -> torch.Tensor:
        kept = [item[:-1] if len(item) and item[-1] == self.eos else item for item in items[:-1]]
        return torch.cat(kept + items[-1:])

    def __getitem__(self, index):
        samples = [self.dataset[j] for j in self.parts(index)]
        return {"id": index, "source": self._joined([s["source"] for s in samples]),
                "target": self._joined([s["target"] for s in samples])}

    def __len__(self):
        return len(self.dataset)

    def collater(self, samples, pad_to_length=None):
        return self.dataset.collater(samples, pad_to_length=pad_to_length)

    @property
    def sizes(self):
        self._plan()
        return np.vstack((self.src_sizes, self.tgt_sizes)).T

    def num_tokens(self, index):
        self._plan()
        return max(self.src_sizes[index], self.tgt_sizes[index])

    def num_tokens_vec(self, indices):
        self._plan()
        return np.maximum(self.src_sizes[indices], self.tgt_sizes[indices])

    def size(self, index):
        self._plan()
        return self.src_sizes[index], self.tgt_sizes[index]

    def ordered_indices(self):
        """LanguagePairDataset's order, by the joined sizes: shuffled (fairseq seeds NumPy), then
        sorted by target and source length."""
        self._plan()
        indices = np.random.permutation(len(self)).astype(np.int64) if self.dataset.shuffle else np.arange(len(self))
        indices = indices[np.argsort(self.tgt_sizes[indices], kind="mergesort")]
        return indices[np.argsort(self.src_sizes[indices], kind="mergesort")]

    def filter_indices_by_size(self, indices, max_sizes):
        self._plan()
        return data_utils.filter_paired_dataset_indices_by_size(self.src_sizes, self.tgt_sizes, indices, max_sizes)

    @property
    def can_reuse_epoch_itr_across_epochs(self):
        return False  # the joins, so the sizes and the batches, change every epoch

    @property
    def supports_prefetch(self):
        return False


@dataclass
class TranslationConcatConfig(TranslationConfig):
    concat_max_sentences: int = field(default=3, metadata={
        "help": "K: a training pair joined with others has 1 to K - 1 of them, drawn at random every epoch; "
                "1: no joins"})
    concat_prob: float = field(default=0.5, metadata={
        "help": "the probability that a training pair is joined with others"})
    concat_from_epoch: int = field(default=1, metadata={
        "help": "join pairs from this epoch on; the epochs before it train on the pairs alone"})
    seed: int = II("common.seed")


@register_task("translation_concat", dataclass=TranslationConcatConfig)
class TranslationConcatTask(TranslationTask):
    """fairseq's translation task with concatenation training (see the module docstring)."""

    cfg: TranslationConcatConfig

    @classmethod
    def setup_task(cls, cfg: TranslationConcatConfig, **kwargs):
        if not (isinstance(cfg.concat_max_sentences, int) and cfg.concat_max_sentences >= 1):
            raise OptionError(f"--concat-max-sentences must be a whole number K >= 1 (1: no joins), "
                              f"got {cfg.concat_max_sentences}")
        if not 0.0 <= cfg.concat_prob <= 1.0:
            raise OptionError(f"--concat-prob must be a probability in [0, 1], got {cfg.concat_prob}")
        if not (isinstance(cfg.concat_from_epoch, int) and cfg.concat_from_epoch >= 1):
            raise OptionError(f"--concat-from-epoch must be an epoch number >= 1, got {cfg.concat_from_epoch}")
        return super().setup_task(cfg, **kwargs)

    def joins(self) -> bool:
        return self.cfg.concat_max_sentences > 1 and self.cfg.concat_prob > 0.0

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        if split == self.cfg.train_subset and self.joins():
            self.datasets[split] = ConcatenatedPairsDataset(
                self.datasets[split], self.cfg.concat_max_sentences, self.cfg.concat_prob, self.cfg.seed,
                self.cfg.max_source_positions, self.cfg.max_target_positions, self.cfg.concat_from_epoch)

    def get_batch_iterator(self, dataset, max_tokens=None, max_sentences=None, max_positions=None,
                           *args, **kwargs):
        if isinstance(dataset, ConcatenatedPairsDataset):
            # the limits fairseq resolves (task, model, --max-tokens) before it sets the epoch
            dataset.limit_lengths(max_positions)
        return super().get_batch_iterator(dataset, max_tokens, max_sentences, max_positions, *args, **kwargs)

