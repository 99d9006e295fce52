"""What the project's scripts share: atomic file and directory writes, output-directory checks and
argument parsing (and, below, running fairseq commands and reading their logs).

Light on purpose -- standard library only -- so that the text steps of the recipe import it
without paying for torch or fairseq. The atomic write is the plugin's own
(``fairseq_rope/atomic_files.py``, standard library only too), loaded from its file so that the
package, which imports fairseq, is not.
"""

import argparse
import ctypes
import errno
import glob
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Optional


def _load_atomic_files():
    path = Path(__file__).resolve().parents[1] / "fairseq_rope" / "atomic_files.py"
    spec = importlib.util.spec_from_file_location("fairseq_rope_atomic_files", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_atomic_files = _load_atomic_files()
current_umask = _atomic_files.current_umask
write_atomically = _atomic_files.write_atomically


def write_lines_atomically(path, lines: Iterable[str]) -> int:
    """Write ``lines`` (without their ``\\n``) as UTF-8 text with ``\\n`` line ends, atomically;
    returns how many were written."""
    count = 0

    def write(tmp):
        nonlocal count
        with open(tmp, "w", encoding="utf-8", newline="\n") as out:
            for line in lines:
                out.write(line + "\n")
                count += 1

    write_atomically(path, write)
    return count


def write_text_atomically(path, text: str) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8", newline="\n") as out:
            out.write(text)

    write_atomically(path, write)


def write_lines(path: Optional[str], lines: Iterable[str]) -> int:
    """:func:`write_lines_atomically`, or standard output when ``path`` is None."""
    if path is not None:
        return write_lines_atomically(path, lines)
    count = 0
    for line in lines:
        sys.stdout.write(line + "\n")
        count += 1
    sys.stdout.flush()
    return count


# --- a directory of files written as one ----------------------------------------------------
# A parallel corpus is several files whose lines belong together: new English next to old German
# is a corpus that looks fine and pairs every sentence with the wrong translation. So the files
# are all written into a hidden directory beside the output directory, which then takes the
# output directory's place in one rename.

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` in one step (Linux renameat2 RENAME_EXCHANGE); False where
    the system or the file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _fsync_tree(directory: str) -> None:
    for parent, _, files in os.walk(directory):
        for name in files + ["."]:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def replace_directory(directory, write, carry=()) -> None:
    """Make ``directory`` hold exactly what ``write(tmp)`` writes into ``tmp``, all of it or none.

    ``tmp`` is a hidden ``.NAME.XXXX.tmp`` beside ``directory`` (same file system); when
    ``write`` has returned, ``tmp`` takes ``directory``'s place in one rename -- an existing
    ``directory`` is swapped with it in one step (renameat2 RENAME_EXCHANGE, Linux), then
    deleted. A reader, or a failure at any point, therefore sees the complete old directory or
    the complete new one, never some new files beside old ones. (Where the system cannot swap,
    the old directory is renamed aside first: for that instant there is none, never a mix.) The
    entries named in ``carry`` (a download cache) are moved from the old directory into the new
    one before the swap, and back if it fails. Everything else of the old directory is deleted:
    callers check first that it holds only what they write (:func:`replaced_dir_problem`). ``tmp`` is
    removed on any exception; a later call removes what a SIGKILL left."""
    directory = os.path.realpath(directory)  # a symlinked directory: its target is replaced, the link kept
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    carried, delete = [], tmp  # delete: the new files after a failure, else the old directory
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp creates 0700; give the usual mode
        write(tmp)
        _fsync_tree(tmp)
        if not os.path.isdir(directory):
            os.rename(tmp, directory)
        else:
            for entry in carry:
                if os.path.lexists(os.path.join(directory, entry)):
                    os.rename(os.path.join(directory, entry), os.path.join(tmp, entry))
                    carried.append(entry)
            delete = tmp if _exchange(tmp, directory) else _rename_aside_and_in(tmp, directory)
            carried = []  # the new directory holds them now
    except BaseException:
        for entry in carried:
            os.rename(os.path.join(tmp, entry), os.path.join(directory, entry))
        raise
    finally:
        shutil.rmtree(delete, ignore_errors=True)
    fd = os.open(parent, os.O_RDONLY)  # the rename itself survives a power cut
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for stale in _hidden_temporaries(directory):
        shutil.rmtree(stale, ignore_errors=True)


def _rename_aside_and_in(tmp: str, directory: str) -> str:
    """Where the system cannot swap: ``directory`` into a hidden directory beside it, then
    ``tmp`` in its place (or the old one back); returns the hidden directory."""
    parent, name = os.path.split(directory)
    aside = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    os.rename(directory, os.path.join(aside, "old"))
    try:
        os.rename(tmp, directory)
    except BaseException:
        os.rename(os.path.join(aside, "old"), directory)
        os.rmdir(aside)
        raise
    return aside


def _hidden_temporaries(directory):
    """What killed :func:`replace_directory` calls for ``directory`` left beside it."""
    parent, name = os.path.split(directory)
    return glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.*.tmp"))


def replaced_dir_problem(flag: str, path, tool: str, written) -> Optional[str]:
    """Why ``tool`` cannot replace the directory ``path`` (given with ``flag``) as a whole with
    :func:`replace_directory`, as one line, or None: :func:`output_dir_problem`, or it holds an
    entry for which ``written(name)`` is false -- not what the tool writes, so not its to delete.
    The hidden temporaries of an interrupted atomic write are the tool's."""
    problem = output_dir_problem(flag, path, replaced=True)
    if problem or not os.path.isdir(path):
        return problem
    foreign = sorted(n for n in os.listdir(path) if not written(n) and not (n.startswith(".") and n.endswith(".tmp")))
    if not foreign:
        return None
    shown = ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "")
    return (f"{flag} {path} holds {shown}, which {tool} does not write: it replaces the directory as a whole; "
            "give a new or empty directory")


def output_dir_problem(flag: str, path, replaced: bool = False) -> Optional[str]:
    """Why the output directory ``path`` (given with ``flag``) cannot be written, as one line, or
    None: it is a file, or it or the directory it would be made in is not writable. With
    ``replaced`` (:func:`replace_directory`), the directory it is in must be writable too."""
    shown, path = path, Path(os.path.realpath(path))
    if path.exists() and not path.is_dir():
        return f"{flag} {shown} is a file, not a directory: give a directory"
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        return f"{flag} {shown} is not writable: give a directory you can write to"
    if path.is_dir() and not replaced:
        return None
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{flag} {shown} cannot be made: {ancestor} is a file"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{flag} {shown} cannot be written: {ancestor} is not writable; give a directory you can write to"
    return None


class ArgumentParser(argparse.ArgumentParser):
    """argparse, saying what to do when a value starts with ``-``: argparse takes it for an
    option and stops with 'expected one argument', which reads as if the value were missing."""

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


class CommandFailed(RuntimeError):
    """A command exited with a non-zero status; the message names it, the status and its log."""


# the commands run_logged is waiting for, from any thread, so that a caller running several at
# once can stop them all when it is interrupted (terminate_running)
_running = set()


def terminate_running() -> None:
    """Terminate every command that run_logged is running (their run_logged calls then raise
    CommandFailed)."""
    for proc in list(_running):
        proc.terminate()


def command_env(extra: Optional[dict] = None) -> dict:
    """os.environ with this environment's bin/ first on PATH, unbuffered Python output and
    ``extra`` on top."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PATH"] = f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def run_logged(cmd, log_path, *, env: Optional[dict] = None, cwd=None, name: Optional[str] = None,
               on_line: Optional[Callable[[str], None]] = None, tail_lines: int = 15) -> None:
    """Run ``cmd`` (a console script of this environment such as ``fairseq-train``, or any
    program) with stdout and stderr written to ``log_path`` as they come; its first line is the
    command. Each output line (without its newline) is also passed to ``on_line``. Raises
    CommandFailed naming the command (``name``, default its program), with the last
    ``tail_lines`` lines and the log's path, if it exits non-zero; the command is terminated if
    the caller is interrupted or ``on_line`` raises."""
    import shlex
    import subprocess

    program = os.path.join(BIN_DIR, str(cmd[0]))
    cmd = [program if os.path.isfile(program) else str(cmd[0]), *map(str, cmd[1:])]
    tail = []
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=command_env(env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
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
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        finally:
            _running.discard(proc)
            proc.stdout.close()
    if status != 0:
        shown = "\n".join("    " + line for line in tail)
        raise CommandFailed(f"{name or os.path.basename(cmd[0])} exited with status {status}; its last lines:\n"
                            f"{shown}\nfull log: {log_path}")


# --- reading fairseq-train's log --------------------------------------------------------------
# fairseq-train logs one line per --log-interval updates (train_inner), one per validation
# (valid) and one per epoch (train), in --log-format simple (the recipe's) or json:
#   ... | train_inner | epoch 001:     25 / 164 loss=9.648, nll_loss=9.529, ..., num_updates=25, ...
#   ... | valid | epoch 001 | valid on 'valid' subset | loss 7.5 | nll_loss 7.2 | ... | num_updates 100
#   ... | valid | {"epoch": 1, "valid_loss": "7.5", ..., "valid_num_updates": "100"}

_LOG_KIND = re.compile(r"\| (train_inner|train|valid) \| (.*)$")
_MODEL_PARAMS = re.compile(r"num\. (?:shared )?model params: ([\d,]+)")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?$")


def parse_train_line(line: str):
    """``(kind, {name: number})`` for a train_inner, train or valid line of fairseq-train's log
    (names without their ``train_``/``valid_`` prefix: loss, nll_loss, wps, num_updates, ...),
    ``("params", {"params": n})`` for the model-size line, else None. Only the ``valid`` subset
    counts as validation."""
    m = _MODEL_PARAMS.search(line)
    if m:
        return "params", {"params": int(m.group(1).replace(",", ""))}
    m = _LOG_KIND.search(line)
    if not m:
        return None
    kind, rest = m.groups()
    if rest.startswith("{"):
        try:
            record = json.loads(rest)
        except ValueError:
            return None
        # json names carry the subset ("valid_loss", "train_wps"; train_inner's do not)
        prefix = f"{kind}_"
        pairs = ((name[len(prefix):] if name.startswith(prefix) else name, value) for name, value in record.items())
    elif kind == "train_inner":
        pairs = (field.split("=", 1) for field in rest.split(", ") if "=" in field)
        pairs = ((name.rsplit(" ", 1)[-1], value) for name, value in pairs)
    else:
        if kind == "valid" and "valid on 'valid' subset" not in rest:
            return None
        pairs = (field.split(" ", 1) for field in rest.split(" | ") if " " in field)
    fields = {}
    for name, value in pairs:
        value = str(value).strip()
        if _NUMBER.match(value):
            fields[name] = float(value)
    return (kind, fields) if "num_updates" in fields else None


def parse_train_log(lines: Iterable[str]) -> dict:
    """What a fairseq-train log says about the run: ``params`` (None if not logged),
    ``train_curve`` [[update, loss]], ``valid_curve`` [[update, loss, nll_loss]] (for a resumed
    run the last value logged for an update wins), ``valid_loss`` / ``valid_nll_loss`` at the
    last validation (nan without one), ``tokens_per_second`` and ``updates_per_second``, the means
    of the logged train_inner words and updates per second (of the per-epoch values when no
    train_inner line was logged), and ``speed_curve`` [[update, words/s, updates/s]] of the
    train_inner lines."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    params, train, valid, speed_curve = None, {}, {}, {}
    inner = {"wps": [], "ups": []}
    epoch = {"wps": [], "ups": []}
    for line in lines:
        parsed = parse_train_line(line)
        if parsed is None:
            continue
        kind, fields = parsed
        if kind == "params":
            params = fields["params"]
            continue
        update = int(fields["num_updates"])
        if kind == "valid" and "loss" in fields:
            valid[update] = (fields["loss"], fields.get("nll_loss", math.nan))
        elif kind == "train_inner":
            if "loss" in fields:
                train[update] = fields["loss"]
            speed_curve[update] = [fields.get("wps", math.nan), fields.get("ups", math.nan)]
        speeds = inner if kind == "train_inner" else epoch if kind == "train" else {}
        for name, values in speeds.items():
            if name in fields:
                values.append(fields[name])
    curve = sorted(valid.items())

    def mean_speed(name):
        values = inner[name] or epoch[name]
        return sum(values) / len(values) if values else math.nan

    return {
        "params": params,
        "train_curve": [[u, loss] for u, loss in sorted(train.items())],
        "valid_curve": [[u, loss, nll] for u, (loss, nll) in curve],
        "valid_loss": curve[-1][1][0] if curve else math.nan,
        "valid_nll_loss": curve[-1][1][1] if curve else math.nan,
        "tokens_per_second": mean_speed("wps"),
        "updates_per_second": mean_speed("ups"),
        "speed_curve": [[u, *speeds] for u, speeds in sorted(speed_curve.items())],
    }
