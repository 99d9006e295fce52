"""Nothing lost, nothing silently changed: atomic checkpoint writes, resuming after a kill,
refused --model-overrides, and bad flags reported as one line when the arguments are parsed."""

import argparse
import errno
import io
import os
import re
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from support.checkpoints import train_args, updates_in
from support.commands import REPO, SCRIPTS, run_cli

import fairseq_rope_base.errors
from fairseq_rope import checkpoints
from fairseq_rope.checkpoint_files import saved_model_config
from fairseq_rope.checkpoints import newest_readable_checkpoint, save_checkpoint_atomically
from fairseq_rope.config_values import OneLineError, OptionError
from fairseq_rope_base.files import remove_stale_temporaries, write_atomically


def final_updates(log: str) -> int:
    return max(int(n) for n in re.findall(r"num_updates[ |:]+(\d+)", log))


@pytest.fixture(scope="module")
def trained_40(tiny_data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("trained_40")
    run_cli(["fairseq-train", *train_args(tiny_data_bin / "data-bin", save_dir, 40)])
    return tiny_data_bin / "data-bin", save_dir


@pytest.mark.e2e
def test_kill_while_writing_checkpoint_last_then_resume_with_the_same_command(tiny_data_bin, tmp_path):
    data_bin, save_dir = tiny_data_bin / "data-bin", tmp_path / "ckpt"
    args = [str(a) for a in train_args(data_bin, save_dir, 60)]
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "hang_while_saving_checkpoint_last.py"), *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, KILL_AT_SAVE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
    )
    seen = []
    try:
        for line in proc.stdout:  # the second save is at update 40
            seen.append(line)
            if line.startswith("HANGING-IN-CHECKPOINT-LAST-WRITE"):
                break
        else:
            pytest.fail("training ended without writing checkpoint_last.pt twice:\n" + "".join(seen[-30:]))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    # checkpoint_last.pt is still the complete one of the first save; the update checkpoint of the
    # second save is complete too
    assert updates_in(save_dir / "checkpoint_last.pt") == 20
    assert updates_in(next(save_dir.glob("checkpoint_*_40.pt"))) == 40

    resumed = run_cli(["fairseq-train", *args])
    log = resumed.stdout + resumed.stderr
    assert re.search(rf"Loaded checkpoint {re.escape(str(save_dir / 'checkpoint_last.pt'))} \(epoch \d+ @ 20 updates\)",
                     log), log[-3000:]
    assert final_updates(log) == 60
    assert updates_in(save_dir / "checkpoint_last.pt") == 60
    # the killed write's temporary file is gone and was never a checkpoint name
    assert sorted(p.name for p in save_dir.iterdir() if not re.fullmatch(r"checkpoint_\d+_\d+\.pt", p.name)) \
        == ["checkpoint_best.pt", "checkpoint_last.pt"]


def saved_record(path):
    model_cfg = torch.load(path, map_location="cpu")["cfg"]["model"]  # saved as a dict (checkpoint_namespaces)
    return model_cfg["rope_trained_length"], model_cfg["rope_trained_length_counts"]


@pytest.mark.e2e
def test_a_resumed_run_records_what_an_uninterrupted_one_does(trained_40, tmp_path):
    data_bin, straight = trained_40
    longest, counts = saved_record(straight / "checkpoint_last.pt")
    assert 3 <= longest <= 11 and len(counts) == longest + 1
    halfway = next(straight.glob("checkpoint_*_20.pt"))
    _, counts_at_20 = saved_record(halfway)
    assert 0 < sum(counts_at_20) < sum(counts)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copyfile(halfway, resumed / "checkpoint_last.pt")
    run_cli(["fairseq-train", *train_args(data_bin, resumed, 40)])
    assert saved_record(resumed / "checkpoint_last.pt") == (longest, counts)


@pytest.mark.e2e
def test_unreadable_checkpoint_last_falls_back_to_the_newest_readable(trained_40, tmp_path):
    data_bin, trained = trained_40
    save_dir = tmp_path / "ckpt"
    shutil.copytree(trained, save_dir)
    last = save_dir / "checkpoint_last.pt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # as a kill mid-copy left it
    newest = next(save_dir.glob("checkpoint_*_40.pt"))
    os.utime(next(save_dir.glob("checkpoint_*_20.pt")))  # newest on disk, not in updates

    proc = run_cli(["fairseq-train", *train_args(data_bin, save_dir, 50)])
    log = proc.stdout + proc.stderr
    warnings = [line for line in log.splitlines() if "is unreadable" in line]
    assert len(warnings) == 1 and str(last) in warnings[0] and str(newest) in warnings[0], warnings
    assert re.search(rf"Loaded checkpoint {re.escape(str(newest))} \(epoch \d+ @ 40 updates\)", log)
    assert final_updates(log) == 50 and updates_in(last) == 50


