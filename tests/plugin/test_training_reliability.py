"""fairseq-train with the plugin: one training per --save-dir (a lock, taken over after a crash),
a save dir it cannot write named in one line, a resume that keeps the trained model's options and
says which values to resume with, a resume from a checkpoint without recorded lengths that says
so, the dictionaries every checkpoint records; and averaging a checkpoint deleted under it."""

import argparse
import builtins
import errno
import logging
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from support.checkpoints import make_checkpoint, random_params, stopped, train_args, updates_in
from support.commands import run_cli

from fairseq_rope import checkpoints, save_dir_lock
from fairseq_rope.checkpoint_files import model_config
from fairseq_rope.checkpoints import DICTIONARIES, TRAINING_CHECKPOINT, dictionary_fingerprint
from fairseq_rope.config_values import OneLineError, OptionError
from fairseq_rope.model_options import check_resumed_model
from fairseq_rope.save_dir_lock import lock_file, lock_save_dir
from fairseq_rope.training_lengths import covering_length
from fairseq_rope_tools.checkpoints import average_checkpoints as avg


@pytest.fixture(scope="module")
def trained_2(tiny_data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("trained_2")
    run_cli(["fairseq-train", *train_args(tiny_data_bin / "data-bin", save_dir, 2)])
    return tiny_data_bin / "data-bin", save_dir


@pytest.fixture
def resumable(trained_2, tmp_path):
    """A copy of the trained save dir, for a run that resumes from its checkpoint_last.pt."""
    data_bin, trained = trained_2
    save_dir = tmp_path / "save dir"
    shutil.copytree(trained, save_dir)
    return data_bin, save_dir


def snapshot(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


# --- one training per --save-dir ------------------------------------------------------------------

def _hold_lock(save_dir, ready):
    lock_save_dir(save_dir)
    ready.set()
    time.sleep(600)


def hold_lock_in_another_process(save_dir):
    """A process that holds the save dir's lock as a training does (forked: no second import)."""
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    holder = context.Process(target=_hold_lock, args=(str(save_dir), ready), daemon=True)
    holder.start()
    assert ready.wait(60), "the holder did not take the lock"
    return holder


@pytest.mark.e2e
def test_the_lock_file_is_no_checkpoint_and_a_clean_exit_removes_it(trained_2):
    _, save_dir = trained_2
    name = os.path.basename(lock_file(save_dir))
    assert name == ".fairseq-train.lock"
    assert not (TRAINING_CHECKPOINT.fullmatch(name) or avg.EPOCH_RE.match(name) or avg.UPDATE_RE.match(name))
    assert sorted(p.name for p in save_dir.iterdir()) == ["checkpoint_best.pt", "checkpoint_last.pt"]


@pytest.mark.e2e
def test_a_second_training_refuses_the_save_dir_and_one_left_by_a_crash_is_taken_over(resumable):
    data_bin, save_dir = resumable
    holder = hold_lock_in_another_process(save_dir)
    before = snapshot(save_dir)
    try:
        proc = run_cli(["fairseq-train", *train_args(data_bin, save_dir, 3)], check=False)
    finally:
        holder.kill()  # a crash: SIGKILL runs no clean-up
        holder.join()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert last_line(proc) == (
        f"fairseq-train: error: --save-dir {save_dir} is in use by another training: PID {holder.pid} on "
        f"{socket.gethostname()}. One training per save dir: wait for it to end, or train in another --save-dir")
    assert "Loaded checkpoint" not in proc.stdout + proc.stderr
    assert snapshot(save_dir) == before  # no checkpoint read for resuming, none written, the holder's record kept

    # the holder died with the lock file still naming it: the next training takes the save dir over
    assert (save_dir / ".fairseq-train.lock").read_text() == f"{holder.pid} {socket.gethostname()}\n"
    run_cli(["fairseq-train", *train_args(data_bin, save_dir, 3)])
    assert updates_in(save_dir / "checkpoint_last.pt") == 3
    assert not (save_dir / ".fairseq-train.lock").exists()


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("holder_runs", [False, True])
def test_without_file_system_locks_the_recorded_pid_decides(tmp_path, monkeypatch, holder_runs):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(save_dir_lock.fcntl, "flock", no_locks)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        pid = sleeper.pid if holder_runs else dead_pid()
        (tmp_path / ".fairseq-train.lock").write_text(f"{pid} {socket.gethostname()}\n")
        if holder_runs:
            with pytest.raises(OneLineError, match=f"in use by another training: PID {pid} on "):
                lock_save_dir(tmp_path)
        else:
            lock_save_dir(tmp_path)
            assert (tmp_path / ".fairseq-train.lock").read_text() == f"{os.getpid()} {socket.gethostname()}\n"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_lock_file_that_is_a_directory_is_one_line(tmp_path):
    os.mkdir(lock_file(tmp_path))
    with pytest.raises(OneLineError) as e:
        lock_save_dir(tmp_path)
    assert str(e.value) == (f"{lock_file(tmp_path)} is a directory, where fairseq-train keeps the lock file of "
                            f"--save-dir {tmp_path}: remove or rename it")


def deny_writes_under(directory, monkeypatch):
    """Files under ``directory`` cannot be created or written, as in a read-only save dir (the
    tests run as root too, whom a file mode does not stop)."""
    real_open, real_os_open = builtins.open, os.open

    def under(path):
        return isinstance(path, (str, os.PathLike)) and os.path.abspath(path).startswith(f"{directory}{os.sep}")

    def denied(path):
        return PermissionError(errno.EACCES, "Permission denied", str(path))

    def open_(file, mode="r", *args, **kwargs):
        if under(file) and set(mode) & set("wax+"):
            raise denied(file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if under(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise denied(path)
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "open", os_open)


def test_a_save_dir_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """fairseq-train checks its save dir (fairseq's verify_checkpoint_directory, which the plugin
    replaces) before it locks it; both say what is wrong in one line."""
    from fairseq import checkpoint_utils

    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    deny_writes_under(save_dir, monkeypatch)
    message = f"--save-dir {save_dir} cannot be written (Permission denied): give a directory you can write to"
    with pytest.raises(OneLineError) as e:
        checkpoint_utils.verify_checkpoint_directory(str(save_dir))
    assert str(e.value) == message
    with pytest.raises(OneLineError) as e:
        lock_save_dir(save_dir)
    assert str(e.value) == message
    a_file = tmp_path / "notes.txt"
    a_file.write_text("a file\n")
    with pytest.raises(OneLineError, match=re.escape(f"--save-dir {a_file} is a file, not a directory")):
        checkpoint_utils.verify_checkpoint_directory(str(a_file))


def test_the_save_dir_check_leaves_a_file_named_dummy_alone(tmp_path):
    """fairseq's own check opens SAVE_DIR/dummy for writing and deletes it."""
    from fairseq import checkpoint_utils

    (tmp_path / "dummy").write_text("the user's notes\n")
    checkpoint_utils.verify_checkpoint_directory(str(tmp_path / "new" / "ckpt"))
    checkpoint_utils.verify_checkpoint_directory(str(tmp_path))
    assert (tmp_path / "dummy").read_text() == "the user's notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dummy", "new"]


def fake_trainer(save_dir, rank_saves=True, finetune_from_model=None, model_cfg=None, model=None):
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(finetune_from_model=finetune_from_model), model=model_cfg)
    task = SimpleNamespace(source_dictionary=None, target_dictionary=None, cfg=SimpleNamespace())  # none to compare
    return SimpleNamespace(cfg=cfg, should_save_checkpoint_on_current_rank=rank_saves, checkpoint_suffix="",
                           get_model=lambda: model, task=task)


@pytest.mark.parametrize("no_save, rank_saves", [(True, True), (False, False)])
def test_runs_that_write_no_checkpoints_take_no_lock(tmp_path, no_save, rank_saves):
    """--no-save, and the DDP ranks other than the one that saves (tests/plugin/test_distributed.py runs both)."""
    load = checkpoints._one_training_per_save_dir(lambda cfg, trainer: "loaded")
    cfg = SimpleNamespace(no_save=no_save, save_dir=str(tmp_path))
    assert load(cfg, fake_trainer(tmp_path, rank_saves)) == "loaded"
    assert not os.path.exists(lock_file(tmp_path))


# --- a resume keeps the options that define the trained model -------------------------------------

@pytest.mark.e2e
def test_resume_with_another_rope_theta_is_refused_in_one_line(resumable):
    data_bin, save_dir = resumable
    before = snapshot(save_dir)
    proc = run_cli(["fairseq-train", *train_args(data_bin, save_dir, 3), "--rope-theta", "500",
                    "--reset-optimizer", "--reset-dataloader"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    checkpoint = save_dir / "checkpoint_last.pt"
    assert last_line(proc) == (
        f"fairseq-train: error: cannot resume {checkpoint} as another model: --rope-theta 500.0 (the checkpoint "
        "has 10000.0). These options define the trained model: resume with the checkpoint's values "
        "(--rope-theta 10000.0), or train the changed model in a new --save-dir")
    assert snapshot(save_dir) == before  # its lock file removed too


def command_line_model(*flags, arch="transformer_rope_tiny"):
    """The model configuration fairseq-train makes of a command line (architecture defaults filled)."""
    from fairseq import options

    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, ["data", "--arch", arch, "--task", "translation",
                                                "--optimizer", "adam", "--lr", "3e-3", *flags])


@pytest.fixture(scope="module")
def saved_model(trained_2):
    return model_config(torch.load(trained_2[1] / "checkpoint_last.pt", map_location="cpu"))


@pytest.mark.e2e
@pytest.mark.parametrize("flags", [
    [],
    ["--rope-theta", "10000", "--rope-layout", "interleaved", "--encoder-layers", "2"],  # defaults, restated
    ["--lr", "1e-4", "--dropout", "0.3", "--attention-dropout", "0.1", "--max-tokens", "99"],
    ["--rope-scaling", "ntk", "--rope-scaling-factor", "2"],  # chooses how the model runs on longer inputs
])
def test_resume_may_change_what_does_not_define_the_model(saved_model, flags):
    check_resumed_model(command_line_model(*flags), saved_model, "ckpt.pt")


@pytest.mark.e2e
@pytest.mark.parametrize("arch, flags, named", [
    ("transformer_rope_tiny", ["--rope-layout", "half"], "--rope-layout half (the checkpoint has interleaved)"),
    ("transformer_rope_tiny", ["--rope-values"], "--rope-values True (the checkpoint has False)"),
    ("transformer_rope_tiny", ["--encoder-layers", "3"], "--encoder-layers 3 (the checkpoint has 2)"),
    ("transformer_rope_tiny", ["--activation-fn", "gelu"], "--activation-fn gelu (the checkpoint has relu)"),
    ("transformer_rope", [], "--arch transformer_rope (the checkpoint has transformer_rope_tiny)"),
    ("transformer_rpe_tiny", [], "--arch transformer_rpe_tiny (the checkpoint has transformer_rope_tiny)"),
    ("transformer_tiny", [], "--arch transformer_tiny (the checkpoint has transformer_rope_tiny)"),
])
def test_resume_as_another_model_is_refused_naming_the_option(saved_model, arch, flags, named):
    with pytest.raises(OptionError, match=re.escape(f"cannot resume ckpt.pt as another model: {named}")):
        check_resumed_model(command_line_model(*flags, arch=arch), saved_model, "ckpt.pt")


@pytest.mark.e2e
def test_fine_tuning_from_a_model_may_change_its_options_and_says_which(trained_2, caplog):
    """--finetune-from-model starts a new training from another model's weights (e.g. with a
    larger --rope-theta for longer inputs): named in the log, not refused. A resume is refused."""
    pretrained = str(trained_2[1] / "checkpoint_last.pt")
    load = checkpoints._resume_checks_the_model(lambda trainer, filename, *args: "loaded")
    changed = command_line_model("--rope-theta", "500")
    with caplog.at_level(logging.WARNING, logger="fairseq_rope.checkpoints"):
        assert load(fake_trainer(None, finetune_from_model=pretrained, model_cfg=changed), pretrained) == "loaded"
    assert f"fine-tuning {pretrained} with --rope-theta 500.0 (it was trained with 10000.0)" in caplog.text
    with pytest.raises(OptionError, match="--rope-theta 500.0 "):
        load(fake_trainer(None, model_cfg=changed), pretrained)


def test_a_resume_without_the_options_a_fine_tuning_gave_names_the_values_to_add():
    """A fine-tuning (--finetune-from-model ... --rope-theta 500 --rope-values) wrote its
    checkpoint_last.pt; a resume whose command line lacks those options gets the defaults, so
    "drop them" would be wrong: the message names the values to give."""
    fine_tuned = command_line_model("--rope-theta", "500", "--rope-values")
    with pytest.raises(OptionError) as e:
        check_resumed_model(command_line_model(), fine_tuned, "ckpt.pt")
    assert str(e.value) == (
        "cannot resume ckpt.pt as another model: --rope-theta 10000.0 (the checkpoint has 500.0); --rope-values "
        "False (the checkpoint has True). These options define the trained model: resume with the checkpoint's "
        "values (--rope-theta 500.0, --rope-values), or train the changed model in a new --save-dir")


def _checkpoint_recording_lengths(path, counts):
    """A checkpoint whose saved model configuration records training lengths, as training writes them."""
    model_cfg = argparse.Namespace(arch="transformer_rope_tiny", rope_trained_length=len(counts) - 1,
                                   rope_trained_length_counts=counts)
    torch.save({"model": {}, "cfg": {"model": model_cfg}}, path)
    return path


def test_a_resume_with_yarn_names_the_L_its_checkpoint_records(tmp_path, monkeypatch):
    """fairseq-train builds the model from the command line before it loads the checkpoint it
    resumes: the check of --rope-scaling yarn cannot take L from it, and says so with its value.
    Only fairseq-train: fairseq-generate builds from a checkpoint's configuration, which names its
    training's --save-dir too, whatever checkpoint it holds now."""
    counts = [0, 0, 3, 40, 150, 1]  # L = 4: 99 % of them have at most 4 tokens; the longest has 5
    last = _checkpoint_recording_lengths(tmp_path / "checkpoint_last.pt", counts)
    scaling = ["--rope-scaling", "yarn", "--rope-scaling-factor", "2"]
    with pytest.raises(OptionError, match="which the checkpoint does not record"):  # as fairseq-generate
        command_line_model("--save-dir", str(tmp_path), *scaling)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/fairseq-train"])
    with pytest.raises(OptionError) as e:
        command_line_model("--save-dir", str(tmp_path), *scaling)
    length = covering_length(counts)
    assert length == 4 and str(e.value) == (
        f"--rope-scaling yarn needs the training length L when the model is built, and fairseq-train builds it "
        f"from the command line before it loads {last}: pass --rope-scaling-original-length 4, the L that {last} "
        "records")
    command_line_model("--save-dir", str(tmp_path), *scaling, "--rope-scaling-original-length", str(length))
    # a fine-tuning's first run: the model it starts from
    pretrained = _checkpoint_recording_lengths(tmp_path / "pretrained.pt", counts)
    with pytest.raises(OptionError, match=re.escape(f"before it loads {pretrained}: pass --rope-scaling-original")):
        command_line_model("--save-dir", str(tmp_path / "new"), "--finetune-from-model", str(pretrained), *scaling)
    # nothing to resume: the check's own message
    with pytest.raises(OptionError, match="which the checkpoint does not record"):
        command_line_model("--save-dir", str(tmp_path / "new"), *scaling)


# --- the dictionaries every checkpoint records ---------------------------------------------------

def test_a_checkpoint_records_the_fingerprints_of_its_dictionaries():
    from fairseq.data import Dictionary

    source, target = Dictionary(), Dictionary()
    for word in ("Haus", "Katze"):
        source.add_symbol(word)
    for word in ("Katze", "Haus"):
        target.add_symbol(word)
    state_dict = checkpoints._records_dictionaries(lambda trainer: {"model": {}})
    task = SimpleNamespace(source_dictionary=source, target_dictionary=target)
    assert state_dict(SimpleNamespace(task=task))[DICTIONARIES] == {
        "source": dictionary_fingerprint(source), "target": dictionary_fingerprint(target)}
    assert dictionary_fingerprint(source) != dictionary_fingerprint(target)  # the order counts
    assert DICTIONARIES not in state_dict(SimpleNamespace(task=SimpleNamespace()))  # a task without dictionaries


@pytest.mark.e2e
def test_fairseq_train_records_the_dictionaries_of_its_data_bin(trained_2):
    from fairseq.data import Dictionary

    data_bin, save_dir = trained_2
    recorded = torch.load(save_dir / "checkpoint_last.pt")[DICTIONARIES]
    assert recorded == {"source": dictionary_fingerprint(Dictionary.load(str(data_bin / "dict.en.txt"))),
                        "target": dictionary_fingerprint(Dictionary.load(str(data_bin / "dict.de.txt")))}


# --- training lengths -------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_resume_from_a_checkpoint_without_recorded_lengths_says_where_the_counts_start(trained_2, tmp_path,
                                                                                        caplog):
    state = torch.load(trained_2[1] / "checkpoint_last.pt", map_location="cpu")
    for name in ("rope_trained_length", "rope_trained_length_counts"):  # saved before they were recorded
        del model_config(state)[name]
    older = tmp_path / "checkpoint_last.pt"
    torch.save(state, older)
    model = SimpleNamespace(training_lengths=None)
    load = checkpoints._resume_continues_training_lengths(lambda trainer, filename, *args: {"extra": 1})
    with caplog.at_level(logging.WARNING, logger="fairseq_rope.checkpoints"):
        load(fake_trainer(None, model=model), str(older))
        assert [r.getMessage() for r in caplog.records] == [
            f"{older} records no sequence-length counts (saved before they were recorded): the counts, and the "
            "L of --rope-scaling yarn and dynamic-* taken from them, start at this resume and cover only the "
            "batches trained from now on"]
        caplog.clear()
        load(fake_trainer(None, model=model), str(trained_2[1] / "checkpoint_last.pt"))  # has its counts
        assert caplog.records == []
    assert model.training_lengths.counts is not None


# --- averaging ----------------------------------------------------------------------------------

def test_averaging_a_checkpoint_deleted_after_listing_names_the_file_that_disappeared(tmp_path, monkeypatch, capsys):
    for update in (1, 2):
        make_checkpoint(tmp_path / f"checkpoint_1_{update}.pt", random_params(update))
    listed = avg.last_n_checkpoints

    def listed_then_deleted(*args):
        paths = listed(*args)
        os.unlink(paths[-1])  # a training's --keep-interval-updates removed it meanwhile
        return paths

    monkeypatch.setattr(avg, "last_n_checkpoints", listed_then_deleted)
    message = stopped(["--inputs", str(tmp_path), "--num-update-checkpoints", "2", "--output", str(tmp_path / "avg.pt")],
                      capsys)
    assert message == (f"cannot load {tmp_path / 'checkpoint_1_1.pt'}: the file disappeared after it "
                       "was listed (deleted or renamed: is a training still writing to that directory?)")
    assert not (tmp_path / "avg.pt").exists()
