"""fairseq-rope-compare end to end on a tiny budget: length split, training
through the recipe's train.sh with live progress, checkpoint averaging, decoding (also with RoPE
scaling overrides, and with CTranslate2 by length bucket), scores with confidence intervals and
paired bootstrap tests, table, plots, resume, --jobs, --prepared-dir; and the helpers it shares
(fairseq_rope_tools/cli.py, fairseq_rope_tools/research/significance.py)."""

import contextlib
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.commands import REPO, cli_command, run_cli
from support.quickstart import shared_quickstart

from fairseq_rope_tools import cli, metrics, training_log
from fairseq_rope_tools.checkpoints import score_bleu
from fairseq_rope_tools.research import significance
from fairseq_rope_tools.research.compare import command as compare_cli
from fairseq_rope_tools.research.compare import data as compare_data
from fairseq_rope_tools.research.compare import decoding as compare_decoding
from fairseq_rope_tools.research.compare import runs as compare_runs
from fairseq_rope_tools.research.compare import schedule as compare_schedule
from fairseq_rope_tools.research.compare import variants as compare_variants

COMPARE = "fairseq-rope-compare"

PNG = b"\x89PNG\r\n\x1a\n"
TINY_RUN = ["--seeds", "1", "--max-update", "4", "--max-tokens", "600", "--average-last", "2",
            "--save-interval-updates", "2", "--batch-size", "100", "--threads", "1"]


def _scores(out, seed):
    """The numbers of results.json for one seed that must not depend on how runs were scheduled."""
    report = json.loads((out / "results.json").read_text())
    runs = {v: [{"valid_curve": r["valid_curve"], "params": r["params"],
                 "decodes": {suffix: {k: x for k, x in decode.items() if k != "decoding_time"}  # the clock's
                             for suffix, decode in r["decodes"].items()}} for r in rs if r["seed"] == seed]
            for v, rs in report["results"].items()}
    return runs, {group: tests[str(seed)] for group, tests in report["significance"].items()}


@pytest.mark.e2e
def test_harness_end_to_end_with_length_split(tiny_data_bin, tmp_path):
    out = tmp_path / "compare"
    args = [COMPARE, "--raw-dir", tiny_data_bin, "--out-dir", out,
            "--variants", "rope", "sinusoidal", *TINY_RUN, "--length-split", "6",
            "--length-buckets", "6", "12", "--extrapolation-scaling", "yarn:3", "dynamic-yarn",
            "--joined-groups", "2", "3", "4", "--max-len-a", "0", "--max-len-b", "30",
            "--ctranslate2-length-buckets", "2", "3",
            # single options as values, the documented way
            "--generate-args", "--remove-bpe", "--train-args", "--report-accuracy"]
    proc = run_cli(args, timeout=400)

    # live progress: a line per logged interval (update, train loss, valid loss, time) before the
    # run's end, and the decoding's progress
    lines = proc.stdout.splitlines()
    progress = [i for i, line in enumerate(lines)
                if re.search(r"rope seed 1: update 2/4 \| train loss \d+\.\d+ \| valid loss [-\d.]+ \| \d+m\d\ds elapsed, ETA", line)]
    finished = [i for i, line in enumerate(lines) if "rope seed 1: done in" in line]
    assert progress and finished and progress[0] < finished[0], proc.stdout
    assert any(re.search(r"rope seed 1: decoding test\+yarnx3: \d+/\d+ sentences", line) for line in lines)

    # the length split: training pairs are short, test groups are what their names say
    lengths = lambda path: [len(line.split()) for line in path.read_text().splitlines()]  # noqa: E731
    assert max(lengths(out / "text" / "train.en")) <= 6 and max(lengths(out / "text" / "valid.de")) <= 6
    groups = json.loads((out / "data-bin" / "test_groups.json").read_text())
    assert list(groups) == ["test <= 6", "test > 6", "test x2", "test x3", "test x4"]
    test_lengths = lengths(out / "text" / "test.en")
    (a, b), (c, d) = groups["test <= 6"], groups["test > 6"]
    assert all(n <= 6 for n in test_lengths[a:b]) and all(n > 6 for n in test_lengths[c:d])
    x3, x4 = groups["test x3"], groups["test x4"]
    assert min(test_lengths[x3[0]:x3[1]]) >= 6  # three sentences of at least 2 tokens
    assert x4[1] == len(test_lengths) and x4[1] - x4[0] == 43 // 4

    report = json.loads((out / "results.json").read_text())["results"]
    rope, sinusoidal = report["rope"][0], report["sinusoidal"][0]
    for run in (rope, sinusoidal):
        assert run["averaged_checkpoints"] == 2
        assert [u for u, _, _ in run["valid_curve"]] == [2, 4]
        assert run["tokens_per_second"] > 0
        assert all(0 <= v <= 100 for v in run["decodes"][""]["bleu"].values())
        assert sum(b["sentences"] for b in run["decodes"][""]["bleu_by_length"].values()) == len(test_lengths)
    # neither adds parameters for positions: same count, read from the training logs
    assert rope["params"] == sinusoidal["params"] > 0
    assert set(rope["decodes"]) == {"", "+yarnx3", "+dynamic-yarn", "+ctranslate2-buckets"}
    assert set(sinusoidal["decodes"]) == {""}
    run_dir = out / "runs" / "rope" / "seed1"
    generate_log = (run_dir / "generate+yarnx3.log").read_text()

    def overrides(suffix):
        command = shlex.split((run_dir / f"generate{suffix}.log").read_text().splitlines()[0])
        return command[command.index("--model-overrides") + 1]

    # the overrides reached fairseq-generate; yarn and dynamic scaling take the training length
    # the checkpoint recorded
    assert overrides("+yarnx3") == "{'rope_scaling': 'yarn', 'rope_scaling_factor': 3.0}"
    assert overrides("+dynamic-yarn") == "{'rope_scaling': 'dynamic-yarn'}"
    assert " --remove-bpe " in generate_log.splitlines()[0]
    # the recipe trained it: train.sh's command (with its knobs) heads the log, and the extra
    # option reached fairseq-train (--report-accuracy logs an accuracy)
    train_log = (run_dir / "train.log").read_text()
    assert "MAX_UPDATE=4" in train_log.splitlines()[0] and "train.sh --report-accuracy" in train_log.splitlines()[0]
    assert re.search(r"train_inner .*accuracy=", train_log)
    assert not (run_dir / "checkpoints").exists()

    table = (out / "results.md").read_text()
    for row in ("`rope`", "`rope+yarnx3`", "`rope+dynamic-yarn`", "`sinusoidal`", "## test x3", "train tokens/s",
                "tok BLEU", "chrF++",
                "against `sinusoidal`"):
        assert row in table
    for png in ("valid_loss.png", "bleu_by_length.png"):
        assert (out / png).read_bytes()[:8] == PNG

    # the sentence-split oracle of every joined group: the decode's own single-sentence hypotheses
    # joined as the sources were, against the group's references
    parts = json.loads((out / "data-bin" / compare_data.JOINED_FILE).read_text())
    assert list(parts) == ["test x2", "test x3", "test x4"]
    refs = (out / "text" / "test.de").read_text().splitlines()
    for suffix in ("", "+yarnx3"):
        hyps = (run_dir / f"hyp{suffix}.tok.txt").read_text().splitlines()
        decode = rope["decodes"][suffix]
        assert set(decode["oracle"]) == set(parts)
        for group, lines in parts.items():
            start, end = groups[group]
            assert [" ".join(refs[i] for i in joined) for joined in lines] == refs[start:end]
            oracle, _ = metrics.score_all([" ".join(hyps[i] for i in joined) for joined in lines],
                                                     refs[start:end], refs[start:end], "de")
            assert decode["oracle"][group]["bleu"] == oracle["tokenized_bleu_compound_split"]["score"]
            assert decode["oracle"][group]["chrf"] == oracle["chrf++"]["score"]
            for key in ("bleu", "chrf"):
                score = decode["oracle"][group][key]
                assert decode["oracle"][group]["ratio"][key] == (
                    pytest.approx(decode[key][group] / score) if score else None)
    assert "## Joined inputs against the sentence-split oracle" in table
    assert "| variant | test x2 | test x3 | test x4 | test <= 6 |" in table
    report = json.loads((out / "results.json").read_text())
    assert report["baseline"] == "sinusoidal" and report["significance_signatures"]["tok_bleu"].startswith("nrefs:1")
    for group in groups:
        tested = report["significance"][group]["1"]
        assert tested["sinusoidal"]["tok_bleu"]["p"] is None
        assert 0 < tested["rope+yarnx3"]["chrf"]["p"] <= 1 and tested["rope"]["sacrebleu"]["ci"] >= 0
        assert report["summary"][group]["rope"]["bleu"]["per_seed"] == [rope["decodes"][""]["bleu"][group]]
    assert not list(out.rglob("*.tmp"))

    # CTranslate2 by length bucket (plain, yarn x2, yarn x3) beside fairseq-generate, each decode timed
    assert "rope seed 1+ctranslate2-buckets: decoding test with CTranslate2" in proc.stdout
    ct2 = rope["decodes"]["+ctranslate2-buckets"]
    assert sum(ct2["decoding_time"]["buckets"].values()) == len(test_lengths)
    assert set(ct2["decoding_time"]["buckets"]) == {"plain", "yarn x2", "yarn x3"}
    assert ct2["decoding_time"]["buckets"]["plain"] > 0 and ct2["decoding_time"]["buckets"]["yarn x3"] > 0
    for decode in rope["decodes"].values():
        assert decode["decoding_time"]["seconds"] > 0
        assert sum(b["sentences"] for b in decode["bleu_by_length"].values()) == len(test_lengths)
    assert json.loads((run_dir / "ct2_length_buckets" / "length_buckets.json").read_text())["buckets"][2]["factor"] == 3
    assert "`rope+ctranslate2-buckets`" in table
    timing = table[table.index("## Decoding time"):]
    seconds = ct2["decoding_time"]["seconds"]
    assert f"| `rope+ctranslate2-buckets` | {seconds:.1f} | {len(test_lengths) / seconds:.1f} |" in timing

    # a second call reuses finished runs instead of training again
    started = time.time()
    proc = run_cli(args, timeout=120)
    assert proc.stdout.count("reusing") == 2
    assert time.time() - started < 60

    # other scalings: the trained models are reused, only the new decodes are made, and the
    # decodes no longer asked for leave no files behind
    scaling = args.index("--extrapolation-scaling")
    args[scaling + 1:scaling + 3] = ["yarn:3", "ntk:2", "--rope-scaling-original-length", "9"]
    proc = run_cli(args, timeout=400)
    assert "training" not in proc.stdout and proc.stdout.count("reusing the trained model") == 1
    assert "sinusoidal seed 1: done before, reusing" in proc.stdout
    decoded = set(re.findall(r"rope seed 1: decoding test(\S*):", proc.stdout))
    assert decoded == {"+yarnx3", "+ntkx2"}  # yarn: its training length changed
    assert overrides("+yarnx3") == "{'rope_scaling': 'yarn', 'rope_scaling_factor': 3.0, 'rope_scaling_original_length': 9}"
    rerun = json.loads((out / "results.json").read_text())["results"]["rope"][0]
    assert set(rerun["decodes"]) == {"", "+yarnx3", "+ntkx2", "+ctranslate2-buckets"}
    assert rerun["decodes"][""] == rope["decodes"][""]
    assert not list(run_dir.glob("*dynamic-yarn*"))
    assert "`rope+ntkx2`" in (out / "results.md").read_text()


