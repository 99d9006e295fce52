"""The harness's progress lines: fairseq-train's log condensed, fairseq-generate's output collected."""

import math
import threading
import time

from fairseq_rope_tools.cli import duration
from fairseq_rope_tools.training_log import parse_train_line

_print_lock = threading.Lock()


def log(message):
    with _print_lock:
        print(f"[compare] {message}", flush=True)


class TrainingProgress:
    """fairseq-train's log condensed to one line per logged interval and per validation. A
    resumed training counts the ``seconds_before`` of its earlier attempts in the elapsed time;
    ``on_elapsed(seconds)`` is told the total at each logged line."""

    def __init__(self, name, total_updates, seconds_before=0.0, on_elapsed=None):
        self.name, self.total, self.started = name, total_updates, time.time()
        self.seconds_before, self.on_elapsed = seconds_before, on_elapsed
        self.first_update = None  # the ETA comes from this attempt's pace alone
        self.valid_loss = None

    def elapsed(self):
        return self.seconds_before + time.time() - self.started

    def __call__(self, line):
        parsed = parse_train_line(line)
        if parsed is None or parsed[0] not in ("train_inner", "valid"):
            return
        kind, fields = parsed
        update = int(fields["num_updates"])
        if self.first_update is None:
            self.first_update = update - 1 if kind == "train_inner" else update
        if kind == "valid":
            self.valid_loss = fields.get("loss")
        elapsed, done = self.elapsed(), update - self.first_update
        eta = (time.time() - self.started) / done * (self.total - update) if done > 0 else math.nan
        if self.on_elapsed is not None:
            self.on_elapsed(elapsed)
        train = f"train loss {fields['loss']:.3f}" if kind == "train_inner" and "loss" in fields else "validation"
        valid = f"valid loss {self.valid_loss:.3f}" if self.valid_loss is not None else "valid loss -"
        log(f"{self.name}: update {update}/{self.total} | {train} | {valid} | {duration(elapsed)} elapsed"
            + (f", ETA {duration(eta)}" if update < self.total and not math.isnan(eta) else ""))


class GeneratedLines:
    """Collects fairseq-generate's S/T/H lines by sentence id and reports every tenth of the way."""

    def __init__(self, name, expected):
        self.name, self.expected, self.started = name, expected, time.time()
        self.rows, self.translated, self.reported = {}, 0, 0

    def __call__(self, line):
        kind, _, rest = line.partition("-")
        if kind not in ("S", "T", "H") or "\t" not in rest:
            return
        fields = rest.split("\t")
        if not fields[0].isdigit():
            return
        self.rows.setdefault(int(fields[0]), {})[kind] = fields[-1]
        if kind != "H":
            return
        self.translated += 1
        if self.expected and self.translated * 10 // self.expected > self.reported:
            self.reported = self.translated * 10 // self.expected
            log(f"{self.name}: {self.translated}/{self.expected} sentences ({duration(time.time() - self.started)})")

    def in_order(self):
        """[(source, hypothesis, reference)] by sentence id."""
        return [(r.get("S", ""), r.get("H", ""), r.get("T", "")) for _, r in sorted(self.rows.items())]
