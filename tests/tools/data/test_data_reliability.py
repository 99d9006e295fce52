"""The data side of the tools kept whole and honest: corpus splits written as one (a failure leaves
the complete old corpus), held-out sizes that cannot make splits overlap, archive links refused,
bad catalogs and unusable output directories named in one line, one prepare.sh per work dir, and
paths that start with "-"."""

import errno
import fcntl
import io
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from support.commands import run_cli
from test_gettext_corpus import write_mo
from test_wmt14_prepare import PREPARE, _prepare, _prepare_byo, wmt14_archives  # noqa: F401

from fairseq_rope_base import files
from fairseq_rope_tools.data import generate_corpus as gc
from fairseq_rope_tools.data import gettext_corpus
from fairseq_rope_tools.data import text_tools as tt
from fairseq_rope_tools.research.compare import command as compare_cli

MESSAGES = {f"message number {i} here": f"Nachricht Nummer {i} hier" for i in range(40)}


def snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir())}


def fail_at_second_file(monkeypatch, module):
    """Make the corpus tool's second file write fail as a full disk would."""
    real, calls = module.write_lines_atomically, []

    def write(path, lines):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, lines)

    monkeypatch.setattr(module, "write_lines_atomically", write)
    return calls


def usage_error(capsys, main, argv):
    """main(argv) must stop with exit status 2; returns its last stderr line."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# --- case 5: a rerun that fails halfway leaves the old corpus, not new English beside old German ----

def test_gettext_rerun_failing_between_files_keeps_the_old_corpus(tmp_path, monkeypatch):
    old_mo, new_mo, out = tmp_path / "old.mo", tmp_path / "new.mo", tmp_path / "out"
    write_mo(old_mo, MESSAGES)
    write_mo(new_mo, {f"another message {i} there": f"Eine andere Nachricht {i} dort" for i in range(40)})
    gettext_corpus.main(["--out-dir", str(out), "--mo", str(old_mo), "--valid-size", "5", "--test-size", "5"])
    before = snapshot(out)
    calls = fail_at_second_file(monkeypatch, gettext_corpus)
    with pytest.raises(OSError, match="No space left"):
        gettext_corpus.main(["--out-dir", str(out), "--mo", str(new_mo), "--valid-size", "5", "--test-size", "5"])
    assert [Path(c).name for c in calls] == ["test.en", "test.de"]
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.mo", "old.mo", "out"]  # no temporary left


def test_generate_corpus_rerun_failing_between_files_keeps_the_old_corpus(tmp_path, monkeypatch):
    out = tmp_path / "corpus"
    sizes = ["--train-size", "30", "--valid-size", "5", "--test-size", "5"]
    gc.main(["--out-dir", str(out), "--seed", "1", *sizes])
    before = snapshot(out)
    fail_at_second_file(monkeypatch, gc)
    with pytest.raises(OSError, match="No space left"):
        gc.main(["--out-dir", str(out), "--seed", "2", *sizes])
    assert snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["corpus"]
    monkeypatch.undo()
    gc.main(["--out-dir", str(out), "--seed", "2", *sizes])
    assert snapshot(out)["train.en"] != before["train.en"] and set(snapshot(out)) == set(before)


@pytest.mark.parametrize("can_exchange", [True, False])
def test_replace_directory_swaps_whole_and_carries_the_cache(tmp_path, monkeypatch, can_exchange):
    if not can_exchange:  # systems without renameat2(RENAME_EXCHANGE): renamed aside, then in
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    (out / "debs").mkdir(parents=True)
    (out / "debs" / "a.deb").write_bytes(b"deb")
    (out / "train.en").write_text("old\n")
    (out / "train.de").write_text("alt\n")

    def write_new(directory):
        (Path(directory) / "train.en").write_text("new\n")
        (Path(directory) / "train.de").write_text("neu\n")

    files.replace_directory(out, write_new, carry=["debs"])
    assert (out / "train.en").read_text() == "new\n" and (out / "train.de").read_text() == "neu\n"
    assert (out / "debs" / "a.deb").read_bytes() == b"deb"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]

    def fail(directory):
        (Path(directory) / "train.en").write_text("newer\n")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        files.replace_directory(out, fail, carry=["debs"])
    assert (out / "train.en").read_text() == "new\n" and (out / "debs" / "a.deb").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_symlinked_out_dir_keeps_its_link_and_its_target_gets_the_corpus(tmp_path):
    target, link = tmp_path / "target", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target)
    gc.main(["--out-dir", str(link), "--train-size", "5", "--valid-size", "1", "--test-size", "1"])
    gc.main(["--out-dir", str(link), "--train-size", "6", "--valid-size", "1", "--test-size", "1"])
    assert link.is_symlink() and len((target / "train.en").read_text().splitlines()) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]


def test_corpus_tools_refuse_an_out_dir_holding_other_files(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    line = usage_error(capsys, gc.main, ["--out-dir", str(out), "--train-size", "5"])
    assert f"--out-dir {out} holds notes.txt, which generate_corpus.py does not write" in line
    mo = tmp_path / "a.mo"
    write_mo(mo, MESSAGES)
    line = usage_error(capsys, gettext_corpus.main, ["--out-dir", str(out), "--mo", str(mo)])
    assert f"--out-dir {out} holds notes.txt, which gettext_corpus.py does not write" in line
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


# --- case 8: held-out sizes that would make the splits overlap ------------------------------------

@pytest.mark.parametrize("flag", ["--valid-size", "--test-size"])
def test_gettext_negative_held_out_size_is_refused(tmp_path, capsys, flag):
    mo = tmp_path / "a.mo"
    write_mo(mo, MESSAGES)
    other = "--test-size" if flag == "--valid-size" else "--valid-size"  # 5: enough pairs are left
    line = usage_error(capsys, gettext_corpus.main, ["--out-dir", str(tmp_path / "out"), "--mo", str(mo),
                                                     other, "5", flag, "-5"])
    assert line.endswith(f"error: {flag} must be 0 or more, not -5")
    assert not (tmp_path / "out").exists()


def test_gettext_held_out_sizes_beyond_the_pairs_are_refused(tmp_path, capsys):
    mo = tmp_path / "a.mo"
    write_mo(mo, MESSAGES)
    with pytest.raises(SystemExit) as stop:
        gettext_corpus.main(["--out-dir", str(tmp_path / "out"), "--mo", str(mo), "--valid-size", "30",
                             "--test-size", "10"])
    assert stop.value.code == 1
    assert "error: only 40 pairs, fewer than --valid-size + --test-size (30 + 10)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_gettext_splits_are_disjoint_and_cover_every_pair():
    pairs = {f"sentence {i}": f"Satz {i}" for i in range(20)}
    for valid, test in ((0, 0), (0, 19), (7, 3), (19, 0)):
        splits = gettext_corpus.split_by_hash(pairs, valid, test)
        assert [len(splits[s]) for s in ("test", "valid", "train")] == [test, valid, 20 - valid - test]
        assert sorted(e for lines in splits.values() for e in lines) == sorted(pairs)


def test_generate_corpus_negative_size_is_refused(tmp_path, capsys):
    line = usage_error(capsys, gc.main, ["--out-dir", str(tmp_path / "out"), "--test-size", "-5"])
    assert line.endswith("error: --test-size must be at least 1, not -5")


# --- case 9: archive members that are links -------------------------------------------------------

@pytest.mark.e2e
def test_prepare_refuses_an_archive_member_that_is_a_symlink(wmt14_archives, tmp_path):  # noqa: F811
    secret = tmp_path / "secret.txt"
    secret.write_text("a private line of the machine\n" * 30)
    raw_dir = tmp_path / "raw"
    shutil.copytree(wmt14_archives[0], raw_dir)
    dev = raw_dir / "dev.tgz"
    with tarfile.open(dev, "w:gz") as tar:
        _add(tar, "dev/newstest2013.en", "The dog sees the cat.\n" * 30)
        link = tarfile.TarInfo("dev/newstest2013.de")
        link.type, link.linkname = tarfile.SYMTYPE, str(secret)
        tar.addfile(link)
    work = tmp_path / "work"
    proc = _prepare(work, "--raw-dir", raw_dir, check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"[prepare] error: archive {dev}: member dev/newstest2013.de is a symbolic link to {secret}, "
        "not a regular file; refusing it (is it the WMT14 archive?)")
    assert not (work / "raw").exists()
    copied = [p for p in work.rglob("*") if p.is_file() and "private line" in p.read_text(errors="replace")]
    assert copied == [] and not [p for p in work.rglob("*") if p.is_symlink()]


def _add(tar, name, text):
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("kind", [tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.DIRTYPE])
def test_extract_refuses_every_member_that_is_not_a_regular_file(tmp_path, capsys, kind):
    archive = tmp_path / "dev.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        _add(tar, "dev/newstest2013.en", "The dog sees the cat.\n")
        other = tarfile.TarInfo("dev/newstest2013.de")
        other.type, other.linkname = kind, "dev/newstest2013.en"
        tar.addfile(other)
    dest = tmp_path / "ex"
    with pytest.raises(SystemExit):
        tt.main(["extract", "--archive", str(archive), "--dest", str(dest), "dev/newstest2013.en",
                 "dev/newstest2013.de"])
    err = capsys.readouterr().err
    assert f"archive {archive}: member dev/newstest2013.de is a" in err and "not a regular file" in err
    assert not (dest / "dev" / "newstest2013.de").exists()


def test_extract_names_a_missing_member(tmp_path, capsys):
    archive = tmp_path / "dev.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        _add(tar, "dev/newstest2013.en", "The dog sees the cat.\n")
    with pytest.raises(SystemExit):
        tt.main(["extract", "--archive", str(archive), "--dest", str(tmp_path / "ex"), "dev/newstest2013.de"])
    assert f"archive {archive} has no member dev/newstest2013.de" in capsys.readouterr().err


# --- case 10: bad catalogs, unusable output directories, a second prepare.sh ----------------------

def _bad_catalogs(tmp_path):
    good = tmp_path / "good.mo"
    write_mo(good, MESSAGES)
    data = good.read_bytes()
    latin1 = data.replace("Nachricht Nummer 1 hier".encode(), "Nachricht Nummer 1 h\xe9er".encode("latin-1"))
    return {"garbage": (b"not a catalog at all\n" * 5, "bad magic number"),
            "truncated-header": (data[:10], "it is truncated"),
            "truncated": (data[: len(data) // 2], "file is corrupt"),
            "latin1": (latin1, "its text is not utf-8, the character set its header declares")}


@pytest.mark.parametrize("case", ["garbage", "truncated-header", "truncated", "latin1"])
def test_gettext_bad_catalog_given_with_mo_is_named(tmp_path, capsys, case):
    content, reason = _bad_catalogs(tmp_path)[case]
    bad = tmp_path / f"{case}.mo"
    bad.write_bytes(content)
    line = usage_error(capsys, gettext_corpus.main, ["--out-dir", str(tmp_path / "out"), "--mo",
                                                     str(tmp_path / "good.mo"), str(bad)])
    assert f"error: --mo {bad} is not a valid compiled gettext catalog: {reason}" in line
    assert not (tmp_path / "out").exists()


def test_gettext_bad_catalog_in_a_package_is_skipped_with_a_warning(tmp_path, capsys):
    content, _ = _bad_catalogs(tmp_path)["garbage"]
    catalogs = [("demo_1.0_all.deb:bad.mo", content), ("demo_1.0_all.deb:good.mo", (tmp_path / "good.mo").read_bytes())]
    read = gettext_corpus.read_catalogs(catalogs, explicit=False)
    assert read[0] == ("demo_1.0_all.deb:bad.mo", None) and len(read[1][1]) == 40
    assert capsys.readouterr().err.strip() == ("gettext_corpus.py: warning: skipping demo_1.0_all.deb:bad.mo: not a "
                                               "valid compiled gettext catalog: bad magic number")


def _read_only(monkeypatch, directory):
    """os.access says ``directory`` is not writable (as chmod 555 would, for a user who is not root)."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != Path(directory) and real(p, mode))


