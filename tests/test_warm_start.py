"""The warm start of the tests' torch commands (support/warm_start.py) gives what a new process
gives: the same output, exit status and time limit, the environment and directory it is given,
and nothing of the plugin without --user-dir; a script's commands start warm through their
stand-ins, which pass signals on and take the command with them when killed, and start cold
where a variable read at start differs."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import warm_start
from support.checkpoints import train_args
from support.commands import REPO, cli_command, run_cli

pytestmark = pytest.mark.e2e


def both_ways(args, cwd, cold_cwd=None, timeout=300):
    """``args`` run warm in ``cwd``, then in a new process in ``cold_cwd`` (or ``cwd``)."""
    cmd, environment = cli_command(args, None)
    warm = warm_start.warm_run(cmd, environment, cwd, timeout)
    assert warm is not None, f"{args[0]} did not start warm"
    cold = subprocess.run(cmd, cwd=cold_cwd or cwd, env=environment, capture_output=True, text=True, timeout=timeout)
    return warm, cold


def untimed(text):
    return re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "TIME", text, flags=re.M)


def test_a_warm_command_answers_as_a_new_process(tmp_path):
    for args in (["fairseq-generate", "--help"], ["fairseq-train", "--no-such-flag"]):
        warm, cold = both_ways(args, tmp_path)
        assert warm.returncode == cold.returncode
        assert untimed(warm.stdout) == untimed(cold.stdout)  # with what fairseq logs while it imports
        assert untimed(warm.stderr) == untimed(cold.stderr)


def test_a_warm_command_works_in_its_directory(tmp_path):
    for way in ("warm", "cold"):
        (tmp_path / way).mkdir()
        (tmp_path / way / "train.en").write_text("a b c\nb c d\n")
    warm, cold = both_ways(["fairseq-preprocess", "--only-source", "--source-lang", "en", "--trainpref", "train",
                            "--destdir", "bin", "--workers", "1"], tmp_path / "warm", tmp_path / "cold")
    assert warm.returncode == cold.returncode == 0, warm.stderr
    dictionary = (tmp_path / "warm" / "bin" / "dict.en.txt").read_text()
    assert dictionary == (tmp_path / "cold" / "bin" / "dict.en.txt").read_text()
    assert dictionary.split("\n")[:2] == ["b 2", "c 2"]


def test_the_plugin_is_not_loaded_without_user_dir(tmp_path):
    warm, cold = both_ways(["fairseq-train", str(tmp_path), "--arch", "transformer_rope_tiny"], tmp_path)
    assert warm.returncode == cold.returncode == 2
    assert "invalid choice: 'transformer_rope_tiny'" in warm.stderr


def test_a_command_past_its_time_is_killed(tmp_path):
    cmd, environment = cli_command(["fairseq-preprocess", "--help"], None)
    with pytest.raises(subprocess.TimeoutExpired):
        warm_start.warm_run(cmd, environment, tmp_path, 0.01)


def test_only_the_starting_environment_starts_warm(tmp_path):
    cmd, environment = cli_command(["fairseq-generate", "--help"], None)
    assert warm_start.warm_run(cmd, environment, tmp_path, 300) is not None
    assert warm_start.warm_run(cmd, dict(environment, OMP_NUM_THREADS="2"), tmp_path, 300) is None
    assert warm_start.warm_run(["bash", "-c", "true"], environment, tmp_path, 300) is None


# --- the stand-ins: what a script starts -----------------------------------------------------------
def _warm_commands():
    """The commands the warm interpreter of this worker runs now: its children's children."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            pid, rest = stat.read_text().split(" ", 1)
            parents[int(pid)] = int(rest.rsplit(")", 1)[1].split()[1])
    managers = {pid for pid, parent in parents.items() if parent == warm_start._starter.process.pid}
    return {pid for pid, parent in parents.items() if parent in managers}


def _script_training(data_bin, save_dir, *variables):
    """bash starting a long fairseq-train by name, as train.sh does: (bash, the stand-in's pid)."""
    cmd, environment = cli_command(["bash", "-c", f'{" ".join(variables)} fairseq-train "$@" & echo $!; wait $!',
                                    "bash", *train_args(data_bin, save_dir, "100000")], None)
    script = subprocess.Popen(cmd, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    return script, int(script.stdout.readline())


def _end(script, stand_in):
    """The script and its stand-in ended, whatever a failed assertion left running: the stand-in
    killed takes a warm command with it, and is the command where it started cold."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(stand_in, signal.SIGKILL)
    script.kill()
    script.wait()
    script.stdout.close()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_scripts_command_starts_warm_and_goes_with_its_stand_in(tiny_data_bin, tmp_path):
    run_cli(["fairseq-preprocess", "--help"])  # this worker's warm interpreter, started
    for signum, status in ((signal.SIGTERM, -signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)):
        script, stand_in = _script_training(tiny_data_bin / "data-bin", tmp_path / signum.name)
        try:
            deadline = time.monotonic() + 60
            while not _warm_commands() and time.monotonic() < deadline:
                time.sleep(0.1)
            (command,) = _warm_commands()  # forked by the warm interpreter, not the stand-in exec'd
            assert command != stand_in
            os.kill(stand_in, signum)  # passed on (SIGTERM), or taking the command with it (SIGKILL)
            assert script.wait(timeout=60) == 128 - status
            deadline = time.monotonic() + 10
            while _warm_commands() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _warm_commands()
        finally:
            _end(script, stand_in)


def test_a_scripts_command_with_another_thread_count_starts_cold(tiny_data_bin, tmp_path):
    run_cli(["fairseq-preprocess", "--help"])
    script, stand_in = _script_training(tiny_data_bin / "data-bin", tmp_path / "cold", "OMP_NUM_THREADS=2")
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "cold").exists() and time.monotonic() < deadline:  # fairseq-train made it
            time.sleep(0.1)
        # the stand-in became the console script (exec), which runs the training itself
        console_script = str(Path(sys.executable).parent / "fairseq-train").encode()
        assert Path(f"/proc/{stand_in}/cmdline").read_bytes().split(b"\0")[1] == console_script
        assert not _warm_commands()
    finally:
        _end(script, stand_in)
