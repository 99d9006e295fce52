"""Checkpoints that survive a kill, and runs that resume from what is on disk.

fairseq 0.12 saves the first checkpoint of a step through ``name.tmp`` and a rename, without an
fsync, then makes ``checkpoint_last.pt`` and ``checkpoint_best.pt`` by copying it in place: a
kill during that copy leaves a truncated ``checkpoint_last.pt`` that the next run cannot load.
Importing the plugin (``patches``: the functions here wrap fairseq's) makes every checkpoint write
atomic (hidden temporary file in the same directory, fsync, rename, fsync of the directory),
lets a resume whose ``checkpoint_last.pt`` is unreadable fall back to the newest readable
checkpoint, refuses ``--model-overrides`` that would change a trained model, and records in the
saved model configuration the lengths of the sequences the model was trained on, continued across
a resume (``training_lengths``: the L of ``--rope-scaling`` yarn and dynamic-*), and records
beside it a fingerprint of the source and target dictionaries (averaging refuses checkpoints of
other dictionaries). ``fairseq-train`` holds a lock on its ``--save-dir`` (``save_dir_lock``: one
training per save dir), and refuses to resume a checkpoint with options that define another model
(``--rope-theta``, ``--arch`` ...).
"""

import copy
import glob
import hashlib
import json
import logging
import os
import re
import shutil
from typing import Optional

import torch
from fairseq.file_io import PathManager

from fairseq_rope_base.files import write_atomically

from .checkpoint_files import (
    is_legacy_checkpoint,
    is_readable_checkpoint,
    load_cheaply,
    model_config,
    saved_model_config,
)
from .checkpoint_namespaces import dicts_as_namespaces, namespaces_as_dicts
from .config_values import OneLineError, config_value
from .initialization import ORIGIN, Start, initialization_problems, origin_record
from .model_options import (
    check_model_overrides,
    check_resumed_model,
    plugin_model_name,
    registered_model_name,
    trained_model_differences,
)
from .plugin_options import INFERENCE, option_flag, options_with_role, resembles_plugin_option
from .save_dir_lock import lock_save_dir
from .training_lengths import COUNTS, TrainingLengths

logger = logging.getLogger(__name__)


def save_checkpoint_atomically(obj, path: str) -> None:
    def save(tmp):
        with open(tmp, "wb") as f:
            torch.save(obj, f)

    write_atomically(path, save)


def copy_atomically(src: str, dst: str) -> None:
    write_atomically(dst, lambda tmp: shutil.copyfile(src, tmp))


def _updates(path: str) -> int:
    try:
        state = load_cheaply(path)
        return int(state["optimizer_history"][-1]["num_updates"])
    except Exception:  # noqa: BLE001 - any checkpoint we cannot date sorts last
        return -1


# the files fairseq's save_checkpoint writes; not e.g. an average (no optimizer state to resume)
TRAINING_CHECKPOINT = re.compile(r"checkpoint(\d+|_\d+_\d+|_best|_last|\.best_.+)\.pt")


def newest_readable_checkpoint(directory: str, exclude: str):
    """The readable training checkpoint of ``directory`` with the most updates, other than
    ``exclude``; None if there is none. Of equals, a numbered checkpoint (``checkpoint_E_U.pt``,
    ``checkpointE.pt``) is named rather than a copy such as ``checkpoint_best.pt``."""
    candidates = [
        path for path in glob.glob(os.path.join(glob.escape(directory), "checkpoint*.pt"))
        if TRAINING_CHECKPOINT.fullmatch(os.path.basename(path))
        and os.path.abspath(path) != os.path.abspath(exclude) and is_readable_checkpoint(path)
    ]
    if not candidates:
        return None
    numbered = re.compile(r"checkpoint(_\d+)?_?\d+\.pt")
    return max(candidates, key=lambda path: (_updates(path), bool(numbered.fullmatch(os.path.basename(path))),
                                             os.path.getmtime(path)))


class AtomicCopyPathManager(PathManager):
    """fairseq's PathManager whose local copies are atomic (used by fairseq's save_checkpoint)."""

    @staticmethod
    def copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
        if PathManager.path_requires_pathmanager(dst_path) or (not overwrite and os.path.exists(dst_path)):
            return PathManager.copy(src_path, dst_path, overwrite=overwrite)
        copy_atomically(src_path, dst_path)
        return True


def atomic_torch_persistent_save(torch_persistent_save):
    def save(obj, filename, async_write: bool = False):
        if async_write or not isinstance(filename, str) or PathManager.path_requires_pathmanager(filename):
            return torch_persistent_save(obj, filename, async_write=async_write)
        save_checkpoint_atomically(obj, filename)

    return save


