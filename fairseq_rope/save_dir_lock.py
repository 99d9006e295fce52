"""One training per save dir.

Two ``fairseq-train`` runs on one ``--save-dir`` both exit 0 while their checkpoints alternate,
and an average of the last checkpoints mixes the two models. The process that writes a run's
checkpoints takes an exclusive lock (``fcntl.flock``) on ``SAVE_DIR/.fairseq-train.lock`` before
it loads or writes any checkpoint, and holds it until it ends: the kernel releases it then, after
a crash or a SIGKILL too, so a lock left by a dead run is taken over. The file records the
holder's PID and host for the message of a second run, which refuses in one line.

A clean exit removes the file (a run that opened it just before locks a removed file: it sees
that and locks the new one); a crash leaves it, naming a process that has ended. Its name matches
no checkpoint name. Where the file system has no locks, the recorded PID decides: a holder that
is no longer running on this host is stale.

Before it starts, fairseq-train checks that it can write its save dir (:func:`verify_save_dir`,
in place of fairseq's check, which writes and deletes a file named ``dummy`` there and stops with a
traceback): a save dir it cannot make or write, and a lock file that is not a file, are one line.
"""

import atexit
import errno
import fcntl
import logging
import os
import socket
import tempfile

from .config_values import OneLineError

logger = logging.getLogger(__name__)

# file systems without flock (some network mounts) answer with one of these
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

_held = {}  # lock file -> its open descriptor, for the life of the process


def lock_file(save_dir, suffix: str = "") -> str:
    """The lock of ``save_dir``; ``suffix`` is fairseq's checkpoint suffix, for runs whose ranks
    each write their own checkpoint files (sharded or model-parallel)."""
    return os.path.join(os.path.realpath(save_dir), f".fairseq-train{suffix}.lock")


def lock_save_dir(save_dir, suffix: str = "") -> str:
    """Hold the lock of ``save_dir`` until this process ends, or raise a OneLineError naming the
    holder (or what is wrong with the save dir). Taking a lock this process holds already does
    nothing (fairseq-train called twice in one process, as tests do)."""
    path = lock_file(save_dir, suffix)
    if path in _held:
        return path
    verify_save_dir(save_dir)
    fd = _locked_descriptor(save_dir, path)
    while not _is_file_at(fd, path):  # its holder removed it as it ended: lock the new one
        os.close(fd)
        fd = _locked_descriptor(save_dir, path)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    _held[path] = fd
    atexit.register(_release, path, fd, os.getpid())
    return path


def _locked_descriptor(save_dir, path) -> int:
    """A descriptor of ``path`` that holds its lock."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except IsADirectoryError:
        raise OneLineError(f"{path} is a directory, where fairseq-train keeps the lock file of --save-dir "
                           f"{save_dir}: remove or rename it") from None
    except OSError as e:
        raise OneLineError(_unwritable_message(save_dir, e)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _recorded_holder(fd)
        if e.errno not in NO_LOCKS or _is_running(holder):
            os.close(fd)
            raise OneLineError(_in_use_message(save_dir, holder, path)) from None
        logger.warning(f"{path}: the file system has no locks; a run on another host is not detected")
    return fd


def _is_file_at(fd, path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _release(path, fd, locker) -> None:
    """At a clean exit: remove the lock file, then unlock it (not in a forked child)."""
    if os.getpid() != locker:
        return
    try:
        if _is_file_at(fd, path):
            os.unlink(path)
    except OSError:
        pass
    os.close(fd)
    _held.pop(path, None)


def _recorded_holder(fd):
    """(PID, host) the lock file records; None before its holder has written them."""
    try:
        pid, host = os.pread(fd, 4096, 0).decode().split()
        return int(pid), host
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _is_running(holder) -> bool:
    """Whether ``holder`` may still run: a process on another host cannot be checked."""
    if holder is None:
        return False
    pid, host = holder
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _in_use_message(save_dir, holder, path) -> str:
    if holder is None:
        who = "another training (starting: no PID recorded yet)"
    elif holder[1] == socket.gethostname() and not _is_running(holder):
        who = (f"PID {holder[0]} on {holder[1]}, which has ended: a process it started still holds "
               f"the lock of {path}; end that process")
    else:
        who = f"another training: PID {holder[0]} on {holder[1]}"
    return (f"--save-dir {save_dir} is in use by {who}. One training per save dir: wait for it to end, "
            "or train in another --save-dir")


def verify_save_dir(save_dir) -> None:
    """Make ``save_dir`` if it is missing and check that files can be created in it, or raise a
    OneLineError naming it. (The probe is a hidden temporary file, removed at once.)"""
    try:
        os.makedirs(save_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".fairseq-train.", suffix=".probe", dir=save_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OneLineError(_unwritable_message(save_dir, e)) from None


def _unwritable_message(save_dir, error: OSError) -> str:
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        return f"--save-dir {save_dir} is a file, not a directory: give a directory"
    return f"--save-dir {save_dir} cannot be written ({error.strerror}): give a directory you can write to"