@pytest.mark.e2e
def test_unreadable_checkpoint_last_and_nothing_else_is_an_error(tiny_data_bin, tmp_path):
    save_dir = tmp_path / "ckpt"
    save_dir.mkdir()
    (save_dir / "checkpoint_last.pt").write_bytes(b"PK\x03\x04 truncated")
    proc = run_cli(["fairseq-train", *train_args(tiny_data_bin / "data-bin", save_dir, 5)], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"fairseq-train: error: {save_dir / 'checkpoint_last.pt'} is unreadable (truncated?) and {save_dir} holds no "
        "other readable checkpoint: delete it to train from scratch, or pass --restore-file FILE")
    assert sorted(p.name for p in save_dir.iterdir()) == ["checkpoint_last.pt"]  # its lock file removed


def resume_from(save_dir):
    """The checkpoint fairseq's load_checkpoint is given, through the plugin's fallback, for a
    run resuming ``save_dir`` with the default --restore-file."""
    loaded = []
    load = checkpoints._resume_falls_back(lambda cfg, trainer: loaded.append(cfg.restore_file))
    load(SimpleNamespace(restore_file="checkpoint_last.pt", save_dir=str(save_dir)),
         SimpleNamespace(checkpoint_suffix=""))
    return loaded[0]


def test_unreadable_checkpoint_last_and_nothing_else_stops_in_one_line(tmp_path):
    (tmp_path / "checkpoint_last.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(OneLineError) as e:
        resume_from(tmp_path)
    assert isinstance(e.value, fairseq_rope_base.errors.OneLineError)  # the class the tools' commands report
    assert issubclass(OptionError, fairseq_rope_base.errors.OneLineError)
    assert str(e.value) == (f"{tmp_path / 'checkpoint_last.pt'} is unreadable (truncated?) and {tmp_path} holds no "
                            "other readable checkpoint: delete it to train from scratch, or pass --restore-file FILE")


def test_a_checkpoint_last_in_torchs_legacy_format_is_resumed_as_it_is(tmp_path):
    """torch's format before 1.6 has no zip directory, and is no truncated file: fairseq loads it,
    and the resume check reads its model configuration."""
    model_cfg = argparse.Namespace(arch="transformer_rope_tiny", rope_theta=500.0)
    state = {"model": {}, "cfg": {"model": model_cfg}, "optimizer_history": [{"num_updates": 30}]}
    torch.save(state, tmp_path / "checkpoint_last.pt", _use_new_zipfile_serialization=False)
    torch.save(dict(state, optimizer_history=[{"num_updates": 20}]), tmp_path / "checkpoint_1_20.pt")
    assert resume_from(tmp_path) == "checkpoint_last.pt"
    assert saved_model_config(str(tmp_path / "checkpoint_last.pt")).rope_theta == 500.0


@pytest.mark.e2e
def test_newest_readable_counts_updates_and_skips_partial_files(trained_40, tmp_path):
    _, trained = trained_40
    shutil.copytree(trained, tmp_path / "c")
    d = tmp_path / "c"
    partial = d / "checkpoint_9_900.pt"
    partial.write_bytes((d / "checkpoint_last.pt").read_bytes()[:1000])
    average = d / "checkpoint.avg5.pt"  # readable, but no optimizer state to resume from
    state = torch.load(d / "checkpoint_last.pt")
    state["optimizer_history"][-1]["num_updates"] = 999
    torch.save(state, average)
    found = newest_readable_checkpoint(str(d), exclude=str(d / "checkpoint_last.pt"))
    assert updates_in(found) == 40 and os.path.basename(found) != partial.name


def test_atomic_write_keeps_the_old_file_on_any_failure(tmp_path):
    path = tmp_path / "checkpoint_last.pt"
    save_checkpoint_atomically({"v": 1}, str(path))

    def half_then_interrupt(tmp):
        with open(tmp, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(str(path), half_then_interrupt)
    assert torch.load(path) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_last.pt"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64")])
