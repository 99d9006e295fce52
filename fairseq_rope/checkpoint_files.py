"""Reading a checkpoint file, below the option table (plugin_options checks an option against
the checkpoint a training resumes): whether a file is a complete checkpoint, its model
configuration read cheaply (tensors mapped, not read), and which checkpoint fairseq-train
resumes or fine-tunes from."""

import os
import pickle
import sys
import zipfile
from typing import Optional

import torch

from .checkpoint_safe_globals import safe_load_kwargs
from .config_values import config_value


def is_readable_checkpoint(path) -> bool:
    """A complete torch zip archive (``path``: a path or a binary file open for reading): a truncated
    file has lost its central directory, which torch.save writes last. Cheap: the tensors are not read."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


# torch.save's format before torch 1.6 (and with _use_new_zipfile_serialization=False): pickles
# that start with torch's magic number. torch still loads it, with the same safe loader; it has no
# directory at its end, so only loading it tells whether it is complete.
LEGACY_MAGIC = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)


def is_legacy_checkpoint(path) -> bool:
    """Whether ``path`` (a path or a binary file open for reading, read from its start) begins as a
    checkpoint in torch's legacy format does."""
    try:
        if isinstance(path, (str, bytes, os.PathLike)):
            with open(path, "rb") as f:
                return f.read(len(LEGACY_MAGIC)) == LEGACY_MAGIC
        path.seek(0)
        return path.read(len(LEGACY_MAGIC)) == LEGACY_MAGIC
    except OSError:
        return False


def load_cheaply(path):
    """The checkpoint ``path`` loaded with its tensors mapped, not read (a legacy-format one, which
    torch cannot map, read whole)."""
    return torch.load(path, map_location="cpu", mmap=not is_legacy_checkpoint(path),
                      **safe_load_kwargs(torch.serialization))


def model_config(state):
    """The model configuration saved in a fairseq checkpoint (``cfg.model`` or legacy ``args``)."""
    cfg = state.get("cfg")
    model_cfg = config_value(cfg, "model") if cfg is not None else None
    return model_cfg if model_cfg is not None else state.get("args")


def saved_model_config(path):
    """The model configuration of the checkpoint ``path``; None where there is no readable one
    (fairseq then starts from scratch, or reports the file). Cheap: mmap, the tensors are not read."""
    if not (os.path.isfile(path) and (is_readable_checkpoint(path) or is_legacy_checkpoint(path))):
        return None
    try:
        return model_config(load_cheaply(path))
    except Exception:  # noqa: BLE001 - fairseq's own load reports what is wrong with the file
        return None


def running_fairseq_train() -> bool:
    """Whether this process is fairseq-train: its console script, or ``python -m fairseq_cli.train``
    as torchrun starts it (fairseq-generate builds models from checkpoint configurations that name
    their training's --save-dir too)."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (os.path.basename(sys.argv[0] or "") in ("fairseq-train", "fairseq-hydra-train")
            or getattr(main_spec, "name", None) in ("fairseq_cli.train", "fairseq_cli.hydra_train"))


def resumed_checkpoint(args) -> Optional[str]:
    """The checkpoint that fairseq-train, run with the parsed ``args``, resumes or fine-tunes from
    (fairseq's rule, in checkpoint_utils.load_checkpoint), when it exists and this process is
    fairseq-train; else None."""
    save_dir, restore_file = getattr(args, "save_dir", None), getattr(args, "restore_file", None)
    if not (save_dir and restore_file and running_fairseq_train()):
        return None
    suffix = getattr(args, "checkpoint_suffix", None) or ""
    if restore_file == "checkpoint_last.pt":
        path = os.path.join(save_dir, f"checkpoint_last{suffix}.pt")
        if not os.path.exists(path):
            path = getattr(args, "finetune_from_model", None)
    else:
        path = restore_file.replace(".pt", suffix + ".pt")
    return path if path and os.path.isfile(path) else None
