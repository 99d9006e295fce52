"""Reading a user's text file as lines, the one way every tool here does it.

A parallel corpus is two files whose line *n* belong together, so a line must end only where the
file has a ``\\n``. Python's text mode also ends lines at ``\\r``, ``str.splitlines()`` at U+2028
and seven other characters, and decoding with ``errors="replace"`` hides a wrong encoding: each
would pair sentences with the translations of others, or corrupt them, without a word.
:class:`LineReader` splits only at ``\\n`` (a CRLF end is a plain end), turns every other
line-break character inside a line into a space, and decodes strictly as UTF-8, stopping at the
first invalid byte with the file and line (a :class:`~fairseq_rope_tools.cli.UserError`), unless asked to
replace.
"""

import re

from fairseq_rope_tools.cli import UserError

# characters that str.splitlines(), Python's universal newlines or other tools take for a line
# break; inside a line each becomes a space
LINE_BREAKS = "\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
_BREAKS_TO_SPACE = str.maketrans({ch: " " for ch in LINE_BREAKS})
_BREAKS_RE = re.compile(f"[{re.escape(LINE_BREAKS)}]")


class LineReader:
    """Iterate over the lines of a file as str: split only at b"\\n" (no trailing "\\n" kept; a
    last line without one counts, no empty line is added after a final "\\n"), a CRLF end
    becomes a plain end, in-line line-break characters become spaces, and bytes are decoded
    strictly as UTF-8 unless ``replace`` (then ``replaced`` counts the lines that had invalid
    bytes and ``first_replaced`` is the first of them). ``broken`` counts the lines in which
    line-break characters were replaced. ``max_bytes``: a longer line is never held whole; it
    comes as an :class:`OverlongLine` of its first ``max_bytes`` bytes."""

    fix = "fix the file"  # what the invalid-UTF-8 error advises

    def __init__(self, path, replace=False, max_bytes=None):
        self.path, self.replace, self.max_bytes = path, replace, max_bytes
        self.lines = self.replaced = self.broken = 0
        self.first_replaced = None

    def __iter__(self):
        try:
            f = open(self.path, "rb")
        except OSError as e:
            raise UserError(f"cannot read {self.path}: {e.strerror}", status=1) from None
        with f:
            for number, (raw, length) in enumerate(self._raw_lines(f), 1):
                self.lines = number
                line = self._decode(raw, number, cut=length is not None)
                if _BREAKS_RE.search(line):
                    line = line.translate(_BREAKS_TO_SPACE)
                    self.broken += 1
                yield line if length is None else OverlongLine(line, length)

    def _raw_lines(self, f):
        """(the line's bytes without its end, None), or for a line over ``max_bytes``: (its first
        ``max_bytes`` bytes, its length in bytes), the rest read in chunks and dropped, so that an
        endless line costs no memory."""
        if self.max_bytes is None:
            for raw in f:
                yield _without_end(raw), None
            return
        while True:
            raw = f.readline(self.max_bytes + 2)  # room for the line's "\r\n"
            if not raw:
                return
            if raw.endswith(b"\n") or len(raw) < self.max_bytes + 2:  # whole (the last line may lack "\n")
                raw = _without_end(raw)
                if len(raw) <= self.max_bytes:
                    yield raw, None
                else:
                    yield raw[:self.max_bytes], len(raw)
                continue
            prefix, length, chunk = raw[:self.max_bytes], len(raw), raw
            while chunk and not chunk.endswith(b"\n"):
                chunk = f.readline(1 << 16)
                length += len(chunk)
            yield prefix, length - chunk.endswith(b"\n")  # its length as a line's: without the "\n"

    def _decode(self, raw: bytes, number: int, cut: bool) -> str:
        """``raw`` as text, strictly unless ``replace``; ``cut``: the first bytes of a longer line,
        whose last character may be cut in two (dropped)."""
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if cut and e.reason == "unexpected end of data":
                return self._decode(raw[:e.start], number, cut=False)
            if not self.replace:
                raise UserError(
                    f"{self.path}: line {number}: invalid UTF-8 (byte 0x{raw[e.start]:02x} at byte "
                    f"{e.start + 1} of the line); {self.fix}", status=1) from None
            self.replaced += 1
            if self.first_replaced is None:
                self.first_replaced = number
            return raw.decode("utf-8", errors="replace")

    def changes(self):
        """What reading changed, one message per kind (none when nothing was)."""
        changes = []
        if self.replaced:
            changes.append(f"{self.path}: replaced invalid UTF-8 with U+FFFD in {self.replaced} "
                           f"line{'s' if self.replaced != 1 else ''} (first: line {self.first_replaced})")
        if self.broken:
            changes.append(f"{self.path}: {self.broken} line{'s' if self.broken != 1 else ''} had line-break "
                           f"characters (\\r, U+2028, ...) inside; replaced by spaces")
        return changes


class OverlongLine(str):
    """The first bytes of a line longer than a reader's ``max_bytes``, as text; ``length``: the
    whole line's length in bytes."""

    def __new__(cls, text: str, length: int):
        line = super().__new__(cls, text)
        line.length = length
        return line


def _without_end(raw: bytes) -> bytes:
    """A line without its "\\n" or "\\r\\n" end."""
    if raw.endswith(b"\n"):
        raw = raw[:-1]
    return raw[:-1] if raw.endswith(b"\r") else raw


def read_lines(path):
    """All lines of a user's text file, strictly (see :class:`LineReader`)."""
    return list(LineReader(path))
