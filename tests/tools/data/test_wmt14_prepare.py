"""examples/wmt14_en_de/prepare.sh on small archives with the real WMT14 names and layout:
extraction, SGML stripping, normalisation and tokenisation, cleaning, BPE, binarization; a rerun
does nothing; a truncated archive is reported by name and leaves nothing a rerun would trust; its
log has plain progress lines, no progress bar."""

import io
import os
import pty
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from support.commands import REPO, run_cli

from fairseq_rope_tools.data import synthetic_grammar as gc
from fairseq_rope_tools.data import text_tools as tt
from fairseq_rope_tools.text_steps import RecipeTokenizer

PREPARE = REPO / "examples" / "wmt14_en_de" / "prepare.sh"
COMMON = REPO / "examples" / "wmt14_en_de" / "common.sh"

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


def _prepare(work, *args, check=True, log=None):
    """prepare.sh; with ``log``, its stderr goes to that file as to a user's log, byte for byte (and
    to proc.stderr too if it fails). BPE learning reports its progress every 0.05 s, so that even
    this small corpus gets such lines."""
    cmd = ["env", "PROGRESS_INTERVAL=0.05", "bash", PREPARE, "--work-dir", work, "--bpe-size", "300", "--workers", "1",
           *args]
    if log is not None:
        cmd = ["bash", "-c", 'log="$1"; shift; "$@" 2> "$log" || { status=$?; cat "$log" >&2; exit $status; }',
               "prepare-to-log", log, *cmd]
    return run_cli(cmd, check=check, timeout=300)


def _lines(path):
    return Path(path).read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def prepared(wmt14_archives, tmp_path_factory):
    raw_dir, test_en, test_de = wmt14_archives
    work = tmp_path_factory.mktemp("wmt14_work")
    log = tmp_path_factory.mktemp("wmt14_log") / "prepare.log"
    _prepare(work, "--raw-dir", raw_dir, log=log)
    return work, log, test_en, test_de


@pytest.mark.e2e
def test_extracts_the_wmt14_layout_and_strips_sgml(prepared):
    work, _, test_en, test_de = prepared
    n_train = N_EUROPARL + len(DROPPED) + N_CC + N_NC
    assert len(_lines(work / "raw/train.en")) == len(_lines(work / "raw/train.de")) == n_train
    assert len(_lines(work / "raw/valid.en")) == N_DEV
    assert _lines(work / "raw/test.en") == test_en  # tags stripped, order kept
    assert _lines(work / "raw/test.de") == test_de
    assert not any("Ceci" in line for line in _lines(work / "raw/train.en"))  # other pairs ignored


@pytest.mark.e2e
def test_normalises_and_tokenises(prepared):
    work = prepared[0]
    tok_en = _lines(work / "tok/train.en")
    tok_de = _lines(work / "tok/train.de")
    assert tok_en[0] == 'He said " the well @-@ known dog " sees the cat .'
    assert tok_de[0] == 'Er sagte " der bekannte Hund " sieht die Katze .'
    assert tok_en[1] == "The dog sees the cat ."  # zero-width space removed
    assert all("\u200b" not in line for line in tok_en + tok_de)


@pytest.mark.e2e
def test_cleans_training_data_only(prepared):
    work = prepared[0]
    clean_en = _lines(work / "clean/train.en")
    assert len(clean_en) == N_EUROPARL + N_CC + N_NC
    assert not any(line.startswith("word word") for line in clean_en)
    assert len(_lines(work / "tok/test.en")) == N_TEST


@pytest.mark.e2e
def test_learns_and_applies_joint_bpe_and_binarizes(prepared):
    work, log = prepared[:2]
    codes = _lines(work / "bpe/codes")
    assert codes[0].startswith("#version") and len(codes) > 1
    # the log of a run off a terminal: subword-nmt's progress bar (one line redrawn with carriage
    # returns) is off; the step says its start and its end, with the merges learnt, in plain lines
    text = log.read_bytes().decode("utf-8")
    assert "\r" not in text
    assert "[prepare] bpe: learning 300 joint subword-nmt merges\n" in text
    assert re.search(rf"^\[prepare\] bpe: learned {len(codes) - 1} merges in \d+ s$", text, re.M)
    # and, while it learns, how far it is, until it is done
    reached = [int(n) for n in re.findall(r"^\[prepare\] bpe: (\d+) of 300 merges learned after \d+ s$", text, re.M)]
    assert reached and reached == sorted(reached) and reached[-1] <= len(codes) - 1
    assert text.index("bpe: learning 300") < text.index(" of 300 merges learned after") < text.index("bpe: learned ")
    assert " of 300 merges learned after" not in text[text.index("bpe: learned "):]
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


