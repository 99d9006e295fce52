"""A bundle is read only inside itself: its files listed without following a symbolic link, its
JSON records read within bounds, its entries kept to relative paths inside it. Standard library
only: fairseq-rope-translate and fairseq-rope-serve read bundles without torch or fairseq.

Each fault is a ValueError of one line naming the file or entry; the callers add the flag and
what to do (export again)."""

import json
import os
import stat
from pathlib import PurePosixPath
from typing import List

#: a record of fairseq-rope-export (bundle.json, length_buckets.json, export_info.json, config.json)
#: is a few KB: anything much larger is not one, and is refused before it is read
MAX_RECORD_BYTES = 2**20
#: and nests 3 deep (the manifest, its segmentation, the tokenizer recipe)
MAX_RECORD_DEPTH = 32


def files_inside(directory) -> List[str]:
    """The relative (posix) paths of every file under ``directory``, sorted. ValueError naming the
    first symbolic link (a file or a directory: the bundle would read or load what lies outside it,
    with a matching sha256 even) or the first entry that is neither a file nor a directory (a FIFO
    would block the hashing). ``directory`` itself may be a link."""
    files, pending = [], [""]
    while pending:
        prefix = pending.pop()
        with os.scandir(os.path.join(directory, prefix)) as listing:
            entries = sorted(listing, key=lambda entry: entry.name)
        for entry in entries:
            name = prefix + entry.name
            if entry.is_symlink():
                raise ValueError(f"{name} is a symbolic link (to {os.readlink(entry.path)}), and a bundle's files "
                                 "must lie inside it")
            if entry.is_dir(follow_symlinks=False):
                pending.append(name + "/")
            elif entry.is_file(follow_symlinks=False):
                files.append(name)
            else:
                raise ValueError(f"{name} is not a regular file")
    return sorted(files)


def read_record(path) -> dict:
    """The JSON object in the file ``path``, within :data:`MAX_RECORD_BYTES` and
    :data:`MAX_RECORD_DEPTH`; ValueError of one line naming ``path`` if it is not one (OSError if
    it cannot be read)."""
    # O_NONBLOCK: a FIFO in place of the file is refused below rather than waited on
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb") as f:
        status = os.fstat(f.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if status.st_size > MAX_RECORD_BYTES:
            raise ValueError(f"{path} is {status.st_size} bytes, more than a record of fairseq-rope-export holds "
                             f"({MAX_RECORD_BYTES} at most)")
        data = f.read(MAX_RECORD_BYTES + 1)
    if len(data) > MAX_RECORD_BYTES:  # grown since
        raise ValueError(f"{path} is more than {MAX_RECORD_BYTES} bytes, more than a record of fairseq-rope-export "
                         "holds")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start} is not)") from None
    try:
        value = json.loads(text)
    except RecursionError:  # json's decoder recurses once per level
        raise ValueError(f"{path} nests deeper than a record of fairseq-rope-export does ({MAX_RECORD_DEPTH} "
                         "levels at most)") from None
    except ValueError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    if _depth(value) > MAX_RECORD_DEPTH:
        raise ValueError(f"{path} nests deeper than a record of fairseq-rope-export does ({MAX_RECORD_DEPTH} "
                         "levels at most)")
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object")
    return value


def _depth(value) -> int:
    """How deep ``value``'s lists and objects nest, counted without recursion (up to just past the bound)."""
    deepest, pending = 0, [(value, 1)]
    while pending and deepest <= MAX_RECORD_DEPTH:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def outside(name) -> bool:
    """Whether the manifest entry ``name`` is no relative path inside the bundle: not a string, empty,
    absolute, or with a ``..`` component."""
    return not isinstance(name, str) or not name or name.startswith("/") or os.path.isabs(name) or (
        ".." in PurePosixPath(name).parts)


def is_directory_name(name) -> bool:
    """Whether ``name`` names one directory inside the export (a bucket's): no separator, not . or ..."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name
