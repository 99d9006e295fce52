"""Let fairseq checkpoints load under torch's default ``torch.load(weights_only=True)``.

Since torch 2.6 ``torch.load`` refuses any pickled class that is not allow-listed. fairseq
checkpoints hold an ``argparse.Namespace`` (the model arguments) and, after ``--eval-bleu`` or
``--best-checkpoint-metric`` runs, numpy scalars and small numeric numpy arrays (BLEU n-gram
counts in the saved meters). ``patches`` allow-lists exactly those types -- nothing is loaded
with ``weights_only=False``. torch before 2.4 has no allow-list (``add_safe_globals``), and
before 2.6 does not load with ``weights_only=True`` unless asked to: there, nothing is needed.
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


def allow_fairseq_checkpoint_types(serialization) -> None:
    """Allow-list :data:`FAIRSEQ_CHECKPOINT_GLOBALS` in ``serialization`` (``torch.serialization``),
    where it has an allow-list (torch >= 2.4)."""
    add_safe_globals = getattr(serialization, "add_safe_globals", None)
    if add_safe_globals is not None:
        add_safe_globals(FAIRSEQ_CHECKPOINT_GLOBALS)
