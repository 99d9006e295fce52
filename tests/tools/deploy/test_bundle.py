"""The bundle of fairseq-rope-export, in-process on stand-in files: its manifest records the
languages, the segmentation and the sha256 of every file; a file changed, missing or added, a
manifest of another version or of a tokenizer this version lacks, is refused by name, and
fairseq-rope-translate refuses such a bundle in one line before it loads a model. The real
export and translation from a bundle alone: tests/tools/deploy/test_translate.py."""

import json
import shutil

import pytest
from support.commands import translate_in_process

from fairseq_rope_tools.deploy import ctranslate2_engine, exported, work_dir
from fairseq_rope_tools.deploy.segmentation import MOSES_RECIPE
from fairseq_rope_tools.text_steps import RECORD_HEADER


def prepared_work_dir(root, threshold=7):
    """The bpe/ and tok/ steps of a work dir as prepare.sh leaves them (subword-nmt)."""
    (root / "bpe").mkdir(parents=True)
    (root / "tok").mkdir()
    (root / "bpe" / "codes").write_text("#version: 0.2\nw 1</w>\n", encoding="utf-8")
    (root / "bpe" / "vocab.en").write_text("w1 100\n", encoding="utf-8")
    (root / "bpe" / ".done").write_text(f"{RECORD_HEADER}\noption BPE=subword-nmt\noption "
                                        f"BPE_VOCAB_THRESHOLD={threshold}\n", encoding="utf-8")
    (root / "tok" / ".done").write_text(f"{RECORD_HEADER}\noption TOKENIZE=1\n", encoding="utf-8")
    return root


def stand_in_bundle(out, segmentation):
    """In the new directory ``out``: a single export's files (stand-ins: never loaded) and its
    bundle with ``segmentation`` (None: a model-only export); the manifest."""
    out.mkdir()
    for name, text in (("model.bin", "weights"), ("config.json", "{}"), ("shared_vocabulary.json", '["<s>"]'),
                       (exported.EXPORT_INFO, json.dumps({"sha256": "0" * 64, "max_source_positions": 16}))):
        (out / name).write_text(text)
    return exported.write_bundle(out, "en", "de", segmentation)


@pytest.fixture
def bundle(tmp_path):
    """A single export's files and its bundle, with the segmentation of a prepared work dir."""
    segmentation = work_dir.segmentation_of(prepared_work_dir(tmp_path / "work"), "en", "de", "subword_nmt")
    out = tmp_path / "export"
    return out, stand_in_bundle(out, segmentation), segmentation


def test_the_manifest_records_the_languages_segmentation_and_every_file(bundle):
    out, manifest, segmentation = bundle
    assert exported.verified_bundle(out) == manifest
    assert (manifest["source_language"], manifest["target_language"]) == ("en", "de")
    assert manifest["segmentation"] == {"tokenizer": MOSES_RECIPE, "bpe": "subword_nmt", "codes": "bpe.codes",
                                        "vocabulary": "bpe.vocab.en", "vocabulary_threshold": 7}
    assert sorted(manifest["files"]) == ["bpe.codes", "bpe.vocab.en", "config.json", "export_info.json", "model.bin",
                                         "shared_vocabulary.json"]
    held = exported.bundle_segmentation(out, manifest)
    assert (held.codes, held.vocabulary, held.vocabulary_threshold, held.tokenize) == (
        out / "bpe.codes", out / "bpe.vocab.en", 7, True)
    assert held.codes.read_bytes() == segmentation.codes.read_bytes()
    assert exported.bundle_holds(manifest, "en", "de", segmentation)
    assert not exported.bundle_holds(manifest, "de", "en", segmentation)
    assert exported.source_limit(out) == 16


def _changed(out):
    (out / "bpe.codes").write_text("#version: 0.2\nw 2</w>\n", encoding="utf-8")
    return "the bundle does not match its manifest: bpe.codes is not the file it was exported with"


