"""fairseq-rope-translate refuses what would fail late or translate wrongly, in one line, before
decoding: a source longer than the model's positions with either engine, a CTranslate2 model
exported with a dictionary in another order, unreadable model and BPE files, a data-bin of
another model, swapped languages, and output paths that cannot be written or collide; a
symlinked output stays a symlink. One RoPE model (max_source_positions 16) trained for a single
update on the reversal corpus is enough: these tests need it to load and decode, not to translate
well."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.commands import REPO, cli_command, run_cli, translate_in_process

from fairseq_rope_tools.deploy import ctranslate2_engine, fairseq_engine
from fairseq_rope_tools.deploy import translate as translate_py

pytest.importorskip("ctranslate2")
from fairseq_rope_tools.deploy import checkpoint_export as exporter  # noqa: E402  (after the skip)

MAX_SOURCE = 16  # the model's max_source_positions: 15 tokens and the </s> appended


@pytest.fixture(scope="module")
def tiny(tiny_data_bin, tmp_path_factory):
    """(data-bin, checkpoint, CTranslate2 export, work dir for raw input) of a tiny RoPE model."""
    root = tmp_path_factory.mktemp("translate_reliability")
    data_bin = tiny_data_bin / "data-bin"
    run_cli(["fairseq-train", data_bin, "--user-dir", "fairseq_rope", "--arch", "transformer_rope_tiny",
             "--max-source-positions", MAX_SOURCE, "--task", "translation", "--cpu", "--optimizer", "adam",
             "--lr", "5e-3", "--max-tokens", "1500", "--max-update", "1", "--criterion", "cross_entropy",
             "--disable-validation", "--no-epoch-checkpoints", "--save-dir", root / "checkpoints",
             "--num-workers", "0", "--log-format", "simple"])
    checkpoint = root / "checkpoints" / "checkpoint_last.pt"
    ct2 = root / "ct2"
    exporter.export(str(checkpoint), str(data_bin), str(ct2))
    # a work dir as prepare.sh leaves it, as far as raw input needs one: subword-nmt codes that
    # keep the corpus' words whole, and the data-bin
    work = root / "work"
    (work / "bpe").mkdir(parents=True)
    codes = "#version: 0.2\n" + "".join(f"w {i}</w>\n" for i in range(10))
    (work / "bpe" / "codes").write_text(codes, encoding="utf-8")
    (work / "bpe" / "vocab.en").write_text("".join(f"w{i} 100\n" for i in range(10)), encoding="utf-8")
    (work / "bpe" / ".done").write_text("# prepare.sh step record v1\noption BPE=subword-nmt\noption "
                                        "BPE_VOCAB_THRESHOLD=1\n", encoding="utf-8")
    shutil.copytree(data_bin, work / "data-bin")
    return data_bin, checkpoint, ct2, work


def _refused(capsys, message, *args, status=2):
    code, lines = translate_in_process(capsys, *args)
    assert code == status and len(lines) == 1 and "error: " in lines[0] and message in lines[0], (code, lines)
    return lines[0]


def _bpe_args(data_bin, *engine):
    return ["--input-format", "bpe", "--output-format", "bpe", "--data-bin", data_bin, *engine]


def _source(tmp_path, tokens, name="in.en"):
    path = tmp_path / name
    path.write_text("w1 w2 w3\n" + " ".join(f"w{i % 10}" for i in range(tokens)) + "\n", encoding="utf-8")
    return path


def _copy_ct2(ct2, tmp_path, **info_changes):
    """A copy of the export; with export_info.json changed (a value None removes the key), as an
    export of an older version wrote it, and the bundle manifest's sha256 of it to match."""
    copy = tmp_path / "ct2"
    shutil.copytree(ct2, copy)
    if not info_changes:
        return copy
    info = json.loads((copy / "export_info.json").read_text())
    info.update(info_changes)
    info = {key: value for key, value in info.items() if value is not None}
    (copy / "export_info.json").write_text(json.dumps(info))
    _rehash(copy, "export_info.json")
    return copy


def _rehash(export, name):
    """The bundle manifest of ``export`` made to record the sha256 of its file ``name`` as it is now."""
    manifest = json.loads((export / "bundle.json").read_text())
    manifest["files"][name] = hashlib.sha256((export / name).read_bytes()).hexdigest()
    (export / "bundle.json").write_text(json.dumps(manifest))


# --- case 6: the CTranslate2 engine has the fairseq engine's input-length limit -------------------
@pytest.mark.e2e
def test_both_engines_refuse_a_line_beyond_the_source_positions_alike(tiny, tmp_path, capsys):
    data_bin, checkpoint, ct2, _ = tiny
    assert json.loads((ct2 / "export_info.json").read_text())["max_source_positions"] == MAX_SOURCE
    fits, too_long = _source(tmp_path, MAX_SOURCE - 1, "fits.en"), _source(tmp_path, MAX_SOURCE, "long.en")
    engines = {"ctranslate2": ["--model-dir", ct2], "fairseq": ["--engine", "fairseq", "--checkpoint", checkpoint]}
    refusals = {}
    for engine, model in engines.items():
        out = tmp_path / f"out.{engine}"
        assert translate_in_process(capsys, fits, "-o", out, *_bpe_args(data_bin, *model)) == (0, [])
        assert len(out.read_text().splitlines()) == 2
        refusals[engine] = _refused(capsys, f"{too_long}: line 2 has {MAX_SOURCE} BPE tokens; the model takes at most "
                                    f"{MAX_SOURCE - 1}", too_long, *_bpe_args(data_bin, *model), status=1)
        # the flag raises the limit, for either engine (rotary positions extend)
        assert translate_in_process(capsys, too_long, "-o", out, "--max-source-positions", MAX_SOURCE + 1,
                     *_bpe_args(data_bin, *model)) == (0, [])
    assert refusals["ctranslate2"] == refusals["fairseq"]
    assert "raise the limit with --max-source-positions" in refusals["fairseq"]


