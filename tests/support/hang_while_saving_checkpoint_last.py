"""Run `fairseq-train` unchanged until it writes checkpoint_last.pt for the N-th time, then stop
for good half-way through that write.

Usage: KILL_AT_SAVE=N python hang_while_saving_checkpoint_last.py <fairseq-train arguments...>
Test instrumentation only: fairseq makes checkpoint_last.pt with shutil.copyfile (in place, or
into a temporary file with fairseq_rope). The N-th such copy writes half the bytes, prints
HANGING-IN-CHECKPOINT-LAST-WRITE and sleeps, so the test can SIGKILL the process at exactly
that point, as a preemption or an OOM kill would.
"""

import os
import shutil
import sys
import time

from fairseq_cli import train

kill_at_save = int(os.environ.get("KILL_AT_SAVE", "1"))
_copyfile = shutil.copyfile
_copies_to_last = []


def _copyfile_hanging_in_nth_last(src, dst, *args, **kwargs):
    if "checkpoint_last" not in os.path.basename(dst):
        return _copyfile(src, dst, *args, **kwargs)
    _copies_to_last.append(dst)
    if len(_copies_to_last) < kill_at_save:
        return _copyfile(src, dst, *args, **kwargs)
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
    print("HANGING-IN-CHECKPOINT-LAST-WRITE", dst, flush=True)
    time.sleep(600)
    sys.exit("not killed in time")


shutil.copyfile = _copyfile_hanging_in_nth_last
sys.exit(train.cli_main())
