"""The warm start of the tests' torch commands (support/warm_start.py) gives what a new process
gives: the same output, exit status and time limit, the environment and directory it is given,
and nothing of the plugin without --user-dir."""

import re
import subprocess

import pytest
from support import warm_start
from support.commands import cli_command

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
