"""fairseq-rope: Rotary Position Embedding for fairseq machine translation.

Load with ``--user-dir "$(fairseq-rope-user-dir)"`` (the plugin's directory, from any working
directory and for any install). Importing first checks the Python, torch and fairseq versions
(``requirements``), then registers the ``transformer_rope`` and ``transformer_rpe`` models and
their architectures and the ``translation_concat`` task (concatenation training), and
installs the plugin's patches (``patches``: every change it makes to fairseq, torch and Python,
with why): checkpoint types allow-listed for ``torch.load``,
fairseq's batching keeping the last, partial batch, atomic checkpoint writes and safe resumes,
and bad model options printed as one line.
"""

from .requirements import check_requirements

check_requirements()

from .patches import install_patches  # noqa: E402  (after the check: it imports torch and fairseq)

install_patches()

from . import models, modules, tasks  # noqa: E402,F401  (register with fairseq)
from .modules.fused_rotary import fused_switched_on  # noqa: E402

fused_switched_on()  # a bad FAIRSEQ_ROPE_FUSED stops the command here, in one line, not at the first CUDA step

__version__ = "0.1.0"
