#!/usr/bin/env python
"""Side-by-side speed of ``transformer`` (sinusoidal positions) and ``transformer_rope``.

One run alternates baseline and RoPE repetitions (A B A B ...) on identical inputs and reports
medians and per-pair ratios (RoPE / baseline), as a markdown table and optionally as JSON:

* training throughput: target tokens per second of forward + backward + optimizer step, and on
  the CPU the minor page faults per step (memory the allocator took fresh from the OS);
* peak training memory of each model (CPU: the resident-set high-water mark of a fresh process
  per model, total and above the process before its first step; CUDA: max_memory_allocated);
* beam-4 generation speed (sentences per second) with incremental decoding, every hypothesis
  forced to the same length so that both models do the same amount of work, and on the CPU the
  minor page faults per generation call;
* the rotation of q and k for a base-size batch, as self-attention runs it (in place on the
  projection outputs on the CPU, the fused kernel on CUDA), against a floor measured in the same
  run: a plain ``dst.copy_(src)`` of the same number of bytes.

On the CPU, glibc's allocator returns large freed blocks to the OS and faults them in again on
the next allocation; how often depends on the whole heap history of the process, so it moves
either model's step time by several percent from run to run. ``--malloc retain`` restarts the
benchmark with ``GLIBC_TUNABLES`` that keep freed memory in the process (no page faults after
warm-up), which isolates the models' own compute.

A line on stderr announces every phase and every repetition as it starts, with the time elapsed.

Every ratio row also gets, in the JSON, a 95 % bootstrap interval of its median; ``--pool``
combines the pairs of several saved reports.

Example::

    fairseq-rope-benchmark-speed --dims tiny base --reps 7 --json-out bench.json
    fairseq-rope-benchmark-speed --pool run1.json run2.json run3.json
    # on a GPU, where users train: fp16, base size, 25k tokens per batch; then the same with the
    # fused kernel switched off (FAIRSEQ_ROPE_FUSED=0) for the kernel's share
    fairseq-rope-benchmark-speed --dims base --dtype float16 --tokens-per-batch 25000 --reps 21 --json-out gpu.json
"""

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from fairseq_rope_base.files import outputs_over_inputs_problem, write_text_atomically
from fairseq_rope_tools.cli import ArgumentParser, UserError, command
from fairseq_rope_tools.research.benchmarks.speed_measures import (
    ARCHS,
    CLOCKS,
    DTYPES,
    MemoryRun,
    Stopwatch,
    batch_sentences,
    bench_generation,
    bench_memory,
    bench_rotation,
    bench_training,
    hardware,
    make_batch,
    progress,
)
from fairseq_rope_tools.research.machine import use_malloc
from fairseq_rope_tools.research.models import DictionaryTask
from fairseq_rope_tools.research.paired_stats import pool_ratios

# --------------------------------------------------------------------------------------------
# the report


def speed_figure(v):
    return f"{v:,.1f}" if v >= 100 else f"{v:.3g}"


def speed_table(rows):
    """Markdown table of (label, summary, target) rows."""
    lines = [
        "| measurement | baseline | RoPE | RoPE / baseline (median of pairs) | pair range | target |",
        "|---|---|---|---|---|---|",
    ]
    for label, res, target in rows:
        ratio, pair_range = "-", "-"
        if res["ratio_median"] is not None:
            ratio = f"**{res['ratio_median']:.3f}**"
            pair_range = f"{res['ratio_min']:.3f} - {res['ratio_max']:.3f}"
        lines.append(
            f"| {label} | {speed_figure(res['baseline'])} {res['unit']} | {speed_figure(res['rope'])} {res['unit']} | "
            f"{ratio} | {pair_range} | {target} |"
        )
    return "\n".join(lines)


def write_json(path, data):
    write_text_atomically(path, json.dumps(data, indent=2))


def read_reports(paths):
    """(path, report, its results) of every saved ``--json-out`` report; a UserError names a file that is not one."""
    reports = []
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
            results = report["results"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"--pool {path}: not a report written by --json-out ({err})", status=1) from None
        reports.append((path, report, results))
    return reports


def pool_reports(paths, json_out=None):
    """Pool the per-pair ratios of several saved reports (``--json-out``) row by row: the median
    of all their pairs and its bootstrap interval, for targets closer than one run resolves."""
    reports = read_reports(paths)
    pooled = pool_ratios([results for _, _, results in reports])
    print("Pooled reports:")
    for path, report, _ in reports:
        settings = report.get("settings", {})
        print(f"- {path}: `{report.get('command', '?')}` ({settings.get('threads', '?')} threads, "
              f"{settings.get('clock', '?')} clock, malloc {settings.get('malloc', '?')})")
    print("\n| measurement | runs | pairs | RoPE / baseline (median of all pairs) | 95 % interval of "
          "that median (bootstrap) | pair range |")
    print("|---|---|---|---|---|---|")
    rows = []
    for key, row in pooled.items():
        interval = row["ratio_median_ci95"]
        ci = f"{interval[0]:.3f} - {interval[1]:.3f}" if interval else "-"
        rows.append(f"| {key} | {row['runs']} | {row['pairs']} | **{row['ratio_median']:.3f}** | {ci} | "
                    f"{row['ratio_min']:.3f} - {row['ratio_max']:.3f} |")
    print("\n".join(rows))
    if json_out:
        write_json(json_out, {"pooled": [str(p) for p in paths], "results": pooled})
        print(f"\nJSON written to {json_out}")


