"""fairseq-rope-translate and evaluate.sh ENGINE=ctranslate2 on a tiny model trained through the
recipe (the small quickstart's: prepare.sh on a generated corpus, RoPE): raw text in, the
recipe's tokenisation and BPE, the same hypotheses from CTranslate2, fairseq's hub interface and
fairseq-generate; CRLF, in-line \\r and invalid UTF-8 handled or refused by name; the same BLEU
from both engines in evaluate.sh, and a rerun that does not export again."""

import json
import re
import shutil

import pytest
from support.commands import BIN, REPO, run_cli
from support.quickstart import shared_quickstart

from fairseq_rope_tools.deploy import exported, segmentation, work_dir

ctranslate2 = pytest.importorskip("ctranslate2")

TRANSLATE = "fairseq-rope-translate"
EVALUATE = REPO / "examples" / "wmt14_en_de" / "evaluate.sh"
EXPORT = "fairseq-rope-export"


def _lines(path):
    return path.read_text(encoding="utf-8").split("\n")[:-1]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A prepared work dir (prepare.sh: subword-nmt, 300 merges) and a RoPE model trained on it
    for 300 updates, enough to translate: the small quickstart's (support/quickstart.py), copied,
    since the tests write beside the model and move the work dir."""
    run = shared_quickstart(tmp_path_factory)
    root = tmp_path_factory.mktemp("translate")
    work = root / "work"
    shutil.copytree(run.work, work, ignore=shutil.ignore_patterns("checkpoints"))
    save_dir = root / "checkpoints"
    save_dir.mkdir()
    shutil.copy2(run.save_dir / "checkpoint_last.pt", save_dir)
    return work, save_dir / "checkpoint_last.pt"


def _evaluate(work, checkpoint, engine, check=True, **knobs):
    return run_cli(["bash", EVALUATE, "--engine", engine], check=check, env={
        "WORK_DIR": str(work), "SAVE_DIR": str(checkpoint.parent), "CHECKPOINT": str(checkpoint), "CPU": "1",
        "THREADS": "1", **knobs})


@pytest.fixture(scope="module")
def evaluated(model):
    """evaluate.sh with both engines: {engine: (eval dir, scores.json, stderr)}; CT2 exports first."""
    work, checkpoint = model
    out = {}
    for engine, suffix in (("fairseq", ""), ("ctranslate2", "_ct2")):
        proc = _evaluate(work, checkpoint, engine)
        eval_dir = checkpoint.parent / f"eval_checkpoint_last_test{suffix}"
        out[engine] = eval_dir, json.loads((eval_dir / "scores.json").read_text()), proc.stderr
    return out


def _translate(*args, check=True, stdin=None):
    cmd = [str(BIN / TRANSLATE), *map(str, args)]
    if stdin is None:
        return run_cli(cmd, check=check)
    import os
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, input=stdin, capture_output=True, env=env, timeout=300)


def _ct2_dir(model):
    """The CTranslate2 export evaluate.sh makes: a test that uses it asks for ``evaluated`` too (a
    pytest worker may run it before the tests that do)."""
    return model[1].parent / "ct2_checkpoint_last"


# --- (a) the same hypotheses from every engine ------------------------------------------------
@pytest.mark.e2e
def test_segmentation_is_the_recipes(model):
    """Raw text -> the recipe's Moses tokenisation and BPE (with vocabulary threshold), token for token."""
    work = model[0]
    segment = segmentation.Segmenter(work_dir.segmentation_of(work, "en", "de", "subword_nmt"))
    assert [segment(line) for line in _lines(work / "raw/test.en")] == [line.split() for line in _lines(work / "bpe/test.en")]
    # normalised and tokenised first (typographic quotes, aggressive hyphen splitting)
    assert segment("He said \u201cthe well-known dog\u201d sees the cat.") == \
        segment.bpe.process_line('He said " the well @-@ known dog " sees the cat .').split()


def test_remove_bpe_is_fairseqs():
    from fairseq.data.data_utils import post_process

    for line, kind in [("Der Hun@@ d sieht die K@@ at@@ ze .", "subword_nmt"), ("a@@", "subword_nmt"),
                       ("\u2581Der \u2581Hu nd \u2581sieht .", "sentencepiece"), ("", "subword_nmt")]:
        assert segmentation.remove_bpe(line, kind) == post_process(line, kind)