def test_parse_train_log_and_concatenation():
    log = "\n".join([
        "2026-01-01 | INFO | fairseq_cli.train | num. shared model params: 1,234 (num. trained: 1,234)",
        '2026-01-01 | INFO | train_inner | {"epoch": 1, "loss": "9", "wps": "100", "num_updates": "1"}',
        '2026-01-01 | INFO | train_inner | {"epoch": 1, "loss": "8", "wps": "300", "num_updates": "2"}',
        '2026-01-01 | INFO | valid | {"epoch": 1, "valid_loss": "7.5", "valid_nll_loss": "7", "valid_num_updates": "2"}',
        '2026-01-01 | INFO | valid | {"epoch": 1, "valid_loss": "6.5", "valid_nll_loss": "6", "valid_num_updates": "4"}',
    ])
    parsed = training_log.parse_train_log(log)
    assert parsed["params"] == 1234 and parsed["tokens_per_second"] == 200
    assert parsed["valid_curve"] == [[2, 7.5, 7.0], [4, 6.5, 6.0]] and parsed["valid_loss"] == 6.5
    rows = [("a", "A"), ("b", "B"), ("c", "C"), ("d", "D"), ("e", "E")]
    assert compare_data.concatenated(rows, 2) == [("a b", "A B"), ("c d", "C D")]


def test_parse_train_log_simple_format():
    """The recipe's --log-format simple, as fairseq 0.12 writes it; other subsets do not count."""
    log = [
        "2026-01-01 | INFO | fairseq_cli.train | num. shared model params: 9,876 (num. trained: 9,876)",
        "2026-01-01 | INFO | train_inner | epoch 001:     25 / 164 loss=9.648, nll_loss=9.529, ppl=738.7, "
        "wps=1352.7, ups=0.37, wpb=3658.2, bsz=236.2, num_updates=25, lr=0.000333417, gnorm=4.524, train_wall=67, wall=70",
        "2026-01-01 | INFO | train_inner | epoch 001:     50 / 164 loss=7.984, nll_loss=7.689, ppl=206.34, "
        "wps=1000.3, ups=0.33, wpb=3627.2, bsz=160, num_updates=50, lr=0.000666733, gnorm=0.94, train_wall=75, wall=145",
        "2026-01-01 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 7.5 | nll_loss 7.25 | ppl 152 | "
        "wps 3000 | wpb 1000 | bsz 50 | num_updates 50",
        "2026-01-01 | INFO | valid | epoch 001 | valid on 'test' subset | loss 1.5 | nll_loss 1.2 | num_updates 50",
        "2026-01-01 | INFO | train | epoch 001 | loss 8.5 | nll_loss 8.3 | wps 900 | num_updates 164 | train_wall 200",
    ]
    assert training_log.parse_train_line(log[1]) == ("train_inner", pytest.approx(
        {"loss": 9.648, "nll_loss": 9.529, "ppl": 738.7, "wps": 1352.7, "ups": 0.37, "wpb": 3658.2, "bsz": 236.2,
         "num_updates": 25, "lr": 0.000333417, "gnorm": 4.524, "train_wall": 67, "wall": 70}))
    parsed = training_log.parse_train_log(log)
    assert parsed["params"] == 9876 and parsed["tokens_per_second"] == pytest.approx(1176.5)
    assert parsed["train_curve"] == [[25, 9.648], [50, 7.984]]
    assert parsed["valid_curve"] == [[50, 7.5, 7.25]] and parsed["valid_nll_loss"] == 7.25


def test_bucketed_scores():
    class Args:
        target_lang, length_buckets = "de", [2]

    rows = [("x y", "a b c d", "a b c d"), ("x y z w", "q r s t", "a b c d")]
    data = compare_data.TestData(None, {"test": [0, 2]}, None, None, [])
    scores, _ = compare_decoding.score_decode(Args, data, rows, ["a b c d", "a b c d"], ["a b c d", "a b c d"])
    assert scores["bleu_by_length"]["1-2"] == {"bleu": pytest.approx(100.0), "sentences": 1}
    assert scores["bleu_by_length"][">2"]["bleu"] == pytest.approx(0.0)


def test_extrapolation_scalings_take_a_factor_as_their_specs_say():
    args = compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--extrapolation-scaling", "dynamic-ntk", "ntk:2"])
    assert compare_decoding.extra_decodes(args, "rope") == {
        "": None, "+dynamic-ntk": {"rope_scaling": "dynamic-ntk"},
        "+ntkx2": {"rope_scaling": "ntk", "rope_scaling_factor": 2.0}}


@pytest.mark.parametrize("bad", [["--data-bin", "x", "--length-split", "5"],
                                 ["--raw-dir", "x", "--ctranslate2-length-buckets"],
                                 ["--data-bin", "x", "--ctranslate2-length-buckets", "--max-len-a", "0"],
                                 ["--raw-dir", "x", "--extrapolation-scaling", "rope:2"],
                                 ["--raw-dir", "x", "--extrapolation-scaling", "dynamic-yarn:2"],
                                 ["--raw-dir", "x", "--variants", "rope", "learned"],  # no baseline
                                 ["--raw-dir", "x", "--generate-args"]])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(SystemExit):
        compare_cli.parse_args([*bad, "--out-dir", "o"])