@pytest.mark.e2e
def test_an_export_without_a_recorded_limit_warns_or_takes_the_flag(tiny, tmp_path, capsys):
    data_bin, _, ct2, _ = tiny
    old = _copy_ct2(ct2, tmp_path, max_source_positions=None)
    too_long = _source(tmp_path, MAX_SOURCE)
    code, lines = translate_in_process(capsys, too_long, "-o", tmp_path / "out.de", *_bpe_args(data_bin, "--model-dir", old))
    assert code == 0 and len(lines) == 1
    assert "records no max_source_positions" in lines[0] and "pass --max-source-positions" in lines[0]
    _refused(capsys, "the model takes at most 14", too_long, "--max-source-positions", 15,
             *_bpe_args(data_bin, "--model-dir", old), status=1)
    # a limit in config.json is taken too
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps(dict(config, max_source_positions=MAX_SOURCE)))
    _rehash(old, "config.json")
    _refused(capsys, f"the model takes at most {MAX_SOURCE - 1}", too_long, *_bpe_args(data_bin, "--model-dir", old),
             status=1)


# --- case 7: the vocabulary check compares order -------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("lang, side", [("en", "source"), ("de", "target")])
def test_a_dictionary_in_another_order_is_refused(tiny, tmp_path, capsys, lang, side):
    data_bin, _, ct2, _ = tiny
    permuted = tmp_path / "data-bin"
    shutil.copytree(data_bin, permuted)
    lines = (permuted / f"dict.{lang}.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    lines[2], lines[5] = lines[5], lines[2]  # the same tokens: only their ids differ
    (permuted / f"dict.{lang}.txt").write_text("".join(lines), encoding="utf-8")
    first, second = lines[5].split()[0], lines[2].split()[0]
    _refused(capsys, f"--model-dir {ct2} was not exported with the dictionary of {permuted}: token 6 of "
             f"{ct2 / 'shared_vocabulary.json'} is {first!r}, of {permuted / f'dict.{lang}.txt'} {second!r} (line 3)",
             _source(tmp_path, 3), *_bpe_args(permuted, "--model-dir", ct2))


# --- case 10: unreadable files, one line each ------------------------------------------------------
@pytest.mark.e2e
def test_unreadable_model_and_bpe_files_are_refused_by_name(tiny, tmp_path, capsys):
    data_bin, checkpoint, ct2, work = tiny
    text = _source(tmp_path, 3)
    binary_codes = tmp_path / "work"
    shutil.copytree(work, binary_codes)
    (binary_codes / "bpe" / "codes").write_bytes(b"\xff\xfe\x00" + bytes(range(256)) * 4)
    _refused(capsys, f"--work-dir {binary_codes}: {binary_codes / 'bpe' / 'codes'} is not subword-nmt BPE codes",
             text, "--work-dir", binary_codes, "--model-dir", ct2)
    corrupt = _copy_ct2(ct2, tmp_path)
    (corrupt / "model.bin").write_bytes((ct2 / "model.bin").read_bytes()[:5000])
    _refused(capsys, f"--model-dir {corrupt}: the bundle does not match its manifest: model.bin is not the file",
             text, *_bpe_args(data_bin, "--model-dir", corrupt))  # the bundle's manifest sees it first
    _rehash(corrupt, "model.bin")  # as if it were truncated before the export wrote its manifest
    _refused(capsys, f"--model-dir {corrupt}: CTranslate2 cannot load {corrupt / 'model.bin'}",
             text, *_bpe_args(data_bin, "--model-dir", corrupt))
    for name, data in (("garbage.pt", bytes(range(256)) * 8), ("empty.pt", b""),
                       ("truncated.pt", checkpoint.read_bytes()[:100000])):
        (tmp_path / name).write_bytes(data)
        _refused(capsys, f"--checkpoint {tmp_path / name} is not a readable fairseq checkpoint",
                 text, *_bpe_args(data_bin, "--engine", "fairseq", "--checkpoint", tmp_path / name))


@pytest.mark.e2e
def test_a_checkpoint_with_another_models_data_bin_is_refused(tiny, tmp_path, capsys):
    data_bin, checkpoint, _, _ = tiny
    other = tmp_path / "data-bin"
    shutil.copytree(data_bin, other)
    for lang in ("en", "de"):
        with open(other / f"dict.{lang}.txt", "a", encoding="utf-8") as f:
            f.write("".join(f"extra{i} 1\n" for i in range(9)))
    _refused(capsys, f"--checkpoint {checkpoint} does not fit the dictionaries of --data-bin {other} (size mismatch",
             _source(tmp_path, 3), *_bpe_args(other, "--engine", "fairseq", "--checkpoint", checkpoint))


@pytest.mark.e2e
def test_output_paths_are_checked_before_decoding(tiny, tmp_path, capsys, monkeypatch):
    data_bin, _, ct2, _ = tiny

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoding started")

    monkeypatch.setattr(translate_py, "translate_sorted", no_decoding)
    text, out = _source(tmp_path, 3), tmp_path / "out.de"
    model = _bpe_args(data_bin, "--model-dir", ct2)
    _refused(capsys, f"--stats-json {tmp_path / 'no' / 's.json'}: directory {tmp_path / 'no'} does not exist",
             text, "-o", out, "--stats-json", tmp_path / "no" / "s.json", *model)
    _refused(capsys, f"--stats-json {tmp_path}", text, "--stats-json", tmp_path, *model)
    unwritable = _unwritable_directory(tmp_path)
    _refused(capsys, f"--output {unwritable}/out.de: cannot create files in {unwritable} (",
             text, "-o", f"{unwritable}/out.de", *model)
    # the same file twice, however spelt
    (tmp_path / "link.de").symlink_to("out.de")
    for stats in (out, f"{tmp_path}/./out.de", tmp_path / "link.de"):
        _refused(capsys, f"--output {out} and --stats-json {stats} are the same file", text, "-o", out,
                 "--stats-json", stats, *model)
    assert not out.exists() and not list(tmp_path.glob(".*.tmp"))


def _unwritable_directory(tmp_path):
    """A directory where no file can be created: a read-only one, or /sys where even root cannot."""
    if os.geteuid() != 0:
        (tmp_path / "read-only").mkdir(mode=0o555)
        return tmp_path / "read-only"
    try:
        fd, probe = tempfile.mkstemp(dir="/sys")
    except OSError:
        return "/sys"
    os.close(fd)
    os.unlink(probe)
    pytest.skip("no directory that root cannot write into")


# --- issue 34, case 5: no output over an input ------------------------------------------------------
def _input_itself(tiny, tmp_path):
    text = _source(tmp_path, 3)
    return text, [text, "-o", text, *_bpe_args(tiny[0], "--model-dir", tiny[2])], \
        f"--output {text} is the input file {text}"


def _stats_over_the_input(tiny, tmp_path):
    text = _source(tmp_path, 3)
    return text, [text, "-o", tmp_path / "out.de", "--stats-json", text, *_bpe_args(tiny[0], "--model-dir", tiny[2])], \
        f"--stats-json {text} is the input file {text}"


def _over_the_model(tiny, tmp_path):
    ct2 = _copy_ct2(tiny[2], tmp_path)
    return ct2 / "model.bin", [_source(tmp_path, 3), "-o", ct2 / "model.bin", *_bpe_args(tiny[0], "--model-dir", ct2)], \
        f"--output {ct2 / 'model.bin'} is --model-dir's model.bin {ct2 / 'model.bin'}"


def _over_a_dictionary(tiny, tmp_path):
    data_bin = tmp_path / "data-bin"
    shutil.copytree(tiny[0], data_bin)
    return data_bin / "dict.de.txt", [_source(tmp_path, 3), "-o", tmp_path / "out.de", "--stats-json",
                                      data_bin / "dict.de.txt", *_bpe_args(data_bin, "--model-dir", tiny[2])], \
        f"--stats-json {data_bin / 'dict.de.txt'} is --data-bin's dict.de.txt {data_bin / 'dict.de.txt'}"


def _over_the_bpe_codes(tiny, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(tiny[3], work)
    return work / "bpe" / "codes", [_source(tmp_path, 3), "--work-dir", work, "--model-dir", tiny[2], "-o",
                                    work / "bpe" / "codes"], \
        f"--output {work / 'bpe' / 'codes'} is --work-dir's bpe/codes {work / 'bpe' / 'codes'}"


def _over_the_checkpoint(tiny, tmp_path):
    checkpoint = tmp_path / "checkpoint.pt"
    shutil.copy(tiny[1], checkpoint)
    return checkpoint, [_source(tmp_path, 3), "-o", checkpoint,
                        *_bpe_args(tiny[0], "--engine", "fairseq", "--checkpoint", checkpoint)], \
        f"--output {checkpoint} is --checkpoint {checkpoint}"


@pytest.mark.e2e
@pytest.mark.parametrize("case", [_input_itself, _stats_over_the_input, _over_the_model, _over_a_dictionary,
                                  _over_the_bpe_codes, _over_the_checkpoint],
                         ids=["-o the input", "--stats-json the input", "-o the model", "--stats-json a dictionary",
                              "-o the BPE codes", "-o the checkpoint"])
def test_an_output_over_one_of_the_inputs_is_refused_before_decoding(tiny, tmp_path, capsys, monkeypatch, case):
    def no_decoding(*args, **kwargs):
        raise AssertionError("decoding started")

    monkeypatch.setattr(translate_py, "translate_sorted", no_decoding)
    monkeypatch.setattr(fairseq_engine.FairseqEngine, "__init__", no_decoding)
    read, args, message = case(tiny, tmp_path)
    before = read.read_bytes()
    _refused(capsys, message + ": the output would overwrite its own input; give another output", *args)
    assert read.read_bytes() == before


@pytest.mark.e2e
@pytest.mark.parametrize("flag", ["-o", "--stats-json"])
def test_an_output_inside_the_model_dir_is_refused_before_decoding(tiny, tmp_path, capsys, monkeypatch, flag):
    """A new file in an export is one its manifest does not list: the export would stop loading."""
    monkeypatch.setattr(translate_py, "translate_sorted", lambda *a, **k: pytest.fail("decoding started"))
    ct2 = _copy_ct2(tiny[2], tmp_path)
    before = sorted(p.name for p in ct2.iterdir())
    outputs = {"-o": tmp_path / "out.de", "--stats-json": None, flag: ct2 / "new"}
    args = [a for f, path in outputs.items() if path is not None for a in (f, path)]
    _refused(capsys, f"{'--output' if flag == '-o' else flag} {ct2 / 'new'} is inside --model-dir {ct2}",
             _source(tmp_path, 3), *args, *_bpe_args(tiny[0], "--model-dir", ct2))
    assert sorted(p.name for p in ct2.iterdir()) == before


# --- issue 34, case 7: standard output closed --------------------------------------------------------
def test_a_closed_stdout_is_refused_before_decoding(tmp_path, capsys, monkeypatch):
    from test_bundle import stand_in_bundle

    stand_in_bundle(tmp_path / "ct2", None)  # never loaded
    text = _source(tmp_path, 3)
    monkeypatch.setattr(ctranslate2_engine, "CTranslate2Engine", lambda *a: pytest.fail("a model was loaded"))
    monkeypatch.setattr(sys, "stdout", None)  # what Python makes of a closed stdout (>&-)
    _refused(capsys, "error: standard output is closed: give --output FILE", text, "--model-dir", tmp_path / "ct2",
             "--input-format", "bpe", "--output-format", "bpe")


@pytest.mark.e2e
def test_translate_with_stdout_closed_is_one_line(tiny, tmp_path):
    data_bin, _, ct2, _ = tiny
    proc = run_cli(["bash", "-c", 'exec "$@" >&-', "bash", "fairseq-rope-translate", _source(tmp_path, 3),
                    "--threads", "1", *_bpe_args(data_bin, "--model-dir", ct2)], check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "fairseq-rope-translate: error: standard output is closed: give --output FILE, or run the command with "
        "stdout open"], proc.stderr


# --- issue 34, case 2: a length-bucket export is verified, not trusted -------------------------------
@pytest.fixture(scope="module")
def tiny_buckets(tiny, tmp_path_factory):
    """The tiny model exported with --length-buckets 2: plain/ and yarn_x2/."""
    data_bin, checkpoint, _, _ = tiny
    out = tmp_path_factory.mktemp("tiny_buckets") / "buckets"
    exporter.export(str(checkpoint), str(data_bin), str(out), length_buckets=(2.0,))
    return out


def _swap_buckets(buckets, tmp_path):
    (buckets / "plain").rename(tmp_path / "aside")
    (buckets / "yarn_x2").rename(buckets / "plain")
    (tmp_path / "aside").rename(buckets / "yarn_x2")


def _permute_a_later_buckets_vocabulary(buckets, tmp_path):
    path = buckets / "yarn_x2" / "shared_vocabulary.json"
    vocabulary = json.loads(path.read_text())
    vocabulary[5], vocabulary[6] = vocabulary[6], vocabulary[5]
    path.write_text(json.dumps(vocabulary))


@pytest.mark.e2e
@pytest.mark.parametrize("spoil, problem", [
    (None, None),
    (_swap_buckets, "the bucket plain holds yarn x2 at L = "),
    (_permute_a_later_buckets_vocabulary, "the bucket yarn_x2's vocabulary files are not those it was exported with"),
], ids=["as exported", "swapped directories", "a later bucket's vocabulary"])
def test_translate_verifies_every_bucket_of_a_length_bucket_export(tiny, tiny_buckets, tmp_path, capsys, spoil,
                                                                   problem):
    data_bin = tiny[0]
    buckets = tmp_path / "buckets"
    shutil.copytree(tiny_buckets, buckets)
    args = [_source(tmp_path, 3), "-o", tmp_path / "out.de", *_bpe_args(data_bin, "--model-dir", buckets)]
    if spoil is None:
        assert translate_in_process(capsys, *args) == (0, [])
        assert len((tmp_path / "out.de").read_text().splitlines()) == 2
        return
    spoil(buckets, tmp_path)
    _refused(capsys, f"--model-dir {buckets}: {problem}", *args)
    assert not (tmp_path / "out.de").exists()


# --- case 11 ---------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_a_symlinked_output_stays_a_symlink(tiny, tmp_path, capsys):
    data_bin, _, ct2, _ = tiny
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "out.de").write_text("old\n")
    link = tmp_path / "out.de"
    link.symlink_to(tmp_path / "real" / "out.de")
    assert translate_in_process(capsys, _source(tmp_path, 3), "-o", link, *_bpe_args(data_bin, "--model-dir", ct2))[0] == 0
    assert link.is_symlink() and len((tmp_path / "real" / "out.de").read_text().splitlines()) == 2
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["out.de"]  # no temporary file left


def test_writing_through_a_symlink_replaces_its_target(tmp_path):
    from fairseq_rope_base.files import write_atomically

    (tmp_path / "target").write_text("old")
    (tmp_path / "link").symlink_to("target")  # relative, as ln -s makes it
    write_atomically(tmp_path / "link", lambda tmp: Path(tmp).write_text("new"))
    assert os.readlink(tmp_path / "link") == "target" and (tmp_path / "target").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]


