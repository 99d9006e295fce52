"""Let fairseq checkpoints load under torch's default ``torch.load(weights_only=True)``.

Since torch 2.6 ``torch.load`` refuses any pickled class that is not allow-listed. fairseq
checkpoints hold an ``argparse.Namespace`` (the model arguments) and, after ``--eval-bleu`` or
``--best-checkpoint-metric`` runs, numpy scalars and small numeric numpy arrays (BLEU n-gram
counts in the saved meters). ``patches`` allow-lists exactly those types -- nothing is loaded
with ``weights_only=False``.
"""

import argparse

import numpy as np


def _numpy_types():
    try:  # numpy 2.x
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct, scalar
    numeric = (np.float64, np.float32, np.float16, np.int64, np.int32, np.uint8, np.bool_)
    dtype_classes = [type(np.dtype(t)) for t in numeric]
    return [scalar, _reconstruct, np.ndarray, np.dtype, *dtype_classes]


FAIRSEQ_CHECKPOINT_GLOBALS = [argparse.Namespace, *_numpy_types()]

