"""The Python, torch and fairseq the plugin needs, checked when it is imported.

torch and fairseq are not dependencies of the package (pyproject.toml): installing fairseq-rope
into a training environment must never install, upgrade or replace them, nor fairseq's pinned
hydra-core and omegaconf. So what is missing or too old is found here, before the plugin touches
either, and stops the import with one line naming the package, the version found and the
supported range (docs/usage.md#install has the table).

The floors, from an audit of the APIs the code uses:

- Python 3.9: the syntax (a test parses every file as 3.9); no standard-library call is newer
  (looked for by hand).
- torch 2.1: ``torch.load(mmap=...)`` (reading checkpoints without copying them) is 2.1's;
  ``F.scaled_dot_product_attention`` is 2.0's. ``torch.serialization.add_safe_globals`` (2.4)
  is only used where it exists (``checkpoint_safe_globals``): before 2.6 ``torch.load`` does
  not default to ``weights_only=True``, so older versions need no allow-list.
- fairseq 0.12.2: the oldest release whose functions the plugin's patches wrap
  (``patches.FAIRSEQ_VERSIONS``; a newer fairseq runs unpatched, with a warning).

Standard library only: it runs before torch or fairseq is imported.
"""

import importlib
import re
import sys
from typing import Callable, Optional, Tuple

from .config_values import OneLineError, one_line_excepthook

PYTHON_FLOOR = "3.9"
TORCH_FLOOR = "2.1"
FAIRSEQ_FLOOR = "0.12.2"
# what each floor is stated with in the one-line message
SUPPORTED = {
    "Python": f">= {PYTHON_FLOOR}",
    "torch": f">= {TORCH_FLOOR}",
    "fairseq": f">= {FAIRSEQ_FLOOR} (on Python 3.11: the fork fairseq-fixed 0.12.3.1)",
}


class RequirementError(OneLineError, ImportError):
    """Python, torch or fairseq is missing or older than the plugin supports (an ImportError, as
    the import of the plugin fails)."""


def release(version: str) -> Tuple[int, ...]:
    """The numeric release of a version string: ``2.5.0a0+git1a2b`` -> (2, 5, 0); () if none.
    A pre-release or local build counts as its release (NVIDIA's containers ship such torches)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(part) for part in match.group(1).split(".")) if match else ()


def requirement_problem(package: str, found: Optional[str], floor: str) -> Optional[str]:
    """Why ``package`` at version ``found`` (None: not installed) cannot run the plugin, as one
    line, or None."""
    where = f"for {sys.executable}"
    if found is None:
        return (f"fairseq_rope needs {package} {SUPPORTED[package]}, which is not installed {where}: install it "
                "first (docs/usage.md#install)")
    if release(found) < release(floor):
        return (f"fairseq_rope needs {package} {SUPPORTED[package]}, found {package} {found} {where}: "
                f"upgrade {package} (docs/usage.md#install)")
    return None


def installed_version(module: str, import_module: Callable) -> Optional[str]:
    """``module.__version__`` once imported, or None when ``module`` is not installed (an
    ImportError from inside an installed module, a broken dependency of it, is raised as it is)."""
    try:
        imported = import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module:
            raise
        return None
    return str(getattr(imported, "__version__", "unknown"))


def requirements_problem(import_module: Optional[Callable] = None,
                         python_version: Optional[str] = None) -> Optional[str]:
    """The first requirement this environment misses, as one line, or None. torch is checked
    before fairseq, which imports it."""
    import_module = import_module or importlib.import_module
    python_version = python_version or ".".join(map(str, sys.version_info[:3]))
    problem = requirement_problem("Python", python_version, PYTHON_FLOOR)
    for package, floor in (("torch", TORCH_FLOOR), ("fairseq", FAIRSEQ_FLOOR)):
        problem = problem or requirement_problem(package, installed_version(package, import_module), floor)
    return problem


def check_requirements() -> None:
    """Raise RequirementError if a requirement is missing or too old. A command (fairseq-train
    ``--user-dir ...``) then ends with the one line and exit status 2, as on a bad option; an
    interactive session keeps its own handling and sees the exception."""
    problem = requirements_problem()
    if problem is None:
        return
    if not (hasattr(sys, "ps1") or sys.flags.interactive):
        sys.excepthook = one_line_excepthook(sys.excepthook)
    raise RequirementError(problem)