def test_full_disk_is_reported_with_the_path(tmp_path, error):
    path = tmp_path / "avg.pt"

    def disk_full(tmp):
        with open(tmp, "wb") as f:
            f.write(b"x" * 100)
        raise error

    with pytest.raises(OSError, match=f"no space left on device while writing {re.escape(str(path))}"):
        write_atomically(str(path), disk_full)
    assert list(tmp_path.iterdir()) == []


def test_a_killed_write_leaves_only_a_hidden_temporary_that_the_next_write_removes(tmp_path):
    path = tmp_path / "checkpoint_last.pt"
    stale = tmp_path / ".checkpoint_last.pt.abc123.tmp"  # what a SIGKILL mid-write leaves
    stale.write_bytes(b"partial")
    other = tmp_path / ".checkpoint_best.pt.abc123.tmp"
    other.write_bytes(b"partial")
    save_checkpoint_atomically({"v": 2}, str(path))
    assert not stale.exists() and other.exists()
    remove_stale_temporaries(str(tmp_path / "checkpoint_best.pt"))
    assert not other.exists()


@pytest.mark.e2e
def test_tools_write_through_the_same_code_without_importing_torch(tmp_path):
    """The plugin's checkpoint writes and the tools share one atomic write: the recipe's text
    steps get it (and the removal of a killed write's leftovers) without fairseq or torch."""
    import fairseq_rope.checkpoints

    script = (
        "import sys; from fairseq_rope_base import files\n"
        "files.write_text_atomically(sys.argv[1], 'text')\n"
        "print(sorted(m for m in ('torch', 'fairseq', 'fairseq_rope') if m in sys.modules))\n"
    )
    stale = tmp_path / ".out.txt.abc123.tmp"
    stale.write_text("partial")
    proc = run_cli([sys.executable, "-c", script, tmp_path / "out.txt"])
    assert proc.stdout == "[]\n"
    assert fairseq_rope.checkpoints.write_atomically is write_atomically
    assert (tmp_path / "out.txt").read_text() == "text" and not stale.exists()


# --- --model-overrides ------------------------------------------------------------------------

def _load(path, overrides):
    from fairseq import checkpoint_utils

    models, _ = checkpoint_utils.load_model_ensemble([str(path)], arg_overrides=overrides)
    return models[0]


@pytest.mark.e2e
@pytest.mark.parametrize("overrides, named", [
    ({"rope_layout": "half"}, "rope_layout='half'"),
    ({"rope_fraction": 0.5}, "rope_fraction=0.5"),
    ({"rope_theta": 500.0}, "rope_theta=500.0"),
    ({"rope_values": True}, "rope_values=True"),
    ({"attention_kind": "linear"}, "attention_kind='linear'"),
    ({"rope_cross_attention": True}, "rope_cross_attention=True"),
])
def test_override_of_a_trained_option_is_refused(trained_40, overrides, named):
    _, save_dir = trained_40
    path = save_dir / "checkpoint_last.pt"
    with pytest.raises(OptionError, match=re.escape(named)) as e:
        _load(path, overrides)
    assert str(path) in str(e.value) and "trained with" in str(e.value)


@pytest.mark.e2e
def test_unknown_plugin_override_is_refused(trained_40):
    with pytest.raises(OptionError, match="'rope_thetaa' is not an option of transformer_rope_tiny"):
        _load(trained_40[1] / "checkpoint_last.pt", {"rope_thetaa": 5})


@pytest.mark.e2e
def test_inference_overrides_and_restated_values_are_accepted(trained_40):
    path = trained_40[1] / "checkpoint_last.pt"
    model = _load(path, {"rope_theta": 10000.0, "rope_layout": "interleaved", "beam": 4})
    assert model.encoder.layers[0].self_attn.rotary.layout == "interleaved"
    plain = model.encoder.layers[0].self_attn.rotary
    scaled = _load(path, {"rope_scaling": "ntk", "rope_scaling_factor": 2.0}).encoder.layers[0].self_attn.rotary
    assert not torch.equal(plain.inv_freq, scaled.inv_freq)


