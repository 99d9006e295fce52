"""What the sections of fairseq-rope-gpu-check (fairseq_rope_tools/research/gpu_check/command.py) share:
the sizes of a CUDA check and of a tiny one, running steps side by side, and keeping one step's
failure from losing the others' results."""

import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fairseq_rope_tools.cli import sayer, terminate_running
from fairseq_rope_tools.research.benchmarks import engine_timings


@dataclass(frozen=True)
class Sizes:
    """Everything a CUDA check and a tiny one do differently, apart from the device."""
    corpus: tuple            # quickstart pairs: train, valid, test
    bpe_merges: int
    archs: dict              # model -> fairseq architecture
    model_args: tuple        # extra fairseq-train arguments for both models
    updates: int
    max_tokens: int
    lr: float
    log_interval: int
    validations: int         # how many times training validates (the rows of the loss table)
    max_len: int             # target tokens before </s>, fairseq-generate and CTranslate2 alike
    kernel_shapes: tuple     # (T, B, H, head_dim) of the kernel check
    kernel_cases: str        # "all": every combination; "covering": each option at least once
    bandwidth_shape: tuple   # (T, B, H, head_dim) of q and k
    bandwidth_reps: int
    copy_bytes: int          # the copy that measures the device's bandwidth
    lanes: int               # steps that time nothing may run this many at a time


FULL = Sizes(corpus=(30000, 500, 500), bpe_merges=2000, archs={"rope": "transformer_rope", "sinusoidal": "transformer"},
             model_args=(), updates=300, max_tokens=4096, lr=1e-3, log_interval=10, validations=6,
             max_len=engine_timings.MAX_LEN, kernel_shapes=((64, 8, 8, 64), (33, 5, 12, 80), (17, 3, 16, 128)),
             kernel_cases="all", bandwidth_shape=(1024, 64, 16, 64), bandwidth_reps=20, copy_bytes=1 << 30, lanes=1)


TINY = Sizes(corpus=(300, 20, 20), bpe_merges=200,
             archs={"rope": "transformer_rope_tiny", "sinusoidal": "transformer_tiny"},
             model_args=("--encoder-layers", "1", "--decoder-layers", "1"), updates=60, max_tokens=1024, lr=3e-3,
             log_interval=10, validations=2, max_len=engine_timings.MAX_LEN, kernel_shapes=((3, 2, 3, 16),),
             kernel_cases="covering",
             bandwidth_shape=(4, 2, 2, 16), bandwidth_reps=3, copy_bytes=1 << 20, lanes=2)



say = sayer("gpu_check")



def run_lanes(jobs, lanes):
    """Run the callables ``jobs`` (a dict name -> fn), ``lanes`` at a time; {name: result}."""
    if lanes <= 1:
        return {name: fn() for name, fn in jobs.items()}
    with ThreadPoolExecutor(lanes) as pool:
        futures = {name: pool.submit(fn) for name, fn in jobs.items()}
        try:
            return {name: future.result() for name, future in futures.items()}
        except BaseException:  # Ctrl-C or SIGTERM: the lanes' commands (in groups of their own) too
            terminate_running()
            raise



def guarded(name, fn):
    """fn()'s section, or {"status": "failed", "error": ...}: one step's failure does not lose the others'."""
    started = time.time()
    try:
        section = fn()
        if isinstance(section, dict):
            section.setdefault("seconds_taken", round(time.time() - started, 1))
        return section
    except Exception as e:
        say(f"{name} failed: {e}")
        return {"status": "failed", "error": str(e).strip() or type(e).__name__,
                "traceback": traceback.format_exc(limit=4)}