@pytest.mark.e2e
def test_both_engines_give_fairseq_generates_translations(model, evaluated, tmp_path):
    """translate.py --engine fairseq (hub interface) and --engine ctranslate2, raw text in, give
    exactly the detokenized hypotheses of fairseq-generate in evaluate.sh; an empty line stays."""
    work, checkpoint = model
    raw = _lines(work / "raw/test.en")
    expected = _lines(evaluated["fairseq"][0] / "hyp.detok.de")
    source = tmp_path / "input.en"
    source.write_text("\n".join(raw[:7] + [""] + raw[7:]) + "\n", encoding="utf-8")
    outputs = {}
    for engine, model_args in (("fairseq", ["--checkpoint", checkpoint]), ("ctranslate2", ["--model-dir", _ct2_dir(model)])):
        out = tmp_path / f"out.{engine}"
        proc = _translate(source, "--work-dir", work, "--engine", engine, *model_args, "--threads", "1",
                          "--batch-size", "6", "--output", out)
        assert f"{len(raw) + 1} lines ({len(raw)} to translate)" in proc.stderr
        # off a terminal, progress in plain lines, no bar: a line after every batch of 6 (a tenth or more)
        said = re.findall(rf"^\[translate\] (\d+)/{len(raw)} sentences translated \(\d+m\d\ds elapsed\)$",
                          proc.stderr, re.M)
        assert said == [str(min(n, len(raw))) for n in range(6, len(raw) + 6, 6)] and "%|" not in proc.stderr
        outputs[engine] = _lines(out)
    assert outputs["ctranslate2"] == outputs["fairseq"]
    same = sum(a == b for a, b in zip(outputs["fairseq"][:7] + outputs["fairseq"][8:], expected))
    assert same == len(expected), f"{same} of {len(expected)} lines as fairseq-generate's"
    assert outputs["fairseq"][7] == ""
    assert len(set(expected)) > len(expected) // 2  # the model has learnt to translate, not one string


@pytest.mark.e2e
def test_the_bundle_alone_translates_raw_text_once_the_work_dir_is_gone(model, evaluated, tmp_path):
    """fairseq-rope-export bundles the work dir's segmentation with the model: with the work dir
    moved away, --model-dir BUNDLE alone gives the translations of the --work-dir form; a bundle
    with one file changed is refused in one line."""
    work, checkpoint = model
    bundle = tmp_path / "bundle"
    proc = run_cli([EXPORT, "--checkpoint", checkpoint, "--data-bin", work / "data-bin", "--output-dir", bundle])
    assert "a bundle with its segmentation (subword_nmt)" in proc.stderr
    assert sorted(p.name for p in bundle.iterdir()) == ["bpe.codes", "bpe.vocab.en", "bundle.json", "config.json",
                                                       "export_info.json", "model.bin", "shared_vocabulary.json"]
    raw = tmp_path / "test.en"
    shutil.copy(work / "raw" / "test.en", raw)
    _translate(raw, "--work-dir", work, "--model-dir", _ct2_dir(model), "--output", tmp_path / "before.de")
    aside = tmp_path / "work_aside"
    work.rename(aside)
    try:
        _translate(raw, "--model-dir", bundle, "--output", tmp_path / "after.de")
    finally:
        aside.rename(work)
    after = _lines(tmp_path / "after.de")
    assert after == _lines(tmp_path / "before.de") == _lines(evaluated["fairseq"][0] / "hyp.detok.de")
    for name, spoil in (("bpe.codes", lambda data: data.replace(b"\n", b"\n\n", 1)),
                        ("model.bin", lambda data: data[:-1] + bytes([data[-1] ^ 1]))):
        changed = tmp_path / f"changed_{name}"
        shutil.copytree(bundle, changed)
        (changed / name).write_bytes(spoil((changed / name).read_bytes()))
        proc = _translate(raw, "--model-dir", changed, check=False)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
            f"fairseq-rope-translate: error: --model-dir {changed}: the bundle does not match its manifest: {name} is "
            "not the file it was exported with (its sha256 is not the one bundle.json records): export it again with "
            "fairseq-rope-export"], proc.stderr


# --- (b) line ends and encodings --------------------------------------------------------------
@pytest.mark.e2e
def test_crlf_and_inline_carriage_returns(model, evaluated, tmp_path):
    work, ct2 = model[0], _ct2_dir(model)
    messy = tmp_path / "messy.en"
    messy.write_bytes(b"The dog sees the cat.\r\nThe friend buys\rthe boat.\r\n\r\nToday the cat sleeps.")
    clean = tmp_path / "clean.en"
    clean.write_bytes(b"The dog sees the cat.\nThe friend buys the boat.\n\nToday the cat sleeps.\n")
    out_messy, out_clean = tmp_path / "messy.de", tmp_path / "clean.de"
    proc = _translate(messy, "--work-dir", work, "--model-dir", ct2, "-o", out_messy)
    assert "1 line had line-break characters" in proc.stderr
    _translate(clean, "--work-dir", work, "--model-dir", ct2, "-o", out_clean)
    data = out_messy.read_bytes()
    assert data == out_clean.read_bytes() and b"\r" not in data
    assert data.count(b"\n") == 4 and data.split(b"\n")[2] == b""
    # stdin, to stdout: the same
    piped = _translate("--work-dir", work, "--model-dir", ct2, stdin=messy.read_bytes())
    assert piped.returncode == 0 and piped.stdout == data


