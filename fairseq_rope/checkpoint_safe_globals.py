"""Let fairseq checkpoints load under torch's default ``torch.load(weights_only=True)``.

Since torch 2.6 ``torch.load`` refuses any pickled class that is not allow-listed. fairseq
checkpoints hold an ``argparse.Namespace`` (the model arguments) and, after ``--eval-bleu`` or
``--best-checkpoint-metric`` runs, numpy scalars and small numeric numpy arrays (BLEU n-gram
counts in the saved meters). ``patches`` allow-lists exactly those types, and the plugin's and
the tools' own loads ask for ``weights_only=True`` wherever torch has the allow-list (2.4 and
later: :func:`safe_load_kwargs`). torch before 2.4 has no allow-list (``add_safe_globals``): there
a checkpoint is unpickled in full, by fairseq and by the tools alike, so load only checkpoints you
trust (fairseq's own loads, as fairseq-train and -generate make them, follow torch's default,
``weights_only=True`` from 2.6 on).
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


def safe_load_kwargs(serialization) -> dict:
    """The ``torch.load`` keyword that loads fairseq checkpoints without running pickled code:
    ``weights_only=True`` where ``serialization`` (``torch.serialization``) has the allow-list that
    lets them load so (torch >= 2.4); none before, where such a load would refuse them."""
    return {"weights_only": True} if hasattr(serialization, "add_safe_globals") else {}


def allow_fairseq_checkpoint_types(serialization) -> None:
    """Allow-list :data:`FAIRSEQ_CHECKPOINT_GLOBALS` in ``serialization`` (``torch.serialization``),
    where it has an allow-list (torch >= 2.4)."""
    add_safe_globals = getattr(serialization, "add_safe_globals", None)
    if add_safe_globals is not None:
        add_safe_globals(FAIRSEQ_CHECKPOINT_GLOBALS)