def test_pass_through_arguments_take_single_options():
    """`--generate-args --remove-bpe` and `--train-args --encoder-learned-pos` are values, not
    options of the harness (argparse alone stops with 'expected one argument')."""
    args = compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--generate-args", "--remove-bpe",
                               "--train-args", "--encoder-learned-pos", "--seeds", "2",
                               "--train-args", "--encoder-embed-dim 32 --decoder-embed-dim 32"])
    assert args.generate_args == ["--remove-bpe"] and args.seeds == [2]
    assert args.train_args == ["--encoder-learned-pos", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32"]
    assert compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--generate-args=--quiet"]).generate_args == ["--quiet"]


def test_job_slots_split_threads_or_give_each_a_gpu():
    cpu = compare_schedule.job_slots(2, 3, [])
    assert [s["OMP_NUM_THREADS"] for s in cpu] == ["3", "3"] and all(s["CPU"] == "1" for s in cpu)
    gpu = compare_schedule.job_slots(4, 1, ["2", "5"])  # at most one run per GPU
    assert [s["CUDA_VISIBLE_DEVICES"] for s in gpu] == ["2", "5"] and all(s["GPUS"] == "1" for s in gpu)


def test_a_run_waiting_for_its_start_leaves_the_free_slot_to_the_next(monkeypatch):
    """--jobs 2, rope then rope_cross@init-from=rope then sinusoidal: while rope trains, its
    fine-tuning waits, and sinusoidal takes the second slot at once (it would wait for rope to
    finish if the waiting run held a worker of the pool)."""
    args = compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--jobs", "2", "--seeds", "1", "--baseline",
                                   "rope", "--variants", "rope", "rope_cross@init-from=rope", "sinusoidal"])
    assert args.variants == ["rope", "rope_cross@init-from=rope", "sinusoidal"]  # the order they are taken in
    sinusoidal_started, order = threading.Event(), []

    def run_one(args, data, variant, seed, slot, start):
        order.append(variant)
        if variant == "rope":  # the start trains until the run after its fine-tuning has begun
            assert sinusoidal_started.wait(timeout=10), "sinusoidal did not start while rope trained"
        if variant == "sinusoidal":
            sinusoidal_started.set()
        return {"variant": variant, "start": start}

    monkeypatch.setattr(compare_schedule, "run_one", run_one)
    monkeypatch.setattr(compare_schedule, "log", lambda message: None)
    results = compare_schedule.run_all(args, None)
    assert order.index("rope") < order.index("rope_cross@init-from=rope")
    assert results["rope_cross@init-from=rope"] == [{"variant": "rope_cross@init-from=rope",
                                                      "start": {"variant": "rope", "start": None}}]


def test_slots_go_in_plan_order_seed_by_seed(monkeypatch):
    """--jobs 1, seeds 1 2, rope then rope_cross@init-from=rope: once rope of seed 1 finishes,
    its fine-tuning comes before rope of seed 2, although rope of seed 2 asked for the slot first
    (a plain queue hands the slot to whoever asked first, and the seeds mix)."""
    args = compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--jobs", "1", "--seeds", "1", "2",
                                   "--baseline", "rope", "--variants", "rope", "rope_cross@init-from=rope"])
    order = []

    def run_one(args, data, variant, seed, slot, start):
        order.append((variant, seed))
        if order == [("rope", 1)]:
            time.sleep(0.3)  # rope of seed 2 asks for the slot meanwhile
        return {}

    monkeypatch.setattr(compare_schedule, "run_one", run_one)
    monkeypatch.setattr(compare_schedule, "log", lambda message: None)
    compare_schedule.run_all(args, None)
    assert order == [("rope", 1), ("rope_cross@init-from=rope", 1), ("rope", 2), ("rope_cross@init-from=rope", 2)]


def test_slots_in_plan_order_whatever_order_they_are_asked_in():
    slots = compare_schedule.SlotsInPlanOrder(["slot"], ["a", "b", "c"], lambda task: None)
    assert slots.take("a") == "slot"
    handed, threads = [], []
    for task in ["c", "b"]:  # c asks first
        threads.append(threading.Thread(target=lambda task=task: handed.append((task, slots.take(task)))))
        threads[-1].start()
        time.sleep(0.1)
    slots.give_back("a", "slot", succeeded=True)
    threads[1].join(timeout=10)
    assert handed == [("b", "slot")]
    slots.give_back("b", "slot", succeeded=True)
    threads[0].join(timeout=10)
    assert handed == [("b", "slot"), ("c", "slot")]


def test_after_a_run_fails_no_run_starts(monkeypatch):
    """--jobs 1, rope (fails) then sinusoidal then rope_cross@init-from=rope: sinusoidal waits for
    the slot in a worker of its own, and must not take it once rope has failed."""
    args = compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--jobs", "1", "--seeds", "1", "--baseline",
                                   "rope", "--variants", "rope", "sinusoidal", "rope_cross@init-from=rope"])
    assert args.variants == ["rope", "sinusoidal", "rope_cross@init-from=rope"]
    started = []

    def run_one(args, data, variant, seed, slot, start):
        started.append(variant)
        if variant == "rope":
            time.sleep(0.3)  # sinusoidal's worker waits for the slot meanwhile
            raise RuntimeError("the training failed")
        return {}

    monkeypatch.setattr(compare_schedule, "run_one", run_one)
    monkeypatch.setattr(compare_schedule, "log", lambda message: None)
    with pytest.raises(RuntimeError, match="the training failed"):
        compare_schedule.run_all(args, None)
    assert started == ["rope"]


def test_run_logged_streams_while_the_command_runs(tmp_path):
    """Each line reaches the log file and the callback while the command is still running: the
    child waits for a file that the callback creates on its first line (captured output would
    deadlock until the timeout)."""
    flag, log, child = tmp_path / "seen", tmp_path / "child.log", tmp_path / "child.py"
    child.write_text("import os, sys, time\nprint('update 1', flush=True)\ndeadline = time.time() + 60\n"
                     f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.05)\n"
                     "    if time.time() > deadline: sys.exit('not streamed')\nprint('update 2')\n")
    seen = []

    def on_line(line):
        if line == "update 1":
            assert "update 1" in log.read_text()  # already in the log, too
            flag.touch()
        seen.append(line)

    cli.run_logged([sys.executable, child], log, on_line=on_line)
    assert seen == ["update 1", "update 2"] and log.read_text().splitlines()[1:] == seen
    with pytest.raises(cli.CommandFailed, match=r"exited with status 3.*\n.*boom.*\nfull log: .*child.log"):
        cli.run_logged([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], log)


def test_progress_lines_say_the_time_since_the_sayer_was_made(capsys, monkeypatch):
    clock = iter([100.0, 165.4, 7480.0])
    monkeypatch.setattr(cli.time, "monotonic", lambda: next(clock))
    progress = cli.progress_sayer("tool")
    progress("rep 1/2")
    progress("rep 2/2")
    assert capsys.readouterr().err == "[tool] rep 1/2 (1m05s elapsed)\n[tool] rep 2/2 (2h03m elapsed)\n"


def test_terminate_running_stops_commands_of_other_threads(tmp_path):
    """What an interrupted --jobs run does: the commands its threads wait for are stopped."""
    import threading

    errors, started = [], threading.Event()

    def run():
        try:
            cli.run_logged([sys.executable, "-c", "print('up', flush=True); import time; time.sleep(120)"],
                              tmp_path / "sleep.log", on_line=lambda line: started.set())
        except cli.CommandFailed as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    cli.terminate_running()
    thread.join(30)
    assert not thread.is_alive() and "exited with status -15" in str(errors[0])


def test_terminate_running_stops_a_scripts_whole_pipeline(tmp_path):
    """train.sh runs fairseq-train piped into tee: a SIGTERM to the shell alone killed the shell,
    and fairseq-train trained on (the harness still reading its output) until its end."""
    import threading

    errors, started = [], threading.Event()
    pid_file = tmp_path / "trainer.pid"
    script = tmp_path / "pipeline.sh"
    script.write_text('set -euo pipefail\n"$PY" -c "import os, sys, time; open(sys.argv[1], \'w\').write(str(os.getpid())); '
                      'print(\'up\', flush=True); time.sleep(120)" "$PID_FILE" | cat\n')

    def run():
        try:
            cli.run_logged(["bash", script], tmp_path / "pipeline.log", env={"PY": sys.executable, "PID_FILE": str(pid_file)},
                           on_line=lambda line: started.set())
        except cli.CommandFailed as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    trainer = int(pid_file.read_text())
    cli.terminate_running()
    thread.join(30)
    assert not thread.is_alive() and "exited with status" in str(errors[0])
    deadline = time.monotonic() + 10
    while not _gone(trainer) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(trainer)


def _corpus(rng, n):
    words = [f"w{i}" for i in range(300)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) for _ in range(n)]


