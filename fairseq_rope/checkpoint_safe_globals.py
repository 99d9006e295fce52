"""Let fairseq checkpoints load under torch's default ``torch.load(weights_only=True)``.

Since torch 2.6 ``torch.load`` refuses any pickled class that is not allow-listed. fairseq
checkpoints hold an ``argparse.Namespace`` (the model arguments) and, after ``--eval-bleu`` or
``--best-checkpoint-metric`` runs, numpy scalars. We allow exactly those types -- nothing is
loaded with ``weights_only=False``.
"""

import argparse

import numpy as np
import torch


def _numpy_scalar_types():
    try:  # numpy >= 1.25 / 2.x
        from numpy._core.multiarray import scalar
    except ImportError:  # pragma: no cover - older numpy
        from numpy.core.multiarray import scalar
    dtype_classes = [type(np.dtype(t)) for t in (np.float64, np.float32, np.int64, np.int32, np.bool_)]
    return [scalar, np.dtype, *dtype_classes]


FAIRSEQ_CHECKPOINT_GLOBALS = [argparse.Namespace, *_numpy_scalar_types()]


def allow_fairseq_checkpoints() -> None:
    add_safe_globals = getattr(torch.serialization, "add_safe_globals", None)
    if add_safe_globals is not None:  # torch < 2.4 loads these without an allow-list
        add_safe_globals(FAIRSEQ_CHECKPOINT_GLOBALS)