@pytest.mark.e2e
def test_swapped_languages_are_refused(tiny, tmp_path, capsys):
    data_bin, _, ct2, _ = tiny
    for flags, given in ((["--src", "de", "--tgt", "en"], "--src de --tgt en"), (["--src", "de"], "--src de --tgt de")):
        _refused(capsys, f"{given}: the data-bin {data_bin} is for en-de (translating en to de): pass --src en "
                 "--tgt de", _source(tmp_path, 3), *flags, *_bpe_args(data_bin, "--model-dir", ct2))


@pytest.mark.e2e
def test_a_path_that_starts_with_a_dash(tiny, tmp_path, capsys, monkeypatch):
    data_bin, _, ct2, _ = tiny
    monkeypatch.chdir(tmp_path)
    text = _source(tmp_path, 3)
    code, lines = translate_in_process(capsys, text, "-o", "-weird.de", *_bpe_args(data_bin, "--model-dir", ct2))
    assert code == 2 and lines[-1].endswith("argument -o/--output: expected one argument (a value that starts with "
                                            "'-' is read as an option: write it as --flag=VALUE, or a path such "
                                            "as -x as ./-x)")
    code, lines = translate_in_process(capsys, "-weird.en", *_bpe_args(data_bin, "--model-dir", ct2))
    assert code == 2 and "given as ./NAME" in lines[-1]
    for spelling in ("--output=-weird.de", "-o=-weird2.de"):
        assert translate_in_process(capsys, text, spelling, *_bpe_args(data_bin, "--model-dir", ct2))[0] == 0
    assert (tmp_path / "-weird.de").is_file() and (tmp_path / "-weird2.de").is_file()


