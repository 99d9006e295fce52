"""fairseq-rope: Rotary Position Embedding for fairseq machine translation.

Load with ``--user-dir fairseq_rope``. Importing registers the ``transformer_rope`` model and
its architectures, allow-lists what fairseq checkpoints need for ``torch.load``, and makes
fairseq's batching keep the last, partial batch (see ``batching``).
"""

from .batching import keep_every_sentence_in_batches
from .checkpoint_safe_globals import allow_fairseq_checkpoints

allow_fairseq_checkpoints()
keep_every_sentence_in_batches()

from . import models, modules  # noqa: E402,F401  (register with fairseq)

__version__ = "0.1.0"
