"""fairseq's batching keeps every sentence once fairseq_rope is imported."""

import numpy as np
import pytest
from fairseq.data import data_utils

import fairseq_rope  # noqa: F401


@pytest.mark.parametrize("n", [1, 7, 9, 13, 40, 500, 3003])
@pytest.mark.parametrize("limits", [dict(max_sentences=16), dict(max_tokens=400), dict(max_sentences=1)])
@pytest.mark.parametrize("multiple", [1, 8])
def test_every_index_is_batched_exactly_once_in_order(n, limits, multiple):
    rng = np.random.default_rng(n)
    sizes = np.sort(rng.integers(1, 40, n)).astype(np.int64)
    indices = np.arange(n, dtype=np.int64)
    batches = data_utils.batch_by_size(
        indices, lambda i: sizes[i], num_tokens_vec=sizes, required_batch_size_multiple=multiple, **limits
    )
    flat = np.concatenate([np.asarray(b) for b in batches])
    assert flat.tolist() == indices.tolist()
    # all batches but the last still respect the multiple, as fairseq intends
    if multiple > 1 and limits.get("max_sentences", 0) != 1:
        assert all(len(b) % multiple == 0 for b in batches[:-1])


def test_wrapping_is_idempotent():
    from fairseq_rope.patches import PATCHES

    before = data_utils.batch_by_size
    next(patch for patch in PATCHES if patch.attribute == "batch_by_size").apply()
    assert data_utils.batch_by_size is before