@pytest.mark.e2e
def test_the_ctranslate2_path_imports_neither_torch_nor_fairseq(tiny, tmp_path):
    data_bin, _, ct2, _ = tiny
    args = [str(a) for a in [_source(tmp_path, 3), "-o", tmp_path / "out.de", "--quiet", "--threads", "1",
                             *_bpe_args(data_bin, "--model-dir", ct2)]]
    code = ("import runpy, sys\nsys.argv = ['fairseq-rope-translate', *sys.argv[1:]]\n"
            f"runpy.run_module({translate_py.__name__!r}, run_name='__main__')\n"
            "print(sorted(m for m in ('torch', 'fairseq', 'fairseq_rope') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "[]\n", proc.stderr


def test_ctranslate2_on_cuda_without_its_cublas_is_refused_in_one_line(monkeypatch):
    """CTranslate2 4.x loads libcublas.so.12 when it first translates; on a machine with only CUDA
    13 (an H200 image with torch 2.11+cu130) it is missing. Refused before loading, naming the
    library and the package that brings it; no problem where it loads, or on a CPU-only wheel."""
    import ctypes

    import ctranslate2

    loaded = []

    def cdll(name, *args, **kwargs):
        loaded.append(name)
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctranslate2, "get_cuda_device_count", lambda: 1)
    monkeypatch.setattr(ctranslate2, "__version__", "4.8.0")
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    problem = ctranslate2_engine.ctranslate2_cuda_problem()
    assert loaded == ["libcublas.so.12"] and "\n" not in problem
    assert "libcublas.so.12" in problem and "pip install nvidia-cublas-cu12" in problem
    monkeypatch.setattr(ctypes, "CDLL", lambda name, *args, **kwargs: None)
    assert ctranslate2_engine.ctranslate2_cuda_problem() is None
    monkeypatch.setattr(ctranslate2, "get_cuda_device_count", lambda: 0)
    assert ctranslate2_engine.ctranslate2_cuda_problem() == "CTranslate2 sees no CUDA device"