@pytest.mark.e2e
def test_progress_bars_only_on_a_terminal():
    """The recipe's steps turn tqdm's bars off when their stderr is not a terminal, and only then."""
    script = f'source "{COMMON}" test; printf "%s" "${{TQDM_DISABLE:-unset}}"'
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    leader, terminal = pty.openpty()
    try:
        on_terminal = subprocess.run(["bash", "-c", script], stdout=subprocess.PIPE, stderr=terminal, env=env,
                                     text=True, timeout=30)
    finally:
        os.close(terminal)
        os.close(leader)
    to_a_log = subprocess.run(["bash", "-c", script], capture_output=True, env=env, text=True, timeout=30)
    assert (on_terminal.stdout, to_a_log.stdout) == ("unset", "1")


@pytest.mark.e2e
def test_rerun_does_nothing(prepared, wmt14_archives):
    work = prepared[0]
    stamps = {p: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file()}
    proc = _prepare(work, "--raw-dir", wmt14_archives[0])
    for step in ("raw", "tok", "clean", "bpe", "data-bin"):
        assert f"{step}: complete, skipping" in proc.stderr
    assert "fairseq-preprocess --joined" not in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file()} == stamps


@pytest.mark.e2e
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


@pytest.mark.e2e
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


# --- bad input: line breaks inside lines, invalid UTF-8, stale outputs, argument errors -------

# (split, language, 0-based line): a character that some tool takes for a line break, put in
# place of a space in the middle of that line; \r on both sides (on different lines) is the case
# where a tool splitting there keeps the line counts equal and silently pairs wrong sentences
BREAKS = {("train", "en", 5): "\r", ("train", "de", 12): "\r", ("train", "de", 20): "\u2028",
          ("train", "de", 30): "\x85", ("train", "en", 40): "\f", ("train", "en", 41): "\v",
          ("train", "de", 42): "\x1c", ("valid", "en", 3): "\u2029", ("valid", "de", 4): "\x1e"}
CRLF = ("train", "en", 50)  # this line ends with \r\n


