"""What the tools' command lines share: the one error the user must act on and the one entry
point that reports it (:class:`UserError`, :func:`command`), argument parsing, messages and
progress lines, a SIGTERM that cleans up, and running fairseq's console scripts with their output
logged line by line.

Standard library only, like :mod:`fairseq_rope_base`.
"""

import argparse
import contextlib
import functools
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

from fairseq_rope_base.errors import OneLineError


class UserError(OneLineError):
    """Something the user must change -- a flag, a file, a directory, the machine (the tools'
    :class:`~fairseq_rope_base.errors.OneLineError`): status 2 when refused before any work, 1 when a
    step fails on the way (a command it runs, an input line it meets). Helpers raise it; only
    :func:`command` exits."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message, status)


def command(main: Optional[Callable] = None, *, label: Optional[str] = None) -> Callable:
    """The entry point of every fairseq-rope-* command, around its ``main(argv)``: main's return
    value is the exit status (None: 0); a :class:`UserError` or a plugin error becomes one line on
    stderr, ``PROG: error: MESSAGE`` (``LABEL error: MESSAGE`` with ``@command(label=...)``, for a
    recipe's own steps), and its exit status; Ctrl-C is one line, ``PROG: interrupted (Ctrl-C)``
    (status 130), and SIGTERM unwinds like it, so that ``finally`` clauses remove what was half
    written (status 143); a reader that closes the pipe early
    (``| head``) ends the command quietly (status 141, as a killed pipe writer)."""
    if main is None:
        return functools.partial(command, label=label)

    @functools.wraps(main)
    def run(argv=None):
        heading = label or f"{os.path.basename(sys.argv[0] or main.__module__)}:"
        try:
            with sigterm_unwinds():
                status = main(argv)
                if sys.stdout is not None:
                    sys.stdout.flush()  # here, where a reader that has gone is caught, not at exit
                return status
        except BrokenPipeError:
            # the reader has gone: later writes (Python's own flush at exit) must not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(128 + signal.SIGPIPE)
        except KeyboardInterrupt:  # Ctrl-C: what was written stays written, the rest was cleaned up on the way
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            sys.stderr.write(f"{heading} interrupted (Ctrl-C)\n")
            sys.exit(128 + signal.SIGINT)
        except Exception as error:
            if not isinstance(error, OneLineError):  # the tools' UserError and the plugin's errors
                raise
            message, status = str(error), error.status
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        sys.stderr.write(f"{heading} error: {message}\n")
        sys.exit(status)

    return run


def closed_stdout_problem(output_flag: str) -> Optional[str]:
    """One line when standard output is closed (``>&-``: Python then sets ``sys.stdout`` to
    None and drops what is printed), for a command about to write its output there; else None."""
    if sys.stdout is None:
        return f"standard output is closed: give {output_flag} FILE, or run the command with stdout open"
    return None


def sayer(tool: str) -> Callable[[str], None]:
    """``say(message)``: ``[TOOL] MESSAGE`` on stderr, a tool's notes and progress kept apart from
    its output."""

    def say(message: str) -> None:
        print(f"[{tool}] {message}", file=sys.stderr, flush=True)

    return say


def duration(seconds: float) -> str:
    """``1m05s``, or ``2h03m`` from an hour on."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def progress_sayer(tool: str) -> Callable[[str], None]:
    """``progress(message)``: ``[TOOL] MESSAGE (1m05s elapsed)`` on stderr, timed from this call.
    A long run's progress as plain lines, which a log keeps as they are (a terminal's progress
    bar redraws one line with carriage returns, a single unreadable line in a log)."""
    say = sayer(tool)
    started = time.monotonic()

    def progress(message: str) -> None:
        say(f"{message} ({duration(time.monotonic() - started)} elapsed)")

    return progress


def _unwind(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_unwinds():
    """Within the block, SIGTERM (a scheduler's cancel, ``kill``) unwinds like Ctrl-C: ``finally``
    clauses run, so no temporary file or directory is left behind."""
    previous = signal.signal(signal.SIGTERM, _unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def plugin_dir() -> str:
    """The directory of the plugin this Python imports, for fairseq's ``--user-dir``: the same
    from any working directory, for a regular and an editable install (fairseq finds a bare
    ``--user-dir fairseq_rope`` only in the working directory or next to its own package). Found
    without importing the plugin, which would load torch and fairseq."""
    spec = importlib.util.find_spec("fairseq_rope")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"this Python ({sys.executable}) has no fairseq_rope: install the package into its "
                        "environment (docs/usage.md#install)")
    return os.path.abspath(spec.submodule_search_locations[0])


PACKAGE = "fairseq-rope"


def package_version() -> str:
    """The installed package's version; in a checkout that is not installed, pyproject.toml's."""
    import importlib.metadata  # here: the commands that never print it do not pay for it

    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
        with contextlib.suppress(OSError), open(pyproject, encoding="utf-8") as f:
            found = re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M)
            if found:
                return found.group(1)
        return "unknown"


class _Version(argparse.Action):
    """``--version``: ``PROG VERSION`` on stdout, exit 0 (argparse's own takes the version string
    when the parser is built; this one reads it only when asked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {package_version()}")
        parser.exit()


def add_version_argument(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` (a plain argparse one; :class:`ArgumentParser` has it) ``--version``."""
    parser.add_argument("--version", action=_Version, help="print the command's name and the package's version")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with ``--version``, saying what to do when a value starts with ``-``: argparse takes
    it for an option and stops with 'expected one argument', which reads as if the value were missing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.add_help:  # not a parents=[...] parser (add_help=False): its options join another's
            add_version_argument(self)

    def error(self, message):
        if re.search(r"expected (one|at least one) argument", message):
            message += (" (a value that starts with '-' is read as an option: write it as --flag=VALUE, "
                        "or a path such as -x as ./-x)")
        elif message.startswith("unrecognized arguments: -"):
            message += " (an input file whose name starts with '-' is given as ./NAME)"
        super().error(message)


# --- running fairseq's console scripts ------------------------------------------------------
# fairseq-train / -generate / -preprocess run as a user would run them, with this Python's
# environment first on PATH, and their output goes to a log file line by line as it comes, so a
# long training can be followed (tail -f, or an ``on_line`` callback) while it runs.

BIN_DIR = os.path.dirname(sys.executable)


# --- children that end with the tool ---------------------------------------------------------
# A tool killed with SIGKILL runs no clean-up, and its commands would run on: fairseq-train is a
# grandchild (train.sh runs it piped into tee), which neither a parent-death signal (it reaches
# the direct child alone) nor a kill of the tool's process group (that may be the caller's
# shell's) reaches safely. So every process the tool starts inherits a token in its environment,
# and a watchdog, told by a pipe when the tool has gone however it went, ends the processes that
# carry it: the tool's descendants, and no other process.

RUN_TOKEN = "FAIRSEQ_ROPE_RUN"


@contextlib.contextmanager
def children_end_with_this_process():
    """Within the block, the processes this one starts carry a token of this run, and a watchdog
    ends those still running when the block ends (it is waited for) or when this process is
    killed, SIGKILL included (Linux: it reads /proc)."""
    previous = os.environ.get(RUN_TOKEN)
    os.environ[RUN_TOKEN] = f"{os.getpid()}-{time.time_ns()}"
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this very module, in a checkout too
    watchdog = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {package_root!r}); "
                               "from fairseq_rope_tools.cli import end_children_when_parent_goes; "
                               "end_children_when_parent_goes()"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        watchdog.stdin.close()
        watchdog.wait()
        if previous is None:
            del os.environ[RUN_TOKEN]
        else:
            os.environ[RUN_TOKEN] = previous


