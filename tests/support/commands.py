"""Running the project's commands from the tests as a user runs them (only from tests marked
e2e), the checkout's paths, and the badly named directory every test works under."""

import contextlib
import io
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from support.warm_start import stand_in_environment, warm_run

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCRIPTS = Path(__file__).resolve().parent  # the helper scripts the tests start: ddp_worker.py ...

# Every test works under a directory named as badly as a user could name one: a space, a semicolon
# and a shell substitution. A tool or recipe that passes a path unquoted fails here, or makes a file
# named x (checked at the end of the session), instead of doing so on a user's machine. Read by
# pytest's tmp_path machinery when it first makes a directory.
WORST_NAME = "a b;$(touch x)"
TEMP_ROOT = Path(tempfile.gettempdir()) / "fairseq-rope-tests" / WORST_NAME
TEMP_ROOT.mkdir(parents=True, exist_ok=True)
os.environ["PYTEST_DEBUG_TEMPROOT"] = str(TEMP_ROOT)


#: the node id of the fast (in-process) test being set up or run, else None: set by conftest.py's
#: hooks, read by cli_command
fast_test_running = None


def cli_command(args, env):
    """The command line and environment run_cli runs ``args`` with (only from an e2e test)."""
    if fast_test_running is not None:
        raise AssertionError(f"{fast_test_running} runs `{' '.join(map(str, args[:2]))} ...` as a user would, "
                             "which makes it an end-to-end test: mark it (or its module) with pytest.mark.e2e")
    exe = BIN / args[0]
    cmd = [str(exe) if exe.exists() else args[0], *map(str, args[1:])]
    if args[0] == "fairseq-train" and "--data-buffer-size" not in cmd:
        # fairseq's prefetching thread, still inside torch when a short training ends, made the
        # process abort at exit now and then ("terminate called without an active exception")
        cmd += ["--data-buffer-size", "0"]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    full_env["PATH"] = f"{BIN}{os.pathsep}{full_env.get('PATH', '')}"
    full_env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    full_env.update(env or {})
    if env is None or "PATH" not in env:  # what the command starts finds the stand-ins first
        full_env = stand_in_environment(full_env)
    return cmd, full_env


def run_cli(args, cwd=REPO, timeout=600, env=None, check=True):
    """Run a console script (``fairseq-train`` ...) or command; return CompletedProcess. One that
    loads torch starts from a warm interpreter where it would start alike (warm_start.py)."""
    cmd, full_env = cli_command(args, env)
    proc = warm_run(cmd, full_env, cwd, timeout)
    if proc is None:
        proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
            f"\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def run_cli_streaming(args, cwd=REPO, timeout=600, env=None):
    """Run a command as run_cli does, its stderr merged into its stdout, reading every line as it
    comes: [(line, running)], ``running`` whether the command had not exited yet when the line was
    read. Raises AssertionError if the command fails or runs past ``timeout`` seconds."""
    cmd, full_env = cli_command(args, env)
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    try:
        lines = [(line.rstrip("\n"), proc.poll() is None) for line in proc.stdout]
        status = proc.wait()
    finally:
        killer.cancel()
        proc.stdout.close()
    if status != 0:
        output = "\n".join(line for line, _ in lines)[-8000:]
        raise AssertionError(f"{' '.join(cmd)} exited {status} (killed after {timeout} s if negative)\n{output}")
    return lines


def translate_in_process(capsys, *args):
    """fairseq-rope-translate's main in this process, quiet, one thread: (exit status, stderr lines)."""
    from fairseq_rope_tools.deploy import translate

    try:
        translate.main([str(a) for a in args] + ["--quiet", "--threads", "1"])
        status = 0
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err.strip().splitlines()


def fairseq_generate_stdout(args, command=False) -> str:
    """fairseq-generate's standard output for ``args`` (its command line after the program name,
    with ``--user-dir`` an absolute path): run as a command (``command``), or by fairseq_cli.generate's
    own main in this process -- the command's code without a new interpreter's start (torch's and
    fairseq's imports). For tests that decode one trained model many ways; each such test runs the
    command itself at least once."""
    if command:
        return run_cli(["fairseq-generate", *args]).stdout
    import torch
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli import generate

    args = [str(a) for a in args]
    if "--num-workers" not in args:  # no data-loading processes forked from this one, which has threads
        args += ["--num-workers", "0"]
    parsed = options.parse_args_and_arch(options.get_generation_parser(), args)
    threads, environment = torch.get_num_threads(), dict(os.environ)
    torch.set_num_threads(1)  # as run_cli's OMP_NUM_THREADS=1
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            generate.main(convert_namespace_to_omegaconf(parsed))
    finally:
        torch.set_num_threads(threads)
        # fairseq sets PYTHONWARNINGS for data-loading workers: every later subprocess of this
        # test process would inherit it (and print the warnings the plugin filters)
        os.environ.clear()
        os.environ.update(environment)
    return out.getvalue()


def fairseq_generate_test_set(data_bin, checkpoint, beam, *extra, command=False):
    """{sentence id: (source, hypothesis, reference, log-probabilities, score)} as fairseq-generate
    prints them for the test set of ``data_bin`` (lenpen 0.6, batches of 64, ``extra`` flags):
    tokens, the natural log-probability of each hypothesis token and its </s> (printed in base 2,
    to 4 decimals) and the hypothesis' score (natural log, as the engines give theirs). Decoded by
    the command itself (``command``) or by its main in this process (:func:`fairseq_generate_stdout`)."""
    from fairseq_rope_tools.cli import plugin_dir

    out = fairseq_generate_stdout([data_bin, "--user-dir", plugin_dir(), "--path", checkpoint, "--cpu", "--beam", beam,
                                   "--lenpen", "0.6", "--batch-size", "64", "--gen-subset", "test", *extra], command)
    lines = {kind: {int(m[1]): m[2] for m in re.finditer(rf"^{kind}-(\d+)\t(.*)$", out, re.M)} for kind in "SHTP"}
    assert lines["S"] and lines["S"].keys() == lines["H"].keys() == lines["T"].keys() == lines["P"].keys()
    scored = {i: line.split("\t", 1) for i, line in lines["H"].items()}  # the score, then the tokens
    return {i: (lines["S"][i].split(), scored[i][1].split(), lines["T"][i].split(),
                [float(p) * math.log(2) for p in lines["P"][i].split()], float(scored[i][0]) * math.log(2))
            for i in lines["S"]}