# --- issue 36: translate for real use -----------------------------------------------------------------
def _lines_of(tokens_lists):
    return "".join(" ".join(tokens) + "\n" for tokens in tokens_lists)


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ["ctranslate2", "fairseq"])
def test_too_long_lines_are_skipped_or_truncated_and_counted(tiny, tmp_path, capsys, engine):
    """--too-long skip: an empty translation; truncate: the translation of the line's first
    tokens; either way a count on stderr, --quiet or not, and in --stats-json."""
    data_bin, checkpoint, ct2, _ = tiny
    model = ["--model-dir", ct2] if engine == "ctranslate2" else ["--engine", "fairseq", "--checkpoint", checkpoint]
    long = [f"w{i % 10}" for i in range(MAX_SOURCE + 5)]
    lines = [["w1", "w2", "w3"], long, ["w4", "w5"], long]
    (tmp_path / "in.en").write_text(_lines_of(lines))
    (tmp_path / "cut.en").write_text(_lines_of(line[:MAX_SOURCE - 1] for line in lines))
    assert translate_in_process(capsys, tmp_path / "cut.en", "-o", tmp_path / "cut.de", *_bpe_args(data_bin, *model)) \
        == (0, [])
    cut = (tmp_path / "cut.de").read_text().splitlines()
    for policy, expected, done in (("skip", [cut[0], "", cut[2], ""], "skipped: their translations are empty"),
                                   ("truncate", cut, f"truncated to their first {MAX_SOURCE - 1} tokens")):
        out, stats = tmp_path / f"{policy}.de", tmp_path / f"{policy}.json"
        code, said = translate_in_process(capsys, tmp_path / "in.en", "-o", out, "--too-long", policy, "--stats-json",
                                          stats, *_bpe_args(data_bin, *model))
        assert code == 0 and said == [f"[translate] {tmp_path / 'in.en'}: 2 lines longer than the model takes "
                                      f"({MAX_SOURCE - 1} BPE tokens) {done} (first: line 2)"]
        assert out.read_text().splitlines() == expected
        assert json.loads(stats.read_text())["too_long"] == {"policy": policy, "limit": MAX_SOURCE, "lines": 2,
                                                             "first_line": 2, "split_lines": 0}


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ["ctranslate2", "fairseq"])
def test_too_long_lines_split_into_sentences_and_joined_back(tiny, tmp_path, capsys, engine):
    """--too-long split: a line over the limit is translated sentence by sentence and joined back
    in order (each sentence as it translates alone); a line within it, an empty line and the
    lines around stay as they are; a sentence still too long falls to --too-long-sentence,
    counted; --json-lines marks the split line."""
    data_bin, checkpoint, ct2, work = tiny
    model = ["--model-dir", ct2] if engine == "ctranslate2" else ["--engine", "fairseq", "--checkpoint", checkpoint]
    sentences = [" ".join(f"w{(i + j) % 10}" for j in range(3 + i % 3)) + "." for i in range(7)]
    long_sentence = " ".join(f"w{i % 10}" for i in range(MAX_SOURCE + 3)) + "."
    lines = ["w1 w2 w3.", " ".join(sentences), "", "w4 w5.", f"{sentences[0]} {long_sentence} {sentences[1]}"]
    (tmp_path / "in.en").write_text("\n".join(lines) + "\n")
    (tmp_path / "alone.en").write_text("\n".join([*sentences, long_sentence]) + "\n")
    raw = ["--work-dir", work, "--output-format", "tok", *model]
    assert translate_in_process(capsys, tmp_path / "alone.en", "-o", tmp_path / "alone.de", "--too-long", "truncate",
                                *raw)[0] == 0
    alone = (tmp_path / "alone.de").read_text().splitlines()
    code, said = translate_in_process(capsys, tmp_path / "in.en", "-o", tmp_path / "out.de", "--too-long", "split",
                                      "--too-long-sentence", "skip", "--stats-json", tmp_path / "stats.json", *raw)
    assert code == 0
    assert said == [f"[translate] {tmp_path / 'in.en'}: 2 lines longer than the model takes ({MAX_SOURCE - 1} BPE "
                    "tokens) split into sentences (first: line 2)",
                    f"[translate] {tmp_path / 'in.en'}: 1 sentence of split lines longer than the model takes "
                    f"({MAX_SOURCE - 1} BPE tokens) skipped: their translations are empty (first: line 5)"]
    out = (tmp_path / "out.de").read_text().splitlines()
    assert len(out) == len(lines) and out[2] == ""
    assert out[1] == " ".join(alone[:len(sentences)])
    assert out[4] == f"{alone[0]} {alone[1]}"  # the sentence too long left out
    assert json.loads((tmp_path / "stats.json").read_text())["too_long"] == {
        "policy": "split", "sentence_policy": "skip", "limit": MAX_SOURCE, "lines": 1, "first_line": 5,
        "split_lines": 2}
    code, said = translate_in_process(capsys, tmp_path / "in.en", "-o", tmp_path / "out.jsonl", "--too-long", "split",
                                      "--too-long-sentence", "truncate", "--json-lines", *raw)
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [record.get("split", False) for record in records] == [False, True, False, False, True]
    assert records[4]["translations"][0]["text"] == f"{alone[0]} {alone[len(sentences)]} {alone[1]}"
    # one sentence at a time, every line of more than one: the sentence-split oracle
    code, said = translate_in_process(capsys, tmp_path / "in.en", "-o", tmp_path / "each.de", "--too-long", "split",
                                      "--too-long-sentence", "skip", "--max-sentences-per-input", 1, *raw)
    each = (tmp_path / "each.de").read_text().splitlines()
    assert code == 0 and each[1] == out[1] and each[4] == out[4] and each[3] == out[3]
    assert said[0] == (f"[translate] {tmp_path / 'in.en'}: 2 lines longer than the model takes ({MAX_SOURCE - 1} BPE "
                       "tokens) or of more than 1 sentence split into sentences (first: line 2)")
    code, said = translate_in_process(capsys, tmp_path / "in.en", "-o", tmp_path / "pairs.de", "--too-long", "split",
                                      "--max-sentences-per-input", 2, "--too-long-sentence", "skip", *raw)
    pairs = (tmp_path / "pairs.de").read_text().splitlines()
    assert code == 0 and pairs[0] == out[0] and pairs[1] != out[1] and len(pairs) == len(lines)
    code, said = translate_in_process(capsys, tmp_path / "in.en", "-o", tmp_path / "refused.de", "--too-long", "split",
                                      *raw)  # --too-long-sentence refuse
    assert code == 1 and said[-1].endswith(
        f"line 5 has a sentence of {MAX_SOURCE + 4} BPE tokens; the model takes at most {MAX_SOURCE - 1}: split it, "
        f"or pass --too-long-sentence skip or truncate (the 4 lines before it: translated to --output "
        f"{tmp_path / 'refused.de'})")
    assert (tmp_path / "refused.de").read_text().splitlines() == out[:4]
    code, said = translate_in_process(capsys, tmp_path / "in.en", "--too-long", "split", *_bpe_args(data_bin, *model))
    assert code == 2 and said[-1].endswith("error: --too-long split splits raw text into sentences: it needs "
                                           "--input-format raw")


