"""Where an export is written, by the rule every tool here keeps: it replaces only what it wrote.
An output is a new path or, with --force, an empty directory or an earlier export (recognised by
its files, nothing else in it); never an input nor a directory that holds one. The export is
written beside it and takes its place in one rename when complete."""

import errno
import json
import os

from fairseq_rope_base.files import file_fingerprint, outputs_over_inputs_problem, replace_directory
from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy.exported import (
    CTRANSLATE2_MODEL_FORMAT,
    EXPORT_INFO,
    LENGTH_BUCKETS,
    MODEL_FILES,
    is_bundle_entry,
    read_bucket_manifest,
    read_export_info,
    vocabulary_digests,
)

# what an export holds: CTranslate2's files for a translation model (.txt: older versions), the ONNX
# engine's, and ours
EXPORT_FILES = frozenset({"config.json", EXPORT_INFO, *(name for names in MODEL_FILES.values() for name in names)} | {
    f"{kind}vocabulary.{ext}" for kind in ("", "shared_", "source_", "target_") for ext in ("json", "txt")})


def has_model_files(directory, info: dict) -> bool:
    """Whether the export ``directory`` holds the model files of the format its export_info.json
    (``info``) records (CTranslate2 for exports from before formats were recorded)."""
    names = MODEL_FILES.get(info.get("format", CTRANSLATE2_MODEL_FORMAT), ())
    return bool(names) and all(os.path.isfile(os.path.join(directory, name)) for name in names)


def checkpoint_identity(path):
    """The file's real path, and the size and sha256 of the bytes read now."""
    size, sha256 = file_fingerprint(path)
    return {"checkpoint": os.path.realpath(path), "size": int(size), "sha256": sha256}


def is_export(directory) -> bool:
    """An export this tool wrote: export_info.json and model.bin, and no file it does not write
    (its bundle's included); or a --length-buckets export: its manifest and the exports it lists,
    nothing else."""
    try:
        entries = list(os.scandir(directory))
        if os.path.isfile(os.path.join(directory, LENGTH_BUCKETS)):
            buckets = {b["directory"] for b in read_bucket_manifest(directory)["buckets"]}
            return all(e.name == LENGTH_BUCKETS or (is_bundle_entry(e.name) and e.is_file(follow_symlinks=False))
                       or (e.name in buckets and e.is_dir(follow_symlinks=False) and is_export(e.path))
                       for e in entries)
        info = read_export_info(directory)
    except (OSError, ValueError):  # read_bucket_manifest checks the manifest's shape: a ValueError
        return False
    return ("sha256" in info and has_model_files(directory, info)
            and all((e.name in EXPORT_FILES or is_bundle_entry(e.name)) and e.is_file(follow_symlinks=False)
                    for e in entries))


def check_output_dir(output_dir, inputs: dict, force) -> None:
    """Raise UserError unless ``output_dir`` may be written: a new path; with ``force``, an
    empty directory or an earlier export. Never an input (``inputs``: flag -> path), or a
    directory that holds one."""
    flag = f"--output-dir {output_dir}"
    problem = outputs_over_inputs_problem({"--output-dir": output_dir}, inputs)
    if problem:
        raise UserError(problem)
    target = os.path.realpath(output_dir)
    if not os.path.lexists(target):
        return
    if not os.path.isdir(target):
        raise UserError(f"{flag} is a file, not a directory: choose a new directory or an earlier export")
    if os.listdir(target) and not is_export(target):
        raise UserError(f"{flag} is not an export (one holds export_info.json and the model's files, CTranslate2's "
                        "or ONNX, nothing else): nothing in it is replaced; choose a new or empty directory")
    if not force:
        raise UserError(f"{flag} exists: pass --force to replace it")


def write_failure(output_dir, error: OSError) -> str:
    advice = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
              errno.EACCES: "make its parent writable", errno.EPERM: "make its parent writable",
              errno.EROFS: "choose a writable file system"}.get(error.errno, "check it")
    reason = error.strerror or str(error)
    return f"--output-dir {output_dir}: cannot write it ({reason}): {advice}, or choose another --output-dir"


def write_model_dir(model_dir, write_model, info) -> None:
    """One export in the new directory ``model_dir``: the model's files (``write_model(directory)``
    makes the directory it writes, as CTranslate2's converter does) and export_info.json, which
    records the vocabularies written (``vocabulary``); returns what it records."""
    converted = os.path.join(model_dir, "model")
    write_model(converted)
    for name in os.listdir(converted):
        os.rename(os.path.join(converted, name), os.path.join(model_dir, name))
    os.rmdir(converted)
    info = dict(info, vocabulary=vocabulary_digests(model_dir))
    with open(os.path.join(model_dir, EXPORT_INFO), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    return info


def write_export(output_dir, write_all, inputs, force) -> str:
    """What ``write_all(dir)`` writes, as one directory that takes ``output_dir``'s place when
    complete (:func:`~fairseq_rope_base.files.replace_directory`): an export it replaces is kept
    until then. Returns the real path."""

    def write(tmp):
        write_all(tmp)
        check_output_dir(output_dir, inputs, force)  # again: the conversion took a while

    try:
        replace_directory(output_dir, write)
    except OSError as e:
        raise UserError(write_failure(output_dir, e)) from e
    return os.path.realpath(output_dir)
