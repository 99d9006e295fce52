#!/usr/bin/env python
"""Split RoPE's training-step overhead into the rotation and the rest of the attention layer.

Times forward + backward + Adam step, alternating in one process, for three models on identical
inputs: stock ``transformer`` (sinusoidal), ``transformer_rope``, and ``transformer_rope`` with
the rotation replaced by the identity (same attention code path, no rotation). Prints the
per-step times, their medians and the minor page faults per step (``--malloc retain``: see
benchmarks/speed.py); a line on stderr as the warm-up and each repetition start.

    fairseq-rope-ablate-rotation --dim base --reps 4
"""

import argparse
import statistics
import time

import torch

from fairseq_rope_tools.cli import ArgumentParser, command, progress_sayer
from fairseq_rope_tools.research.benchmarks.speed_measures import ARCHS, build_on, make_batch, train_step
from fairseq_rope_tools.research.machine import page_faults, use_malloc
from fairseq_rope_tools.research.models import DictionaryTask


@command
def main(argv=None):
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", choices=sorted(ARCHS), default="base")
    parser.add_argument("--reps", type=int, default=4, help="timed steps per model (after one warm-up)")
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--malloc", choices=["default", "retain"], default="default")
    args = parser.parse_args(argv)
    progress = progress_sayer("ablate-rotation")
    use_malloc(args.malloc)
    torch.set_num_threads(args.threads)

    from fairseq_rope.modules import RotaryEmbedding

    task = DictionaryTask(8000)
    device = torch.device("cpu")
    batch = make_batch(task, args.tokens_per_batch // args.length, args.length, device)
    stock_arch, rope_arch = ARCHS[args.dim]
    models = {}
    for name, arch in (("stock", stock_arch), ("rope", rope_arch), ("rope, rotation off", rope_arch)):
        model = build_on(device, arch, task).train()
        models[name] = (model, torch.optim.Adam(model.parameters(), lr=1e-4))

    rotate = RotaryEmbedding.rotate
    faults = {name: [] for name in models}

    def step(name):
        off = name == "rope, rotation off"
        RotaryEmbedding.rotate = (lambda self, xs, *_, **__: list(xs)) if off else rotate
        try:
            before = page_faults()
            start = time.perf_counter()
            train_step(*models[name], batch)
            seconds = time.perf_counter() - start
            faults[name].append(page_faults() - before)
            return seconds
        finally:
            RotaryEmbedding.rotate = rotate

    progress(f"{args.dim}: one warm-up step of each of {', '.join(models)}")
    for name in models:
        step(name)
    times = {name: [] for name in models}
    for rep in range(args.reps):
        progress(f"{args.dim}: rep {rep + 1}/{args.reps}, a training step of each model")
        for name in (list(models) if rep % 2 == 0 else list(models)[::-1]):
            times[name].append(step(name))
    print(f"{args.dim}, {args.threads} thread(s), malloc {args.malloc}, seconds per training step:")
    for name, values in times.items():
        print(
            f"  {name:20s} median {statistics.median(values):6.2f}   all {[round(v, 2) for v in values]}"
            f"   page faults/step {statistics.median(faults[name][1:]):,.0f}"
        )


if __name__ == "__main__":
    main()
