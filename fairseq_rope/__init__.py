"""fairseq-rope: Rotary Position Embedding for fairseq machine translation.

Load with ``--user-dir fairseq_rope``. Importing registers the ``transformer_rope`` model and
its architectures, allow-lists what fairseq checkpoints need for ``torch.load``, makes
fairseq's batching keep the last, partial batch (see ``batching``), makes checkpoint writes
atomic and resumes safe (see ``checkpoints``), and prints bad model options as one line.
"""

from .batching import keep_every_sentence_in_batches
from .checkpoint_safe_globals import allow_fairseq_checkpoints
from .checkpoints import make_fairseq_checkpoints_safe
from .model_options import print_option_errors_as_one_line

allow_fairseq_checkpoints()
keep_every_sentence_in_batches()
make_fairseq_checkpoints_safe()
print_option_errors_as_one_line()

from . import models, modules  # noqa: E402,F401  (register with fairseq)

__version__ = "0.1.0"
