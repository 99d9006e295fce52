"""Driving an :class:`~fairseq_rope_tools.deploy.engine.Engine`: sources sorted by length into
batches (:func:`translate_sorted`), lines batched as they arrive from a pipe or a terminal
(:func:`batches_as_they_come`), and the policy for sources longer than the model takes
(:class:`LengthLimit`)."""

import itertools
import queue
import sys
import threading
import time
from typing import Iterable, Iterator, List, Optional, Tuple

from fairseq_rope_tools.cli import UserError, progress_sayer
from fairseq_rope_tools.deploy.engine import Decoding, Engine, Hypothesis, decode
from fairseq_rope_tools.text_lines import OverlongLine

TOO_LONG_POLICIES = ("refuse", "skip", "truncate")
#: --too-long's choices: a policy, or split into sentences (paragraphs.py; each policy then applies
#: to a sentence still too long)
TOO_LONG_CHOICES = (*TOO_LONG_POLICIES, "split")


def add_too_long_arguments(p, choices=TOO_LONG_CHOICES, default="refuse", sentence_choices=TOO_LONG_POLICIES,
                           refusal="stopping"):
    """--too-long and --too-long-sentence, as fairseq-rope-translate and fairseq-rope-serve take them;
    ``refusal``: what a refusal does."""
    meaning = {"refuse": f"refuse it ({refusal})",
               "skip": "skip it (an empty translation)", "truncate": "truncate it to fit",
               "split": "split it into sentences, translated one by one and joined back into one"}
    p.add_argument("--too-long", choices=choices, default=default,
                   help="a text beyond the model's source positions: "
                        + "; ".join(f"{meaning[c]}{' (default)' if c == default else ''}" for c in choices)
                        + ". Counted on stderr or in /metrics")
    meaning["skip"] = "leave it out of the joined translation"
    p.add_argument("--too-long-sentence", choices=sentence_choices, default="refuse",
                   help="with --too-long split, a sentence still beyond them: "
                        + "; ".join(f"{meaning[c]}{' (default)' if c == 'refuse' else ''}" for c in sentence_choices))


#: the most characters one source token of a model is taken to hold: a BPE token (subword-nmt or
#: sentencepiece) is a vocabulary entry, and no vocabulary has entries this long. Text with more
#: (non-space) characters per position than this cannot fit, and is refused without segmenting it:
#: BPE over one long word takes seconds.
MAX_CHARACTERS_PER_TOKEN = 64


def fits(tokens: List[str], limit: Optional[int]) -> bool:
    """Whether a source of ``tokens`` fits in ``limit`` positions with the ``</s>`` appended to it,
    as fairseq counts source lengths (None: no limit is known)."""
    return limit is None or len(tokens) + 1 <= limit


class LengthLimit:
    """``--too-long``: a source longer than the model takes (its tokens and the ``</s>`` appended
    must fit in ``limit`` positions) is refused (UserError, status 1: a 24k-token line would
    otherwise take minutes and gigabytes, or be killed for memory without a word), skipped (no
    translation: an empty output line) or truncated to its first ``limit - 1`` tokens. The lines
    skipped or truncated are counted, for :meth:`report`. ``limit`` None: no limit is known.
    ``split``: the sources are the sentences of lines split by ``--too-long split``."""

    def __init__(self, limit: Optional[int], policy: str, path, split=False):
        self.limit, self.policy, self.path, self.split = limit, policy, path, split
        self.lines, self.first = 0, None

    def apply(self, number: int, tokens: List[str]) -> Optional[List[str]]:
        """The source of input line ``number`` as it is translated; None when it is skipped."""
        if fits(tokens, self.limit):
            return tokens
        if self.policy == "refuse" and self.split:
            raise UserError(f"{self.path}: line {number} has a sentence of {len(tokens)} BPE tokens; the model takes "
                            f"at most {self.limit - 1}: split it, or pass --too-long-sentence skip or truncate",
                            status=1)
        if self.policy == "refuse":
            raise UserError(f"{self.path}: line {number} has {len(tokens)} BPE tokens; the model takes at most "
                            f"{self.limit - 1}: split the line, raise the limit with --max-source-positions, or "
                            "pass --too-long split, skip or truncate", status=1)
        self._count(number)
        return None if self.policy == "skip" else tokens[:self.limit - 1]

    def apply_overlong(self, number: int, line: OverlongLine, segment) -> Optional[List[str]]:
        """:meth:`apply` for a line over :func:`line_byte_cap` bytes, of which ``line`` holds the
        first: refused or skipped unread, or truncated to the first tokens of those bytes
        (``segment``: raw text -> tokens; the last word, perhaps cut, left out)."""
        if self.policy == "refuse":
            raise UserError(f"{self.path}: line {number} is {line.length} bytes long, more than the model's "
                            f"{self.limit - 1} BPE tokens can hold: split the line, or pass --too-long "
                            f"{'split with --too-long-sentence ' if self.split else ''}skip or truncate", status=1)
        self._count(number)
        if self.policy == "skip":
            return None
        words = line.split()  # each at least one token: the first limit - 1 are enough
        kept = words[:self.limit - 1] if len(words) >= self.limit else words[:-1] or words
        return segment(" ".join(kept))[:self.limit - 1]

    def _count(self, number: int) -> None:
        self.lines += 1
        self.first = self.first or number

    def report(self) -> Optional[str]:
        """One line on the lines skipped or truncated, or None when there were none."""
        if not self.lines:
            return None
        done = ("skipped: their translations are empty" if self.policy == "skip"
                else f"truncated to their first {self.limit - 1} tokens")
        unit = ("sentence" if self.split else "line") + ("s" if self.lines != 1 else "")
        return (f"{self.path}: {self.lines} {unit}{' of split lines' if self.split else ''} longer than the model "
                f"takes ({self.limit - 1} BPE tokens) {done} (first: line {self.first})")

    def stats(self) -> dict:
        return {"policy": self.policy, "limit": self.limit, "lines": self.lines, "first_line": self.first}