def end_children_when_parent_goes(grace_seconds=10.0) -> None:
    """The watchdog: wait until standard input closes (its parent has exited or was killed), then
    SIGTERM every process that carries the run's token, and SIGKILL those left after
    ``grace_seconds``. Ctrl-C, SIGTERM and a hang-up, which reach the parent's process group, are
    ignored: it ends when the parent has."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    token = os.environ[RUN_TOKEN]
    sys.stdin.buffer.read()
    deadline, terminated = time.monotonic() + grace_seconds, set()
    while True:
        left = [pid for pid in processes_carrying(RUN_TOKEN, token) if pid != os.getpid()]
        if not left:
            return
        for pid in left:
            if pid not in terminated or time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM if pid not in terminated else signal.SIGKILL)
                terminated.add(pid)
        time.sleep(0.1)


def processes_carrying(name, value):
    """The ids of the live processes (of this user: others' environments cannot be read) started
    with ``name=value`` in their environment."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "environ"), "rb") as environ:
                if wanted in environ.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


class CommandFailed(UserError):
    """A command exited with a non-zero status; the message names it, the status and its log."""

    def __init__(self, message: str):
        super().__init__(message, status=1)


# the commands run_logged is waiting for, from any thread, so that a caller running several at
# once can stop them all when it is interrupted (terminate_running)
_running = set()


def terminate_running() -> None:
    """Terminate every command that run_logged is running (their run_logged calls then raise
    CommandFailed)."""
    for proc in list(_running):
        _signal_command(proc, signal.SIGTERM)


def _signal_command(proc, signum) -> None:
    """``signum`` to the command's process group (run_logged starts each in its own): a script's
    whole pipeline (train.sh's fairseq-train | tee) gets it, not only its shell, which would die
    and leave fairseq-train training, its output still read."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signum)


def command_env(extra: Optional[dict] = None) -> dict:
    """os.environ with this environment's bin/ first on PATH, unbuffered Python output and
    ``extra`` on top."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PATH"] = f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def run_logged(cmd, log_path, *, env: Optional[dict] = None, cwd=None, name: Optional[str] = None,
               on_line: Optional[Callable[[str], None]] = None, tail_lines: int = 15, append: bool = False) -> None:
    """Run ``cmd`` (a console script of this environment such as ``fairseq-train``, or any
    program) with stdout and stderr written to ``log_path`` as they come; its first line is the
    command. Each output line (without its newline) is also passed to ``on_line``. Raises
    CommandFailed naming the command (``name``, default its program), with the last
    ``tail_lines`` lines and the log's path, if it exits non-zero; the command is terminated if
    the caller is interrupted or ``on_line`` raises. ``append`` continues an existing log (a
    resumed command), starting with the command again."""
    import shlex

    program = os.path.join(BIN_DIR, str(cmd[0]))
    cmd = [program if os.path.isfile(program) else str(cmd[0]), *map(str, cmd[1:])]
    tail = []
    with open(log_path, "a" if append else "w", encoding="utf-8") as log:
        log.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=command_env(env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                                start_new_session=True)  # a process group of its own: _signal_command
        _running.add(proc)
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                line = line.rstrip("\n")
                tail = (tail + [line])[-tail_lines:]
                if on_line is not None:
                    on_line(line)
            status = proc.wait()
        except BaseException:
            _signal_command(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _signal_command(proc, signal.SIGKILL)
                proc.wait()
            raise
        finally:
            _running.discard(proc)
            proc.stdout.close()
    if status != 0:
        shown = "\n".join("    " + line for line in tail)
        raise CommandFailed(f"{name or os.path.basename(cmd[0])} exited with status {status}; its last lines:\n"
                            f"{shown}\nfull log: {log_path}")