def _out_dir_cases(tmp_path, monkeypatch):
    mo = tmp_path / "a.mo"
    write_mo(mo, MESSAGES)
    raw = tmp_path / "raw"
    raw.mkdir()
    return {"gettext": (gettext_corpus.main, ["--mo", str(mo)]),
            "generate": (gc.main, ["--train-size", "5"]),
            "harness": (compare_cli.main, ["--raw-dir", str(raw)])}


@pytest.mark.parametrize("tool", ["gettext", "generate", "harness"])
def test_out_dir_that_is_a_file_or_read_only_is_named_before_any_work(tmp_path, monkeypatch, capsys, tool):
    main, args = _out_dir_cases(tmp_path, monkeypatch)[tool]
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    line = usage_error(capsys, main, [*args, "--out-dir", str(a_file)])
    assert line.endswith(f"error: --out-dir {a_file} is a file, not a directory: give a directory")
    assert a_file.read_text() == "keep me"

    read_only = tmp_path / "read_only"
    read_only.mkdir()
    _read_only(monkeypatch, read_only)
    line = usage_error(capsys, main, [*args, "--out-dir", str(read_only)])
    assert line.endswith(f"error: --out-dir {read_only} is not writable: give a directory you can write to")
    line = usage_error(capsys, main, [*args, "--out-dir", str(read_only / "new" / "out")])
    assert f"error: --out-dir {read_only / 'new' / 'out'} cannot be written: {read_only} is not writable" in line
    assert list(read_only.iterdir()) == []