def _one_training_per_save_dir(load_checkpoint):
    def load_checkpoint_with_save_dir_locked(cfg, trainer, **passthrough_args):
        # fairseq-train calls this once, before it reads or writes any checkpoint; only the
        # processes that write checkpoints lock (not --no-save runs, not the other DDP ranks)
        if not cfg.no_save and trainer.should_save_checkpoint_on_current_rank:
            lock_save_dir(cfg.save_dir, trainer.checkpoint_suffix)
        return load_checkpoint(cfg, trainer, **passthrough_args)

    return load_checkpoint_with_save_dir_locked


def _resume_falls_back(load_checkpoint):
    def load_checkpoint_or_newest_readable(cfg, trainer, **passthrough_args):
        last = os.path.join(cfg.save_dir, f"checkpoint_last{trainer.checkpoint_suffix}.pt")
        if (cfg.restore_file == "checkpoint_last.pt" and os.path.isfile(last) and not is_readable_checkpoint(last)
                and not is_legacy_checkpoint(last)):  # one of an older torch: fairseq loads it
            fallback = newest_readable_checkpoint(cfg.save_dir, exclude=last)
            if fallback is None:
                raise OneLineError(
                    f"{last} is unreadable (truncated?) and {cfg.save_dir} holds no other readable "
                    "checkpoint: delete it to train from scratch, or pass --restore-file FILE"
                )
            logger.warning(f"{last} is unreadable (truncated?); resuming from {fallback}, "
                           "the newest readable checkpoint")
            cfg = copy.deepcopy(cfg)
            cfg.restore_file = fallback
        return load_checkpoint(cfg, trainer, **passthrough_args)

    return load_checkpoint_or_newest_readable


def load_checkpoint_to_cpu_checking_overrides(load_checkpoint_to_cpu):
    def load_checkpoint_to_cpu_checked(path, arg_overrides=None, load_on_all_ranks=False):
        plugin = {k: v for k, v in (arg_overrides or {}).items() if resembles_plugin_option(k)}
        if plugin:
            # an allowed override of a trained option restates its value: applying it is a no-op
            arg_overrides = {k: v for k, v in arg_overrides.items() if k not in plugin}
            arg_overrides.update({k: v for k, v in plugin.items() if k in options_with_role(INFERENCE)})
        state = dicts_as_namespaces(load_checkpoint_to_cpu(path, arg_overrides, load_on_all_ranks), arg_overrides)
        if plugin:
            check_model_overrides(model_config(state), plugin, path)
        return state

    return load_checkpoint_to_cpu_checked


def _records_training_lengths(state_dict):
    def state_dict_with_training_lengths(trainer):
        lengths = getattr(trainer.get_model(), "training_lengths", None)
        if lengths is not None:
            lengths.record_in(trainer.cfg.model)
        return state_dict(trainer)

    return state_dict_with_training_lengths


# The checkpoint entry that records the dictionaries a model was trained with: a token id is a
# position in a dictionary, so two checkpoints of dictionaries with the same size and other orders
# have parameters of the same shapes that mean other tokens.
DICTIONARIES = "dictionaries"


def dictionary_fingerprint(dictionary) -> Optional[str]:
    """sha256 of a fairseq Dictionary's symbols in their order (the counts do not matter); None
    for no dictionary."""
    if dictionary is None:
        return None
    return hashlib.sha256(json.dumps(list(dictionary.symbols), ensure_ascii=False).encode("utf-8")).hexdigest()


def dictionaries_record(task) -> Optional[dict]:
    """``{"source": fingerprint, "target": fingerprint}`` of a task's dictionaries; None if it has none."""
    record = {side: dictionary_fingerprint(getattr(task, f"{side}_dictionary", None)) for side in ("source", "target")}
    return record if any(record.values()) else None


def dictionaries_of(state) -> Optional[dict]:
    """The dictionaries' fingerprints of a loaded checkpoint: as it records them, else (saved before
    they were recorded) from the dictionaries of the data-bin its configuration names, where they
    still are; None when neither can be had."""
    record = state.get(DICTIONARIES)
    if isinstance(record, dict):
        return record
    cfg = state.get("cfg")
    task = config_value(cfg, "task") if cfg is not None else state.get("args")
    data, langs = config_value(task, "data"), (config_value(task, "source_lang"), config_value(task, "target_lang"))
    if not data or None in langs:
        return None
    paths = [os.path.join(str(data).split(os.pathsep)[0], f"dict.{lang}.txt") for lang in langs]
    if not all(os.path.isfile(path) for path in paths):
        return None
    from fairseq.data import Dictionary

    return {side: dictionary_fingerprint(Dictionary.load(path)) for side, path in zip(("source", "target"), paths)}


