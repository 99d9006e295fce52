"""The warnings fairseq's own code makes its libraries print, filtered out of every fairseq command
that loads the plugin (``--user-dir``) and of the hub interface.

fairseq 0.12 builds its configuration with APIs that hydra 1.1+ deprecates: every
``fairseq-train``, ``-generate``, ``-interactive`` and ``-validate`` prints the same six hydra
warnings, about twenty lines, at its start. torch warns on every CPU data loader, because fairseq
always asks for pinned memory, and about the deprecated ``torch.cuda.amp`` calls in fairseq's
training step. None of them is about anything the user set or can change. Each filter matches
one message (its start) and, where the warning names one, the module that caused it (fairseq's
own code), so every other warning -- about the user's options, data or model -- is printed as
before; and a user who asks for warnings (``python -W ...`` or ``PYTHONWARNINGS``) gets them
all, these included.
"""

import sys
import warnings

# (message: a regular expression matched at the start of the warning's text, its category,
#  the module it is attributed to: a regular expression, "" for any)
THIRD_PARTY_NOISE = (
    # hydra 1.1+, about how fairseq 0.12 calls it (attributed to hydra, fairseq's scripts or "sys")
    (r"hydra\.experimental\.(initialize|compose)\(\) is no longer experimental", UserWarning, ""),
    (r"\s*The version_base parameter is not specified", UserWarning, ""),
    (r"In '[^']*': Usage of deprecated keyword in package header '# @package _group_'", UserWarning, ""),
    (r"\s*'[^']*' is validated against ConfigStore schema with the same name", UserWarning, ""),
    (r"\s*The strict flag in the compose API is deprecated", UserWarning, ""),
    # torch, about fairseq's DataLoader(pin_memory=True) on a machine without a GPU
    (r"'pin_memory' argument is set as true but no accelerator is found", UserWarning, r"torch\.utils\.data\."),
    # torch 2.4+, about fairseq's calls of torch.cuda.amp (its training step, --amp)
    (r"`torch\.cuda\.amp\.(autocast|GradScaler)\(args\.\.\.\)` is deprecated", FutureWarning, r"fairseq\."),
)


def quiet_third_party_warnings() -> None:
    """Ignore the warnings of THIRD_PARTY_NOISE, unless the user configured warnings themselves
    (Python's advice for a program that changes the default filters). Running it again changes
    nothing: the warnings module replaces a filter that is already there."""
    if sys.warnoptions:
        return
    for message, category, module in THIRD_PARTY_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
