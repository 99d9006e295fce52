"""examples/wmt14_en_de/prepare.sh on small archives with the real WMT14 names and layout:
extraction, SGML stripping, normalisation and tokenisation, cleaning, BPE, binarization; a rerun
does nothing; a truncated archive is reported by name and leaves nothing a rerun would trust."""

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from conftest import REPO, run_cli

PREPARE = REPO / "examples" / "wmt14_en_de" / "prepare.sh"

import importlib.util  # noqa: E402

_spec = importlib.util.spec_from_file_location("generate_corpus", REPO / "scripts" / "generate_corpus.py")
gc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gc)

N_EUROPARL, N_CC, N_NC, N_DEV, N_TEST = 120, 80, 60, 30, 25
# training pairs the cleaning step must drop: one side too long, length ratio above 1.5
LONG = ("word " * 260).strip()
DROPPED = [(LONG, "ein Satz ."), ("Ein sehr sehr sehr sehr langer Satz mit vielen Wörtern hier .", "Kurz .")]


def _tgz(path, members):
    """members: {name in archive: text}"""
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _text(lines):
    return "".join(line + "\n" for line in lines)


def _sgm(setid, lang, lines, kind):
    body = "".join(f'<seg id="{i + 1}">{line}</seg>\n' for i, line in enumerate(lines))
    return (f'<{kind}set setid="{setid}" srclang="any" trglang="{lang}">\n<doc sysid="ref" docid="d1" '
            f'genre="news" origlang="en">\n<p>\n{body}</p>\n</doc>\n</{kind}set>\n')


@pytest.fixture(scope="module")
def wmt14_archives(tmp_path_factory):
    root = tmp_path_factory.mktemp("wmt14_raw")
    pairs = gc.generate(seed=11, sizes=[("ep", N_EUROPARL), ("cc", N_CC), ("nc", N_NC), ("dev", N_DEV),
                                         ("test", N_TEST)])
    ep = pairs["ep"]
    # things the text steps must handle: typographic quotes, a zero-width space, hyphenated compounds
    ep[0] = ("He said \u201cthe well-known dog\u201d sees the cat.", "Er sagte \u201eder bekannte Hund\u201c sieht die Katze.")
    ep[1] = ("The dog\u200b sees the cat.", "Der Hund\u200b sieht die Katze.")
    ep += DROPPED
    _tgz(root / "training-parallel-europarl-v7.tgz", {
        "training/europarl-v7.de-en.en": _text(e for e, _ in ep),
        "training/europarl-v7.de-en.de": _text(d for _, d in ep),
        "training/europarl-v7.fr-en.fr": "Ceci n'est pas utilisé.\n",
    })
    _tgz(root / "training-parallel-commoncrawl.tgz", {
        "commoncrawl.de-en.en": _text(e for e, _ in pairs["cc"]),
        "commoncrawl.de-en.de": _text(d for _, d in pairs["cc"]),
        "commoncrawl.de-en.annotation": "x\n" * N_CC,
    })
    _tgz(root / "training-parallel-nc-v9.tgz", {
        "training/news-commentary-v9.de-en.en": _text(e for e, _ in pairs["nc"]),
        "training/news-commentary-v9.de-en.de": _text(d for _, d in pairs["nc"]),
    })
    _tgz(root / "dev.tgz", {
        "dev/newstest2013.en": _text(e for e, _ in pairs["dev"]),
        "dev/newstest2013.de": _text(d for _, d in pairs["dev"]),
        "dev/newstest2013-src.en.sgm": _sgm("newstest2013", "en", [e for e, _ in pairs["dev"]], "src"),
    })
    test_en = [e for e, _ in pairs["test"]]
    test_de = [d for _, d in pairs["test"]]
    _tgz(root / "test-full.tgz", {
        "test-full/newstest2014-deen-src.en.sgm": _sgm("newstest2014", "en", test_en, "src"),
        "test-full/newstest2014-deen-ref.de.sgm": _sgm("newstest2014", "de", test_de, "ref"),
        "test-full/newstest2014-deen-src.de.sgm": _sgm("newstest2014", "de", test_de, "src"),
        "test-full/newstest2014-deen-ref.en.sgm": _sgm("newstest2014", "en", test_en, "ref"),
    })
    return root, test_en, test_de


def _prepare(work, *args, check=True):
    return run_cli(["bash", PREPARE, "--work-dir", work, "--bpe-size", "300", "--workers", "1", *args],
                   check=check, timeout=300)


def _lines(path):
    return Path(path).read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def prepared(wmt14_archives, tmp_path_factory):
    raw_dir, test_en, test_de = wmt14_archives
    work = tmp_path_factory.mktemp("wmt14_work")
    proc = _prepare(work, "--raw-dir", raw_dir)
    return work, proc, test_en, test_de