def _missing(out):
    (out / "bpe.vocab.en").unlink()
    return "bpe.vocab.en, which bundle.json lists, is missing"


def _added(out):  # CTranslate2 would load this vocabulary instead of the shared one
    shutil.copy(out / "shared_vocabulary.json", out / "source_vocabulary.json")
    return "source_vocabulary.json is not one of the files bundle.json lists"


def _newer_version(out):
    manifest = json.loads((out / exported.BUNDLE).read_text())
    (out / exported.BUNDLE).write_text(json.dumps(dict(manifest, version=2)))
    return "is a bundle of version 2; this fairseq-rope-translate reads version 1"


def _unknown_tokenizer(out):
    manifest = json.loads((out / exported.BUNDLE).read_text())
    manifest["segmentation"]["tokenizer"] = dict(MOSES_RECIPE, escape=True)
    (out / exported.BUNDLE).write_text(json.dumps(manifest))
    return "records a tokenizer this version does not apply"


SPOILED = {"a file changed": _changed, "a file missing": _missing, "a file added": _added,
           "a newer version": _newer_version, "another tokenizer": _unknown_tokenizer}


@pytest.mark.parametrize("spoil", SPOILED.values(), ids=SPOILED.keys())
def test_a_bundle_that_does_not_match_its_manifest_is_refused_by_name(bundle, spoil):
    out = bundle[0]
    problem = spoil(out)
    with pytest.raises(ValueError, match=problem):
        exported.verified_bundle(out)


@pytest.mark.parametrize("spoil", SPOILED.values(), ids=SPOILED.keys())
def test_translate_refuses_such_a_bundle_in_one_line_before_loading_a_model(bundle, tmp_path, capsys, monkeypatch,
                                                                           spoil):
    out = bundle[0]
    problem = spoil(out)
    monkeypatch.setattr(ctranslate2_engine, "CTranslate2Engine", lambda *a: pytest.fail("a model was loaded"))
    (tmp_path / "in.txt").write_text("w1\n")
    status, lines = translate_in_process(capsys, tmp_path / "in.txt", "--model-dir", out, "-o", tmp_path / "out.txt")
    assert status == 2 and len(lines) == 1 and f"error: --model-dir {out}: " in lines[0] and problem in lines[0], lines
    assert lines[0].endswith("export it again with fairseq-rope-export")
    assert not (tmp_path / "out.txt").exists()


def test_a_work_dir_given_with_a_bundle_must_hold_its_segmentation(bundle, tmp_path, capsys, monkeypatch):
    out = bundle[0]
    other = prepared_work_dir(tmp_path / "other", threshold=50)  # the same files, another threshold
    (other / "data-bin").mkdir()
    for lang in ("en", "de"):
        (other / "data-bin" / f"dict.{lang}.txt").write_text("w1 1\n")
    monkeypatch.setattr(ctranslate2_engine, "CTranslate2Engine", lambda *a: pytest.fail("a model was loaded"))
    (tmp_path / "in.txt").write_text("w1\n")
    status, lines = translate_in_process(capsys, tmp_path / "in.txt", "--model-dir", out, "--work-dir", other)
    assert status == 2 and len(lines) == 1, lines
    assert f"--work-dir {other}: its segmentation (bpe/ and tok/ steps) is not the one --model-dir {out} holds" in lines[0]


def test_a_model_only_bundle_needs_a_work_dir_for_raw_text(bundle, tmp_path, capsys):
    out = bundle[0]
    for name in ("bpe.codes", "bpe.vocab.en", exported.BUNDLE):
        (out / name).unlink()
    manifest = exported.write_bundle(out, "en", "de", None)
    assert manifest["segmentation"] is None and exported.verified_bundle(out) == manifest
    (tmp_path / "in.txt").write_text("w1\n")
    status, lines = translate_in_process(capsys, tmp_path / "in.txt", "--model-dir", out)
    assert status == 2 and len(lines) == 1 and "--work-dir is needed to tokenize and BPE raw text" in lines[0], lines
