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
#: imported before any fork: torch and what fairseq imports that prints nothing (never fairseq itself,
#: whose import logs, nor the plugin, which registers architectures: a command without --user-dir
#: must not find them)
PRELOADED = ("torch", "torch.onnx", "numpy", "sklearn.metrics", "sklearn.preprocessing", "sacrebleu", "omegaconf",
             "hydra.compose", "hydra.utils", "portalocker", "tqdm", "yaml")

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
    argv, cwd, environment = pickle.loads(message[8:])
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
    _, status = os.waitpid(pid, 0)
    connection.sendall(os.waitstatus_to_exitcode(status).to_bytes(8, "big", signed=True))
    connection.close()
    os._exit(0)
'''


class WarmStarter:
    """The warm interpreter of this pytest worker, started on first use with ``environment``."""

    def __init__(self, bin_dir: Path, environment: dict):
        self.environment = dict(environment)
        self.directory = tempfile.mkdtemp(prefix="warm-")
        self.address = os.path.join(self.directory, "socket")
        code = (f"BIN = {str(bin_dir)!r}\nADDRESS = {self.address!r}\nPRELOADED = {PRELOADED!r}\n" + _SERVER)
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
            request = pickle.dumps((argv, str(cwd), environment))
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