def test_extracts_the_wmt14_layout_and_strips_sgml(prepared):
    work, _, test_en, test_de = prepared
    n_train = N_EUROPARL + len(DROPPED) + N_CC + N_NC
    assert len(_lines(work / "raw/train.en")) == len(_lines(work / "raw/train.de")) == n_train
    assert len(_lines(work / "raw/valid.en")) == N_DEV
    assert _lines(work / "raw/test.en") == test_en  # tags stripped, order kept
    assert _lines(work / "raw/test.de") == test_de
    assert not any("Ceci" in line for line in _lines(work / "raw/train.en"))  # other pairs ignored


def test_normalises_and_tokenises(prepared):
    work = prepared[0]
    tok_en = _lines(work / "tok/train.en")
    tok_de = _lines(work / "tok/train.de")
    assert tok_en[0] == 'He said " the well @-@ known dog " sees the cat .'
    assert tok_de[0] == 'Er sagte " der bekannte Hund " sieht die Katze .'
    assert tok_en[1] == "The dog sees the cat ."  # zero-width space removed
    assert all("\u200b" not in line for line in tok_en + tok_de)


def test_cleans_training_data_only(prepared):
    work = prepared[0]
    clean_en = _lines(work / "clean/train.en")
    assert len(clean_en) == N_EUROPARL + N_CC + N_NC
    assert not any(line.startswith("word word") for line in clean_en)
    assert len(_lines(work / "tok/test.en")) == N_TEST


def test_learns_and_applies_joint_bpe_and_binarizes(prepared):
    work = prepared[0]
    assert (work / "bpe/codes").stat().st_size > 0
    bpe_train = _lines(work / "bpe/train.de")
    assert any("@@ " in line for line in bpe_train)
    assert [line.replace("@@ ", "") for line in bpe_train] == _lines(work / "clean/train.de")
    data_bin = work / "data-bin"
    assert (data_bin / "dict.en.txt").read_text() == (data_bin / "dict.de.txt").read_text()  # joined
    assert (data_bin / "bpe_type").read_text().strip() == "subword_nmt"
    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            assert (data_bin / f"{split}.en-de.{lang}.bin").stat().st_size > 0
    from fairseq.data import Dictionary, data_utils

    d = Dictionary.load(str(data_bin / "dict.de.txt"))
    test = data_utils.load_indexed_dataset(str(data_bin / "test.en-de.de"), d)
    assert len(test) == N_TEST
    assert d.string(test[0]).replace("@@ ", "") == _lines(work / "tok/test.de")[0]


def test_rerun_does_nothing(prepared, wmt14_archives):
    work = prepared[0]
    stamps = {p: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file()}
    proc = _prepare(work, "--raw-dir", wmt14_archives[0])
    for step in ("raw", "tok", "clean", "bpe", "data-bin"):
        assert f"{step}: complete, skipping" in proc.stderr
    assert "fairseq-preprocess --joined" not in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file()} == stamps


def test_truncated_archive_is_reported_by_name(wmt14_archives, tmp_path):
    raw_dir = tmp_path / "raw"
    shutil.copytree(wmt14_archives[0], raw_dir)
    archive = raw_dir / "test-full.tgz"
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    work = tmp_path / "work"
    proc = _prepare(work, "--raw-dir", raw_dir, check=False)
    assert proc.returncode != 0
    assert f"archive {archive} is corrupt or truncated" in proc.stderr
    assert not (work / "raw").exists() and not (work / "data-bin").exists()
    # a missing archive is named too, with where to get it
    archive.unlink()
    proc = _prepare(work, "--raw-dir", raw_dir, check=False)
    assert proc.returncode != 0 and "has no test-full.tgz" in proc.stderr and "statmt.org/wmt14" in proc.stderr


def test_bring_your_own_corpus_with_sentencepiece(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    data = gc.generate(seed=2, sizes=[("train", 400), ("valid", 20), ("test", 20)])
    for split, pairs in data.items():
        (corpus / f"{split}.en").write_text(_text(e for e, _ in pairs), encoding="utf-8")
        (corpus / f"{split}.de").write_text(_text(d for _, d in pairs), encoding="utf-8")
    work = tmp_path / "work"
    run_cli(["bash", PREPARE, "--work-dir", work, "--train-prefix", corpus / "train", "--valid-prefix",
             corpus / "valid", "--test-prefix", corpus / "test", "--bpe", "sentencepiece", "--bpe-size", "250",
             "--workers", "1"], timeout=300)
    assert (work / "data-bin/bpe_type").read_text().strip() == "sentencepiece"
    assert (work / "data-bin/spm.model").exists()
    pieces = _lines(work / "bpe/test.de")
    assert any("\u2581" in line for line in pieces)
    assert ["".join(line.split()).replace("\u2581", " ").strip() for line in pieces] == _lines(work / "tok/test.de")