def _write_corpus(directory, data, edit=None):
    """Write {split: [(en, de), ...]} as directory/split.{en,de}; edit(split, lang, i, line) -> bytes
    of the line including its end."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, pairs in data.items():
        for side, lang in enumerate(("en", "de")):
            lines = [(edit or (lambda s, lg, i, line: (line + "\n").encode()))(split, lang, i, p[side])
                     for i, p in enumerate(pairs)]
            (directory / f"{split}.{lang}").write_bytes(b"".join(lines))
    return directory


def _with_breaks(split, lang, i, line):
    ch = BREAKS.get((split, lang, i))
    if ch is not None:
        middle = line.index(" ", len(line) // 3)
        line = line[:middle] + ch + line[middle + 1:]
    return (line + ("\r\n" if (split, lang, i) == CRLF else "\n")).encode("utf-8")


def _prepare_byo(work, corpus, *args, train=None, check=True, env=None):
    return run_cli(["bash", PREPARE, "--work-dir", work, "--train-prefix", train or corpus / "train",
                    "--valid-prefix", corpus / "valid", "--test-prefix", corpus / "test",
                    "--bpe-size", "200", "--workers", "1", *args], check=check, env=env, timeout=300)


def _mtimes(work, *dirs):
    return {p: p.stat().st_mtime_ns for d in dirs for p in (work / d).rglob("*") if p.is_file()}


def test_normalize_splits_only_at_newline(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes("one\r\ntwo\rthree\n four\u2028five\x85six\fseven\veight\x1cnine\x1d\x1eten\u2029\nlast"
                  .encode("utf-8"))
    b.write_bytes(b"x\n")
    out = tmp_path / "out"
    tt.main(["normalize", "--output", str(out), str(a), str(b)])
    # a CRLF end is a plain end, every other break inside a line a space; a last line without
    # "\n" is a line, a final "\n" adds no empty line
    assert out.read_bytes().decode("utf-8") == "one\ntwo three\n four five six seven eight nine  ten \nlast\nx\n"


@pytest.mark.parametrize("cmd", ["normalize", "sgm2txt", "tokenize", "detokenize", "clean"])
def test_text_tools_stop_at_invalid_utf8(tmp_path, capsys, cmd):
    bad = tmp_path / "in.en"
    bad.write_bytes(b'<seg id="1">fine</seg>\n<seg id="2">caf\xe9</seg>\n')
    (tmp_path / "in.de").write_bytes(b"gut\ngut\n")
    out = tmp_path / "out"
    argv = {"normalize": ["normalize", "--output", str(out), str(bad)],
            "sgm2txt": ["sgm2txt", str(bad), str(out)],
            "tokenize": ["tokenize", "--lang", "en", str(bad), str(out)],
            "detokenize": ["detokenize", "--lang", "en", str(bad), str(out)],
            "clean": ["clean", "--src", "en", "--tgt", "de", str(tmp_path / "in"), str(out)]}[cmd]
    with pytest.raises(SystemExit) as e:
        tt.main(argv)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert f"error: {bad}: line 2: invalid UTF-8 (byte 0xe9" in err and "--replace-invalid-utf8" in err
    assert not list(tmp_path.glob("out*"))
    tt.main([argv[0], "--replace-invalid-utf8", *argv[1:]])
    assert f"{bad}: replaced invalid UTF-8 with U+FFFD in 1 line (first: line 2)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def byo_breaks(tmp_path_factory):
    """Your own corpus with line-break characters inside lines, prepared once."""
    root = tmp_path_factory.mktemp("byo_breaks")
    data = gc.generate(seed=5, sizes=[("train", 300), ("valid", 20), ("test", 20)])
    corpus = _write_corpus(root / "corpus", data, _with_breaks)
    work = root / "work"
    proc = _prepare_byo(work, corpus)
    return root, data, corpus, work, proc


@pytest.mark.e2e
def test_line_breaks_inside_lines_keep_pairs_aligned(byo_breaks):
    _, data, corpus, work, proc = byo_breaks
    assert f"{corpus}/train.en: 3 lines had line-break characters" in proc.stderr
    assert f"{corpus}/train.de: 4 lines had line-break characters" in proc.stderr
    for split, pairs in data.items():
        for side, lang in enumerate(("en", "de")):
            # raw/: the original sentences (the breaks replaced a space), line for line
            assert _lines(work / f"raw/{split}.{lang}") == [p[side] for p in pairs], (split, lang)
            # tok/: line i is the tokenization of sentence i
            tokenize = RecipeTokenizer(lang)
            assert _lines(work / f"tok/{split}.{lang}") == [tokenize(p[side]) for p in pairs], (split, lang)
    tok_pairs = set(zip(_lines(work / "tok/train.en"), _lines(work / "tok/train.de")))
    clean = list(zip(_lines(work / "clean/train.en"), _lines(work / "clean/train.de")))
    assert len(clean) > 250 and all(pair in tok_pairs for pair in clean)
    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            source = work / ("clean" if split == "train" else "tok") / f"{split}.{lang}"
            assert [line.replace("@@ ", "") for line in _lines(work / f"bpe/{split}.{lang}")] == _lines(source)


@pytest.mark.e2e
def test_rerun_with_other_bpe_size_rebuilds_bpe_and_data_bin_only(byo_breaks, tmp_path):
    root, _, corpus, work0, _ = byo_breaks
    work = tmp_path / "work"
    shutil.copytree(work0, work)  # keeps mtimes; the records do not depend on where WORK_DIR is
    kept = _mtimes(work, "raw", "tok", "clean")
    codes = (work / "bpe/codes").read_text(encoding="utf-8")
    done = (work / "data-bin/.done").stat().st_mtime_ns
    proc = _prepare_byo(work, corpus, "--bpe-size", "250")
    for step in ("raw", "tok", "clean"):
        assert f"{step}: complete, skipping" in proc.stderr
    assert "bpe: options changed (BPE_SIZE 200 -> 250), rebuilding" in proc.stderr
    assert re.search(r"data-bin: inputs changed \(bpe/[^)]*\), rebuilding", proc.stderr)
    assert "fairseq-preprocess --joined" in proc.stderr
    assert _mtimes(work, "raw", "tok", "clean") == kept
    new_codes = (work / "bpe/codes").read_text(encoding="utf-8")
    assert new_codes != codes and len(new_codes.splitlines()) > len(codes.splitlines())
    assert (work / "data-bin/bpe.codes").read_text(encoding="utf-8") == new_codes
    assert (work / "data-bin/.done").stat().st_mtime_ns != done
    # and the same options again: nothing to do
    proc = _prepare_byo(work, corpus, "--bpe-size", "250")
    for step in ("raw", "tok", "clean", "bpe", "data-bin"):
        assert f"{step}: complete, skipping" in proc.stderr


@pytest.mark.e2e
def test_rerun_with_other_train_files_rebuilds_everything(byo_breaks, tmp_path):
    _, _, corpus, work0, _ = byo_breaks
    work = tmp_path / "work"
    shutil.copytree(work0, work)
    other = gc.generate(seed=6, sizes=[("train", 280)])
    corpus2 = _write_corpus(tmp_path / "corpus2", other)
    proc = _prepare_byo(work, corpus, train=corpus2 / "train")
    assert (f"raw: inputs changed (train.en is now {corpus2}/train.en, was {corpus}/train.en, "
            f"train.de is now {corpus2}/train.de") in proc.stderr
    assert "tok: inputs changed (raw/train.en, raw/train.de), rebuilding" in proc.stderr
    assert "clean: inputs changed (tok/train.en, tok/train.de), rebuilding" in proc.stderr
    assert "bpe: inputs changed (clean/train.en, clean/train.de), rebuilding" in proc.stderr
    assert "data-bin: inputs changed" in proc.stderr
    assert "complete, skipping" not in proc.stderr
    assert _lines(work / "raw/train.de") == [d for _, d in other["train"]]
    assert len(_lines(work / "tok/train.en")) == 280
    assert [line.replace("@@ ", "") for line in _lines(work / "bpe/train.de")] == _lines(work / "clean/train.de")


@pytest.mark.e2e
def test_invalid_utf8_stops_with_file_and_line(tmp_path):
    data = gc.generate(seed=7, sizes=[("train", 150), ("valid", 10), ("test", 10)])

    def latin1(split, lang, i, line):
        if (split, lang) == ("train", "de") and i in (6, 8):
            return line.encode("latin-1", errors="replace") + b" caf\xe9\n"  # Latin-1, not UTF-8
        return (line + "\n").encode("utf-8")

    corpus = _write_corpus(tmp_path / "corpus", data, latin1)
    work = tmp_path / "work"
    proc = _prepare_byo(work, corpus, check=False)
    assert proc.returncode != 0
    assert f"[prepare] error: {corpus}/train.de: line 7: invalid UTF-8" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (work / "raw").exists() and not (work / "data-bin").exists()
    proc = _prepare_byo(work, corpus, "--replace-invalid-utf8")
    assert f"{corpus}/train.de: replaced invalid UTF-8 with U+FFFD in 2 lines (first: line 7)" in proc.stderr
    raw_de = _lines(work / "raw/train.de")
    assert len(raw_de) == 150 and "\ufffd" in raw_de[6] and "\ufffd" in raw_de[8] and "\ufffd" not in raw_de[7]
    assert (work / "data-bin/train.en-de.de.bin").exists()


VALUE_OPTIONS = ["--work-dir", "--raw-dir", "--src", "--tgt", "--train-prefix", "--valid-prefix", "--test-prefix",
                 "--bpe", "--bpe-size", "--bpe-vocab-threshold", "--clean-min", "--clean-max", "--clean-ratio",
                 "--workers"]


@pytest.mark.e2e
def test_argument_errors_are_one_line(tmp_path):
    cases = [([opt], f"{opt} needs a value") for opt in VALUE_OPTIONS]
    cases += [
        (["--bpe-size", "--workers", "1"], "--bpe-size needs a value"),
        (["--bpe-size", ""], "--bpe-size needs a value"),
        (["--bpe-size", "4k"], "--bpe-size (BPE_SIZE) must be a positive whole number, not '4k'"),
        (["--workers", "0"], "--workers (WORKERS) must be a positive whole number, not '0'"),
        (["--clean-ratio", "x"], "--clean-ratio (CLEAN_RATIO) must be a positive number"),
        (["--bogus"], "unknown option '--bogus'"),
    ]
    for args, message in cases:
        proc = run_cli(["bash", PREPARE, "--work-dir", tmp_path / "work", *args], check=False)
        assert proc.returncode != 0, args
        assert proc.stderr.strip().splitlines() == [f"[prepare] error: {message}"] or \
            (len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(f"[prepare] error: {message}")), \
            (args, proc.stderr)
        assert "unbound variable" not in proc.stderr
    assert not (tmp_path / "work").exists()
    proc = run_cli(["bash", PREPARE, "--work-dir", tmp_path / "work"], check=False,
                   env={"BPE_SIZE": "many"})
    assert proc.stderr.strip() == "[prepare] error: --bpe-size (BPE_SIZE) must be a positive whole number, not 'many'"