def _records_dictionaries(state_dict):
    def state_dict_with_dictionaries(trainer):
        state = state_dict(trainer)
        record = dictionaries_record(trainer.task)
        if record is not None:
            state[DICTIONARIES] = record
        return state

    return state_dict_with_dictionaries


def trainer_state_dict_recorded(state_dict):
    """fairseq's ``Trainer.state_dict`` (what every checkpoint saves) recording the training
    lengths in the model configuration and the dictionaries' fingerprints beside it, its
    Namespaces saved as dicts (:mod:`.checkpoint_namespaces`)."""
    recorded = _records_dictionaries(_records_training_lengths(state_dict))

    def state_dict_recorded(trainer):
        return namespaces_as_dicts(recorded(trainer), lambda model: plugin_model_name(getattr(model, "arch", None))
                                   is not None)

    return state_dict_recorded


def _resume_checks_the_model(load_checkpoint):
    def load_checkpoint_of_the_same_model(trainer, filename, *args, **kwargs):
        saved = saved_model_config(filename)
        if saved is not None and filename == trainer.cfg.checkpoint.finetune_from_model:
            start_from(trainer, filename)
        elif saved is not None:
            check_resumed_model(trainer.cfg.model, saved, filename)
        return load_checkpoint(trainer, filename, *args, **kwargs)

    return load_checkpoint_of_the_same_model


def start_from(trainer, filename) -> None:
    """--finetune-from-model ``filename``: a start whose tensors map one to one onto the model (else
    OneLineError listing every difference), recorded as the model's origin. Options may differ on
    purpose (e.g. a larger --rope-theta for longer inputs): a plugin model's are named, not refused.
    Its later resumes (from its own checkpoint_last.pt) are checked as any resume."""
    state = load_cheaply(filename)
    dictionaries = state.get(DICTIONARIES)
    start = Start(filename, model_config(state), state.get("model") or {},
                  dictionaries if isinstance(dictionaries, dict) else None)
    model_cfg, arch = trainer.cfg.model, config_value(trainer.cfg.model, "arch")
    problems = initialization_problems(start, model_cfg, trainer.task, dictionary_fingerprint, registered_model_name)
    if problems:
        raise OneLineError(f"--finetune-from-model {filename}: cannot start {arch} from it: {'; '.join(problems)}: "
                           "give the flags it was trained with, or a checkpoint of this shape")
    origin = origin_record(start)
    setattr(model_cfg, ORIGIN, origin)
    logger.info(f"starting {arch} from {filename} ({origin['arch']}): its tensors map one to one")
    if plugin_model_name(origin["arch"]) is not None:
        for name, value, old in trained_model_differences(model_cfg, start.saved):
            logger.warning(f"fine-tuning {filename} with {option_flag(name)} {value} (it was trained with {old})")


def _resume_continues_training_lengths(load_checkpoint):
    def load_checkpoint_and_training_lengths(trainer, filename, *args, **kwargs):
        extra_state = load_checkpoint(trainer, filename, *args, **kwargs)
        model = trainer.get_model()
        saved = saved_model_config(filename) if extra_state is not None else None
        start = filename == trainer.cfg.checkpoint.finetune_from_model
        if saved is not None and not start and config_value(saved, ORIGIN):  # a fine-tuned model's resume
            setattr(trainer.cfg.model, ORIGIN, config_value(saved, ORIGIN))
        # a start that counted nothing (not a RoPE model): this training counts from zero, unsaid
        counts_from_zero = start and saved is not None and not config_value(saved, COUNTS)
        if saved is not None and hasattr(model, "training_lengths") and not counts_from_zero:
            # the model was built from the command line; the counts so far are in the checkpoint
            model.training_lengths = TrainingLengths(saved)
            if not config_value(saved, COUNTS):
                logger.warning(
                    f"{filename} records no sequence-length counts (saved before they were recorded): "
                    "the counts, and the L of --rope-scaling yarn and dynamic-* taken from them, start at "
                    "this resume and cover only the batches trained from now on"
                )
        return extra_state

    return load_checkpoint_and_training_lengths


def load_checkpoint_locked_and_recovering(load_checkpoint):
    """fairseq's ``checkpoint_utils.load_checkpoint`` holding the save dir's lock, and resuming
    from the newest readable checkpoint when checkpoint_last.pt is unreadable."""
    return _one_training_per_save_dir(_resume_falls_back(load_checkpoint))


def trainer_load_checkpoint_checked(load_checkpoint):
    """fairseq's ``Trainer.load_checkpoint`` refusing to resume another model or to start from
    one that does not map one to one, and continuing the checkpoint's training-length counts and
    origin (:mod:`.initialization`)."""
    return _resume_continues_training_lengths(_resume_checks_the_model(load_checkpoint))
