"""Running the harness's runs, --jobs at a time, each on its CPU threads or GPU, each start before
the runs that start from it."""

import os
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


class SlotsInPlanOrder:
    """The free job slots, each handed to the run planned first among those ready for one.

    Runs that wait for their start have workers of their own, so more workers than slots ask for
    slots at once; a plain queue would hand them out in whatever order the workers happened to ask,
    mixing seeds and leaving a fine-tuning whose start has finished behind later seeds' runs."""

    def __init__(self, slots, tasks, start_task):
        self.free = list(slots)
        self.plan_order = {task: index for index, task in enumerate(tasks)}
        self.not_started = set(tasks)
        self.start_unfinished = {task for task in tasks if start_task(task)}
        self.starting_from = {}  # a task -> the tasks that start from its model
        for task in tasks:
            if start_task(task):
                self.starting_from.setdefault(start_task(task), []).append(task)
        self.changed = threading.Condition()

    def _first_ready(self):
        ready = self.not_started - self.start_unfinished
        return min(ready, key=self.plan_order.get) if ready else None

    def take(self, task):
        with self.changed:
            self.changed.wait_for(lambda: self.free and self._first_ready() == task)
            self.not_started.discard(task)
            self.changed.notify_all()
            return self.free.pop(0)

    def give_back(self, task, slot, succeeded):
        with self.changed:
            self.free.append(slot)
            if succeeded:  # in the same step, so the runs starting from it come before later runs
                self.start_unfinished.difference_update(self.starting_from.get(task, ()))
            self.changed.notify_all()

    def drop(self, task):
        """A run that will not ask for a slot (its start failed, or it was cancelled)."""
        with self.changed:
            self.not_started.discard(task)
            self.changed.notify_all()


def run_all(args, data):
    """{variant: [result per seed]}, ``--jobs`` runs at a time."""
    planned = job_slots(args.jobs, args.threads, visible_gpus())
    log(f"{len(args.variants) * len(args.seeds)} runs, {len(planned)} at a time, "
        f"{args.threads} CPU thread(s) each" + (", a GPU each" if planned[0]["GPUS"] == "1" else ""))
    # seed by seed: the runs of one seed finish close together and under the same load, so a
    # comparison stopped half-way already has whole seeds to compare
    tasks = [(v, s) for s in args.seeds for v in in_training_order(args)]

    def start_task(task):
        variant, seed = task
        return (start_of(args, variant), seed) if start_of(args, variant) else None

    slots = SlotsInPlanOrder(planned, tasks, start_task)
    futures = {}
    stopping = threading.Event()  # a run failed, or the harness was stopped: no run starts any more

    def run(variant, seed):
        task = (variant, seed)
        try:
            # a run that starts from another waits for it without holding a slot; that run was
            # submitted before it, so a worker already has it (the pool takes its tasks in order)
            start = futures[start_task(task)].result() if start_task(task) else None
        except BaseException:
            slots.drop(task)
            raise
        slot = slots.take(task)
        succeeded = False
        try:
            if stopping.is_set():
                raise CancelledError()
            result = run_one(args, data, variant, seed, slot, start)
            succeeded = True
            return result
        except BaseException:
            stopping.set()
            raise
        finally:
            slots.give_back(task, slot, succeeded)

    # a worker for each run that may wait for its start besides one per slot: the waiting
    # never keeps a free slot from the runs after them
    waiting = sum(1 for task in tasks if start_task(task))
    with ThreadPoolExecutor(max_workers=len(planned) + waiting) as pool:
        for task in tasks:
            futures[task] = pool.submit(run, *task)
        try:
            done = {task: future.result() for task, future in futures.items()}
        except BaseException as e:
            stopping.set()
            for task, future in futures.items():
                if future.cancel():
                    slots.drop(task)
            if isinstance(e, Exception):
                log("a run failed: the runs in progress finish first (a rerun reuses them)")
            else:  # interrupted: stop what runs
                terminate_running()
            raise
    return {v: [done[(v, s)] for s in args.seeds] for v in args.variants}
