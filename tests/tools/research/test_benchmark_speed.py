"""fairseq-rope-benchmark-speed end to end on a tiny budget: it runs, alternates, says every phase
and repetition while it runs, and reports every row. The speed figures themselves are measured by
hand (docs/benchmarks.md), never in tests."""

import json
import re

import pytest
from support.commands import run_cli, run_cli_streaming

TINY_BUDGET = [
    "--dims", "tiny", "--reps", "2", "--min-rep-seconds", "0", "--warmup", "1",
    "--tokens-per-batch", "256", "--length", "8", "--vocab", "100",
    "--gen-sentences", "2", "--gen-length", "3", "--rotation-reps", "2", "--rotation-inner", "1",
    "--memory-reps", "1", "--memory-steps", "1", "--threads", "1",
]


@pytest.mark.e2e
@pytest.mark.parametrize("malloc", ["default", "retain"])
def test_benchmark_reports_every_row(tmp_path, malloc):
    out = tmp_path / "bench.json"
    skip = ["--skip", "memory"] if malloc == "retain" else []
    lines = run_cli_streaming(["fairseq-rope-benchmark-speed", *TINY_BUDGET, *skip,
                               "--malloc", malloc, "--json-out", out])
    output = "\n".join(line for line, _ in lines)
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
    assert "| tiny: page faults per generation call |" in output
    rotation = [key for key in results if key.startswith("rotation")]
    assert len(rotation) == 2
    assert f"malloc {malloc}" in output and "| tiny: training throughput |" in output

    # a line as every repetition starts, while the benchmark runs: before its table, the first one
    # read before the command exited
    table = next(i for i, (line, _) in enumerate(lines) if line.startswith("| measurement |"))
    reps = [(i, m[1]) for i, (line, _) in enumerate(lines)
            if (m := re.fullmatch(r"\[benchmark-speed\] (.*: rep \d+/\d+) \(\d+m\d\ds elapsed\)", line))]
    memory = ["tiny memory: rep 1/1"] if malloc == "default" else []
    assert [rep for _, rep in reps] == ["tiny training: rep 1/2", "tiny training: rep 2/2", *memory,
                                        "tiny generation: rep 1/2", "tiny generation: rep 2/2"]
    assert lines[reps[0][0]][1] and reps[-1][0] < table

    # --pool: the pairs of several reports, row by row
    pooled_out = tmp_path / "pooled.json"
    pooled = run_cli(["fairseq-rope-benchmark-speed", "--pool", out, out,
                      "--json-out", pooled_out])
    pooled_train = json.loads(pooled_out.read_text())["results"]["train_tiny"]
    assert pooled_train["runs"] == 2 and pooled_train["pairs"] == 4
    assert sorted(train["ratios"] * 2)[1] <= pooled_train["ratio_median"] <= sorted(train["ratios"] * 2)[2]
    assert "| train_tiny | 2 | 4 |" in pooled.stdout


@pytest.mark.e2e
def test_both_models_run_in_the_dtype_asked_for(tmp_path):
    """--dtype bfloat16 (float16 on a GPU): both models train and decode in it, and the rotation
    moves 2-byte elements; the report says which dtype and whether the fused kernel was on."""
    out = tmp_path / "bench.json"
    proc = run_cli(["fairseq-rope-benchmark-speed", *TINY_BUDGET, "--skip", "memory", "--dtype", "bfloat16",
                    "--json-out", out], env={"FAIRSEQ_ROPE_FUSED": "0"})
    report = json.loads(out.read_text())
    assert report["settings"]["dtype"] == "bfloat16"
    assert report["hardware"]["fused_rotation_switch"] == "FAIRSEQ_ROPE_FUSED=0"
    assert "bfloat16, FAIRSEQ_ROPE_FUSED=0" in proc.stdout
    rotation = report["results"]["rotation self-attention (positions shared by the batch)"]
    length, sentences, embed = rotation["shape"]
    assert rotation["bytes"] == 2 * length * sentences * embed * 2
    for row in ("train_tiny", "generate_tiny"):  # the weights both models really had
        assert report["results"][row]["weights_dtype"] == "bfloat16" and report["results"][row]["rope"] > 0


@pytest.mark.e2e
def test_pool_rejects_a_file_that_is_not_a_report(tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_text("[1, 2, 3]")
    proc = run_cli(["fairseq-rope-benchmark-speed", "--pool", bad], check=False)
    assert proc.returncode != 0 and f"--pool {bad}: not a report written by --json-out" in proc.stderr


def test_median_interval_brackets_the_median_and_narrows_with_more_pairs():
    from fairseq_rope_tools.research.paired_stats import median_interval

    assert median_interval([1.0, 0.9, 1.1, 1.0]) is None  # too few pairs to resample
    few = [0.90, 0.95, 1.00, 1.05, 1.10] * 2
    many = few * 20
    low, high = median_interval(few)
    assert low <= 1.0 <= high and low < high
    low_many, high_many = median_interval(many)
    assert low <= low_many <= 1.0 <= high_many <= high and (high_many - low_many) < (high - low)
    assert median_interval([0.99] * 9) == [0.99, 0.99]


@pytest.mark.e2e
def test_the_rotation_ablation_says_each_rep_before_its_table():
    lines = run_cli_streaming(["fairseq-rope-ablate-rotation", "--dim", "tiny", "--reps", "2", "--tokens-per-batch", "64",
                               "--length", "8", "--threads", "1"])
    text = [line for line, _ in lines]
    reps = [i for i, line in enumerate(text) if re.fullmatch(r"\[ablate-rotation\] tiny: rep \d/2, a training step "
                                                              r"of each model \(\d+m\d\ds elapsed\)", line)]
    table = next(i for i, line in enumerate(text) if line.startswith("tiny, 1 thread(s)"))
    assert len(reps) == 2 and reps[-1] < table and lines[reps[0]][1], text  # the first while it ran
    assert all(any(line.lstrip().startswith(name) for line in text[table:]) for name in ("stock", "rope"))


def test_pool_never_writes_its_report_over_one_it_reads(tmp_path, capsys):
    """--pool A B --json-out A would replace report A by the pooled one: refused before reading."""
    from fairseq_rope_tools.research.benchmarks import speed as benchmark_speed

    report = tmp_path / "run1.json"
    report.write_text('{"results": {}}')
    with pytest.raises(SystemExit) as stop:
        benchmark_speed.main(["--pool", str(report), str(report), "--json-out", str(report)])
    assert stop.value.code == 2 and f"--json-out {report} is --pool {report}" in capsys.readouterr().err
    assert report.read_text() == '{"results": {}}'
