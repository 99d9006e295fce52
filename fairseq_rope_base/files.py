"""Writes that leave either the old file or directory or the complete new one, never a part, and
the checks that no output lands on an input. The plugin's checkpoint writes and every tool
share them."""

import contextlib
import ctypes
import errno
import fcntl
import glob
import hashlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Optional


def write_atomically(path, write) -> None:
    """``write(tmp_path)``, then fsync and rename onto ``path``. The temporary file is a hidden
    ``.NAME.XXXX.tmp`` in the same directory (the rename cannot cross file systems, and no
    checkpoint or corpus pattern matches it); it is removed on any exception, KeyboardInterrupt
    and SystemExit included, and a later write of ``path`` removes what a SIGKILL left. A full
    disk is reported with the path. A symlink stays a symlink: its target is what is replaced
    (as ``open(path, "w")`` would write through it), with the temporary file beside the target."""
    named = os.path.abspath(os.fspath(path))  # as the caller named it, for the message
    path = os.path.realpath(named)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path))
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp creates 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if _is_disk_full(e):
            raise OSError(errno.ENOSPC, f"no space left on device while writing {named}") from e
        raise
    fd = os.open(os.path.dirname(path), os.O_RDONLY)  # the rename itself survives a power cut
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    remove_stale_temporaries(path)


def file_fingerprint(path):
    """(its size in bytes as text, sha256) of a file's bytes, read now: an edited or rewritten
    file of the same size and time is still told apart."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
            size += len(block)
    return str(size), digest.hexdigest()


def remove_stale_temporaries(path) -> None:
    """Delete what a killed write of ``path`` left behind (SIGKILL runs no clean-up)."""
    path = os.path.abspath(os.fspath(path))
    pattern = os.path.join(glob.escape(os.path.dirname(path)), f".{glob.escape(os.path.basename(path))}.*.tmp")
    for stale in glob.glob(pattern):
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _is_disk_full(error: BaseException) -> bool:
    # torch.save reports ENOSPC as a RuntimeError ("... unexpected pos ..."), without errno
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(error, RuntimeError) and "unexpected pos" in str(error)


def write_lines_atomically(path, lines: Iterable[str]) -> int:
    """Write ``lines`` (without their ``\\n``) as UTF-8 text with ``\\n`` line ends, atomically;
    returns how many were written."""
    count = 0

    def write(tmp):
        nonlocal count
        with open(tmp, "w", encoding="utf-8", newline="\n") as out:
            for line in lines:
                out.write(line + "\n")
                count += 1

    write_atomically(path, write)
    return count


def write_text_atomically(path, text: str) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8", newline="\n") as out:
            out.write(text)

    write_atomically(path, write)


def write_lines(path: Optional[str], lines: Iterable[str]) -> int:
    """:func:`write_lines_atomically`, or standard output when ``path`` is None."""
    if path is not None:
        return write_lines_atomically(path, lines)
    count = 0
    for line in lines:
        sys.stdout.write(line + "\n")
        count += 1
    sys.stdout.flush()
    return count


# --- a directory of files written as one ----------------------------------------------------
# A parallel corpus is several files whose lines belong together: new English next to old German
# is a corpus that looks fine and pairs every sentence with the wrong translation. So the files
# are all written into a hidden directory beside the output directory, which then takes the
# output directory's place in one rename.

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` in one step (Linux renameat2 RENAME_EXCHANGE); False where
    the system or the file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _fsync_tree(directory: str) -> None:
    for parent, _, files in os.walk(directory):
        for name in files + ["."]:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def replace_directory(directory, write, carry=()) -> None:
    """Make ``directory`` hold exactly what ``write(tmp)`` writes into ``tmp``, all of it or none.

    ``tmp`` is a hidden ``.NAME.XXXX.tmp`` beside ``directory`` (same file system); when
    ``write`` has returned, ``tmp`` takes ``directory``'s place in one rename -- an existing
    ``directory`` is swapped with it in one step (renameat2 RENAME_EXCHANGE, Linux), then
    deleted. A reader, or a failure at any point, therefore sees the complete old directory or
    the complete new one, never some new files beside old ones. (Where the system cannot swap,
    the old directory is renamed aside first: for that instant there is none, never a mix.) The
    entries named in ``carry`` (a download cache) are moved from the old directory into the new
    one before the swap, and back if it fails. Everything else of the old directory is deleted:
    callers check first that it holds only what they write (:func:`replaced_dir_problem`). ``tmp`` is
    removed on any exception; a later call removes what a SIGKILL left, but not the ``tmp`` of a
    call still running (it holds a lock on it)."""
    directory = os.path.realpath(directory)  # a symlinked directory: its target is replaced, the link kept
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    remove_stale_temporary_directories(directory)
    tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    carried, delete = [], tmp  # delete: the new files after a failure, else the old directory
    try:
        with _directory_locked(tmp):
            os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp creates 0700; give the usual mode
            write(tmp)
            _fsync_tree(tmp)
            if not os.path.isdir(directory):
                os.rename(tmp, directory)
            else:
                for entry in carry:
                    if os.path.lexists(os.path.join(directory, entry)):
                        os.rename(os.path.join(directory, entry), os.path.join(tmp, entry))
                        carried.append(entry)
                delete = tmp if _exchange(tmp, directory) else _rename_aside_and_in(tmp, directory)
                carried = []  # the new directory holds them now
    except BaseException:
        for entry in carried:
            os.rename(os.path.join(tmp, entry), os.path.join(directory, entry))
        raise
    finally:
        shutil.rmtree(delete, ignore_errors=True)
    fd = os.open(parent, os.O_RDONLY)  # the rename itself survives a power cut
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_aside_and_in(tmp: str, directory: str) -> str:
    """Where the system cannot swap: ``directory`` into a hidden directory beside it, then
    ``tmp`` in its place (or the old one back); returns the hidden directory."""
    parent, name = os.path.split(directory)
    aside = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    os.rename(directory, os.path.join(aside, "old"))
    try:
        os.rename(tmp, directory)
    except BaseException:
        os.rename(os.path.join(aside, "old"), directory)
        os.rmdir(aside)
        raise
    return aside


@contextlib.contextmanager
def _directory_locked(directory):
    """Try to hold an exclusive lock on ``directory`` while the block runs; yields whether it is
    held (not when another process holds it, or the file system has no locks)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        except OSError:
            held = False
        yield held
    finally:
        os.close(fd)


