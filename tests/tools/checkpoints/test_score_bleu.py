"""fairseq-rope-score: compound-split tokenized BLEU and sacreBLEU on hand-checked files."""

import json
import math
import signal
import subprocess

import pytest

from fairseq_rope_tools import metrics
from fairseq_rope_tools.checkpoints import score_bleu


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_compound_split_is_the_standard_rewrite():
    assert metrics.compound_split("ein gut-bekannter Test") == "ein gut ##AT##-##AT## bekannter Test"
    # Moses -a output: the "@-@" token itself is rewritten, as fairseq's compound_split_bleu.sh does
    assert metrics.compound_split("gut @-@ bekannter") == "gut @ ##AT##-##AT## @ bekannter"
    # no rewrite next to spaces; non-overlapping matches like perl's s///g
    assert metrics.compound_split("a - b -c d-") == "a - b -c d-"
    assert metrics.compound_split("a-b-c") == "a ##AT##-##AT## b-c"


def test_tokenized_bleu_by_hand():
    # hyp drops one "the": n-gram matches 5/5, 3/4, 2/3, 1/2; BP = exp(1 - 6/5)
    score, _ = metrics.tokenized_bleu(["the cat sat on mat"], ["the cat sat on the mat"])
    expected = 100 * math.exp(1 - 6 / 5) * (5 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25
    assert score.score == pytest.approx(expected, abs=1e-6)
    assert score.sys_len == 5 and score.ref_len == 6


def test_compound_splitting_changes_the_score_as_computed_by_hand():
    ref = ["das ist ein gut-bekannter Test für alle"]
    hyp = ["das ist ein gut-erzogener Test für alle"]
    # after splitting, 9 tokens each; matches 8/9, 6/8, 4/7, 2/6
    score, _ = metrics.tokenized_bleu(hyp, ref)
    assert score.score == pytest.approx(100 * (8 / 9 * 6 / 8 * 4 / 7 * 2 / 6) ** 0.25, abs=1e-6)
    assert score.sys_len == 9
    # without the split no 4-gram matches: multi-bleu (no smoothing) gives 0
    from sacrebleu.metrics import BLEU

    unsplit = BLEU(tokenize="none", smooth_method="none", force=True).corpus_score(hyp, [ref])
    assert unsplit.score == 0.0


def test_cli_both_scores_and_files(tmp_path, capsys):
    hyp = _write(tmp_path / "hyp.tok.de", [
        "Das ist ein gut @-@ bekannter Test , oder ?",
        "Der Hund sieht die Katze .",
    ])
    ref = _write(tmp_path / "ref.tok.de", [
        "Das ist ein gut @-@ bekannter Test , oder ?",
        "Der Hund sieht die Katze .",
    ])
    raw = _write(tmp_path / "ref.de", ["Das ist ein gut-bekannter Test, oder?", "Der Hund sieht die Katze."])
    out_json = tmp_path / "scores.json"
    detok = tmp_path / "hyp.detok.de"
    score_bleu.run(["--hyp", str(hyp), "--ref", str(ref), "--raw-ref", str(raw), "--lang", "de",
                     "--out-json", str(out_json), "--detok-out", str(detok)])
    printed = capsys.readouterr().out
    assert "Tokenized BLEU (compound split): 100.00" in printed
    assert "sacreBLEU: 100.00" in printed
    assert "chrF++: 100.00" in printed
    # the Moses detokenizer undoes "@-@" and the spaces before punctuation
    assert detok.read_text(encoding="utf-8").splitlines() == raw.read_text(encoding="utf-8").splitlines()
    result = json.loads(out_json.read_text())
    assert result["tokenized_bleu_compound_split"]["score"] == 100.0
    sig = result["sacrebleu"]["signature"]
    assert "nrefs:1" in sig and "tok:13a" in sig and "version:" in sig
    assert result["chrf++"]["score"] == 100.0 and "nw:2" in result["chrf++"]["signature"]  # chrF++: word bigrams
    assert not list(tmp_path.glob("*.tmp"))


def test_cli_sacrebleu_by_hand(tmp_path, capsys):
    # 13a tokenization: "mat." -> "mat ." ; hyp "the cat sat on mat ." vs ref "the cat sat on the mat ."
    hyp = _write(tmp_path / "hyp", ["the cat sat on mat ."])
    ref = _write(tmp_path / "ref", ["the cat sat on the mat ."])
    raw = _write(tmp_path / "raw", ["the cat sat on the mat."])
    result = score_bleu.run(["--hyp", str(hyp), "--ref", str(ref), "--raw-ref", str(raw), "--lang", "en"])
    # 6 hypothesis tokens, 7 reference tokens. 2-grams: "on mat" is the only miss (4/5); 3-grams:
    # "the cat sat", "cat sat on" match, "sat on mat", "on mat ." do not (2/4); 4-grams: only
    # "the cat sat on" (1/3). Smoothing does not matter: no precision is zero.
    expected = 100 * math.exp(1 - 7 / 6) * (6 / 6 * 4 / 5 * 2 / 4 * 1 / 3) ** 0.25
    assert result["sacrebleu"]["score"] == pytest.approx(expected, abs=0.01)
    assert result["tokenized_bleu_compound_split"]["score"] == pytest.approx(expected, abs=0.01)
    # chrF++ of the detokenized hypothesis against the raw reference, as sacreBLEU computes it
    import sacrebleu

    chrf_pp = sacrebleu.corpus_chrf(["the cat sat on mat."], [["the cat sat on the mat."]], word_order=2)
    assert result["chrf++"]["score"] == pytest.approx(chrf_pp.score, abs=0.01)


def test_score_all_is_what_the_cli_computes(tmp_path):
    """The importable scoring (used by fairseq-rope-compare) and the CLI agree."""
    hyps = ["Der Hund sieht die Katze .", "Das ist ein gut @-@ bekannter Test ."]
    refs = ["Der Hund sieht eine Katze .", "Das ist ein gut @-@ bekannter Test ."]
    raw = ["Der Hund sieht eine Katze.", "Das ist ein gut-bekannter Test."]
    scores, detok = metrics.score_all(hyps, refs, raw, "de")
    assert detok == ["Der Hund sieht die Katze.", "Das ist ein gut-bekannter Test."]
    cli = score_bleu.run(["--hyp", str(_write(tmp_path / "h", hyps)), "--ref", str(_write(tmp_path / "r", refs)),
                           "--raw-ref", str(_write(tmp_path / "raw", raw)), "--lang", "de"])
    assert scores == cli and 0 < scores["chrf++"]["score"] < 100
    assert metrics.score_all(hyps, refs)[0] == {"tokenized_bleu_compound_split": cli["tokenized_bleu_compound_split"]}


def test_cli_tokenize_option(tmp_path):
    hyp = _write(tmp_path / "hyp", ["Ein gut-bekannter Test, oder?"])
    ref = _write(tmp_path / "ref", ["Ein gut-bekannter Test, oder?"])
    result = score_bleu.run(["--hyp", str(hyp), "--ref", str(ref), "--tokenize", "--lang", "de"])
    assert result["tokenized_bleu_compound_split"]["score"] == 100.0
    # tokenized with -a: Ein gut @ ##AT##-##AT## @ bekannter Test , oder ?
    assert result["tokenized_bleu_compound_split"]["sys_len"] == 10


def stopped(argv, capsys, status):
    """The one line ``fairseq-rope-score argv`` stops with (its exit status checked), and what it printed."""
    with pytest.raises(SystemExit) as e:
        score_bleu.main(argv)
    assert e.value.code == status
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and ": error: " in captured.err, captured.err
    return captured.err.split(": error: ", 1)[1].rstrip("\n"), captured.out


def test_cli_refuses_files_of_different_length(tmp_path, capsys):
    hyp = _write(tmp_path / "hyp", ["a b", "c d"])
    ref = _write(tmp_path / "ref", ["a b"])
    message, _ = stopped(["--hyp", str(hyp), "--ref", str(ref)], capsys, status=1)
    assert message == f"{hyp} has 2 lines but {ref} has 1; they must be parallel"


@pytest.mark.parametrize("flag", ["--out-json", "--detok-out"])
def test_an_output_that_cannot_be_written_is_refused_before_scoring(tmp_path, capsys, flag):
    hyp = _write(tmp_path / "hyp", ["a b c"])
    raw = _write(tmp_path / "raw", ["a b c"])
    args = ["--hyp", str(hyp), "--ref", str(hyp), "--raw-ref", str(raw)]
    missing = tmp_path / "no-such-dir" / "out"
    message, printed = stopped([*args, flag, str(missing)], capsys, status=2)
    assert message == (f"{flag} {missing}: directory {missing.parent} does not exist: create it, or give a file in an "
                       "existing one")
    assert printed == ""  # nothing scored
    message, _ = stopped([*args, flag, str(tmp_path)], capsys, status=2)
    assert message == f"{flag} {tmp_path} is a directory: give a file"


@pytest.mark.parametrize("flag, over", [("--out-json", "--hyp"), ("--detok-out", "--raw-ref"), ("--out-json", "--ref")])
def test_an_output_over_an_input_is_refused(tmp_path, capsys, flag, over):
    inputs = {"--hyp": _write(tmp_path / "hyp", ["a b c"]), "--ref": _write(tmp_path / "ref", ["a b c"]),
              "--raw-ref": _write(tmp_path / "raw", ["a b c"])}
    link = tmp_path / "link"
    link.symlink_to(inputs[over])  # the same file under another name
    before = {path: path.read_bytes() for path in inputs.values()}
    argv = [arg for name, path in inputs.items() for arg in (name, str(path))]
    message, _ = stopped([*argv, flag, str(link)], capsys, status=2)
    assert message == f"{flag} {link} is {over} {inputs[over]}: the output would overwrite its own input; give another output"
    assert {path: path.read_bytes() for path in inputs.values()} == before


def test_the_scores_and_the_hypotheses_are_two_files(tmp_path, capsys):
    hyp = _write(tmp_path / "hyp", ["a b c"])
    raw = _write(tmp_path / "raw", ["a b c"])
    out = tmp_path / "out"
    message, _ = stopped(["--hyp", str(hyp), "--ref", str(hyp), "--raw-ref", str(raw), "--out-json", str(out),
                          "--detok-out", str(out)], capsys, status=2)
    assert message.startswith(f"--out-json {out} and --detok-out {out} are the same file")


def test_detok_out_is_written_without_a_raw_reference(tmp_path):
    """Detokenizing needs no reference: --detok-out without --raw-ref is not ignored."""
    hyp = _write(tmp_path / "hyp", ["Das ist ein gut @-@ bekannter Test , oder ?"])
    score_bleu.main(["--hyp", str(hyp), "--ref", str(hyp), "--detok-out", str(tmp_path / "detok")])
    assert (tmp_path / "detok").read_text(encoding="utf-8") == "Das ist ein gut-bekannter Test, oder?\n"


def _run(*args):
    from support.commands import run_cli

    return run_cli(["fairseq-rope-score", *args], check=False, timeout=120)


def _one_line_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fairseq-rope-score: error: "), proc.stderr
    for needle in needles:
        assert str(needle) in lines[0], (needle, lines[0])


@pytest.mark.e2e
def test_cli_bad_files_are_one_clear_line(tmp_path):
    hyp = _write(tmp_path / "hyp", ["a b c", "d e f"])
    ref = _write(tmp_path / "ref", ["a b c", "d e f"])
    empty_hyp, empty_ref = _write(tmp_path / "empty.hyp", []), _write(tmp_path / "empty.ref", [])
    _one_line_error(_run("--hyp", empty_hyp, "--ref", empty_ref), empty_hyp, empty_ref, "empty")
    missing = tmp_path / "no-such-file"
    _one_line_error(_run("--hyp", missing, "--ref", ref), missing, "No such file")
    _one_line_error(_run("--hyp", hyp, "--ref", ref, "--raw-ref", missing), missing)
    latin1 = tmp_path / "ref.latin1"
    latin1.write_bytes(b"a b c\nd \xe9 f\n")
    _one_line_error(_run("--hyp", hyp, "--ref", latin1), f"{latin1}: line 2", "UTF-8")


@pytest.mark.e2e
@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_reader_that_goes_away_ends_the_scorer_quietly(tmp_path, unbuffered):
    """``fairseq-rope-score ... | head -1``, the reader gone before the scores are printed: the
    command ends with the status of a killed pipe writer and nothing on stderr, its files written;
    whether Python writes each line at once (PYTHONUNBUFFERED) or at the end."""
    from support.commands import cli_command

    hyp = _write(tmp_path / "hyp", ["a b c d e", "f g h i j"])
    raw = _write(tmp_path / "raw", ["a b c d e", "f g h i j"])
    cmd, env = cli_command(["fairseq-rope-score", "--hyp", hyp, "--ref", hyp, "--raw-ref", raw,
                            "--out-json", tmp_path / "scores.json"], {"PYTHONUNBUFFERED": unbuffered})
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # long before the scorer has imported sacreBLEU and scored
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE
    assert proc.stderr.read() == ""
    assert json.loads((tmp_path / "scores.json").read_text())["sacrebleu"]["score"] == 100.0
