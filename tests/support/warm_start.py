"""Commands that load torch started from a warm interpreter: a process per pytest worker that has
imported torch and the libraries fairseq imports (nothing of fairseq or the project) forks a
fresh process per command, which runs the console script as a new interpreter would.

Starting torch and fairseq's dependencies takes seconds of CPU per command, most of the suite's
time (docs/development.md); a forked process starts in milliseconds. What the command itself imports (fairseq, the plugin, the tools) and prints while
importing happens in the forked process, as in a new one.

Only when the command would start exactly so: a console script of this environment from
:data:`WARM_COMMANDS`, with the environment the warm interpreter started with (variables read
at import, such as ``OMP_NUM_THREADS``, cannot change after it). Anything else, and every
command when ``FAIRSEQ_ROPE_TESTS_COLD=1``, runs in a new interpreter (commands.run_cli).

The scripts a test starts (prepare.sh, train.sh, evaluate.sh, ...) start their commands
through a stand-in of each of :data:`WARM_COMMANDS` first on their PATH (:func:`stand_in_environment`):
it asks the warm interpreter for the command, hands it its standard streams, passes on every
signal it gets and exits as the command did; when it is killed, the command is killed with it.
The warm interpreter starts it only where the environment differs from its own in no variable
read while an interpreter starts (:data:`READ_AT_START`: a script's own settings, such as
MAX_UPDATE, may differ); else, or with no warm interpreter to ask, the stand-in becomes the
console script itself (exec). A tool that starts a command by this environment's bin/ path, or
puts bin/ first on PATH (fairseq-rope-compare), starts it cold.
"""

import array
import atexit
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import List, Optional

#: the commands that load torch, by console script: started warm
WARM_COMMANDS = ("fairseq-train", "fairseq-generate", "fairseq-preprocess", "fairseq-interactive",
                 "fairseq-rope-average", "fairseq-rope-export")
#: variables that may differ from the warm interpreter's: nothing reads them while importing
READ_WHEN_RUN = ("PYTEST_CURRENT_TEST",)
#: prefixes of the variables that Python, torch and the preloaded libraries may read while they
#: start: a command started by a script is warm only where none of these differ
READ_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOTO", "TORCH", "PYTORCH", "CUDA", "NVIDIA",
                 "NUMPY", "LD_", "MALLOC", "LANG", "LC_", "HOME", "TMP", "TEMP", "XDG_", "HYDRA", "SACREBLEU",
                 "TQDM", "SKLEARN", "SCIPY", "JOBLIB", "TRITON", "FAIRSEQ", "CT2_")
#: of those, what a script's command may set otherwise all the same: CUDA reads its devices when it
#: starts, which importing torch does not do (the harness hides the GPUs from a CPU run's commands);
#: MKL_NUM_THREADS as OMP_NUM_THREADS (evaluate.sh sets both) is one thread count either way
SET_BY_SCRIPTS = ("CUDA_VISIBLE_DEVICES", "MKL_NUM_THREADS")
#: the stand-ins find the warm interpreter's socket in this variable
ADDRESS_VARIABLE = "FAIRSEQ_ROPE_TESTS_WARM_SOCKET"
#: imported before any fork: torch and what fairseq imports that prints nothing (never fairseq itself,
#: whose import logs, nor the plugin, which registers architectures: a command without --user-dir
#: must not find them)
PRELOADED = ("torch", "torch.onnx", "numpy", "sklearn.metrics", "sklearn.preprocessing", "sacrebleu", "omegaconf",
             "hydra.compose", "hydra.utils", "portalocker", "tqdm", "yaml")

_directory: Optional[str] = None


def _worker_directory() -> str:
    """This worker's directory: the warm interpreter's socket and log, the stand-ins (bin/)."""
    global _directory
    if _directory is None:
        _directory = tempfile.mkdtemp(prefix="warm-")
        atexit.register(shutil.rmtree, _directory, True)
    return _directory


