"""Shared fixtures and hooks: a tiny parallel corpus binarized once per session, the fast and e2e
markers (a fast test may not run a command as a user would: support.commands.run_cli), the
fused kernel on the CPU, and the check that no path went unquoted to a shell. The helpers the
tests import are in tests/support/."""

import importlib.util
import os
import sys

import joblib  # noqa: F401
import pytest
import sklearn  # noqa: F401
from support import commands
from support.commands import REPO, TEMP_ROOT, run_cli
from support.corpora import write_reversal_corpus

# ------------------------------------------------------------------ markers: fast and e2e
# A test is fast (in-process) unless it is marked e2e; `make test-fast` runs the fast ones.


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
    commands.fast_test_running = item.nodeid if item.get_closest_marker("fast") else None


def pytest_runtest_teardown(item):
    commands.fast_test_running = None


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


# scikit-learn and joblib (which fairseq imports) set KMP_* variables when first imported: imported
# above, before any test, they are in every test's environment and every command's from the start
@pytest.fixture(autouse=True)
def environment_left_as_found():
    """A test leaves os.environ as it found it (monkeypatch.setenv restores, os.environ[...] = does
    not): what it left would reach every later test of its worker, and a command whose environment
    differs from the warm interpreter's starts cold (support/warm_start.py)."""
    before = dict(os.environ)
    yield
    changed = sorted(name for name in before.keys() | os.environ.keys()
                     if before.get(name) != os.environ.get(name) and name != "PYTEST_CURRENT_TEST")  # pytest's own
    if changed:
        os.environ.clear()
        os.environ.update(before)
        pytest.fail(f"the test left the environment changed: {', '.join(changed)} (use monkeypatch.setenv)")


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


