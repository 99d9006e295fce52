#!/usr/bin/env python3
"""One command that checks a CUDA machine end to end, and writes down what it found.

    fairseq-rope-gpu-check --out-dir work/gpu_check [--updates 300]
    fairseq-rope-gpu-check --out-dir /tmp/gpu_check --tiny      # the same steps on a CPU, tiny sizes

``report.json`` and ``report.md`` in --out-dir (each written atomically), one section per step:

1. environment: the GPU (name, compute capability, memory), CUDA, torch, Triton, CTranslate2, fairseq;
2. kernel: the fused Triton rotation (fairseq_rope/modules/fused_rotary.py) on the device against
   the rotation from its definition (fairseq_rope/modules/rotation_reference.py), forward and
   backward, fp32 / fp16 / bf16, both layouts, whole and partial rotation, shared (T,) and
   per-sentence (B, T) positions, strided inputs, one tensor and the q/k pair: the largest error,
   absolute and in units in the last place (ulps) of the dtype; it passes within 1e-6 in fp32 and
   one ulp in fp16 and bf16 beyond what fp32 arithmetic may err by, the tests' tolerances;
3. training: transformer_rope and transformer, trained by the recipe (examples/wmt14_en_de/train.sh)
   on the quickstart corpus (fairseq-rope-generate-corpus, prepared by prepare.sh) for --updates
   updates in fp32 and with --fp16, same seed and batches: train and validation loss side by side
   (a table and losses.png), and the verdict: RoPE's final fp16 validation loss above its fp32 one
   by at most --loss-tolerance (relative) plus what sinusoidal loses to fp16; RoPE in fp16 once more
   with the reference rotation (FAIRSEQ_ROPE_FUSED=0), for the kernel's share of the speed. bf16 is
   reported as skipped: fairseq 0.12's --bf16 implies --tpu, so fairseq-train cannot train in bf16
   on a GPU (the kernel is checked in bf16);
4. generation: each fp32-trained model decodes the test set with fairseq-generate, beam 4, length
   penalty 0.6 (fairseq-rope-benchmark-ct2's settings), in fp32 and, on CUDA, with --fp16;
5. speed: RoPE / sinusoidal ratios of training speed (words and updates per second, fairseq's
   logged intervals without the first, which holds start-up and Triton's compilation) and of
   generation (sentences per second);
6. bandwidth: the fused rotation of q and k as self-attention launches it (fp16), in GB/s read and
   written, against the device's peak: its specified bandwidth from a table of known GPUs, else a
   large copy measured here (the report says which);
7. the exported engines of --engines: the RoPE model exported (fairseq-rope-export) and decoded
   on the device with the same beam, length penalty and length limit: per compute type the lines
   identical to fairseq-generate's and the speed-up over it. CTranslate2 in float32 and with int8
   weights (float16 and int8_float16 against fairseq's fp16 on cuda); ONNX Runtime in float32,
   on the CPU only (--tiny). float32 must give fairseq's output on every line.

Without CUDA it stops with one line, exit status 2, unless --tiny: then every step runs on the CPU
with tiny sizes, so that the plumbing is tested anywhere (tests/tools/research/test_gpu_check.py): the kernel
under Triton's interpreter (TRITON_INTERPRET=1, in a child process), fp32 training only, for a
few updates (fp16 is reported as skipped), CTranslate2 float32 and int8 and ONNX Runtime float32
on the CPU, and steps that time nothing run two at a time. Its timings mean nothing.
``--data-bin`` trains on a binarized corpus of your own instead of the quickstart one (joined
dictionary, en->de unless --src/--tgt).

This module is the command; each section is a module of its own in this package (environment,
kernel with the bandwidth, training, generation with the speed ratios, exported_engines), what
they share is in common, and report.md is rendered by report. The exported engines decode with
fairseq-rope-translate's engines, opened through their registry (fairseq_rope_tools/deploy/engines.py).

Exit status: 0 when every verdict passes, 1 when one fails or a step fails (the report says which
and why), 2 for bad arguments or no CUDA device.
"""

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fairseq_rope_base.files import output_dir_problem, outputs_over_inputs_problem, write_text_atomically
from fairseq_rope_tools.cli import (
    ArgumentParser,
    CommandFailed,
    UserError,
    children_end_with_this_process,
    command,
)
from fairseq_rope_tools.deploy import engines
from fairseq_rope_tools.research.gpu_check.common import FULL, TINY, guarded, say
from fairseq_rope_tools.research.gpu_check.environment import environment_section
from fairseq_rope_tools.research.gpu_check.exported_engines import exported_engine_section
from fairseq_rope_tools.research.gpu_check.generation import generation_section, speed_section
from fairseq_rope_tools.research.gpu_check.kernel import device_sections
from fairseq_rope_tools.research.gpu_check.report import report_markdown, verdicts
from fairseq_rope_tools.research.gpu_check.training import quickstart_data_bin, training_section