def test_paired_bootstrap_tells_a_real_difference(tmp_path):
    import random

    rng = random.Random(0)
    refs = _corpus(rng, 300)
    good = [" ".join(w if rng.random() < 0.8 else "x" for w in r.split()) for r in refs]
    worse = [h if rng.random() < 0.6 else " ".join(h.split()[: len(h.split()) // 2]) for h in good]
    one_line_off = good[:-1] + ["y"]
    paths = {}
    for name, lines in (("good", good), ("copy", good), ("worse", worse), ("one_line_off", one_line_off)):
        paths[name] = tmp_path / f"{name}.txt"
        paths[name].write_text("\n".join(lines) + "\n")
    systems = [(name, path.read_text().splitlines()) for name, path in paths.items()]
    tested, signatures = significance.paired_bootstrap(systems, refs, refs_raw=refs, lang="en")
    for metric in ("tok_bleu", "sacrebleu", "chrf"):
        assert tested["good"][metric]["p"] is None
        assert tested["copy"][metric]["p"] == pytest.approx(1.0)  # identical files: no difference at all
        assert tested["worse"][metric]["p"] < 0.05
        assert tested["one_line_off"][metric]["p"] > 0.05
        result = tested["worse"][metric]
        assert result["mean"] - result["ci"] <= result["score"] <= result["mean"] + result["ci"]
    assert tested["worse"]["tok_bleu"]["score"] < tested["good"]["tok_bleu"]["score"]
    assert "bs:1000" in signatures["tok_bleu"] and "chrF" not in signatures["tok_bleu"]


@pytest.mark.e2e
def test_plot_rope_decay_redraws_fig2(tmp_path):
    png, csv = tmp_path / "decay.png", tmp_path / "decay.csv"
    run_cli(["fairseq-rope-plot-decay", "--out", png, "--csv", csv,
             "--dim", "128", "--max-distance", "256"])
    assert png.read_bytes()[:8] == PNG
    rows = [line.split(",") for line in csv.read_text().splitlines()[1:]]
    bound = [float(b) for _, b in rows]
    assert len(bound) == 257
    assert bound[0] == pytest.approx(32.5)  # distance 0: mean of |S_j| = j over j = 1..64
    assert max(bound[200:]) < bound[20] < bound[0]  # decays with distance (Fig. 2)


def test_raw_text_is_read_strictly_and_stays_aligned(tmp_path, capsys):
    """A \\r or U+2028 inside a line is a space, not a line break (which would pair sentences with
    the translations of others); a side with another number of lines or invalid UTF-8 is refused."""
    (tmp_path / "train.en").write_bytes("a b\rc\nd e\nf\n".encode())
    (tmp_path / "train.de").write_bytes("A B C\nD\u2028E\nF\n".encode())
    assert compare_data.read_pairs(tmp_path, "train", "en", "de") == [
        (["a", "b", "c"], ["A", "B", "C"]), (["d", "e"], ["D", "E"]), (["f"], ["F"])]
    (tmp_path / "valid.en").write_text("a\nb\n")
    (tmp_path / "valid.de").write_text("A\n")
    err = _refused(capsys, ["--raw-dir", str(tmp_path), "--out-dir", str(tmp_path / "out")], status=1)
    assert "error: " in err and "valid.en (2 lines)" in err and "not parallel" in err
    (tmp_path / "valid.de").write_bytes(b"A\n\xe9\n")
    err = _refused(capsys, ["--raw-dir", str(tmp_path), "--out-dir", str(tmp_path / "out")], status=1)
    assert f"error: {tmp_path / 'valid.de'}: line 2: invalid UTF-8" in err


@pytest.fixture(scope="module")
def prepared_quickstart(tmp_path_factory):
    """A small quickstart corpus (fairseq-rope-generate-corpus) prepared by prepare.sh, as
    scripts/quickstart.sh prepares it (support/quickstart.py's run; read only); returns (work dir,
    prepare.sh's log)."""
    run = shared_quickstart(tmp_path_factory)
    return run.work, (run.root / "prepare.log").read_text(encoding="utf-8")


@pytest.mark.e2e
def test_prepared_dir_end_to_end_and_jobs_give_the_same_numbers(prepared_quickstart, tmp_path):
    """--prepared-dir trains on prepare.sh's BPE text and scores against its tok/ and raw/
    references exactly as fairseq-rope-score does; two runs at a time give the numbers of
    one at a time."""
    work, prepare_log = prepared_quickstart
    assert re.search(r"vocabulary threshold (0|50) \(auto: \d+ training words for 300 merges", prepare_log)
    args = [COMPARE, "--prepared-dir", work, "--variants", "sinusoidal", *TINY_RUN]
    run_cli([*args, "--out-dir", tmp_path / "parallel", "--jobs", "2", "--seeds", "1", "2"], timeout=400)  # last --seeds wins
    run_cli([*args, "--out-dir", tmp_path / "sequential", "--jobs", "1", "--seeds", "2"], timeout=400)
    parallel = _scores(tmp_path / "parallel", 2)
    assert parallel == _scores(tmp_path / "sequential", 2) and parallel[0]["sinusoidal"]

    run_dir = tmp_path / "parallel" / "runs" / "sinusoidal" / "seed2"
    assert f"{shlex.quote(str(work / 'data-bin'))} " in (run_dir / "generate.log").read_text().splitlines()[0]
    expected = score_bleu.run(["--hyp", str(run_dir / "hyp.tok.txt"), "--ref", str(work / "tok" / "test.de"),
                                "--raw-ref", str(work / "raw" / "test.de")])
    result = json.loads((run_dir / "result.json").read_text())["decodes"][""]
    assert result["bleu"]["test"] == expected["tokenized_bleu_compound_split"]["score"]
    assert result["sacrebleu"]["test"] == expected["sacrebleu"]["score"]
    assert result["chrf"]["test"] == expected["chrf++"]["score"]
    hyps = (run_dir / "hyp.tok.txt").read_text()
    assert "@@" not in hyps and len(hyps.splitlines()) == 30  # BPE removed, every sentence translated
    report = json.loads((tmp_path / "parallel" / "results.json").read_text())
    assert report["references"] == "the corpus's own"
    assert report["summary"]["test"]["sinusoidal"]["chrf"]["per_seed"] == [
        r["decodes"][""]["chrf"]["test"] for r in report["results"]["sinusoidal"]]


@pytest.mark.e2e
def test_length_split_of_a_prepared_corpus(prepared_quickstart, tmp_path):
    """--length-split on a prepared corpus: lengths in words of the tokenized text, the BPE text
    binarized with the corpus's own dictionary, references joined like the sources."""
    work, _ = prepared_quickstart
    args = compare_cli.parse_args(["--prepared-dir", str(work), "--out-dir", str(tmp_path), "--length-split", "12"])
    args.out_dir = tmp_path
    data = compare_data.prepare(args, lambda message: None)
    assert list(data.groups) == ["test <= 12", "test > 12", "test x2", "test x3"]
    assert data.generate_args == ["--remove-bpe"]
    assert (tmp_path / "data-bin" / "dict.en.txt").read_text() == (work / "data-bin" / "dict.en.txt").read_text()
    tok_src = (work / "tok" / "test.en").read_text().splitlines()
    raw_tgt = (work / "raw" / "test.de").read_text().splitlines()
    start, end = data.groups["test <= 12"]
    assert all(len(r.split()) <= 12 for r in data.refs_tok[start:end])
    start, end = data.groups["test x2"]
    assert data.refs_raw[start] == f"{raw_tgt[0]} {raw_tgt[1]}"
    bpe_lines = (tmp_path / "text" / "test.en").read_text().splitlines()
    assert bpe_lines[start].replace("@@ ", "") == f"{tok_src[0]} {tok_src[1]}"
    train_words = [max(len(a.split()), len(b.split())) for a, b in zip(
        (tmp_path / "text" / "train.en").read_text().replace("@@ ", "").splitlines(),
        (tmp_path / "text" / "train.de").read_text().replace("@@ ", "").splitlines())]
    assert train_words and max(train_words) <= 12


@pytest.mark.e2e
def test_a_failing_training_names_its_log(tiny_data_bin, tmp_path):
    proc = run_cli([COMPARE, "--data-bin", tiny_data_bin / "data-bin", "--out-dir", tmp_path, "--variants", "sinusoidal",
                    *TINY_RUN, "--train-args", "--no-such-option"], check=False, timeout=300)
    log = tmp_path / "runs" / "sinusoidal" / "seed1" / "train.log"
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("fairseq-rope-compare: error: train.sh exited with status")
    assert "unrecognized arguments: --no-such-option" in proc.stderr and proc.stderr.rstrip().endswith(f"full log: {log}")
    assert not (tmp_path / "runs" / "sinusoidal" / "seed1" / "result.json").exists()


@pytest.mark.e2e
def test_a_killed_training_resumes_from_its_last_checkpoint(tiny_data_bin, tmp_path):
    args = [COMPARE, "--data-bin", tiny_data_bin / "data-bin", "--out-dir", tmp_path / "compare", "--variants", "rope", "--baseline", "rope",
            "--seeds", "1", "--max-update", "24", "--max-tokens", "600", "--average-last", "2",
            "--save-interval-updates", "4", "--batch-size", "100", "--threads", "1"]
    run_dir = tmp_path / "compare" / "runs" / "rope" / "seed1"
    cmd, env = cli_command(args, None)
    harness_run = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in harness_run.stdout:  # killed at the first update logged after a checkpoint
            seen.append(line)
            if (run_dir / "checkpoints" / "checkpoint_last.pt").exists() and re.search(r"update \d+/24 \| train", line):
                break
        else:
            pytest.fail("the training ended before it could be killed:\n" + "".join(seen[-30:]))
        # the harness alone, as `kill -9 PID` does (case 8 of issue 34: train.sh and fairseq-train ran on)
        os.kill(harness_run.pid, signal.SIGKILL)
        harness_run.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _session_processes(harness_run.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _session_processes(harness_run.pid) == [], "the harness's commands outlived it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(harness_run.pid, signal.SIGKILL)
        harness_run.wait(timeout=60)
        harness_run.stdout.close()
    seconds_before = json.loads((run_dir / "training.json").read_text())["seconds"]
    assert seconds_before > 0 and not (run_dir / "result.json").exists()

    proc = run_cli(args, timeout=400)
    assert "rope seed 1: resuming its interrupted training" in proc.stdout, proc.stdout
    assert "rope seed 1: training" not in proc.stdout
    log = (run_dir / "train.log").read_text()
    assert len([line for line in log.splitlines() if line.startswith("env ")]) == 2  # one command per attempt
    resumed_at = re.findall(rf"Loaded checkpoint {re.escape(str(run_dir))}\S*/checkpoint_last\.pt \(epoch \d+ @ (\d+) updates\)",
                            log)
    assert len(resumed_at) == 1 and 4 <= int(resumed_at[0]) < 24, log[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["train_curve"][-1][0] == 24 and [u for u, _ in result["train_curve"]] == list(range(1, 25))
    assert result["train_seconds"] > seconds_before
    assert not (run_dir / "training.json").exists()


def test_only_an_interrupted_training_of_the_same_settings_is_resumed(tmp_path):
    settings = {"variant": "rope", "seed": 1}
    assert compare_runs.interrupted_training(tmp_path, settings, overwrite=False) is None  # nothing there
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "checkpoint_last.pt").write_bytes(b"")
    (tmp_path / "training.json").write_text(json.dumps({"settings": settings, "seconds": 61.5}))
    assert compare_runs.interrupted_training(tmp_path, settings, overwrite=False) == 61.5
    assert compare_runs.interrupted_training(tmp_path, settings, overwrite=True) is None
    assert compare_runs.interrupted_training(tmp_path, {**settings, "seed": 2}, overwrite=False) is None
    (tmp_path / "training.json").write_text('{"settings": ')  # cut short: trained again, from scratch
    assert compare_runs.interrupted_training(tmp_path, settings, overwrite=False) is None


# ---------------------------------------------------------------- issue 34: what the harness writes and refuses

def _refused(capsys, argv, status=2):
    """compare_cli.main(argv) must stop with ``status`` before any work; returns its stderr."""
    with pytest.raises(SystemExit) as stop:
        compare_cli.main(argv)
    assert stop.value.code == status
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture
def no_real_commands(monkeypatch):
    """fairseq-preprocess makes a data-bin of three files, and the trainings are not run: the
    harness's writes (or refusals) before training, in-process."""
    def preprocess(cmd, log_path, **kwargs):
        assert cmd[0] == "fairseq-preprocess", cmd
        destdir = Path(cmd[cmd.index("--destdir") + 1])
        destdir.mkdir(parents=True, exist_ok=True)
        for name in ("dict.en.txt", "dict.de.txt", "test.en-de.en.idx"):
            (destdir / name).write_text("made\n")

    def no_training(args, data):
        raise AssertionError("the harness went on to train")

    monkeypatch.setattr(compare_data, "run_logged", preprocess)
    monkeypatch.setattr(compare_cli, "run_all", no_training)


def _raw_dir(directory, test_target="C D"):
    directory.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid", "test"):
        (directory / f"{split}.en").write_text("a b\nc d\n")
        (directory / f"{split}.de").write_text(f"B A\n{test_target if split == 'test' else 'D C'}\n")
    return directory


def _prepared_work_dir(work):
    """What prepare.sh leaves: its step directories with their .done, BPE text, a data-bin."""
    for step in compare_data.PREPARE_STEPS:
        (work / step).mkdir(parents=True)
        (work / step / ".done").write_text(f"{step} done\n")
        if step != "data-bin":
            _raw_dir(work / step)
    for name in ("bpe_type", "bpe.codes", "dict.en.txt", "dict.de.txt", "test.en-de.en.idx"):
        (work / "data-bin" / name).write_text("subword_nmt\n" if name == "bpe_type" else "prepared\n")
    return work


def _tree(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_case1_a_prepared_work_dir_as_out_dir_is_refused_and_kept(tmp_path, capsys, no_real_commands):
    """Case 1: --prepared-dir W --out-dir W --length-split N replaced W's data-bin by the split one
    (.done, bpe_type and bpe.codes gone, training cut to the short pairs), exit 0."""
    work = _prepared_work_dir(tmp_path / "work")
    before = _tree(work)
    err = _refused(capsys, ["--prepared-dir", str(work), "--out-dir", str(work), "--length-split", "2"])
    assert (f"error: --out-dir's data-bin/ {work / 'data-bin'} is --prepared-dir's data-bin/ {work / 'data-bin'}: "
            "the output would overwrite its own input") in err
    # without a length split nothing of W would be replaced, but the comparison's files do not go among the corpus's
    err = _refused(capsys, ["--prepared-dir", str(work), "--out-dir", str(work)])
    assert f"error: --out-dir {work} is a prepare.sh work dir (it holds raw/.done, tok/.done" in err
    other = tmp_path / "other"
    err = _refused(capsys, ["--prepared-dir", str(other), "--out-dir", str(work), "--length-split", "2"])
    assert f"error: --out-dir {work} is a prepare.sh work dir" in err
    assert _tree(work) == before


@pytest.mark.parametrize("made_by", ["fairseq-preprocess", "a user"])
@pytest.mark.parametrize("name", ["data-bin", "text"])
def test_case1_a_data_bin_or_text_the_harness_did_not_make_is_refused(tmp_path, capsys, no_real_commands, name,
                                                                        made_by):
    raw, out = _raw_dir(tmp_path / "raw"), tmp_path / "out"
    (out / name).mkdir(parents=True)
    (out / name / "dict.en.txt").write_text(f"made by {made_by}\n")
    err = _refused(capsys, ["--raw-dir", str(raw), "--out-dir", str(out)])
    assert (f"error: --out-dir {out} holds a {name}/ that fairseq-rope-compare did not make (it has no "
            f"{compare_data.MARKER}), and the comparison replaces {name}/ as a whole") in err
    assert _tree(out) == {f"{name}/dict.en.txt": f"made by {made_by}\n".encode()}
    # where the harness binarizes nothing, a data-bin beside its runs is no concern of its
    args = compare_cli.parse_args(["--data-bin", str(out / name), "--out-dir", str(out)])
    assert compare_data.out_dir_problem(args, compare_cli.harness_outputs(args)) is None


def test_case1_the_harness_marks_what_it_binarizes_and_replaces_it_on_a_rerun(tmp_path, no_real_commands):
    raw, out = _raw_dir(tmp_path / "raw"), tmp_path / "out"
    args = compare_cli.parse_args(["--raw-dir", str(raw), "--out-dir", str(out)])
    for _ in range(2):
        assert compare_data.out_dir_problem(args, compare_cli.harness_outputs(args)) is None
        data = compare_data.prepare(args, lambda message: None)
        assert data.data_bin == out / "data-bin"
        assert (out / "text" / compare_data.MARKER).is_file() and (out / "data-bin" / compare_data.MARKER).is_file()
        assert (out / "text" / "test.de").read_text() == "B A\nC D\n"
    assert sorted(p.name for p in out.iterdir()) == ["data-bin", "text"]  # no temporaries left beside them


@pytest.mark.parametrize("layout", ["raw-dir is out/text", "raw-dir links to out/text", "data-bin in out/runs"])
def test_case5_an_output_over_an_input_is_refused(tmp_path, capsys, no_real_commands, layout):
    out = tmp_path / "out"
    if layout == "data-bin in out/runs":
        source = out / "runs" / "data-bin"
        source.mkdir(parents=True)
        for name in ("dict.en.txt", "dict.de.txt"):
            (source / name).write_text("a 1\n")
        argv, expected = ["--data-bin", str(source)], f"--out-dir's runs/ {out / 'runs'} holds --data-bin {source}"
    else:
        source = _raw_dir(out / "text")
        if layout == "raw-dir links to out/text":
            (tmp_path / "link").symlink_to(source)
            source = tmp_path / "link"
        argv, expected = ["--raw-dir", str(source)], f"--out-dir's text/ {out / 'text'} is --raw-dir {source}"
    before = _tree(out)
    err = _refused(capsys, [*argv, "--out-dir", str(out), "--variants", "sinusoidal"])
    assert f"error: {expected}: the output would overwrite its own input; give another output" in err
    assert _tree(out) == before


def test_case6_the_training_length_reaches_the_bucket_export(tmp_path, monkeypatch):
    """Case 6: --rope-scaling-original-length L --ctranslate2-length-buckets gave L to fairseq's
    decodes only; the bucket export then failed on a checkpoint that records no L."""
    def parsed(*extra):
        return compare_cli.parse_args(["--raw-dir", "x", "--out-dir", str(tmp_path), "--variants", "rope", "--baseline",
                                   "rope", "--max-len-a", "0", "--ctranslate2-length-buckets", "2", *extra])

    commands = []

    class Exported(Exception):
        pass

    def run_logged(cmd, log_path, **kwargs):
        commands.append([str(c) for c in cmd])
        raise Exported

    monkeypatch.setattr(compare_decoding, "run_logged", run_logged)
    data = compare_data.TestData(tmp_path / "data-bin", {"test": [0, 1]}, None, None, [], tmp_path / "test.en")
    for args in (parsed("--rope-scaling-original-length", "9"), parsed()):
        settings = compare_decoding.wanted_decodes(args, "rope")[compare_decoding.CT2_BUCKETS]
        with pytest.raises(Exported):
            compare_decoding.decode_with_ctranslate2(args, data, tmp_path / "averaged.pt", settings, tmp_path / "log", "rope",
                                            {}, tmp_path)
    given, recorded = commands
    assert given[0] == "fairseq-rope-export" and given[given.index("--rope-scaling-original-length") + 1] == "9"
    assert "--rope-scaling-original-length" not in recorded  # the checkpoint's own L
    # another L is another decode: a rerun exports and decodes again
    assert compare_decoding.wanted_decodes(parsed("--rope-scaling-original-length", "10"), "rope") != \
        compare_decoding.wanted_decodes(parsed("--rope-scaling-original-length", "9"), "rope")


@pytest.mark.parametrize("bad, message", [
    (["--rope-scaling-original-length", "9"], "--rope-scaling-original-length is read only by yarn and the dynamic"),
    (["--extrapolation-scaling", "ntk:2", "--rope-scaling-original-length", "9"],
     "--rope-scaling-original-length is read only by yarn"),
    (["--extrapolation-scaling", "yarn:2", "--rope-scaling-original-length=-3"],
     "--rope-scaling-original-length must be a number of tokens > 0, got -3"),
    (["--variants", "sinusoidal", "learned", "--extrapolation-scaling", "yarn:2"],
     "decode the RoPE variants only, and --variants names none"),
    (["--variants", "sinusoidal", "--ctranslate2-length-buckets", "--max-len-a", "0"],
     "decode the RoPE variants only"),
    (["--gen-subset", "valid"], "--gen-subset valid: the references of --raw-dir, --prepared-dir and"),
    (["--corpus-train-size", "100"], "--corpus-train-size: the options of --quickstart-corpus, which is not asked"),
])
def test_case6_options_that_would_change_nothing_are_refused(capsys, bad, message):
    with pytest.raises(SystemExit) as stop:
        compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", *bad])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_case6_bpe_markers_in_raw_text_with_remove_bpe_are_refused(tmp_path, capsys, no_real_commands):
    """Case 6: --raw-dir text with '@@ ' and --generate-args --remove-bpe scored hypotheses without
    the markers against references with them (tok BLEU 3-5 points low, exit 0)."""
    raw, out = _raw_dir(tmp_path / "raw", test_target="D@@ C"), tmp_path / "out"
    err = _refused(capsys, ["--raw-dir", str(raw), "--out-dir", str(out), "--generate-args", "--remove-bpe"])
    assert (f"error: {raw / 'test.de'} carries subword markers ('@@', line 2), which --generate-args --remove-bpe "
            "removes from the hypotheses only") in err
    assert not (out / "data-bin").exists() and not (out / "text").exists()
    assert compare_data.removed_marker(["--remove-bpe", "--quiet"]) == "@@ "
    assert compare_data.removed_marker(["--remove-bpe=subword_nmt"]) == "@@ "
    assert compare_data.removed_marker(["--quiet", "--remove-bpe", "sentencepiece"]) == "\u2581"
    assert compare_data.removed_marker(["--quiet"]) is None


def _gone(pid):
    """Whether process ``pid`` has ended (a zombie not yet reaped by its new parent counts)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _session_processes(session):
    """The live processes of a session (a command started with start_new_session: its descendants)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] not in ("Z", "X"):
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the watchdog reads /proc (Linux)")
def test_case8_the_commands_of_a_harness_killed_with_sigkill_end_with_it(tmp_path):
    """Case 8: the harness killed with kill -9 left its fairseq-train children running. A stand-in
    harness runs a grandchild as train.sh runs fairseq-train (bash, then a process of its own)."""
    pid_file = tmp_path / "grandchild.pid"
    grandchild = (f"{shlex.quote(sys.executable)} -c 'import os, sys, time; open(sys.argv[1], \"w\")"
                  f".write(str(os.getpid())); time.sleep(300)' {shlex.quote(str(pid_file))}; echo never reached")
    stand_in = ("import sys\nfrom fairseq_rope_tools import cli\n"
                "with cli.children_end_with_this_process():\n"
                "    cli.run_logged(['bash', '-c', sys.argv[1]], sys.argv[2])\n")
    run = subprocess.Popen([sys.executable, "-c", stand_in, grandchild, str(tmp_path / "log")], cwd=REPO,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and run.poll() is None, "the grandchild did not start"
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        os.kill(run.pid, signal.SIGKILL)  # the harness alone, as kill -9 PID does
        run.wait(timeout=30)
        deadline = time.monotonic() + 20
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(pid), "the grandchild outlived the harness"
        deadline = time.monotonic() + 20  # the watchdog, its work done, ends too
        while _session_processes(run.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _session_processes(run.pid) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)


def test_commands_still_running_when_the_harness_ends_are_ended(monkeypatch):
    from fairseq_rope_tools import cli

    monkeypatch.delenv(cli.RUN_TOKEN, raising=False)
    sleeper = None
    try:
        with cli.children_end_with_this_process():
            token = os.environ[cli.RUN_TOKEN]
            sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            assert sleeper.pid in cli.processes_carrying(cli.RUN_TOKEN, token)
        assert sleeper.wait(timeout=20) == -signal.SIGTERM
        assert cli.RUN_TOKEN not in os.environ
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()


# ---------------------------------------------------------------- issue 38: long inputs

def test_the_oracle_is_the_score_of_the_same_decodes_single_hypotheses_joined():
    """A hand-built case: four test sentences decoded one by one (the first two perfectly), and
    two joined pairs of them, of which the decode of the joined inputs kept the first half only.
    The oracle of the pairs is the score of the single hypotheses joined in the order of the
    sources, against the pairs' references; the ratio is the joined decode's share of it."""
    class Args:
        target_lang, length_buckets = "de", [4]

    singles = ["das ist ein Haus", "wir gehen nach Hause", "der Hund schläft heute", "sie liest ein Buch"]
    pairs = [f"{singles[0]} {singles[1]}", f"{singles[2]} {singles[3]}"]
    refs = singles + pairs
    single_hyps = [singles[0], singles[1], "der Hund schläft", "sie liest das Buch heute"]
    hyps = single_hyps + ["das ist ein Haus", "der Hund schläft heute sie liest"]
    rows = [(r, h, r) for h, r in zip(hyps, refs)]
    data = compare_data.TestData(None, {"test <= 4": [0, 4], "test x2": [4, 6]}, refs, refs, [],
                                 joined={"test x2": [[0, 1], [2, 3]]})
    scores, _ = compare_decoding.score_decode(Args, data, rows, refs, refs)
    oracle = scores["oracle"]["test x2"]
    expected, _ = metrics.score_all([f"{single_hyps[0]} {single_hyps[1]}", f"{single_hyps[2]} {single_hyps[3]}"],
                                               pairs, pairs, "de")
    assert oracle["bleu"] == expected["tokenized_bleu_compound_split"]["score"]
    assert oracle["sacrebleu"] == expected["sacrebleu"]["score"] and oracle["chrf"] == expected["chrf++"]["score"]
    assert 0 < scores["bleu"]["test x2"] < oracle["bleu"] < 100
    for key in ("bleu", "sacrebleu", "chrf"):
        assert oracle["ratio"][key] == pytest.approx(scores[key]["test x2"] / oracle[key])
    assert set(scores["oracle"]) == {"test x2"}  # the single sentences' own group has none
    # all single sentences perfect: the oracle is the references themselves
    perfect = [(r, r, r) for r in singles] + rows[4:]
    assert compare_decoding.score_decode(Args, data, perfect, refs, refs)[0]["oracle"]["test x2"]["bleu"] == pytest.approx(100)


def test_joined_groups_know_the_single_sentences_they_join():
    lengths = [2, 5, 3, 6, 1, 4, 7, 2, 3, 5, 2]
    test = [(f"s{i}", f"t{i}", " ".join(["w"] * n), " ".join(["v"] * n), f"raw{i}") for i, n in enumerate(lengths)]
    _, _, groups, parts = compare_data.split_by_length(test[:1], test[:1], test, 3, joined=[2, 3, 6, 12])
    assert [name for name, _ in groups] == ["test <= 3", "test > 3", "test x2", "test x3", "test x6"]
    assert list(parts) == ["test x2", "test x3", "test x6"]  # 11 sentences make no group of 12
    lines = [row for _, rows in groups for row in rows]
    singles = len(test)
    for name, rows in groups[2:]:
        assert len(parts[name]) == len(rows) == len(test) // int(name[len("test x"):])
        for row, joined in zip(rows, parts[name]):
            assert all(line < singles for line in joined)  # lines of the single-sentence groups
            assert row == tuple(" ".join(lines[line][field] for line in joined) for field in range(5))


@pytest.mark.parametrize("bad, message", [
    (["--joined-groups", "2", "6"], "--joined-groups names the test groups of --length-split, which is not asked"),
    (["--length-split", "8", "--joined-groups", "1", "6"], "--joined-groups: each is a number N >= 2"),
    (["--concat-max-sentences", "3"], "--concat-max-sentences is read by the variants sinusoidal_concat rope_concat "
                                      "rope_concat_randpos rope_cross_concat, and --variants names none"),
    (["--concat-prob", "0.5"], "--concat-prob is read by the variants"),
    (["--rope-random-positions", "4"], "--rope-random-positions is read by the variants rope_randpos "
                                       "rope_concat_randpos"),
    (["--variants", "rope_concat", "--baseline", "rope_concat", "--concat-max-sentences", "1"],
     "--concat-max-sentences must be a number K >= 2"),
    (["--variants", "rope_concat", "--baseline", "rope_concat", "--concat-prob", "0"], "--concat-prob must be"),
    (["--variants", "rope_randpos", "--baseline", "rope_randpos", "--rope-random-positions", "1"],
     "--rope-random-positions must be a number R > 1"),
])
def test_options_of_the_long_input_recipes_that_would_change_nothing_are_refused(capsys, bad, message):
    with pytest.raises(SystemExit) as stop:
        compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", *bad])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_the_long_input_recipes_train_through_the_recipes_knob_and_the_plugins_flag():
    args = compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--length-split", "8", "--joined-groups", "8", "2",
                               "6", "3", "--variants", "rope", "sinusoidal_concat", "rope_concat",
                               "rope_concat_randpos", "--baseline", "rope_concat", "--concat-prob", "0.3",
                               "--extrapolation-scaling", "dynamic-yarn"])
    assert args.joined_groups == [2, 3, 6, 8] and args.variants[0] == "rope_concat"
    concat = compare_runs.run_settings(args, "rope_concat", 1)
    assert concat["arch"] == "transformer_rope_tiny" and concat["flags"] == []
    assert concat["recipe_env"]["CONCAT_MAX_SENTENCES"] == "3" and concat["recipe_env"]["CONCAT_PROB"] == "0.3"
    assert compare_runs.run_settings(args, "sinusoidal_concat", 1)["arch"] == "transformer_tiny"
    both = compare_runs.run_settings(args, "rope_concat_randpos", 1)
    assert both["flags"] == ["--rope-random-positions", "4"] and both["recipe_env"] == concat["recipe_env"]
    # the encodings' runs have the settings they had: a rerun reuses their trained models
    plain = compare_runs.run_settings(args, "rope", 1)
    assert plain["flags"] == [] and not any(k.startswith("CONCAT") for k in plain["recipe_env"])
    # the joined groups decide the test set: a decode of other groups is made again
    assert compare_decoding.decode_settings(args, None)["joined_groups"] == [2, 3, 6, 8]
    assert set(compare_decoding.extra_decodes(args, "rope_concat_randpos")) == {"", "+dynamic-yarn"}
    assert set(compare_decoding.extra_decodes(args, "sinusoidal_concat")) == {""}
    # RoPE in the encoder-decoder attention too, named only: with and without concatenation
    cross = compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--variants", "rope_cross", "rope_cross_concat",
                                "--baseline", "rope_cross"])
    assert compare_runs.run_settings(cross, "rope_cross", 1)["flags"] == ["--rope-cross-attention"]
    cross_concat = compare_runs.run_settings(cross, "rope_cross_concat", 1)
    assert cross_concat["flags"] == ["--rope-cross-attention"] and cross_concat["recipe_env"]["CONCAT_MAX_SENTENCES"] == "3"
    default = compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o"])
    assert default.variants == ["sinusoidal", "learned", "none", "rpe", "rope", "roper", "rope_linear"]
    assert "joined_groups" not in compare_decoding.decode_settings(default, None)  # no length split: no groups
    assert compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--length-split", "8"]).joined_groups == [2, 3]


def test_a_recipes_variant_takes_settings_of_its_own():
    """rope_concat@concat-max-sentences=8 beside rope_concat: one comparison, one baseline, each
    run with its own K; a run of the same model under another name is reused (same settings)."""
    args = compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--variants", "rope",
                               "rope_concat@concat-prob=0.20,concat-max-sentences=16", "rope_concat",
                               "rope_concat_randpos@rope-random-positions=2", "--baseline", "rope_concat",
                               "--concat-max-sentences", "8"])
    own = "rope_concat@concat-max-sentences=16,concat-prob=0.2"  # canonical: the options' order, numbers as %g
    assert args.variants == ["rope_concat", "rope", own, "rope_concat_randpos@rope-random-positions=2"]
    env = {v: compare_runs.run_settings(args, v, 1)["recipe_env"] for v in args.variants}
    assert (env["rope_concat"]["CONCAT_MAX_SENTENCES"], env["rope_concat"]["CONCAT_PROB"]) == ("8", "0.5")
    assert (env[own]["CONCAT_MAX_SENTENCES"], env[own]["CONCAT_PROB"]) == ("16", "0.2")
    randpos = compare_runs.run_settings(args, "rope_concat_randpos@rope-random-positions=2", 1)
    assert randpos["flags"] == ["--rope-random-positions", "2"] and randpos["recipe_env"] == env["rope_concat"]
    assert set(compare_decoding.extra_decodes(args, own)) == {""} and compare_variants.variant_spec(own).family == "transformer_rope"
    renamed = compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--variants",
                                  "rope_concat@concat-max-sentences=8", "--baseline", "rope_concat@concat-max-sentences=8"])
    assert compare_runs.run_settings(renamed, renamed.variants[0], 1) == compare_runs.run_settings(args, "rope_concat", 1)
    # joins from a later epoch: train.sh's CONCAT_FROM_EPOCH, absent at its default (the runs made before it)
    later = compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--variants", "rope_concat",
                                "rope_concat@concat-from-epoch=5", "--baseline", "rope_concat"])
    assert compare_runs.run_settings(later, "rope_concat@concat-from-epoch=5", 1)["recipe_env"]["CONCAT_FROM_EPOCH"] == "5"
    assert "CONCAT_FROM_EPOCH" not in compare_runs.run_settings(later, "rope_concat", 1)["recipe_env"]