def certainly_too_long(text: str, limit: Optional[int]) -> bool:
    """Whether ``text`` cannot fit in ``limit`` positions whatever its segmentation: more
    whitespace-separated words than positions (each word is one token at least) or more characters
    than its positions hold (:data:`MAX_CHARACTERS_PER_TOKEN`). Cheap: no tokeniser, no BPE."""
    if limit is None:
        return False
    words = text.split()
    return len(words) + 1 > limit or sum(map(len, words)) > (limit - 1) * MAX_CHARACTERS_PER_TOKEN


def line_byte_cap(limit: Optional[int]) -> Optional[int]:
    """The bytes of a line (UTF-8: at most 4 a character, and a space between tokens) beyond which
    it cannot fit in ``limit`` positions, read no further (None: no limit is known)."""
    return None if limit is None else (limit - 1) * (4 * MAX_CHARACTERS_PER_TOKEN + 1)


def translate_sorted(engine: Engine, sources: List[Optional[List[str]]], batch_size: int,
                     progress=False, decoding: Optional[Decoding] = None) -> Tuple[List[List[Hypothesis]], float]:
    """The hypotheses of ``sources`` in input order, and the seconds spent decoding. Sentences are
    sorted by the engine's group, then length, into batches; an empty or skipped (None) source
    gets none. ``progress``: a bar on a terminal; elsewhere (a log) a plain line every tenth of the
    way, since a bar is redrawn with carriage returns. ``decoding``: another beam search than the
    engine's own (:meth:`Engine.translate`)."""
    order = sorted((i for i, s in enumerate(sources) if s), key=lambda i: (engine.group(sources[i]), len(sources[i])))
    batches = [ids for _, group in itertools.groupby(order, key=lambda i: engine.group(sources[i]))
               for ids in chunks(list(group), batch_size)]  # a batch holds one group
    results: List[List[Hypothesis]] = [[] for _ in sources]
    seconds = 0.0
    from tqdm import tqdm

    on_terminal = sys.stderr.isatty()
    lines = progress_sayer("translate") if progress and not on_terminal else None
    done = tenths = 0
    with tqdm(total=len(order), unit="sent", disable=not (progress and on_terminal), file=sys.stderr,
              dynamic_ncols=True) as bar:
        for ids in batches:
            began = time.perf_counter()
            out = decode(engine, [sources[i] for i in ids], decoding)
            seconds += time.perf_counter() - began
            for i, hypotheses in zip(ids, out):
                results[i] = hypotheses
            bar.update(len(ids))
            done += len(ids)
            if lines is not None and done * 10 // len(order) > tenths:
                tenths = done * 10 // len(order)
                lines(f"{done}/{len(order)} sentences translated")
    return results, seconds


def chunks(items: list, size: int) -> List[list]:
    return [items[start:start + size] for start in range(0, len(items), size)]


_END = object()


def batches_as_they_come(lines: Iterable[str], batch_size: int, wait: float) -> Iterator[List[Tuple[int, str]]]:
    """(line number, line) in batches, each as soon as it holds ``batch_size`` lines or ``wait``
    seconds after its first line came, whichever is first, and the rest at the end: a line sent
    into a pipe that stays open gets its translation within ``wait`` seconds plus its decoding.
    The lines are read by a thread; its error (invalid UTF-8 ...) is raised after the batch of
    the lines before it."""
    arrived: "queue.Queue" = queue.Queue()

    def read():
        try:
            for item in enumerate(lines, 1):
                arrived.put(item)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            arrived.put(e)
        else:
            arrived.put(_END)

    threading.Thread(target=read, daemon=True).start()  # a daemon: stdin left open does not hold the exit
    pending: List[Tuple[int, str]] = []
    deadline = 0.0
    while True:
        try:
            item = arrived.get(timeout=max(0.0, deadline - time.monotonic()) if pending else None)
        except queue.Empty:
            yield pending
            pending = []
            continue
        if item is _END or isinstance(item, BaseException):
            if pending:
                yield pending
            if item is _END:
                return
            raise item
        pending.append(item)
        if len(pending) == 1:
            deadline = time.monotonic() + wait
        if len(pending) >= batch_size:
            yield pending
            pending = []