_SERVER = r'''
import os, pickle, select, signal, socket, sys, array
sys.path[0] = BIN
import importlib
for name in PRELOADED:
    importlib.import_module(name)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(ADDRESS)
listener.listen(16)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the per-command managers are reaped unwaited
sys.stdout.write("ready\n")
sys.stdout.flush()
while True:
    readable, _, _ = select.select([listener, sys.stdin], [], [])
    if sys.stdin in readable:  # the pytest worker has gone (end of file) or says stop
        break
    connection, _ = listener.accept()
    if os.fork():
        connection.close()
        continue
    # the manager: starts the command, sends its pid, waits for it, sends its exit status
    listener.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    fds = array.array("i")
    message, ancillary, _, _ = connection.recvmsg(1 << 16, socket.CMSG_SPACE(3 * fds.itemsize))
    for _, _, data in ancillary:
        fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    size = int.from_bytes(message[:8], "big")
    while len(message) < 8 + size:
        message += connection.recv(1 << 16)
    argv, cwd, environment, from_stand_in = pickle.loads(message[8:])

    def read_at_start(variables):
        read = {name: value for name, value in variables.items()
                if name.startswith(READ_AT_START) and name not in READ_WHEN_RUN + SET_BY_SCRIPTS}
        mkl = variables.get("MKL_NUM_THREADS")
        return read, mkl in (None, variables.get("OMP_NUM_THREADS"))

    if from_stand_in and read_at_start(environment) != read_at_start(os.environ):
        connection.sendall((0).to_bytes(8, "big"))  # not as it would start: the stand-in starts it cold
        os._exit(0)
    pid = os.fork()
    if pid == 0:  # the command, as its console script runs it
        connection.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environment)
        sys.argv = argv
        import numpy, runpy
        numpy.random.seed()  # a new process' own seed, as torch and random get theirs at fork
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit:
            raise
        except BaseException as error:  # as the interpreter reports it: from the script's frame on
            frames = error.__traceback__
            while frames is not None and frames.tb_frame.f_code.co_filename != argv[0]:
                frames = frames.tb_next
            frames = frames or error.__traceback__
            sys.excepthook(type(error), error.with_traceback(frames), frames)
            sys.exit(1)
        sys.exit(0)
    for fd in fds:
        os.close(fd)
    connection.sendall(pid.to_bytes(8, "big"))
    while True:
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            break
        # the one who asked has gone (a stand-in killed with its script): the command goes with it
        if select.select([connection], [], [], 0.05)[0] and not connection.recv(1):
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
    connection.sendall(os.waitstatus_to_exitcode(status).to_bytes(8, "big", signed=True))
    connection.close()
    os._exit(0)
'''


class WarmStarter:
    """The warm interpreter of this pytest worker, started on first use with ``environment``."""

    def __init__(self, bin_dir: Path, environment: dict):
        self.environment = dict(environment)
        self.directory = _worker_directory()
        self.address = os.path.join(self.directory, "socket")
        code = (f"BIN = {str(bin_dir)!r}\nADDRESS = {self.address!r}\nPRELOADED = {PRELOADED!r}\n"
                f"READ_AT_START = {READ_AT_START!r}\nREAD_WHEN_RUN = {READ_WHEN_RUN!r}\n"
                f"SET_BY_SCRIPTS = {SET_BY_SCRIPTS!r}\n" + _SERVER)
        self.log = open(os.path.join(self.directory, "log"), "w+")
        self.process = subprocess.Popen([str(bin_dir / "python"), "-c", code], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, env=self.environment,
                                        cwd=self.directory, text=True)
        first = self.process.stdout.readline()
        self.log.seek(0)
        noise = self.log.read()
        # what the imports print would be missing from each command's output: then none starts warm
        self.usable = first == "ready\n" and not noise
        if not self.usable:
            self.close()
        atexit.register(self.close)

    def close(self):
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def run(self, argv: List[str], cwd, environment: dict, timeout: float) -> subprocess.CompletedProcess:
        """``argv`` (the console script's path first) run in ``cwd`` with ``environment``: its exit
        status, standard output and error, as subprocess.run(capture_output=True, text=True) gives them;
        subprocess.TimeoutExpired after ``timeout`` seconds, the command killed."""
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(self.address)
            request = pickle.dumps((argv, str(cwd), environment, False))
            connection.sendmsg([len(request).to_bytes(8, "big") + request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                            array.array("i", [null, out_write, err_write]))])
        finally:
            for fd in (null, out_write, err_write):
                os.close(fd)
        replies = connection.makefile("rb")
        started = replies.read(8)
        if len(started) != 8:  # never kill(0): that would be this process' group
            raise RuntimeError(f"the warm interpreter did not start {argv[0]} (its log: {self.log.name})")
        pid = int.from_bytes(started, "big")
        outputs = {}

        def drain(name, fd):
            with open(fd, "rb") as stream:
                outputs[name] = stream.read().decode("utf-8", errors="replace")

        readers = [threading.Thread(target=drain, args=(name, fd), daemon=True)
                   for name, fd in (("stdout", out_read), ("stderr", err_read))]
        for reader in readers:
            reader.start()
        killed = threading.Event()

        def kill():
            killed.set()
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            ended = replies.read(8)
            if len(ended) != 8:
                raise RuntimeError(f"the warm interpreter lost {argv[0]} (its log: {self.log.name})")
            code = int.from_bytes(ended, "big", signed=True)
        finally:
            timer.cancel()
            for reader in readers:
                reader.join()
            replies.close()
            connection.close()
        if killed.is_set():
            raise subprocess.TimeoutExpired(argv, timeout, outputs["stdout"], outputs["stderr"])
        return subprocess.CompletedProcess(argv, code, outputs["stdout"], outputs["stderr"])


