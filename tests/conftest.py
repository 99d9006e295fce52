"""Shared fixtures: a tiny parallel corpus binarized once per session, and a CLI runner that
calls fairseq's console scripts from this environment exactly as a user would (only from tests
marked e2e: every other test is marked fast, see pytest.ini)."""

import importlib.util
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Every test works under a directory named as badly as a user could name one: a space, a semicolon
# and a shell substitution. A tool or recipe that passes a path unquoted fails here, or makes a file
# named x (checked at the end of the session), instead of doing so on a user's machine. Read by
# pytest's tmp_path machinery when it first makes a directory.
WORST_NAME = "a b;$(touch x)"
TEMP_ROOT = Path(tempfile.gettempdir()) / "fairseq-rope-tests" / WORST_NAME
TEMP_ROOT.mkdir(parents=True, exist_ok=True)
os.environ["PYTEST_DEBUG_TEMPROOT"] = str(TEMP_ROOT)


def cli_command(args, env):
    """The command line and environment run_cli runs ``args`` with (only from an e2e test)."""
    if _fast_test_running is not None:
        raise AssertionError(f"{_fast_test_running} runs `{' '.join(map(str, args[:2]))} ...` as a user would, "
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
    return cmd, full_env


def run_cli(args, cwd=REPO, timeout=600, env=None, check=True):
    """Run a console script (``fairseq-train`` ...) or command; return CompletedProcess."""
    cmd, full_env = cli_command(args, env)
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


# ------------------------------------------------------------------ markers: fast and e2e
# A test is fast (in-process) unless it is marked e2e; `make test-fast` runs the fast ones.

_fast_test_running = None  # the node id of the fast test being set up or run, else None


def speed_marker(item):
    """The speed marker of a collected test, e2e or fast: fast unless marked e2e, never both."""
    marked = {mark.name for mark in item.iter_markers()} & {"e2e", "fast"}
    if len(marked) == 2:
        raise pytest.UsageError(f"{item.nodeid} is marked both e2e and fast: a test is one or the other")
    return marked.pop() if marked else "fast"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if speed_marker(item) == "fast":
            item.add_marker(pytest.mark.fast)


@pytest.hookimpl(tryfirst=True)  # before fixtures are set up: a fixture of a fast test may not run_cli either
def pytest_runtest_setup(item):
    global _fast_test_running
    _fast_test_running = item.nodeid if item.get_closest_marker("fast") else None


def pytest_runtest_teardown(item):
    global _fast_test_running
    _fast_test_running = None


def write_reversal_corpus(directory: Path, seed: int = 0, sizes=(("train", 1500), ("valid", 60), ("test", 43))):
    """A toy task that needs positions: the target is the source reversed."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(40)]
    for split, n in sizes:
        with open(directory / f"{split}.en", "w") as src, open(directory / f"{split}.de", "w") as tgt:
            for _ in range(n):
                sentence = [rng.choice(vocab) for _ in range(rng.randint(2, 10))]
                src.write(" ".join(sentence) + "\n")
                tgt.write(" ".join(reversed(sentence)) + "\n")


@pytest.fixture(scope="session")
def tiny_data_bin(tmp_path_factory):
    """Raw text and a fairseq data-bin of the reversal corpus (en -> de)."""
    root = tmp_path_factory.mktemp("tiny_corpus")
    write_reversal_corpus(root)
    run_cli([
        "fairseq-preprocess", "--source-lang", "en", "--target-lang", "de",
        "--trainpref", root / "train", "--validpref", root / "valid", "--testpref", root / "test",
        "--destdir", root / "data-bin", "--joined-dictionary", "--workers", "1",
    ])
    return root


def subword_work_dir(root: Path, tiny_data_bin: Path) -> Path:
    """``root/work`` as prepare.sh leaves it for the tiny corpus: its data-bin and subword-nmt codes
    that keep the corpus' words whole."""
    work = root / "work"
    (work / "bpe").mkdir(parents=True)
    (work / "bpe" / "codes").write_text("#version: 0.2\n" + "".join(f"w {i}</w>\n" for i in range(10)))
    (work / "bpe" / "vocab.en").write_text("".join(f"w{i} 100\n" for i in range(40)))
    (work / "bpe" / ".done").write_text("# prepare.sh step record v1\noption BPE=subword-nmt\n"
                                        "option BPE_VOCAB_THRESHOLD=1\n")
    shutil.copytree(tiny_data_bin / "data-bin", work / "data-bin")
    return work


def build_model(arch="transformer_rope_tiny", *extra_args, vocab_size=30, seed=0):
    """``(model, dictionary, args)``: built in-process exactly as fairseq-train would, from
    command-line style args, with ``vocab_size`` symbols besides fairseq's special ones."""
    from fairseq.data import Dictionary

    from fairseq_rope_tools.research.models import DictionaryTask, build_model

    task = DictionaryTask(len(Dictionary()) + vocab_size)
    model, args = build_model(arch, task, *extra_args, seed=seed)
    return model, task.source_dictionary, args


def table_cos_sin(rotary, positions, length):
    """fp32 cos and sin of m * theta_i from a RotaryEmbedding's tables, for integer ``positions``."""
    cos, sin, _ = rotary.tables(length, positions.device)
    return cos[positions], sin[positions]


def rotate(attn, x, positions, length):
    """R_m x for a time-first (time, batch, heads, head_dim) ``x``, through the layer's rotation."""
    return attn.rotary.rotate([x], positions, length, x.shape)[0]


# ------------------------------------------------------------------ the fused kernel on the CPU


@pytest.fixture(scope="module")
def interpreted_kernel():
    """The fused rotation kernel run by Triton's interpreter on CPU tensors, for one test module.

    Triton 3.x reads TRITON_INTERPRET when a function is decorated with ``@triton.jit`` (not when
    triton is imported): the kernel built here, with the variable set, is an interpreted one, and
    ``fused_runs_on`` sends CPU tensors to it while the variable is set. Afterwards the variable
    is restored and the cached kernel dropped, so that other test files run by the same pytest
    worker (``--dist loadfile``) see the CPU fallback exactly as in a process of their own; the
    kernel is checked to really be interpreted, so a Triton that behaves otherwise skips
    instead of testing the wrong thing.
    """
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (scripts/setup_env.sh installs it)")
    from fairseq_rope.modules import fused_rotary

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        patch.setattr(fused_rotary, "_KERNEL", None)
        if not fused_rotary.fused_runs_on("cpu"):
            pytest.skip("Triton's interpreter does not run the fused kernel here")
        if type(fused_rotary._KERNEL).__name__ != "InterpretedFunction":
            pytest.skip(f"TRITON_INTERPRET=1 built a {type(fused_rotary._KERNEL).__name__}, not an interpreted kernel")
        yield fused_rotary
    # patch.setattr restored _KERNEL to what it was before: a compiled kernel or "not tried yet"


@pytest.fixture(scope="module")
def one_thread():
    """Tensors this small gain nothing from intra-op threads, which only contend: on a busy
    2-core machine a training step of the tiny model took 2 s with 2 threads, 15 ms with one."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def kernel_launches(interpreted_kernel, monkeypatch):
    """The shapes of the tensors of every fused kernel launch made during a test, in order."""
    launches = []
    launch = interpreted_kernel._launch

    def counting_launch(xs, *args, **kwargs):
        launches.append([tuple(x.shape) for x in xs])
        return launch(xs, *args, **kwargs)

    monkeypatch.setattr(interpreted_kernel, "_launch", counting_launch)
    return launches



UNQUOTED_PATH_WITNESSES = (REPO / "x", TEMP_ROOT.parent / "x", TEMP_ROOT / "x")


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # what an earlier session's bug left
        for witness in UNQUOTED_PATH_WITNESSES:
            witness.unlink(missing_ok=True)


def pytest_sessionfinish(session, exitstatus):
    """A path passed unquoted to a shell ran ``touch x`` there: in the checkout (every command's
    working directory) or beside the tests' directories."""
    if hasattr(session.config, "workerinput"):
        return  # the controller checks once, after every worker
    made = [str(path) for path in UNQUOTED_PATH_WITNESSES if path.exists()]
    if made:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\na path was passed unquoted to a shell: it made {', '.join(made)}", file=sys.stderr)


def translate_in_process(capsys, *args):
    """fairseq-rope-translate's main in this process, quiet, one thread: (exit status, stderr lines)."""
    from fairseq_rope_tools.deploy import translate

    try:
        translate.main([str(a) for a in args] + ["--quiet", "--threads", "1"])
        status = 0
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err.strip().splitlines()