SOURCES = [["w1"], ["w2", "w3"], ["w4", "w5", "w6"], ["w7", "w8", "w9", "w1"]]  # sorted by length, as batched


@pytest.mark.e2e
def test_nbest_with_scores_equal_to_ctranslate2s_own(tiny, tmp_path, capsys):
    data_bin, _, ct2, _ = tiny
    (tmp_path / "in.en").write_text(_lines_of(SOURCES))
    json_out, text_out = tmp_path / "nbest.jsonl", tmp_path / "nbest.txt"
    assert translate_in_process(capsys, tmp_path / "in.en", "-o", json_out, "--nbest", 3, "--json-lines",
                                *_bpe_args(data_bin, "--model-dir", ct2)) == (0, [])
    assert translate_in_process(capsys, tmp_path / "in.en", "-o", text_out, "--nbest", 3,
                                *_bpe_args(data_bin, "--model-dir", ct2)) == (0, [])
    import ctranslate2

    own = ctranslate2.Translator(str(ct2), device="cpu", intra_threads=1).translate_batch(
        SOURCES, beam_size=4, length_penalty=0.6, max_decoding_length=200, num_hypotheses=3, return_scores=True)
    records = [json.loads(line) for line in json_out.read_text().splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 4]
    assert [[(t["text"].split(), t["score"]) for t in r["translations"]] for r in records] == [
        list(zip(result.hypotheses, result.scores)) for result in own]
    assert all(len(r["translations"]) == 3 for r in records)
    # plain text: three lines per input line, best first
    assert text_out.read_text().splitlines() == [t["text"] for r in records for t in r["translations"]]
    code, lines = translate_in_process(capsys, tmp_path / "in.en", "--nbest", 5, "--beam", 4,
                                       *_bpe_args(data_bin, "--model-dir", ct2))
    assert code == 2 and "--nbest 5: beam search keeps --beam 4 hypotheses" in lines[-1]