@pytest.mark.e2e
def test_refused_override_is_one_line_at_generate_time(trained_40):
    data_bin, save_dir = trained_40
    proc = run_cli(["fairseq-generate", data_bin, "--user-dir", "fairseq_rope", "--cpu",
                    "--path", save_dir / "checkpoint_last.pt", "--model-overrides", "{'rope_layout': 'half'}"],
                   check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "H-0" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "fairseq-generate: error: --model-overrides: rope_layout='half' differs")


# --- flags checked when the command line is parsed ----------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("flags, message", [
    (["--rope-theta", "inf"], "--rope-theta must be a finite positive number, got inf"),
    (["--rope-scaling", "none", "--rope-scaling-factor", "4"], "--rope-scaling-factor 4 has no effect with --rope-scaling none"),
])
def test_bad_flag_is_one_line_before_any_data_is_read(tmp_path, flags, message):
    missing_data = tmp_path / "no-such-data-bin"  # reading data would fail differently
    proc = run_cli(["fairseq-train", missing_data, "--user-dir", "fairseq_rope", "--arch", "transformer_rope_tiny",
                    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "100", "--cpu",
                    "--save-dir", tmp_path / "ckpt", *flags], check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"fairseq-train: error: {message}")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("arch, flags, message", [
    ("transformer_rope_tiny", ["--rope-theta", "nan"], "--rope-theta must be a finite positive number, got nan"),
    ("transformer_rope_tiny", ["--rope-theta", "-1"], "--rope-theta must be a finite positive number, got -1"),
    ("transformer_rope_tiny", ["--rope-scaling", "ntk", "--rope-scaling-factor", "inf"],
     "--rope-scaling-factor must be a finite number >= 1, got inf"),
    ("transformer_rope_tiny", ["--rope-scaling", "linear", "--rope-scaling-factor", "2",
                               "--rope-scaling-original-length", "-5"], "--rope-scaling-original-length must be"),
    ("transformer_rope_tiny", ["--cross-self-attention"], "--cross-self-attention is not supported"),
    ("transformer_rpe_tiny", ["--cross-self-attention"], "--cross-self-attention is not supported"),
])
def test_bad_flag_is_refused_by_the_argument_parser(arch, flags, message):
    """The check runs in fairseq's parse_args_and_arch (architecture defaults), before a model
    or any data exists; uncaught at the top of a command, it becomes the one line above."""
    from fairseq import options

    import fairseq_rope  # noqa: F401

    parser = options.get_training_parser()
    with pytest.raises(OptionError, match=re.escape(message)):
        options.parse_args_and_arch(parser, ["data", "--arch", arch, "--task", "translation", *flags])


def test_namespaces_are_saved_as_dicts_and_loaded_back_with_every_override():
    """What Trainer.state_dict gives fairseq to save, and what the plugin's load makes of what
    fairseq reads back (an omegaconf config, as fairseq's load_checkpoint_to_cpu creates it)."""
    from omegaconf import OmegaConf

    from fairseq_rope.checkpoint_namespaces import (
        NAMESPACES,
        NEEDS_THE_PLUGIN,
        dicts_as_namespaces,
        namespaces_as_dicts,
    )

    model = argparse.Namespace(arch="transformer_rope_tiny", rope_theta=10000.0, layers=(1, 2))
    state = namespaces_as_dicts({"cfg": {"model": model, "task": {"data": "bin"}}, "model": {}}, lambda m: True)
    assert state[NAMESPACES] == ["model"] and state["cfg"]["task"] == {"data": "bin"}
    assert list(state["cfg"]["model"]) == [NEEDS_THE_PLUGIN, "arch", "rope_theta", "layers"]
    assert vars(model) == {"arch": "transformer_rope_tiny", "rope_theta": 10000.0, "layers": (1, 2)}  # untouched
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # no Namespace left to allow-list
    loaded["cfg"] = OmegaConf.create(loaded["cfg"], flags={"allow_objects": True})
    OmegaConf.set_struct(loaded["cfg"], True)
    back = dicts_as_namespaces(loaded, {"rope_scaling": "yarn", "rope_theta": 10000.0})["cfg"].model
    assert isinstance(back, argparse.Namespace)
    assert vars(back) == {"arch": "transformer_rope_tiny", "rope_theta": 10000.0, "layers": [1, 2],
                          "rope_scaling": "yarn"}  # every override, as fairseq sets them on a Namespace
    old = {"cfg": {"model": model}}  # a checkpoint saved before: left as it is
    assert dicts_as_namespaces(old)["cfg"]["model"] is model
