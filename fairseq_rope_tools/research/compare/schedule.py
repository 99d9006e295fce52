"""Running the harness's runs, --jobs at a time, each on its CPU threads or GPU, each start before
the runs that start from it."""

import os
import queue
import shutil
import subprocess
import sys
import threading
from concurrent.futures import CancelledError, ThreadPoolExecutor

from fairseq_rope_tools.cli import terminate_running
from fairseq_rope_tools.research.compare.progress import log
from fairseq_rope_tools.research.compare.runs import run_one
from fairseq_rope_tools.research.compare.variants import in_training_order, start_of


def visible_gpus():
    """The CUDA_VISIBLE_DEVICES entries of the GPUs torch can use here ([] on a CPU machine)."""
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
        return []  # no NVIDIA driver: spare the seconds of importing torch to ask
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True)
    count = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return (listed or [str(i) for i in range(count)])[:count]


def job_slots(jobs, threads, gpus):
    """The environment of each of ``jobs`` concurrent runs: a GPU each while there are GPUs
    (then at most one run per GPU), else CPU threads only."""
    threads = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if gpus:
        return [{**threads, "CUDA_VISIBLE_DEVICES": gpu, "GPUS": "1", "CPU": "0"} for gpu in gpus[:jobs]]
    return [{**threads, "CUDA_VISIBLE_DEVICES": "", "GPUS": "0", "CPU": "1"} for _ in range(jobs)]


def run_all(args, data):
    """{variant: [result per seed]}, ``--jobs`` runs at a time."""
    slots = queue.Queue()
    planned = job_slots(args.jobs, args.threads, visible_gpus())
    for slot in planned:
        slots.put(slot)
    log(f"{len(args.variants) * len(args.seeds)} runs, {len(planned)} at a time, "
        f"{args.threads} CPU thread(s) each" + (", a GPU each" if planned[0]["GPUS"] == "1" else ""))

    futures = {}
    stopping = threading.Event()  # a run failed, or the harness was stopped: no run starts any more

    def run(variant, seed):
        # a run that starts from another waits for it without holding a slot; that run was
        # submitted before it, so a worker already has it (the pool takes its tasks in order)
        start = futures[(start_of(args, variant), seed)].result() if start_of(args, variant) else None
        slot = slots.get()
        try:
            if stopping.is_set():
                raise CancelledError()
            return run_one(args, data, variant, seed, slot, start)
        except BaseException:
            stopping.set()
            raise
        finally:
            slots.put(slot)

    # seed by seed: the runs of one seed finish close together and under the same load, so a
    # comparison stopped half-way already has whole seeds to compare
    tasks = [(v, s) for s in args.seeds for v in in_training_order(args)]
    # a worker for each run that may wait for its start besides one per slot: the waiting
    # never keeps a free slot from the runs after them
    waiting = sum(1 for variant, _ in tasks if start_of(args, variant))
    with ThreadPoolExecutor(max_workers=len(planned) + waiting) as pool:
        for task in tasks:
            futures[task] = pool.submit(run, *task)
        try:
            done = {task: future.result() for task, future in futures.items()}
        except BaseException as e:
            stopping.set()
            for future in futures.values():
                future.cancel()
            if isinstance(e, Exception):
                log("a run failed: the runs in progress finish first (a rerun reuses them)")
            else:  # interrupted: stop what runs
                terminate_running()
            raise
    return {v: [done[(v, s)] for s in args.seeds] for v in args.variants}
