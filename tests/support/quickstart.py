"""scripts/quickstart.sh, small, run once per test run for the modules that test it and use its
model or prepared corpus (tests/e2e/test_quickstart.py, tests/plugin/test_raw_text.py,
tests/tools/deploy/test_translate.py, tests/tools/research/test_compare_harness.py)."""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from support.commands import REPO, WORST_NAME, run_cli
from support.shared import shared_directory

# enough updates for translations that depend on their input, few enough for a minute on one core
QUICKSTART = {
    "TRAIN_SIZE": "2000", "VALID_SIZE": "20", "TEST_SIZE": "30", "BPE_SIZE": "300", "MAX_UPDATE": "300",
    "SAVE_INTERVAL": "60", "NUM_AVG": "5", "MAX_TOKENS": "2048", "LR": "5e-3", "WARMUP_UPDATES": "50",
    "LOG_INTERVAL": "50", "THREADS": "1", "SHOW_EXAMPLES": "1",
}


@dataclass(frozen=True)
class QuickstartRun:
    root: Path      # QUICKSTART_DIR: its name holds a space and shell metacharacters
    stdout: str     # what the first run printed
    again: str      # what a second run with the same settings printed

    @property
    def work(self) -> Path:
        (work,) = self.root.glob("prep-*")
        return work

    @property
    def save_dir(self) -> Path:
        (save_dir,) = (self.work / "checkpoints").glob("transformer_rope_tiny-*")
        return save_dir


def shared_quickstart(tmp_path_factory) -> QuickstartRun:
    """quickstart.sh with :data:`QUICKSTART`'s settings, run twice by the first worker that asks
    (the second run, which finds every step complete, while no test reads the directory). Read it only."""
    key = hashlib.sha256(json.dumps(QUICKSTART, sort_keys=True).encode()).hexdigest()

    def build(directory):
        root = directory / WORST_NAME / "qs"
        for run in ("stdout", "again"):
            out = run_cli(["bash", REPO / "scripts" / "quickstart.sh"], env=dict(QUICKSTART, QUICKSTART_DIR=str(root)),
                          timeout=600).stdout
            (directory / f"{run}.txt").write_text(out, encoding="utf-8")

    directory = shared_directory(tmp_path_factory, "quickstart", key, build)
    return QuickstartRun(directory / WORST_NAME / "qs", *((directory / f"{run}.txt").read_text(encoding="utf-8")
                                                         for run in ("stdout", "again")))