@pytest.mark.parametrize("variants, message", [
    (["rope@concat-prob=0.2"], "--variants rope@concat-prob=0.2: rope reads no concat-prob: it is an option of the "
                               "variants sinusoidal_concat rope_concat rope_concat_randpos rope_cross_concat"),
    (["rope_concat@k=8"], "'k=8' is not OPTION=VALUE with OPTION one of concat-max-sentences, concat-prob, "
                          "concat-from-epoch, rope-random-positions"),
    (["rope_concat@concat-from-epoch=0"], "concat-from-epoch must be an epoch number >= 1, got 0"),
    (["rope_concat@"], "'' is not OPTION=VALUE"),
    (["rope_concat@concat-max-sentences=8.5"], "concat-max-sentences takes a whole number, got '8.5'"),
    (["rope_concat@concat-max-sentences=1"], "concat-max-sentences must be a number K >= 2"),
    (["rope_concat@concat-prob=0,concat-max-sentences=4"], "concat-prob must be a probability in (0, 1]"),
    (["rope_concat@concat-prob=0.2,concat-prob=0.3"], "concat-prob is given twice"),
    (["rope_cat"], "--variants rope_cat: unknown variant 'rope_cat': choose from sinusoidal, learned"),
    (["rope_concat", "rope_concat@concat-max-sentences=3"],
     "--variants rope_concat and rope_concat@concat-max-sentences=3 train the same model: drop one"),
    (["rope_concat@concat-prob=0.2", "--concat-prob", "0.3"],
     "--concat-prob is read by no variant of --variants: rope_concat@concat-prob=0.2 set their own; drop it"),
    # a start and a budget of its own
    (["sinusoidal", "rope@init-from=learned"],
     "--variants rope@init-from=learned: init-from=learned is not among --variants: add learned"),
    (["sinusoidal", "rope@init-from=rope_concat@concat-max-sentences=8"],
     "init-from must be the plain name of another variant of --variants, got rope_concat@concat-max-sentences=8"),
    (["sinusoidal", "rope@init-from=sinus"], "init-from must be the plain name of another variant of --variants, "
                                             "got sinus"),
    (["sinusoidal", "rope@max-update=0"], "max-update must be a number of updates >= 1, got 0"),
    (["sinusoidal", "rope@warmup-updates=-1"], "warmup-updates must be a number of updates >= 0, got -1"),
    (["sinusoidal", "rope@max-update=1e3"], "max-update takes a whole number, got '1e3'"),
])
def test_a_variants_own_settings_are_checked_as_the_flags_are(capsys, variants, message):
    with pytest.raises(SystemExit) as stop:
        compare_cli.parse_args(["--raw-dir", "x", "--out-dir", "o", "--baseline", variants[0], "--variants", *variants])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_variant_can_start_from_another_variants_model():
    """rope_cross_concat@init-from=sinusoidal,max-update=150: the sinusoidal run of the same seed,
    fine-tuned for 150 updates, with that budget's warm-up and checkpoints; the runs from scratch
    keep the settings they had (a rerun reuses them)."""
    common = ["--raw-dir", "x", "--out-dir", "o", "--max-update", "1500", "--baseline", "sinusoidal"]
    tuned = "rope_cross_concat@concat-max-sentences=16,init-from=sinusoidal,max-update=150"
    args = compare_cli.parse_args([*common, "--variants", "rope", "rope_cross_concat@max-update=150,init-from=sinusoidal,"
                               "concat-max-sentences=16", "sinusoidal", "rope_cross_concat@init-from=rope,"
                               "max-update=375,warmup-updates=0"])
    assert args.variants == ["sinusoidal", "rope", tuned, "rope_cross_concat@init-from=rope,max-update=375,warmup-updates=0"]
    env = compare_runs.run_settings(args, tuned, 1)["recipe_env"]
    assert (env["MAX_UPDATE"], env["WARMUP_UPDATES"], env["SAVE_INTERVAL_UPDATES"], env["LOG_INTERVAL"]) == (
        "150", "15", "15", "3")
    assert env["CONCAT_MAX_SENTENCES"] == "16"
    own_warmup = compare_runs.run_settings(args, args.variants[3], 1)["recipe_env"]
    assert (own_warmup["MAX_UPDATE"], own_warmup["WARMUP_UPDATES"], own_warmup["SAVE_INTERVAL_UPDATES"]) == (
        "375", "0", "37")
    # a start's model decides the run: its sha256 is in the settings a rerun compares
    assert compare_runs.run_settings(args, tuned, 1, "ab")["init_from"] == {"variant": "sinusoidal", "sha256": "ab"}
    assert compare_runs.run_settings(args, tuned, 1, "ab") != compare_runs.run_settings(args, tuned, 1, "cd")
    alone = compare_cli.parse_args([*common, "--variants", "sinusoidal", "rope"])
    for plain in ("sinusoidal", "rope"):
        assert compare_runs.run_settings(args, plain, 1) == compare_runs.run_settings(alone, plain, 1)
        assert "init_from" not in compare_runs.run_settings(args, plain, 1)
    # each start before the first run that starts from it, the order of --variants kept otherwise
    later_start = compare_cli.parse_args([*common, "--variants", "sinusoidal", "rope_cross@init-from=rope", "rope_concat",
                                      "rope"])
    assert compare_variants.in_training_order(later_start) == ["sinusoidal", "rope", "rope_cross@init-from=rope",
                                                      "rope_concat"]
    # given budgets hold for every variant; else a fine-tuning's own come from its max-update
    given = compare_cli.parse_args([*common, "--variants", "sinusoidal", "rope@init-from=sinusoidal,max-update=150",
                                "--warmup-updates", "40", "--save-interval-updates", "50"])
    env = compare_runs.run_settings(given, given.variants[1], 1)["recipe_env"]
    assert (env["MAX_UPDATE"], env["WARMUP_UPDATES"], env["SAVE_INTERVAL_UPDATES"]) == ("150", "40", "50")