def _hold_prepare_lock(work):
    """Hold the lock a running prepare.sh holds on its work dir, with its holder file."""
    work.mkdir(parents=True, exist_ok=True)
    fd = os.open(work, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    (work / ".prepare.pid").write_text("PID 4242 on somehost\n")
    return fd


@pytest.mark.e2e
def test_second_prepare_on_one_work_dir_refuses_naming_the_first(tmp_path):
    work, corpus = tmp_path / "work", tmp_path / "missing"
    fd = _hold_prepare_lock(work)
    try:
        proc = _prepare_byo(work, corpus, check=False)
    finally:
        os.close(fd)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"[prepare] error: another prepare.sh (PID 4242 on somehost) is preparing {work}: wait for it to finish "
        "or stop it, or give another --work-dir"]
    # released (as on any exit of the holder, kill -9 included): the next run goes on to its input
    proc = _prepare_byo(work, corpus, check=False)
    assert proc.returncode != 0 and f"raw: your corpus has no file {corpus}/train.en" in proc.stderr
    assert not (work / ".prepare.pid").exists()


# --- case 11: paths that start with "-" -----------------------------------------------------------

@pytest.mark.e2e
def test_prepare_takes_a_work_dir_that_starts_with_a_dash_for_a_path(tmp_path):
    proc = run_cli(["bash", PREPARE, "--work-dir", "-w", "--train-prefix", "c/train", "--valid-prefix", "c/valid",
                    "--test-prefix", "c/test", "--bpe-size", "10"], cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == "[prepare] error: raw: your corpus has no file c/train.en"
    assert (tmp_path / "-w").is_dir()
    proc = run_cli(["bash", PREPARE, "--work-dir", "--src"], cwd=tmp_path, check=False)
    assert proc.stderr.strip() == ("[prepare] error: --work-dir needs a value, not the option '--src' "
                                   "(a path that starts with '-' is written ./--src)")


def test_python_tools_say_how_to_give_a_path_that_starts_with_a_dash(tmp_path, monkeypatch, capsys):
    line = usage_error(capsys, gc.main, ["--out-dir", "-x"])
    assert line.endswith("argument --out-dir: expected one argument (a value that starts with '-' is read as an "
                         "option: write it as --flag=VALUE, or a path such as -x as ./-x)")
    line = usage_error(capsys, gettext_corpus.main, ["--out-dir", "out", "--mo", "-a.mo"])
    assert "argument --mo: expected at least one argument (a value that starts with '-'" in line
    monkeypatch.chdir(tmp_path)
    gc.main(["--out-dir", "./-x", "--train-size", "5", "--valid-size", "1", "--test-size", "1"])
    assert (tmp_path / "-x" / "train.en").is_file()


# --- the output rule: no tool writes over one of its own inputs -------------------------------------

@pytest.mark.parametrize("step", ["normalize", "sgm2txt", "tokenize", "clean", "spm-encode"])
def test_a_text_step_never_writes_over_its_input(tmp_path, capsys, step):
    """A text step given its input as its output (directly, or through a symlink) is refused
    before it reads a line: the file is left as it was."""
    for name in ("in.en", "in.de"):
        (tmp_path / name).write_text("<seg id=\"1\"> a sentence </seg>\n")
    (tmp_path / "alias.en").symlink_to(tmp_path / "in.en")
    before = snapshot(tmp_path)
    argv = {"normalize": ["normalize", "--output", tmp_path / "alias.en", tmp_path / "in.en"],
            "sgm2txt": ["sgm2txt", tmp_path / "in.en", tmp_path / "alias.en"],
            "tokenize": ["tokenize", "--lang", "en", tmp_path / "in.en", tmp_path / "in.en"],
            "clean": ["clean", "--src", "en", "--tgt", "de", tmp_path / "in", tmp_path / "in"],
            "spm-encode": ["spm-encode", "--model", tmp_path / "in.de", tmp_path / "in.en", tmp_path / "in.de"]}[step]
    with pytest.raises(SystemExit) as stop:
        tt.main([str(arg) for arg in argv])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and err.count("\n") == 0
    assert f"] error: {step}: " in err and "would overwrite its own input" in err
    assert snapshot(tmp_path) == before


def test_gettext_never_reads_a_catalog_it_would_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    mo = out / "train.en"  # a name the tool writes
    write_mo(mo, MESSAGES)
    line = usage_error(capsys, gettext_corpus.main, ["--out-dir", str(out), "--mo", str(mo)])
    assert f"--out-dir's train.en {out / 'train.en'} is --mo {mo}" in line
    assert mo.read_bytes() == (tmp_path / "out" / "train.en").read_bytes() and len(list(out.iterdir())) == 1