_starter: Optional[WarmStarter] = None


def warm_run(cmd: List[str], environment: dict, cwd, timeout: float) -> Optional[subprocess.CompletedProcess]:
    """``cmd`` (as commands.cli_command makes it) run from this worker's warm interpreter, or None
    when it must start cold (see the module's docstring)."""
    global _starter
    bin_dir = Path(sys.executable).parent
    command = Path(cmd[0]).name
    if (os.environ.get("FAIRSEQ_ROPE_TESTS_COLD") == "1" or command not in WARM_COMMANDS
            or Path(cmd[0]).parent != bin_dir):
        return None
    if _starter is None:
        _starter = WarmStarter(bin_dir, environment)
    if not _starter.usable or _read_at_start(environment) != _read_at_start(_starter.environment):
        return None
    return _starter.run(cmd, cwd, environment, timeout)


def _read_at_start(environment: dict) -> dict:
    return {name: value for name, value in environment.items() if name not in READ_WHEN_RUN}


# --- the stand-ins a test's scripts and commands find first on their PATH ----------------------------
_STAND_IN = """#!{python}
import sys
sys.path.insert(0, {tests!r})
from support.warm_start import run_as_stand_in
run_as_stand_in({name!r})
"""


def stand_in_environment(environment: dict) -> dict:
    """``environment`` (a command's, as commands.cli_command makes it) with the stand-ins first on
    its PATH and the warm interpreter's address, unless commands start cold."""
    if os.environ.get("FAIRSEQ_ROPE_TESTS_COLD") == "1":
        return environment
    stand_ins = os.path.join(_worker_directory(), "bin")
    if not os.path.isdir(stand_ins):
        os.makedirs(stand_ins)
        tests = str(Path(__file__).resolve().parents[1])
        for name in WARM_COMMANDS:
            path = os.path.join(stand_ins, name)
            with open(path, "w") as stand_in:
                stand_in.write(_STAND_IN.format(python=sys.executable, tests=tests, name=name))
            os.chmod(path, 0o755)
    return {**environment, "PATH": f"{stand_ins}{os.pathsep}{environment.get('PATH', '')}",
            ADDRESS_VARIABLE: os.path.join(_worker_directory(), "socket")}


def run_as_stand_in(name: str):
    """The stand-in of console script ``name``: the command from the warm interpreter, else the
    console script itself in this process."""
    import signal

    script = str(Path(sys.executable).parent / name)
    argv = [script, *sys.argv[1:]]
    pid, replies = 0, None
    address = os.environ.get(ADDRESS_VARIABLE)
    if address and os.environ.get("FAIRSEQ_ROPE_TESTS_COLD") != "1":
        try:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.connect(address)
            request = pickle.dumps((argv, os.getcwd(), dict(os.environ), True))
            connection.sendmsg([len(request).to_bytes(8, "big") + request],
                               [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
            replies = connection.makefile("rb")
            started = replies.read(8)
            pid = int.from_bytes(started, "big") if len(started) == 8 else 0
        except OSError:  # no warm interpreter (yet, or any more)
            pid = 0
    if not pid:
        os.execv(script, argv)

    def pass_on(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, pass_on)
    ended = replies.read(8)
    code = int.from_bytes(ended, "big", signed=True) if len(ended) == 8 else 1
    if code < 0:  # killed by a signal: so is the stand-in
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)