@pytest.mark.e2e
def test_invalid_utf8_is_refused_by_file_and_line(model, evaluated, tmp_path):
    work, ct2 = model[0], _ct2_dir(model)
    bad = tmp_path / "bad.en"
    bad.write_bytes(b"The dog sees the cat.\nThe caf\xe9 is open.\n")
    out = tmp_path / "out" / "bad.de"
    out.parent.mkdir()
    proc = _translate(bad, "--work-dir", work, "--model-dir", ct2, "-o", out, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"fairseq-rope-translate: error: {bad}: line 2: invalid UTF-8 (byte 0xe9 at byte 8 of the line); fix the file, "
        "or pass --replace-invalid-utf8 to replace invalid bytes with U+FFFD")
    assert list(out.parent.iterdir()) == []  # nothing written, no temporary file left
    proc = _translate("--work-dir", work, "--model-dir", ct2, stdin=bad.read_bytes())
    assert proc.returncode == 1 and b"standard input: line 2: invalid UTF-8" in proc.stderr
    assert proc.stdout.count(b"\n") == 1  # a stream: the line before it was translated as it came
    proc = _translate(bad, "--work-dir", work, "--model-dir", ct2, "-o", out, "--replace-invalid-utf8")
    assert f"[translate] {bad}: replaced invalid UTF-8 with U+FFFD in 1 line (first: line 2)" in proc.stderr
    assert len(_lines(out)) == 2


