"""What the project's scripts share: atomic file writes.

Light on purpose -- standard library only -- so that the text steps of the recipe import it
without paying for torch or fairseq. Checkpoints are written by the plugin itself
(``fairseq_rope.checkpoints``), which cannot import from ``scripts/``.
"""

import os
import sys
import tempfile
from typing import Callable, Iterable, Optional


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomically(path, write: Callable[[str], None]) -> None:
    """``write(tmp_path)``, then fsync and rename onto ``path``: readers see either the old file
    or the complete new one, never a partial one. The temporary file is a hidden
    ``.NAME.XXXX.tmp`` in the same directory (so the rename cannot cross file systems) and is
    removed on any exception, KeyboardInterrupt and SystemExit included."""
    path = os.path.abspath(os.fspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(path))
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp creates 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
