"""scripts/benchmark_speed.py end to end on a tiny budget: it runs, alternates, and reports every
row. The speed figures themselves are measured by hand (docs/benchmarks.md), never in tests."""

import json
import sys

import pytest

from conftest import REPO, run_cli

TINY_BUDGET = [
    "--dims", "tiny", "--reps", "2", "--min-rep-seconds", "0", "--warmup", "1",
    "--tokens-per-batch", "256", "--length", "8", "--vocab", "100",
    "--gen-sentences", "2", "--gen-length", "3", "--rotation-reps", "2", "--rotation-inner", "1",
    "--memory-reps", "1", "--memory-steps", "1", "--threads", "1",
]


@pytest.mark.parametrize("malloc", ["default", "retain"])
def test_benchmark_reports_every_row(tmp_path, malloc):
    out = tmp_path / "bench.json"
    skip = ["--skip", "memory"] if malloc == "retain" else []
    proc = run_cli([sys.executable, REPO / "scripts" / "benchmark_speed.py", *TINY_BUDGET, *skip,
                    "--malloc", malloc, "--json-out", out])
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["settings"]["malloc"] == malloc
    train = results["train_tiny"]
    assert len(train["ratios"]) == 2 and all(r > 0 for r in train["ratios"])
    assert len(train["page_faults"]["baseline_all"]) == 2
    if malloc == "retain":
        # no fresh memory from the OS once warm: the tunables reached the restarted process
        assert max(train["page_faults"]["baseline_all"] + train["page_faults"]["rope_all"]) < 1000
    else:
        assert results["memory_tiny"]["peak_mib"]["rope"] > 0
    assert results["generate_tiny"]["rope"] > 0
    assert len(results["generate_tiny"]["page_faults"]["rope_all"]) == 2
    assert "| tiny: page faults per generation call |" in proc.stdout
    rotation = [key for key in results if key.startswith("rotation")]
    assert len(rotation) == 2
    assert f"malloc {malloc}" in proc.stdout and "| tiny: training throughput |" in proc.stdout
