"""What several test modules build alike, built once per test run: the first pytest worker that
asks builds it, the others wait for it and then read it (never write to it: every worker shares it)."""

import os
import shutil
from pathlib import Path
from typing import Callable

from filelock import FileLock


def shared_directory(tmp_path_factory, kind: str, key: str, build: Callable[[Path], None]) -> Path:
    """The directory of ``kind`` and ``key`` (hex), made by ``build(directory)`` in this test run
    unless a worker made it already. It counts as made once ``build`` has returned (a marker beside
    it), so that a worker killed midway leaves nothing the next would take as done; it is built in
    place, since what it holds may record its own path."""
    # the run's own directory: under xdist the parent of each worker's, else this process's
    run_dir = tmp_path_factory.getbasetemp()
    root = (run_dir.parent if os.environ.get("PYTEST_XDIST_WORKER") else run_dir) / f"shared_{kind}"
    root.mkdir(exist_ok=True)
    directory = root / key[:16]
    made = directory.with_suffix(".made")
    with FileLock(str(directory) + ".lock"):
        if not made.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            made.touch()
    return directory
