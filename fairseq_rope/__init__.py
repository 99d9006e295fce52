"""fairseq-rope: Rotary Position Embedding for fairseq machine translation.

Load with ``--user-dir fairseq_rope``. Importing registers the ``transformer_rope`` model and
its architectures, and allow-lists what fairseq checkpoints need for ``torch.load``.
"""

from .checkpoint_safe_globals import allow_fairseq_checkpoints

allow_fairseq_checkpoints()

from . import models, modules  # noqa: E402,F401  (register with fairseq)

__version__ = "0.1.0"
