"""fairseq-rope: Rotary Position Embedding for fairseq machine translation.

Load with ``--user-dir fairseq_rope``. Importing registers the ``transformer_rope`` and
``transformer_rpe`` models and their architectures, and installs the plugin's patches
(``patches``: every change it makes to fairseq, torch and Python, with why): checkpoint types
allow-listed for ``torch.load``, fairseq's batching keeping the last, partial batch, atomic
checkpoint writes and safe resumes, and bad model options printed as one line.
"""

from .patches import install_patches

install_patches()

from . import models, modules  # noqa: E402,F401  (register with fairseq)

__version__ = "0.1.0"
