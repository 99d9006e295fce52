"""fairseq-train with the plugin: one training per --save-dir (a lock, taken over after a crash),
a resume that keeps the trained model's options, a resume from a checkpoint without recorded
lengths that says so; and averaging a checkpoint deleted under it."""

import errno
import logging
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import run_cli
from test_average_checkpoints import make_checkpoint, random_params
from test_checkpoints import train_args, updates_in

from fairseq_rope import checkpoints, save_dir_lock
from fairseq_rope.checkpoints import TRAINING_CHECKPOINT
from fairseq_rope.config_values import OptionError
from fairseq_rope.model_options import check_resumed_model, model_config
from fairseq_rope.save_dir_lock import SaveDirInUse, lock_file, lock_save_dir
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
            with pytest.raises(SaveDirInUse, match=f"in use by another training: PID {pid} on "):
                lock_save_dir(tmp_path)
        else:
            lock_save_dir(tmp_path)
            assert (tmp_path / ".fairseq-train.lock").read_text() == f"{os.getpid()} {socket.gethostname()}\n"
    finally:
        sleeper.kill()
        sleeper.wait()


def fake_trainer(save_dir, rank_saves=True, finetune_from_model=None, model_cfg=None, model=None):
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(finetune_from_model=finetune_from_model), model=model_cfg)
    return SimpleNamespace(cfg=cfg, should_save_checkpoint_on_current_rank=rank_saves, checkpoint_suffix="",
                           get_model=lambda: model)


@pytest.mark.parametrize("no_save, rank_saves", [(True, True), (False, False)])
def test_runs_that_write_no_checkpoints_take_no_lock(tmp_path, no_save, rank_saves):
    """--no-save, and the DDP ranks other than the one that saves (tests/test_distributed.py runs both)."""
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
        "has 10000.0). These options define the trained model: drop them to resume with the checkpoint's "
        "values, or train the changed model in a new --save-dir")
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


# --- training lengths -------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_resume_from_a_checkpoint_without_recorded_lengths_says_where_the_counts_start(trained_2, tmp_path,
                                                                                        caplog):
    state = torch.load(trained_2[1] / "checkpoint_last.pt", map_location="cpu")
    for name in ("rope_trained_length", "rope_trained_length_counts"):  # saved before they were recorded
        delattr(model_config(state), name)
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
    with pytest.raises(SystemExit) as e:
        avg.main(["--inputs", str(tmp_path), "--num-update-checkpoints", "2", "--output", str(tmp_path / "avg.pt")])
    assert str(e.value) == (f"error: cannot load {tmp_path / 'checkpoint_1_1.pt'}: the file disappeared after it "
                            "was listed (deleted or renamed: is a training still writing to that directory?)")
    assert not (tmp_path / "avg.pt").exists()