@pytest.mark.e2e
def test_nbest_from_fairseq_starts_with_its_best(tiny, tmp_path, capsys):
    data_bin, checkpoint, _, _ = tiny
    model = _bpe_args(data_bin, "--engine", "fairseq", "--checkpoint", checkpoint)
    (tmp_path / "in.en").write_text(_lines_of(SOURCES))
    assert translate_in_process(capsys, tmp_path / "in.en", "-o", tmp_path / "best.de", *model) == (0, [])
    assert translate_in_process(capsys, tmp_path / "in.en", "-o", tmp_path / "nbest.jsonl", "--nbest", 2,
                                "--json-lines", *model) == (0, [])
    records = [json.loads(line) for line in (tmp_path / "nbest.jsonl").read_text().splitlines()]
    assert [r["translations"][0]["text"] for r in records] == (tmp_path / "best.de").read_text().splitlines()
    assert all(len(r["translations"]) == 2 and r["translations"][0]["score"] >= r["translations"][1]["score"]
               for r in records)


def _read_line(stream, timeout):
    """A line of ``stream`` (unbuffered bytes) within ``timeout`` seconds, else what came before."""
    import select
    import time

    data, deadline = b"", time.monotonic() + timeout
    while not data.endswith(b"\n") and time.monotonic() < deadline:
        if select.select([stream], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(stream.fileno(), 1)
            if not chunk:
                break
            data += chunk
    return data


@pytest.mark.e2e
def test_a_line_is_answered_while_stdin_stays_open(tiny, tmp_path):
    """From a pipe, each line's translation comes out while the pipe stays open: the command can
    serve a process that writes a line and waits for its answer."""
    data_bin, _, ct2, _ = tiny
    (tmp_path / "in.en").write_text(_lines_of(SOURCES[:2]))
    run_cli(["fairseq-rope-translate", tmp_path / "in.en", "-o", tmp_path / "file.de", "--threads", "1",
             *_bpe_args(data_bin, "--model-dir", ct2)])
    expected = (tmp_path / "file.de").read_bytes().splitlines(keepends=True)
    cmd, env = cli_command(["fairseq-rope-translate", "--threads", "1", "--quiet",
                            *_bpe_args(data_bin, "--model-dir", ct2)], None)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            bufsize=0)
    try:
        for source, translation in zip(SOURCES[:2], expected):
            proc.stdin.write((" ".join(source) + "\n").encode())
            assert _read_line(proc.stdout, timeout=60) == translation
            assert proc.poll() is None  # answered, and still reading its open input
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0 and proc.stdout.read() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- issue 45: no line lost before a refused one; a line's bytes capped; Ctrl-C one line -------------
@pytest.mark.e2e
@pytest.mark.parametrize("words, says", [(1000, "line 3 has 1000 BPE tokens; the model takes at most 15"),
                                         (10_000, "line 3 is 29999 bytes long, more than the model's 15 BPE tokens")],
                         ids=["segmented", "over the byte cap"])
