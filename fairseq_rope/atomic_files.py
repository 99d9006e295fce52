"""Writes that leave either the old file or the complete new one, never a partial one.

Standard library only: ``scripts/common.py`` loads this file by its path, so the recipe's text
steps share it with the plugin's checkpoint writes without importing fairseq or torch.
"""

import errno
import glob
import os
import tempfile


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
