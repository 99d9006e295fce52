"""scripts/compare_position_encodings.py end to end on a tiny budget: length split, training,
checkpoint averaging, decoding (also with RoPE scaling overrides), table, plots, resume."""

import importlib.util
import json
import sys
import time

import pytest

from conftest import REPO, run_cli

SCRIPT = REPO / "scripts" / "compare_position_encodings.py"
spec = importlib.util.spec_from_file_location("compare_position_encodings", SCRIPT)
harness = importlib.util.module_from_spec(spec)
spec.loader.exec_module(harness)

PNG = b"\x89PNG\r\n\x1a\n"


def test_harness_end_to_end_with_length_split(tiny_data_bin, tmp_path):
    out = tmp_path / "compare"
    args = [sys.executable, SCRIPT, "--raw-dir", tiny_data_bin, "--out-dir", out,
            "--variants", "rope", "sinusoidal", "--seeds", "1", "--max-update", "4", "--max-tokens", "600",
            "--average-last", "2", "--save-interval-updates", "2", "--length-split", "6",
            "--length-buckets", "6", "12", "--extrapolation-scaling", "yarn:3", "--batch-size", "100"]
    run_cli(args, timeout=300)

    # the length split: training pairs are short, test groups are what their names say
    lengths = lambda path: [len(line.split()) for line in path.read_text().splitlines()]  # noqa: E731
    assert max(lengths(out / "text" / "train.en")) <= 6 and max(lengths(out / "text" / "valid.de")) <= 6
    groups = json.loads((out / "data-bin" / "test_groups.json").read_text())
    assert list(groups) == ["test <= 6", "test > 6", "test x2", "test x3"]
    test_lengths = lengths(out / "text" / "test.en")
    (a, b), (c, d) = groups["test <= 6"], groups["test > 6"]
    assert all(n <= 6 for n in test_lengths[a:b]) and all(n > 6 for n in test_lengths[c:d])
    x3 = groups["test x3"]
    assert min(test_lengths[x3[0]:x3[1]]) >= 6  # three sentences of at least 2 tokens
    assert x3[1] == len(test_lengths)

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
    assert set(rope["decodes"]) == {"", "+yarnx3"} and set(sinusoidal["decodes"]) == {""}
    generate_log = (out / "runs" / "rope" / "seed1" / "generate+yarnx3.log").read_text()
    assert "rope_scaling" in generate_log.splitlines()[0]  # the override reached fairseq-generate
    assert not (out / "runs" / "rope" / "seed1" / "checkpoints").exists()

    table = (out / "results.md").read_text()
    for row in ("`rope`", "`rope+yarnx3`", "`sinusoidal`", "BLEU test x3", "train tokens/s"):
        assert row in table
    for png in ("valid_loss.png", "bleu_by_length.png"):
        assert (out / png).read_bytes()[:8] == PNG

    # a second call reuses finished runs instead of training again
    started = time.time()
    proc = run_cli(args, timeout=120)
    assert proc.stdout.count("reusing") == 2
    assert time.time() - started < 60


def test_parse_train_log_and_concatenation():
    log = "\n".join([
        "2026-01-01 | INFO | fairseq_cli.train | num. shared model params: 1,234 (num. trained: 1,234)",
        '2026-01-01 | INFO | train_inner | {"epoch": 1, "loss": "9", "wps": "100", "num_updates": "1"}',
        '2026-01-01 | INFO | train_inner | {"epoch": 1, "loss": "8", "wps": "300", "num_updates": "2"}',
        '2026-01-01 | INFO | valid | {"epoch": 1, "valid_loss": "7.5", "valid_nll_loss": "7", "valid_num_updates": "2"}',
        '2026-01-01 | INFO | valid | {"epoch": 1, "valid_loss": "6.5", "valid_nll_loss": "6", "valid_num_updates": "4"}',
    ])
    parsed = harness.parse_train_log(log)
    assert parsed["params"] == 1234 and parsed["tokens_per_second"] == 200
    assert parsed["valid_curve"] == [[2, 7.5, 7.0], [4, 6.5, 6.0]] and parsed["valid_loss"] == 6.5
    pairs = [(["a"], ["A"]), (["b"], ["B"]), (["c"], ["C"]), (["d"], ["D"]), (["e"], ["E"])]
    assert harness.concatenated(pairs, 2) == [(["a", "b"], ["A", "B"]), (["c", "d"], ["C", "D"])]


def test_bucketed_scores():
    outputs = {0: ("x y", "a b c d", "a b c d"), 1: ("x y z w", "q r s t", "a b c d")}
    scores = harness.score(outputs, {"test": [0, 2]}, [2])
    assert scores["bleu_by_length"]["1-2"] == {"bleu": pytest.approx(100.0), "sentences": 1}
    assert scores["bleu_by_length"][">2"]["bleu"] == pytest.approx(0.0)


@pytest.mark.parametrize("bad", [["--data-bin", "x", "--length-split", "5"],
                                 ["--raw-dir", "x", "--extrapolation-scaling", "rope:2"]])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(SystemExit):
        harness.parse_args([*bad, "--out-dir", "o"])


def test_plot_rope_decay_redraws_fig2(tmp_path):
    png, csv = tmp_path / "decay.png", tmp_path / "decay.csv"
    run_cli([sys.executable, REPO / "scripts" / "plot_rope_decay.py", "--out", png, "--csv", csv,
             "--dim", "128", "--max-distance", "256"])
    assert png.read_bytes()[:8] == PNG
    rows = [line.split(",") for line in csv.read_text().splitlines()[1:]]
    bound = [float(b) for _, b in rows]
    assert len(bound) == 257
    assert bound[0] == pytest.approx(32.5)  # distance 0: mean of |S_j| = j over j = 1..64
    assert max(bound[200:]) < bound[20] < bound[0]  # decays with distance (Fig. 2)


def test_raw_text_is_read_strictly_and_stays_aligned(tmp_path):
    """A \\r or U+2028 inside a line is a space, not a line break (which would pair sentences with
    the translations of others); a side with another number of lines or invalid UTF-8 is refused."""
    (tmp_path / "train.en").write_bytes("a b\rc\nd e\nf\n".encode())
    (tmp_path / "train.de").write_bytes("A B C\nD\u2028E\nF\n".encode())
    assert harness.read_pairs(tmp_path, "train", "en", "de") == [
        (["a", "b", "c"], ["A", "B", "C"]), (["d", "e"], ["D", "E"]), (["f"], ["F"])]
    (tmp_path / "valid.en").write_text("a\nb\n")
    (tmp_path / "valid.de").write_text("A\n")
    with pytest.raises(SystemExit) as e:
        harness.main(["--raw-dir", str(tmp_path), "--out-dir", str(tmp_path / "out")])
    assert "valid.en (2 lines)" in str(e.value) and "not parallel" in str(e.value)
    (tmp_path / "valid.de").write_bytes(b"A\n\xe9\n")
    with pytest.raises(SystemExit) as e:
        harness.main(["--raw-dir", str(tmp_path), "--out-dir", str(tmp_path / "out")])
    assert f"{tmp_path / 'valid.de'}: line 2: invalid UTF-8" in str(e.value)