def remove_stale_temporary_directories(directory) -> None:
    """Delete the hidden ``.NAME.XXXXXXXX.tmp`` directories that killed :func:`replace_directory`
    calls for ``directory`` left beside it (``.old``: from older exports). mkdtemp's 8 characters
    exactly, so that another output's (``ct2.int8`` beside ``ct2``) never match; those of running
    calls are locked, and kept."""
    parent, name = os.path.split(os.path.realpath(directory))
    pattern = re.compile(rf"\.{re.escape(name)}\.[a-z0-9_]{{8}}\.(tmp|old)")
    for entry in os.scandir(parent):
        if not (pattern.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
            continue
        try:
            with _directory_locked(entry.path) as stale:
                if stale:
                    shutil.rmtree(entry.path, ignore_errors=True)
        except FileNotFoundError:  # its call has just finished
            pass


def replaced_dir_problem(flag: str, path, tool: str, written) -> Optional[str]:
    """Why ``tool`` cannot replace the directory ``path`` (given with ``flag``) as a whole with
    :func:`replace_directory`, as one line, or None: :func:`output_dir_problem`, or it holds an
    entry for which ``written(name)`` is false -- not what the tool writes, so not its to delete.
    The hidden temporaries of an interrupted atomic write are the tool's."""
    problem = output_dir_problem(flag, path, replaced=True)
    if problem or not os.path.isdir(path):
        return problem
    foreign = sorted(n for n in os.listdir(path) if not written(n) and not (n.startswith(".") and n.endswith(".tmp")))
    if not foreign:
        return None
    shown = ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "")
    return (f"{flag} {path} holds {shown}, which {tool} does not write: it replaces the directory as a whole; "
            "give a new or empty directory")


