"""fairseq-rope-export loses nothing and never passes a stale model for the current one:
--force replaces only an earlier export (never the save dir or the data-bin, also through
evaluate.sh); export_info.json hashes the bytes that were converted; a bad checkpoint, data-bin or
output is one line with nothing left behind; a killed export's workspace is removed next time."""

import errno
import fcntl
import hashlib
import json
import os
import shutil

import pytest
from support.commands import REPO, run_cli

from fairseq_rope_base import files

pytest.importorskip("ctranslate2")
from fairseq_rope_tools.deploy import checkpoint_export as exporter  # noqa: E402  (after the skip)
from fairseq_rope_tools.deploy import export_ctranslate2  # noqa: E402
from fairseq_rope_tools.deploy.exported import EXPORT_INFO  # noqa: E402

# every test converts a checkpoint that a module fixture trains with fairseq-train
pytestmark = pytest.mark.e2e

EVALUATE = REPO / "examples" / "wmt14_en_de" / "evaluate.sh"
ERROR = "error: "  # after the program's name, which main() in-process takes from sys.argv[0]


@pytest.fixture(scope="module")
def trained_checkpoint(tiny_data_bin, tmp_path_factory):
    """A transformer_rope_tiny checkpoint after 2 updates: converting it is all these tests need."""
    save_dir = tmp_path_factory.mktemp("export_reliability") / "save"
    run_cli(["fairseq-train", tiny_data_bin / "data-bin", "--user-dir", "fairseq_rope", "--arch",
             "transformer_rope_tiny", "--task", "translation", "--cpu", "--optimizer", "adam", "--lr", "5e-3",
             "--max-tokens", "1500", "--max-update", "2", "--seed", "1", "--criterion", "cross_entropy",
             "--disable-validation", "--no-epoch-checkpoints", "--save-dir", save_dir, "--num-workers", "0"])
    return save_dir / "checkpoint_last.pt"


@pytest.fixture
def work(tiny_data_bin, trained_checkpoint, tmp_path):
    """A save dir of this test's own (checkpoint, train.log, notes) and the data-bin, with the
    tiny corpus's test set as the recipe's references."""
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    shutil.copy(trained_checkpoint, save_dir / "checkpoint_last.pt")
    (save_dir / "train.log").write_text("epoch 1 | loss 9.9\n")
    (save_dir / "notes.txt").write_text("run 1: theta 10000\n")
    data_bin = tmp_path / "data-bin"
    shutil.copytree(tiny_data_bin / "data-bin", data_bin)
    return save_dir / "checkpoint_last.pt", data_bin