# --------------------------------------------------------------------------------------------
# command line


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", nargs="+", choices=sorted(ARCHS), default=["tiny", "base"])
    p.add_argument("--reps", type=int, default=7, help="A/B pairs per training and generation row")
    p.add_argument("--steps", type=int, default=1, help="least training steps timed per repetition")
    p.add_argument("--min-rep-seconds", type=float, default=3.0,
                   help="more steps per repetition until one lasts this long")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--length", type=int, default=32, help="source and target length of every sentence")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--gen-sentences", type=int, default=32)
    p.add_argument("--gen-length", type=int, default=24)
    p.add_argument("--rotation-reps", type=int, default=21)
    p.add_argument("--rotation-inner", type=int, default=10)
    p.add_argument("--memory-reps", type=int, default=2)
    p.add_argument("--memory-steps", type=int, default=2)
    p.add_argument("--skip", nargs="*", default=[], choices=["train", "generate", "rotation", "memory"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="weights and activations of both models (float16: as fairseq-train --fp16 and "
                        "fairseq-generate --fp16 run them on a GPU)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall: elapsed time; process: CPU time of this process, less sensitive to "
                        "other programs on a shared CPU (use with --threads 1; not for CUDA)")
    p.add_argument("--malloc", choices=["default", "retain"], default="default",
                   help="retain: rerun under GLIBC_TUNABLES that keep freed memory in the process "
                        "(no page faults after warm-up); CPU timings then show compute alone")
    p.add_argument("--json-out")
    p.add_argument("--pool", nargs="+", metavar="REPORT",
                   help="run nothing: pool the pairs of these --json-out reports row by row")
    return p.parse_args(argv)


def memory_run(args) -> MemoryRun:
    """What each peak-memory process trains."""
    return MemoryRun(device=args.device, vocab=args.vocab, length=args.length, steps=args.memory_steps,
                     sentences=batch_sentences(args.tokens_per_batch, args.length), dtype=args.dtype,
                     threads=args.threads)


def speed_rows(dim, label, faults_label, res):
    """Table rows of a training or generation result: the speed (target on base), the faults."""
    rows = [(f"{dim}: {label}", res, ">= 0.98" if dim in ("base", "d256") else "")]
    if "page_faults" in res:
        rows.append((f"{dim}: page faults per {faults_label}", res["page_faults"], ""))
    return rows


def run_benchmarks(args, device, stopwatch):
    """Every measurement ``args`` asks for: (results by JSON key, table rows)."""
    task = DictionaryTask(args.vocab)
    sentences = batch_sentences(args.tokens_per_batch, args.length)
    dtype = DTYPES[args.dtype]
    results, rows = {}, []
    for dim in args.dims:
        archs = ARCHS[dim]
        models = f"{archs[0]} and {archs[1]}"
        if "train" not in args.skip:
            progress(f"{dim} training: building {models}, {args.warmup} warm-up step(s) each")
            batch = make_batch(task, sentences, args.length, device)
            res = bench_training(archs, task, batch, stopwatch, args.reps, args.warmup, args.steps,
                                 args.min_rep_seconds, label=f"{dim} training", dtype=dtype)
            results[f"train_{dim}"] = res
            rows += speed_rows(dim, "training throughput", "training step", res)
            progress(f"{dim} training done: RoPE / baseline {res['ratio_median']:.3f}")
        if "memory" not in args.skip:
            progress(f"{dim} memory: {models}, a fresh process each")
            res = bench_memory(archs, memory_run(args), args.memory_reps, label=f"{dim} memory")
            results[f"memory_{dim}"] = res
            target = "<= 1.02" if dim == "base" else ""
            rows.append((f"{dim}: peak training memory (process)", res["peak_mib"], target))
            if "peak_above_start_mib" in res:
                rows.append((f"{dim}: peak training memory (above model + batch)", res["peak_above_start_mib"], target))
            progress(f"{dim} memory done")
        if "generate" not in args.skip:
            progress(f"{dim} generation: building {models}, {args.warmup} warm-up call(s) each")
            res = bench_generation(archs, task, args.gen_sentences, args.gen_length, stopwatch, args.reps,
                                   args.warmup, label=f"{dim} generation", dtype=dtype)
            results[f"generate_{dim}"] = res
            rows += speed_rows(dim, "beam-4 generation", "generation call", res)
            progress(f"{dim} generation done: RoPE / baseline {res['ratio_median']:.3f}")
    if "rotation" not in args.skip:
        rotation = bench_rotation(sentences, args.length, stopwatch, args.rotation_reps, args.rotation_inner,
                                  args.warmup, dtype)
        for label, res in rotation.items():
            results[f"rotation {label}"] = res
            rows.append((f"base: rotate q and k, {label} (baseline column: copy floor)", res, "<= 2"))
    return results, rows


@command
def main(argv=None):
    args = parse_args(argv)
    problem = outputs_over_inputs_problem({"--json-out": args.json_out}, {"--pool": args.pool})
    if problem:
        raise UserError(problem)
    if args.pool:
        pool_reports(args.pool, args.json_out)
        return
    use_malloc(args.malloc)
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    device = torch.device(args.device)
    logging.disable(logging.WARNING)
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "hardware": hardware(device),
              "settings": vars(args), "results": {}}
    report["results"], rows = run_benchmarks(args, device, Stopwatch(device, CLOCKS[args.clock]))

    hw = report["hardware"]
    print(f"\nCommand: `{report['command']}`")
    print(f"Hardware: {hw['device']}, torch {hw['torch']}, {hw['threads']} threads, {args.clock} clock, "
          f"malloc {args.malloc}, {args.dtype}, {hw['fused_rotation_switch']}\n")
    print(speed_table(rows))
    if args.json_out:
        write_json(args.json_out, report)
        print(f"\nJSON written to {args.json_out}")


if __name__ == "__main__":
    main()