def parse_args(argv):
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", help="report.json, report.md, losses.png and work/ go here")
    p.add_argument("--tiny", action="store_true", help="the same steps on the CPU with tiny sizes (plumbing test)")
    p.add_argument("--updates", type=int,
                   help=f"training updates per run (default {FULL.updates}; --tiny {TINY.updates})")
    p.add_argument("--loss-tolerance", type=float, default=0.03,
                   help="RoPE's fp16 final validation loss may exceed its fp32 one by this fraction, plus what "
                        "sinusoidal's fp16 run loses to its fp32 one (0.03)")
    p.add_argument("--data-bin", help="train on this data-bin (joined dictionary) instead of the quickstart corpus")
    p.add_argument("--src", default="en", help="source language of --data-bin (en)")
    p.add_argument("--tgt", default="de", help="target language of --data-bin (de)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="CPU threads per process")
    exported = engines.served_engines()  # the engines that read an export
    p.add_argument("--engines", nargs="+", choices=[entry.name for entry in exported],
                   help=f"the exported engines of step 7 (default: each that decodes on the device: "
                        f"{' '.join(e.name for e in exported if 'cuda' in e.devices)} on a GPU, "
                        f"{' '.join(e.name for e in exported)} with --tiny)")
    args = p.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    if args.engines is None:
        args.engines = [entry.name for entry in exported if device in entry.devices]
    for engine in args.engines:
        if device not in engines.engine_named(engine).devices:
            p.error(f"--engines {engine} decodes on the CPU only here: leave it out, or pass --tiny")
    if args.out_dir is None:
        p.error("--out-dir is required")
    if args.updates is not None and args.updates < 2:
        p.error(f"--updates must be at least 2, not {args.updates}")
    if args.threads < 1:
        p.error(f"--threads must be at least 1, not {args.threads}")
    problem = output_dir_problem("--out-dir", args.out_dir)
    if problem:
        p.error(problem)
    if args.data_bin and not (Path(args.data_bin) / f"dict.{args.src}.txt").is_file():
        p.error(f"--data-bin {args.data_bin} has no dict.{args.src}.txt: give a fairseq data-bin (and --src/--tgt)")
    out_dir = Path(args.out_dir)
    # what a run deletes and rewrites: the trainings, the exports, the report
    written = {"--out-dir's work/runs": out_dir / "work" / "runs", "--out-dir's work/ct2": out_dir / "work" / "ct2",
               "--out-dir's report.json": out_dir / "report.json", "--out-dir's report.md": out_dir / "report.md",
               "--out-dir's losses.png": out_dir / "losses.png"}
    problem = outputs_over_inputs_problem(written, {"--data-bin": args.data_bin})
    if problem:
        p.error(problem)
    return args


def run_checks(args, device, sizes, out_dir, data_bin_ready, report, progress):
    """Every section into ``report``, calling ``progress()`` after each (a check stopped midway
    keeps what it found); ``data_bin_ready()`` gives the corpus to train on."""
    work_dir = out_dir / "work"
    updates = args.updates or sizes.updates
    report["environment"] = guarded("environment", lambda: environment_section(device))
    progress()

    def device_job():
        return guarded("kernel", lambda: device_sections(device, args.tiny, work_dir / "device_worker.log"))

    with ThreadPoolExecutor(1) as background:
        # tiny: the kernel's process times nothing that matters, so it runs beside the trainings
        pending = background.submit(device_job) if sizes.lanes > 1 else None
        say(f"kernel and bandwidth on {device} (log: {work_dir / 'device_worker.log'})")
        def device_done(device_results):
            if "kernel" not in device_results:  # the child itself failed: both sections say why
                device_results = {"kernel": device_results, "bandwidth": device_results}
            report.update(kernel=device_results["kernel"], bandwidth=device_results["bandwidth"])
            progress()

        if not pending:
            device_done(device_job())
        data_bin = data_bin_ready()
        say(f"training {', '.join(sizes.archs.values())} for {updates} updates")
        report["training"] = training = guarded("training", lambda: training_section(
            data_bin, (args.src, args.tgt), work_dir, out_dir, device, sizes, updates, args.threads,
            args.loss_tolerance))
        progress()
        decodes = {}
        say("generation")
        report["generation"] = generation = guarded("generation", lambda: generation_section(
            training, data_bin, device, sizes, args.threads, decodes))
        report["speed"] = guarded("speed", lambda: speed_section(training, generation))
        progress()
        if pending:
            device_done(pending.result())
    for engine in args.engines:
        say(f"exported engine: {engine}")
        report[engine] = guarded(engine, lambda engine=engine: exported_engine_section(
            engine, training, data_bin, work_dir, device, sizes, args.threads, decodes))
        progress()


@command
def main(argv=None):
    args = parse_args(argv)
    import torch

    if not args.tiny and not torch.cuda.is_available():
        reason = "torch was built without CUDA" if torch.version.cuda is None else "torch sees no GPU"
        raise UserError(f"no CUDA device: {reason} (torch {torch.__version__}); run on a CUDA machine, or pass "
                        "--tiny to check the plumbing on the CPU")
    device, sizes = ("cpu", TINY) if args.tiny else ("cuda", FULL)
    out_dir = Path(args.out_dir).resolve()
    (out_dir / "work").mkdir(parents=True, exist_ok=True)

    def data_bin_ready():
        if args.data_bin:
            return Path(args.data_bin).resolve()
        say("quickstart corpus")
        try:
            return quickstart_data_bin(out_dir / "work", sizes, args.threads)
        except CommandFailed as e:
            raise UserError(f"preparing the quickstart corpus failed: {e}", status=1) from None

    started = time.time()
    report = {"tiny": args.tiny, "complete": False, "engines": args.engines,
              "command": [sys.executable, "-m", __spec__.name, *(sys.argv[1:] if argv is None else argv)]}

    def write_report():
        report.update(verdicts=verdicts(report), seconds=round(time.time() - started, 1))
        write_text_atomically(out_dir / "report.json", json.dumps(report, indent=1) + "\n")
        write_text_atomically(out_dir / "report.md", report_markdown(report))

    with children_end_with_this_process():  # its trainings and decodes, also if it is killed
        run_checks(args, device, sizes, out_dir, data_bin_ready, report, write_report)
    report["complete"] = True
    write_report()
    say(f"report: {out_dir / 'report.md'} ({report['seconds']} s)")
    return 1 if False in report["verdicts"].values() else 0  # None: not run here (fp16 on a CPU)


if __name__ == "__main__":
    raise SystemExit(main())