@pytest.mark.e2e
def test_setup_errors_name_the_flag_or_file(model, evaluated, tmp_path):
    work, checkpoint, ct2 = model[0], model[1], _ct2_dir(model)
    text = tmp_path / "in.en"
    text.write_text("The dog sees the cat.\n", encoding="utf-8")
    partial = tmp_path / "partial"
    shutil.copytree(work / "data-bin", partial / "data-bin")
    shutil.copytree(work / "bpe", partial / "bpe")
    (partial / "bpe" / "vocab.en").unlink()
    other = tmp_path / "other_dict"
    shutil.copytree(work / "data-bin", other)
    (other / "dict.en.txt").write_text("x 1\n", encoding="utf-8")
    model_only = tmp_path / "model_only"  # an export without a work dir beside its data-bin
    shutil.copytree(ct2, model_only, ignore=shutil.ignore_patterns("bpe.*", exported.BUNDLE))
    exported.write_bundle(model_only, "en", "de", None)
    cases = [
        ([text, "--work-dir", work], "give --model-dir (what fairseq-rope-export wrote) or --engine fairseq --checkpoint CKPT"),
        ([text, "--work-dir", tmp_path / "nowhere", "--model-dir", ct2], f"--work-dir {tmp_path / 'nowhere'} is not a directory"),
        ([text, "--model-dir", model_only], "--work-dir is needed to tokenize and BPE raw text"),
        ([text, "--work-dir", work, "--model-dir", tmp_path], f"--model-dir {tmp_path}: not a fairseq-rope-export bundle (no bundle.json)"),
        ([text, "--work-dir", work, "--engine", "fairseq", "--checkpoint", tmp_path / "no.pt"],
         f"--checkpoint {tmp_path / 'no.pt'} is not a file"),
        ([text, "--work-dir", partial, "--model-dir", ct2], f"no {partial / 'bpe' / 'vocab.en'} (subword-nmt BPE)"),
        ([text, "--data-bin", other, "--work-dir", work, "--model-dir", ct2],
         f"--model-dir {ct2} was not exported with the dictionary of {other}"),
        ([text, "--work-dir", work, "--model-dir", ct2, "--compute-type", "int3"], "--compute-type int3 is not supported"),
        ([text, "--work-dir", work, "--engine", "fairseq", "--checkpoint", checkpoint, "--compute-type", "int8"],
         "--compute-type int8 is for --engine ctranslate2"),
        ([tmp_path / "missing.en", "--work-dir", work, "--model-dir", ct2], f"input file {tmp_path / 'missing.en'} does not exist"),
        ([text, "--work-dir", work, "--model-dir", ct2, "-o", tmp_path / "no" / "out.de"], "directory"),
    ]
    for args, message in cases:
        proc = _translate(*args, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("fairseq-rope-translate: error: ") and message in lines[0], (args, proc.stderr)


# --- (c) evaluate.sh ENGINE=ctranslate2 --------------------------------------------------------
@pytest.mark.e2e
def test_evaluate_with_ctranslate2_scores_as_fairseq(model, evaluated):
    work, checkpoint = model
    (fs_dir, fs, _), (ct2_dir, ct2, stderr) = evaluated["fairseq"], evaluated["ctranslate2"]
    assert f"wrote {_ct2_dir(model)} (none)" in stderr and (_ct2_dir(model) / "model.bin").is_file()
    for kind in ("tokenized_bleu_compound_split", "sacrebleu"):
        assert abs(fs[kind]["score"] - ct2[kind]["score"]) <= 0.1, (kind, fs, ct2)
    assert fs["tokenized_bleu_compound_split"]["score"] > 1  # a model that translates
    assert _lines(ct2_dir / "hyp.tok.de") == _lines(fs_dir / "hyp.tok.de")
    for eval_dir, engine in ((fs_dir, "fairseq"), (ct2_dir, "ctranslate2")):
        assert (eval_dir / "speed.txt").read_text().startswith(f"{engine}: {len(_lines(work / 'raw/test.en'))} "
                                                              "sentences in ")

    # a rerun finds the scores complete
    again = _evaluate(work, checkpoint, "ctranslate2")
    assert "skipping generation" in again.stderr and "export" not in again.stderr
    assert again.stdout == (ct2_dir / "scores.txt").read_text()
    # without the scores, and with a checkpoint touched but not changed: decodes again, no export
    shutil.rmtree(ct2_dir)
    checkpoint.touch()
    again = _evaluate(work, checkpoint, "ctranslate2")
    assert "holds this checkpoint (none) already: nothing to do" in again.stderr
    assert "wrote" not in again.stderr
    assert json.loads((ct2_dir / "scores.json").read_text()) == ct2
    # an export of another checkpoint is replaced
    info_path = _ct2_dir(model) / "export_info.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps(dict(info, sha256="0" * 64)))
    shutil.rmtree(ct2_dir)
    again = _evaluate(work, checkpoint, "ctranslate2")
    assert "wrote" in again.stderr and json.loads(info_path.read_text())["sha256"] == info["sha256"]
    assert json.loads((ct2_dir / "scores.json").read_text()) == ct2


@pytest.mark.e2e
def test_evaluate_with_dynamic_yarn_decodes_by_length_bucket_in_ctranslate2(model, evaluated):
    """ROPE_SCALING=dynamic-yarn: fairseq-generate scales per sentence, CTranslate2 exports a model
    per length bucket; the test sentences are within the training length, so both give the plain
    model's hypotheses, CTranslate2 through its plain bucket."""
    work, checkpoint = model
    plain = _lines(evaluated["fairseq"][0] / "hyp.tok.de")
    for engine, suffix in (("fairseq", ""), ("ctranslate2", "_ct2")):
        proc = _evaluate(work, checkpoint, engine, ROPE_SCALING="dynamic-yarn", LENGTH_BUCKETS="2 4")
        eval_dir = checkpoint.parent / f"eval_checkpoint_last_test{suffix}_dynamic-yarn_2_4"
        assert _lines(eval_dir / "hyp.tok.de") == plain, engine
    assert re.search(rf"\[evaluate\] length buckets \(L = \d+ tokens\): plain {len(plain)}, yarn x2 0, yarn x4 0",
                     proc.stderr)
    buckets = checkpoint.parent / "ct2_checkpoint_last_dynamic-yarn_2_4"
    assert sorted(p.name for p in buckets.iterdir()) == ["bpe.codes", "bpe.vocab.en", "bundle.json",
                                                         "length_buckets.json", "plain", "yarn_x2", "yarn_x4"]
    generate_log = (checkpoint.parent / "eval_checkpoint_last_test_dynamic-yarn_2_4" / "generate.log").read_text()
    assert "'rope_scaling': 'dynamic-yarn'" in generate_log  # fairseq logs its configuration, overrides included
    proc = _evaluate(work, checkpoint, "fairseq", check=False, ROPE_SCALING="yarn", LENGTH_BUCKETS="2")
    assert proc.returncode == 1 and "LENGTH_BUCKETS goes with ROPE_SCALING=dynamic-yarn" in proc.stderr


@pytest.mark.e2e
def test_evaluate_refuses_an_unknown_engine(model):
    proc = _evaluate(*model, "onnx", check=False)
    assert proc.returncode == 1
    assert "--engine (ENGINE) must be fairseq or ctranslate2, not 'onnx'" in proc.stderr