@pytest.mark.e2e
def test_fine_tuning_the_long_input_recipes_and_a_failing_decode_end_to_end(tiny_data_bin, tmp_path):
    """One harness, three variants (a run each costs seconds of starting fairseq):
    * sinusoidal, then fine-tuned into rope_cross_concat through train.sh's INIT_FROM: the start
      is the sinusoidal run's averaged model of the same seed, recorded in the new checkpoint and in
      the report with the updates both spent;
    * rope_concat_randpos, trained through train.sh's concatenation knob with the plugin's
      --rope-random-positions, decoded and scored with the oracle like any variant;
    * a decode that fails keeps its trained model (the next call decodes it without training), and
      no run starts after it; a rerun reuses every run."""
    import torch

    out = tmp_path / "compare"
    tuned = "rope_cross_concat@init-from=sinusoidal,max-update=2"
    # its own settings in its name: the run's directory, fairseq-train's --save-dir and fairseq-generate's --path
    # (which splits at ':') take the name as it is
    randpos = "rope_concat_randpos@concat-prob=1,rope-random-positions=3"
    command = [COMPARE, "--raw-dir", tiny_data_bin, "--out-dir", out, "--variants", tuned, "sinusoidal", randpos,
               "--baseline", "sinusoidal", *TINY_RUN, "--length-split", "6", "--joined-groups", "2"]

    failed = run_cli([*command, "--generate-args", "--no-such-option"], check=False, timeout=300)
    assert failed.returncode != 0 and "unrecognized arguments: --no-such-option" in failed.stderr
    assert "sinusoidal seed 1: training" in failed.stdout
    assert f"{tuned} seed 1: training" not in failed.stdout and f"{randpos} seed 1: training" not in failed.stdout
    proc = run_cli(command, timeout=500)
    assert "sinusoidal seed 1: training" not in proc.stdout and "sinusoidal seed 1: reusing the trained model" in proc.stdout
    assert "sinusoidal seed 1: done in" in proc.stdout

    start = out / "runs" / "sinusoidal" / "seed1" / "averaged.pt"
    run_dir = out / "runs" / tuned / "seed1"
    first_line = (run_dir / "train.log").read_text().splitlines()[0]
    assert f"INIT_FROM={start}" in first_line and "MAX_UPDATE=2" in first_line
    cfg = torch.load(run_dir / "averaged.pt", map_location="cpu", weights_only=False)["cfg"]
    origin = cfg["model"]["rope_init_from"]
    assert origin["path"] == str(start) and origin["arch"] == "transformer_tiny"
    assert origin["sha256"] == hashlib.sha256(start.read_bytes()).hexdigest()
    report = json.loads((out / "results.json").read_text())
    run = report["results"][tuned][0]
    assert run["updates"] == {"own": 2, "total": 6} and run["settings"]["init_from"]["sha256"] == origin["sha256"]
    table = (out / "results.md").read_text()
    assert f"| `{tuned}` |" in table and "| 2 (6) |" in table
    assert (f"`{tuned}`: MAX_UPDATE=2 CONCAT_MAX_SENTENCES=3 CONCAT_PROB=0.5 INIT_FROM=sinusoidal "
            "--rope-cross-attention") in table

    run_dir = out / "runs" / randpos / "seed1"
    train_log = (run_dir / "train.log").read_text()
    assert "CONCAT_MAX_SENTENCES=3" in train_log.splitlines()[0] and "CONCAT_PROB=1" in train_log.splitlines()[0]
    assert "train.sh --rope-random-positions 3" in train_log.splitlines()[0]
    assert "'concat_from_epoch': 1" in train_log  # train.sh passes CONCAT_FROM_EPOCH (default 1) to the task
    assert "training pairs joined with 1 to 2 others (--concat-prob 1, --concat-max-sentences 3)" in train_log
    cfg = torch.load(run_dir / "averaged.pt", map_location="cpu", weights_only=False)["cfg"]
    assert cfg["task"]["_name"] == "translation_concat" and cfg["model"]["rope_random_positions"] == 3.0
    assert cfg["model"]["rope_trained_length"] > 7  # pairs of at most 6 words (+ EOS) were joined
    assert set(report["results"][randpos][0]["decodes"][""]["oracle"]) == {"test x2"}
    assert f"`{randpos}`: CONCAT_MAX_SENTENCES=3 CONCAT_PROB=1 --rope-random-positions 3" in table

    again = run_cli(command, timeout=300).stdout
    for variant in (tuned, "sinusoidal", randpos):
        assert f"{variant} seed 1: done before, reusing" in again


def test_every_size_of_every_family_is_a_registered_architecture():
    """--size names each family's architecture by a rule (variants.architecture), with no fairseq
    loaded: every name it gives is in fairseq's registry once the plugin has registered its own."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    import fairseq_rope  # noqa: F401  (registers transformer_rope*, transformer_rpe*)

    families = {variant.family for variant in compare_variants.VARIANTS.values()}
    named = {compare_variants.architecture(family, size) for family in families for size in compare_variants.SIZES}
    assert len(named) == len(families) * len(compare_variants.SIZES)
    assert sorted(named - set(ARCH_MODEL_REGISTRY)) == []
