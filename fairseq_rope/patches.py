"""Every change that importing the plugin makes to fairseq, torch and Python, in one table.

Each :class:`Patch` names the attribute it replaces, the function (in the module of its concern)
that makes the replacement from the original, and what a user loses without it. The fairseq
patches wrap functions of :data:`FAIRSEQ_VERSIONS` only: with another fairseq, fairseq is left
as it is and one warning names each patch not applied; torch's and Python's apply whatever the
version. :func:`install_patches` runs once; a replaced attribute is marked, so no import under
another name wraps it twice.

Besides the table, :func:`install_patches` filters out the warnings that fairseq's own
code makes hydra and torch print (``third_party_warnings``), and registers the tokenizer and BPE
that segment raw text as the recipe did (``text_encoders``: ``--tokenizer moses_normalized``,
``--bpe subword_nmt_vocabulary``), with any fairseq.
"""

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from .checkpoint_safe_globals import allow_fairseq_checkpoint_types
from .checkpoints import (
    AtomicCopyPathManager,
    atomic_torch_persistent_save,
    load_checkpoint_locked_and_recovering,
    load_checkpoint_to_cpu_checking_overrides,
    trainer_load_checkpoint_checked,
    trainer_state_dict_recorded,
)
from .config_values import one_line_excepthook
from .last_batch import keep_last_batch
from .save_dir_lock import verify_save_dir
from .text_encoders import register_text_encoders
from .third_party_warnings import quiet_third_party_warnings

# 0.12.3.1: the fairseq-fixed fork this is tested with; 0.12.2 (the last release) and 0.12.3 (the
# main branch it forks): the same code for every function wrapped here. Named one by one, not as
# 0.12.*: a later release may change a wrapped signature, which would fail only mid-training.
FAIRSEQ_VERSIONS = ("0.12.2", "0.12.3", "0.12.3.1")
MARK = "_fairseq_rope_patch"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Patch:
    target: str  # a module, or module:Class
    attribute: Optional[str]  # None: a registration, ``replace(target)`` is called
    replace: Callable[[Any], Any]  # the original attribute -> its replacement
    why: str  # what is lost without it
    fairseq: bool = True

    @property
    def name(self) -> str:
        return f"{self.target}.{self.attribute}" if self.attribute else self.target

    def owner(self):
        module, _, cls = self.target.partition(":")
        return getattr(importlib.import_module(module), cls) if cls else importlib.import_module(module)

    def applied(self) -> bool:
        return self.attribute is not None and getattr(getattr(self.owner(), self.attribute), MARK, False)

    def apply(self) -> None:
        owner = self.owner()
        if self.attribute is None:
            self.replace(owner)
        elif not self.applied():
            replacement = self.replace(getattr(owner, self.attribute))
            setattr(replacement, MARK, True)
            setattr(owner, self.attribute, replacement)


PATCHES = (
    Patch("sys", "excepthook", one_line_excepthook,
          "a bad option is printed as one line with exit code 2, not as a traceback", fairseq=False),
    Patch("torch.serialization", None, allow_fairseq_checkpoint_types,
          "fairseq checkpoints load under torch.load(weights_only=True), torch's default", fairseq=False),
    Patch("fairseq.data.data_utils", "batch_by_size", keep_last_batch,
          "the last, partial batch: without it up to --required-batch-size-multiple - 1 sentences of each "
          "set are dropped, and fairseq-generate scores a test set without them"),
    Patch("fairseq.checkpoint_utils", "torch_persistent_save", atomic_torch_persistent_save,
          "atomic checkpoint writes: a kill while saving can leave a truncated checkpoint"),
    Patch("fairseq.checkpoint_utils", "PathManager", lambda path_manager: AtomicCopyPathManager,
          "atomic copies to checkpoint_last.pt and checkpoint_best.pt: a kill while copying truncates them"),
    Patch("fairseq.checkpoint_utils", "verify_checkpoint_directory", lambda fairseq_check: verify_save_dir,
          "a --save-dir that cannot be made or written is one line, not a traceback, and a file named dummy in it "
          "is left alone (fairseq's check writes and deletes one)"),
    Patch("fairseq.checkpoint_utils", "load_checkpoint", load_checkpoint_locked_and_recovering,
          "the --save-dir lock (two trainings can write one save dir) and the resume from the newest readable "
          "checkpoint when checkpoint_last.pt is truncated"),
    Patch("fairseq.checkpoint_utils", "load_checkpoint_to_cpu", load_checkpoint_to_cpu_checking_overrides,
          "the --model-overrides check (an override can change an option the model was trained with), and the "
          "model options of checkpoints saved with the plugin made a Namespace again, as fairseq builds a "
          "legacy architecture from"),
    Patch("fairseq.trainer:Trainer", "state_dict", trainer_state_dict_recorded,
          "the training lengths in checkpoints (--rope-scaling yarn and dynamic-* need "
          "--rope-scaling-original-length), the dictionaries' fingerprints (averaging checkpoints of "
          "other dictionaries is not refused), and model options saved as a dict, which fairseq without "
          "--user-dir reads far enough to name the unknown architecture (a Namespace is an UnpicklingError)"),
    Patch("fairseq.trainer:Trainer", "load_checkpoint", trainer_load_checkpoint_checked,
          "the resume check (a resume can change an option that defines the trained model), the "
          "--finetune-from-model check (a start that does not map one to one) with its origin record, and the "
          "continued training-length counts"),
)
_installed = False


def fairseq_version() -> str:
    import fairseq

    return fairseq.__version__


def install_patches() -> List[Patch]:
    """Apply every patch that fits this fairseq (once); the patches not applied."""
    global _installed
    if _installed:
        return []
    _installed = True
    quiet_third_party_warnings()
    register_text_encoders()
    supported = fairseq_version() in FAIRSEQ_VERSIONS
    skipped = [patch for patch in PATCHES if patch.fairseq and not supported]
    for patch in PATCHES:
        if patch not in skipped:
            patch.apply()
    if skipped:
        lost = "; ".join(f"{patch.name}: {patch.why}" for patch in skipped)
        logger.warning(f"fairseq_rope is written for fairseq {', '.join(FAIRSEQ_VERSIONS)}, not {fairseq_version()}: "
                       f"fairseq is left unpatched, so these are lost: {lost}")
    return skipped