def outputs_over_inputs_problem(outputs, inputs) -> Optional[str]:
    """Why a tool would write over one of its own inputs, as one line, or None. ``outputs`` and
    ``inputs`` map a flag (``-o``, ``--out-dir``, ``--raw-dir``, or a description such as
    ``--out-dir's data-bin``) to a path, a list of paths or None; paths are compared resolved,
    symlinks followed. An output is refused when it is an input, or a directory that holds one
    (the tool writes or replaces it as a whole)."""
    def paths(value):
        if value is None:
            return []
        return list(value) if isinstance(value, (list, tuple)) else [value]

    for out_flag, out_value in outputs.items():
        for out_path in paths(out_value):
            out = Path(os.path.realpath(os.fspath(out_path)))
            for in_flag, in_value in inputs.items():
                for in_path in paths(in_value):
                    source = Path(os.path.realpath(os.fspath(in_path)))
                    if source == out or out in source.parents:
                        held = "is" if source == out else "holds"
                        return (f"{out_flag} {out_path} {held} {in_flag} {in_path}: the output would overwrite its "
                                "own input; give another output")
    return None


def output_file_problem(flag: str, path) -> Optional[str]:
    """Why the output file ``path`` (given with ``flag``) cannot be written atomically, as one
    line, or None: it is a directory, its directory does not exist, it is read-only, or no file
    can be made beside it, where the atomic write makes its temporary file (tried, since a mode
    says nothing to root). A symlink's target is what gets replaced."""
    if os.path.isdir(path):
        return f"{flag} {path} is a directory: give a file"
    target = Path(os.path.realpath(path))
    if not target.parent.is_dir():
        return f"{flag} {path}: directory {target.parent} does not exist: create it, or give a file in an existing one"
    if target.exists() and not os.access(target, os.W_OK):
        return f"{flag} {path} is read-only: make it writable, or give another file"
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return (f"{flag} {path}: cannot create files in {target.parent} ({e.strerror}): give a file in a "
                "writable directory")
    return None


def output_files_problem(outputs, inputs) -> Optional[str]:
    """Why a tool cannot write its output files, as one line, or None; checked before any work.
    ``outputs`` maps a flag to a file path or None, ``inputs`` a flag to the paths the tool reads:
    each output must be writable (:func:`output_file_problem`), none the same file as another, none
    an input (:func:`outputs_over_inputs_problem`)."""
    given = {flag: path for flag, path in outputs.items() if path is not None}
    for flag, path in given.items():
        problem = output_file_problem(flag, path)
        if problem:
            return problem
    seen = {}
    for flag, path in given.items():
        other = seen.setdefault(os.path.realpath(path), flag)
        if other != flag:
            return (f"{other} {given[other]} and {flag} {path} are the same file: one would replace the other; "
                    "give two different files")
    return outputs_over_inputs_problem(given, inputs)


def output_dir_problem(flag: str, path, replaced: bool = False) -> Optional[str]:
    """Why the output directory ``path`` (given with ``flag``) cannot be written, as one line, or
    None: it is a file, or it or the directory it would be made in is not writable. With
    ``replaced`` (:func:`replace_directory`), the directory it is in must be writable too."""
    shown, path = path, Path(os.path.realpath(path))
    if path.exists() and not path.is_dir():
        return f"{flag} {shown} is a file, not a directory: give a directory"
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        return f"{flag} {shown} is not writable: give a directory you can write to"
    if path.is_dir() and not replaced:
        return None
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{flag} {shown} cannot be made: {ancestor} is a file"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{flag} {shown} cannot be written: {ancestor} is not writable; give a directory you can write to"
    return None