def contents(directory):
    """Every file under ``directory`` with its sha256: what 'nothing deleted or changed' compares."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def export_main(capsys, checkpoint, data_bin, output_dir, *extra):
    """main() in-process: (exit status, stderr lines)."""
    try:
        export_ctranslate2.main(["--checkpoint", str(checkpoint), "--data-bin", str(data_bin), "--output-dir", str(output_dir),
                       *extra])
        status = 0
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err.strip().splitlines()


def assert_refused(status, lines, flag, *phrases):
    assert status == 2 and not any("Traceback" in line for line in lines), lines
    assert ERROR + flag in lines[-1], lines[-1]
    for phrase in phrases:
        assert phrase in lines[-1], lines[-1]


def hidden(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# --- case 1: --force replaces only an earlier export ------------------------------------------
@pytest.mark.parametrize("target", ["save dir", "data-bin", "their parent"])
@pytest.mark.parametrize("flags", [["--force"], ["--force", "--if-changed"]])
def test_force_refuses_a_directory_that_holds_the_checkpoint_or_the_data_bin(capsys, work, target, flags):
    checkpoint, data_bin = work
    output_dir = {"save dir": checkpoint.parent, "data-bin": data_bin, "their parent": data_bin.parent}[target]
    before = contents(output_dir)
    status, lines = export_main(capsys, checkpoint, data_bin, output_dir, *flags)
    held = "is --data-bin" if target == "data-bin" else "holds --checkpoint"
    assert_refused(status, lines, f"--output-dir {output_dir} {held}", "the output would overwrite its own input")
    assert contents(output_dir) == before


@pytest.mark.parametrize("kind", ["directory of other files", "export with a file added", "regular file"])
def test_force_refuses_what_is_not_an_export(capsys, work, tmp_path, kind):
    checkpoint, data_bin = work
    output_dir = tmp_path / "out"
    if kind == "regular file":
        output_dir.write_text("my notes\n")
    elif kind == "directory of other files":
        output_dir.mkdir()
        (output_dir / "results.txt").write_text("BLEU 27.3\n")
    else:
        exporter.export(str(checkpoint), str(data_bin), str(output_dir))
        (output_dir / "notes.txt").write_text("int8 is 1.4x faster\n")
    before = output_dir.read_bytes() if kind == "regular file" else contents(output_dir)
    status, lines = export_main(capsys, checkpoint, data_bin, output_dir, "--force")
    assert_refused(status, lines, f"--output-dir {output_dir} is ")
    assert (output_dir.read_bytes() if kind == "regular file" else contents(output_dir)) == before
    assert hidden(tmp_path) == []


def test_force_replaces_an_empty_directory_or_an_earlier_export(capsys, work, tmp_path):
    checkpoint, data_bin = work
    output_dir = tmp_path / "ct2"
    output_dir.mkdir()
    assert export_main(capsys, checkpoint, data_bin, output_dir, "--force")[0] == 0
    info = json.loads((output_dir / EXPORT_INFO).read_text())
    # the model's length limits (translate.py refuses longer lines), beside the keys there were
    import torch

    model_cfg = torch.load(checkpoint, map_location="cpu", weights_only=False)["cfg"]["model"]
    assert (info["max_source_positions"], info["max_target_positions"]) == (
        model_cfg["max_source_positions"], model_cfg["max_target_positions"]) and info["max_source_positions"] > 0
    assert {"checkpoint", "size", "sha256", "data_bin", "quantization", "arch", "overrides"} <= info.keys()
    first = (output_dir / "model.bin").stat().st_ino
    status, lines = export_main(capsys, checkpoint, data_bin, output_dir, "--force", "--quantization", "int8")
    assert status == 0 and (output_dir / "model.bin").stat().st_ino != first
    assert json.loads((output_dir / EXPORT_INFO).read_text())["quantization"] == "int8"
    assert hidden(tmp_path) == []
    # an export that does not record the length limits (older versions) is exported again
    del info["max_source_positions"]
    (output_dir / EXPORT_INFO).write_text(json.dumps(dict(info, quantization="int8")))
    assert not exporter.is_current(str(output_dir), str(checkpoint), "int8")


def test_evaluate_with_ct2_dir_in_the_save_dir_refuses_and_deletes_nothing(tiny_data_bin, work):
    checkpoint, data_bin = work
    save_dir = checkpoint.parent
    before = contents(save_dir)
    corpus = tiny_data_bin
    proc = run_cli(["bash", EVALUATE, "--engine", "ctranslate2"], check=False, env={
        "WORK_DIR": str(save_dir.parent), "DATA_BIN": str(data_bin), "SAVE_DIR": str(save_dir),
        "CHECKPOINT": str(checkpoint), "CT2_DIR": str(save_dir), "REF_TOK": str(corpus / "test.de"),
        "REF_RAW": str(corpus / "test.de"), "BPE_SRC": str(corpus / "test.en"), "CPU": "1", "THREADS": "1"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"[evaluate] error: export to CTranslate2 refused (CT2_DIR is its --output-dir): --output-dir {save_dir} "
        f"holds --checkpoint {checkpoint}: the output would overwrite its own input; give another output")
    after = contents(save_dir)  # evaluate.sh's own eval dir is all that was added
    assert {k: v for k, v in after.items() if not k.startswith("eval_")} == before


# --- case 2: the identity is that of the bytes converted --------------------------------------
def _another_checkpoint(checkpoint, path):
    """The same model with other weights, as the next save of a running training would be."""
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    weight = state["model"]["encoder.embed_tokens.weight"]
    weight += 0.5
    torch.save(state, path)
    return path


def test_a_checkpoint_replaced_during_the_export_is_not_taken_as_exported(capsys, work, tmp_path, monkeypatch):
    checkpoint, data_bin = work
    converted = sha256(checkpoint)
    newer = _another_checkpoint(checkpoint, tmp_path / "newer.pt")
    newer_sha = sha256(newer)
    check_exportable = exporter.check_exportable

    def replaced_after_loading(args):  # the training saves checkpoint_last.pt while the export converts
        os.replace(newer, checkpoint)
        return check_exportable(args)

    monkeypatch.setattr(exporter, "check_exportable", replaced_after_loading)
    output_dir = tmp_path / "ct2"
    assert export_main(capsys, checkpoint, data_bin, output_dir)[0] == 0
    monkeypatch.undo()
    assert json.loads((output_dir / EXPORT_INFO).read_text())["sha256"] == converted != newer_sha
    assert not exporter.is_current(str(output_dir), str(checkpoint))
    old_model = (output_dir / "model.bin").read_bytes()
    status, lines = export_main(capsys, checkpoint, data_bin, output_dir, "--if-changed", "--force")
    assert status == 0 and lines[-1].startswith("wrote ")
    assert json.loads((output_dir / EXPORT_INFO).read_text())["sha256"] == newer_sha
    assert (output_dir / "model.bin").read_bytes() != old_model
    status, lines = export_main(capsys, checkpoint, data_bin, output_dir, "--if-changed", "--force")
    assert status == 0 and lines[-1].endswith("already: nothing to do")


def test_a_checkpoint_replaced_while_it_is_read_is_refused(capsys, work, tmp_path, monkeypatch):
    from fairseq import checkpoint_utils

    checkpoint, data_bin = work
    newer = _another_checkpoint(checkpoint, tmp_path / "newer.pt")
    load = checkpoint_utils.load_checkpoint_to_cpu

    def replaced_while_loading(path, *args, **kwargs):
        state = load(path, *args, **kwargs)
        os.replace(newer, checkpoint)
        return state

    monkeypatch.setattr(checkpoint_utils, "load_checkpoint_to_cpu", replaced_while_loading)
    status, lines = export_main(capsys, checkpoint, data_bin, tmp_path / "ct2")
    assert_refused(status, lines, f"--checkpoint {checkpoint} changed while it was read", "export again")
    assert not (tmp_path / "ct2").exists() and hidden(tmp_path) == []


# --- issue 34, case 3: --if-changed keeps no bucket of another checkpoint ---------------------
def test_if_changed_re_exports_a_bucket_of_another_checkpoint(capsys, work, tmp_path):
    checkpoint, data_bin = work
    buckets, other = tmp_path / "buckets", tmp_path / "other"
    assert export_main(capsys, checkpoint, data_bin, buckets, "--length-buckets", "2")[0] == 0
    exported = (buckets / "yarn_x2" / "model.bin").read_bytes()
    newer = _another_checkpoint(checkpoint, tmp_path / "newer.pt")
    assert export_main(capsys, newer, data_bin, other, "--length-buckets", "2")[0] == 0
    shutil.rmtree(buckets / "yarn_x2")
    shutil.copytree(other / "yarn_x2", buckets / "yarn_x2")  # the manifest and plain/ still of checkpoint
    assert (buckets / "yarn_x2" / "model.bin").read_bytes() != exported
    status, lines = export_main(capsys, checkpoint, data_bin, buckets, "--length-buckets", "2", "--if-changed",
                                "--force")
    assert status == 0 and lines[-1].startswith("wrote "), lines
    assert (buckets / "yarn_x2" / "model.bin").read_bytes() == exported
    status, lines = export_main(capsys, checkpoint, data_bin, buckets, "--length-buckets", "2", "--if-changed",
                                "--force")
    assert status == 0 and lines[-1].endswith("already: nothing to do")


# --- case 10: bad inputs and outputs are one line, and leave nothing --------------------------
def _text(checkpoint, data_bin):
    checkpoint.write_text("this is not a checkpoint\n")


def _truncated(checkpoint, data_bin):
    checkpoint.write_bytes(checkpoint.read_bytes()[:100_000])


def _empty(checkpoint, data_bin):
    checkpoint.write_bytes(b"")


def _another_models_data_bin(checkpoint, data_bin):
    for lang in ("en", "de"):  # a smaller vocabulary: embeddings of another size
        path = data_bin / f"dict.{lang}.txt"
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:20]))


def _empty_data_bin(checkpoint, data_bin):
    shutil.rmtree(data_bin)
    data_bin.mkdir()


@pytest.mark.parametrize("spoil, flag, phrase", [
    (_text, "--checkpoint", "is not a complete checkpoint"),
    (_truncated, "--checkpoint", "is not a complete checkpoint"),
    (_empty, "--checkpoint", "is not a complete checkpoint"),
    (_another_models_data_bin, "--data-bin", "does not belong to --checkpoint"),
    (_empty_data_bin, "--data-bin", "holds no dictionary"),
], ids=["text checkpoint", "truncated checkpoint", "empty checkpoint", "another model's data-bin", "empty data-bin"])
def test_a_bad_input_is_one_line_and_leaves_nothing(capsys, work, tmp_path, spoil, flag, phrase):
    checkpoint, data_bin = work
    spoil(checkpoint, data_bin)
    output_dir = tmp_path / "exports" / "ct2"
    status, lines = export_main(capsys, checkpoint, data_bin, output_dir)
    assert_refused(status, lines, flag, phrase, "pass ")
    assert not (tmp_path / "exports").exists()


def test_a_read_only_parent_is_one_line_and_leaves_nothing(capsys, work, tmp_path, monkeypatch):
    checkpoint, data_bin = work
    parent = tmp_path / "read-only"
    parent.mkdir()
    parent.chmod(0o555)
    if os.geteuid() == 0:  # root writes anyway: refuse as the file system would
        def refused(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", str(parent))

        monkeypatch.setattr(files.tempfile, "mkdtemp", refused)
    try:
        status, lines = export_main(capsys, checkpoint, data_bin, parent / "ct2")
        assert_refused(status, lines, f"--output-dir {parent / 'ct2'}: cannot write it (Permission denied)",
                       "make its parent writable")
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)


def test_a_full_disk_is_one_line_and_keeps_the_earlier_export(capsys, work, tmp_path, monkeypatch):
    from ctranslate2.specs import model_spec

    checkpoint, data_bin = work
    output_dir = tmp_path / "ct2"
    exporter.export(str(checkpoint), str(data_bin), str(output_dir))
    earlier = contents(output_dir)

    def disk_full(self, path):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(model_spec.ModelSpec, "_serialize", disk_full)
    status, lines = export_main(capsys, checkpoint, data_bin, output_dir, "--force", "--quantization", "int8")
    assert_refused(status, lines, f"--output-dir {output_dir}: cannot write it (No space left on device)",
                   "free some space")
    assert contents(output_dir) == earlier and hidden(tmp_path) == []


# --- case 11: what a killed export left is removed by the next one ----------------------------
def test_a_killed_exports_workspaces_are_removed_by_the_next_export(capsys, work, tmp_path):
    checkpoint, data_bin = work
    killed = [tmp_path / ".ct2.k1ll3d00.tmp", tmp_path / ".ct2.0ld_0ne1.old"]  # .old: older versions
    for path in killed:
        (path / "model").mkdir(parents=True)
        (path / "model" / "model.bin").write_bytes(b"\0" * 1000)
    others = [tmp_path / ".ct2.int8.k1ll3d00.tmp", tmp_path / ".ct2.notes"]  # another output's, not ours
    for path in others:
        path.mkdir()
    running = tmp_path / ".ct2.runn1ng0.tmp"  # an export into ct2 at work: it holds the lock
    running.mkdir()
    fd = os.open(running, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert export_main(capsys, checkpoint, data_bin, tmp_path / "ct2")[0] == 0
    finally:
        os.close(fd)
    assert hidden(tmp_path) == sorted(p.name for p in [*others, running])


# --- issue 36: the bundle ------------------------------------------------------------------------------
def _prepared_work_dir(root):
    """The bpe/ step of a work dir as prepare.sh leaves it (subword-nmt)."""
    (root / "bpe").mkdir(parents=True)
    (root / "bpe" / "codes").write_text("#version: 0.2\nw 1</w>\n")
    (root / "bpe" / "vocab.en").write_text("w1 100\n")
    (root / "bpe" / ".done").write_text("# prepare.sh step record v1\noption BPE=subword-nmt\n"
                                        "option BPE_VOCAB_THRESHOLD=1\n")
    return root


def test_the_work_dirs_segmentation_is_bundled_and_if_changed_follows_it(capsys, work, tmp_path):
    checkpoint, data_bin = work
    work_dir, output_dir = _prepared_work_dir(tmp_path / "prepared"), tmp_path / "ct2"
    status, lines = export_main(capsys, checkpoint, data_bin, output_dir, "--work-dir", str(work_dir))
    assert status == 0 and lines[-1].endswith("a bundle with its segmentation (subword_nmt)"), lines
    manifest = json.loads((output_dir / "bundle.json").read_text())
    assert manifest["segmentation"]["codes"] == "bpe.codes" and manifest["segmentation"]["vocabulary_threshold"] == 1
    assert (output_dir / "bpe.codes").read_bytes() == (work_dir / "bpe" / "codes").read_bytes()
    status, lines = export_main(capsys, checkpoint, data_bin, output_dir, "--work-dir", str(work_dir), "--if-changed",
                                "--force")
    assert status == 0 and lines[-1].endswith("already: nothing to do")
    # without the work dir the bundle would hold no segmentation: not the export asked for
    status, lines = export_main(capsys, checkpoint, data_bin, output_dir, "--if-changed", "--force")
    assert status == 0 and lines[-1].endswith("the model only, no work dir of prepare.sh beside --data-bin: raw text "
                                              "will need fairseq-rope-translate --work-dir (or export with --work-dir)")
    assert not (output_dir / "bpe.codes").exists()
    export_main(capsys, checkpoint, data_bin, output_dir, "--work-dir", str(work_dir), "--force")
    (work_dir / "bpe" / "codes").write_text("#version: 0.2\nw 2</w>\n")  # BPE learnt again
    status, lines = export_main(capsys, checkpoint, data_bin, output_dir, "--work-dir", str(work_dir), "--if-changed",
                                "--force")
    assert status == 0 and lines[-1].startswith("wrote ")
    assert (output_dir / "bpe.codes").read_bytes() == (work_dir / "bpe" / "codes").read_bytes()


def test_a_work_dir_of_another_bpe_than_the_data_bins_is_refused(capsys, work, tmp_path):
    checkpoint, data_bin = work
    work_dir = _prepared_work_dir(tmp_path / "prepared")
    (data_bin / ".done").write_text("# prepare.sh step record v1\noption SRC=en\noption TGT=de\n"
                                    f"input bpe/codes 9 {'0' * 64} /elsewhere/bpe/codes\n")
    status, lines = export_main(capsys, checkpoint, data_bin, tmp_path / "ct2", "--work-dir", str(work_dir))
    assert_refused(status, lines, f"--work-dir {work_dir}: {work_dir / 'bpe' / 'codes'} is not the BPE that "
                   f"--data-bin {data_bin} was binarized with")
    status, lines = export_main(capsys, checkpoint, data_bin, tmp_path / "ct2", "--work-dir", str(tmp_path))
    assert_refused(status, lines, f"--work-dir {tmp_path} has no complete bpe/ step (bpe/.done)")
    assert not (tmp_path / "ct2").exists()
