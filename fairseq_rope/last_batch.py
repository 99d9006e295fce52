"""Keep every sentence when fairseq batches a dataset.

fairseq 0.12's ``data_utils.batch_by_size`` drops the last batch when its size is not a multiple
of ``--required-batch-size-multiple`` (default 8). For training that loses a few sentences per
epoch; for ``fairseq-generate`` and validation it silently scores a test set without its last
sentences (e.g. 3000 of newstest2014's 3003). Importing fairseq_rope wraps the function
(``patches``) so that batch is kept; batches, their order and their sizes are otherwise unchanged.
"""

import numpy as np


def keep_last_batch(batch_by_size):
    def batch_by_size_keeping_every_sentence(indices, *args, **kwargs):
        if not isinstance(indices, np.ndarray):
            indices = np.fromiter(indices, dtype=np.int64, count=-1)
        batches = batch_by_size(indices, *args, **kwargs)
        kept = sum(len(batch) for batch in batches)
        if kept < len(indices):
            # batches are consecutive slices of ``indices``: what was dropped is the tail
            batches = list(batches) + [indices[kept:]]
        return batches

    batch_by_size_keeping_every_sentence.__doc__ = batch_by_size.__doc__
    return batch_by_size_keeping_every_sentence