def test_the_lines_before_a_refused_one_are_translated_and_written(tiny, tmp_path, capsys, words, says):
    """Under --too-long refuse, from a file (-o) and from a pipe (standard output): the lines before
    the refused one are translated and written, then one line names it, status 1."""
    data_bin, _, ct2, _ = tiny
    good = [["w1", "w2", "w3"], ["w4", "w5"]]
    (tmp_path / "good.en").write_text(_lines_of(good))
    assert translate_in_process(capsys, tmp_path / "good.en", "-o", tmp_path / "good.de",
                                *_bpe_args(data_bin, "--model-dir", ct2)) == (0, [])
    expected = (tmp_path / "good.de").read_text().splitlines()
    long = [f"w{i % 10}" for i in range(words)]
    (tmp_path / "in.en").write_text(_lines_of(good + [long, ["w6"]]))
    line = _refused(capsys, f"{tmp_path / 'in.en'}: {says}", tmp_path / "in.en", "-o", tmp_path / "out.de",
                    *_bpe_args(data_bin, "--model-dir", ct2), status=1)
    assert line.endswith(f"(the 2 lines before it: translated to --output {tmp_path / 'out.de'})"), line
    assert (tmp_path / "out.de").read_text().splitlines() == expected

    cmd, env = cli_command(["fairseq-rope-translate", "--threads", "1", "--quiet",
                            *_bpe_args(data_bin, "--model-dir", ct2)], None)
    done = subprocess.run(cmd, input=(tmp_path / "in.en").read_bytes(), capture_output=True, env=env, timeout=120)
    said = done.stderr.decode().strip().splitlines()
    assert done.returncode == 1 and len(said) == 1 and says in said[0], said
    assert said[0].endswith("(the 2 lines before it: translated to standard output)")
    assert done.stdout.decode().splitlines() == expected


def test_a_line_is_read_only_up_to_its_cap(tmp_path):
    """A 30 MB line without an end is never held: the reader's memory stays within a few of its
    caps, and the line comes as its first bytes with its length."""
    import tracemalloc

    from fairseq_rope_tools.text_lines import LineReader, OverlongLine

    path = tmp_path / "endless.en"
    with open(path, "wb") as f:
        f.write("short é\n".encode())
        for _ in range(30):
            f.write(("wörd " * 200_000).encode())  # 1.2 MB
        f.write(b"\nlast\n")
    tracemalloc.start()
    try:
        lines = list(LineReader(path, max_bytes=1000))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert lines[0] == "short é" and lines[2] == "last" and not isinstance(lines[0], OverlongLine)
    assert isinstance(lines[1], OverlongLine) and lines[1].length == 30 * 6 * 200_000
    assert len(lines[1].encode()) <= 1000 and lines[1].startswith("wörd wörd")
    assert peak < 1_000_000, peak


@pytest.mark.e2e
def test_an_endless_line_from_a_pipe_costs_no_memory(tiny, tmp_path):
    """60 MB of one line, piped under --too-long skip: an empty translation for it, the next line
    translated, and the process' peak memory far below the line's size (it was a 5.4 GB spike for
    100 MB, and an OOM kill for an endless one)."""
    data_bin, _, ct2, _ = tiny
    cmd, env = cli_command(["fairseq-rope-translate", "--threads", "1", "--quiet", "--too-long", "skip",
                            *_bpe_args(data_bin, "--model-dir", ct2)], None)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        chunk = b"w1 w2 w3 " * 100_000  # 0.9 MB
        for _ in range(67):
            proc.stdin.write(chunk)
        proc.stdin.write(b"\nw4 w5\n")
        proc.stdin.flush()
        with open(f"/proc/{proc.pid}/status") as f:
            peak_kib = int(next(line for line in f if line.startswith("VmHWM:")).split()[1])
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    assert out.decode().split("\n")[0] == "" and out.decode().split("\n")[1] != ""
    assert "1 line longer than the model takes" in err.decode()
    assert peak_kib < 40_000 + 400_000, f"peak resident memory {peak_kib} KiB"


@pytest.mark.e2e
def test_ctrl_c_is_one_line_and_status_130(tiny, tmp_path):
    data_bin, _, ct2, _ = tiny
    cmd, env = cli_command(["fairseq-rope-translate", "--threads", "1", "--quiet",
                            *_bpe_args(data_bin, "--model-dir", ct2)], None)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            bufsize=0, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        proc.stdin.write(b"w1 w2\n")
        assert _read_line(proc.stdout, timeout=60).strip()  # it is reading its input
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert err.decode().splitlines() == ["fairseq-rope-translate: interrupted (Ctrl-C)"]
