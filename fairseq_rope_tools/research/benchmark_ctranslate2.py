#!/usr/bin/env python3
"""Translation speed and BLEU: fairseq-generate against the same model exported to CTranslate2.

    fairseq-rope-benchmark-ct2 --checkpoint work/quickstart/.../checkpoint.avg5.pt \\
        --data-bin work/quickstart/.../data-bin --out-dir work/bench_ct2 [--threads 1 2] [--reps 3] \\
        [--device cuda]

The test set of --data-bin is decoded with beam 4 and length penalty 0.6 by
* ``fairseq-generate`` (its own timer: generation only, model loading excluded), and
* CTranslate2 (``translate_batch`` on the same sources, model loading excluded), float32 and
  int8 (exported by fairseq-rope-export), each with its CPU backend chosen by
  ``CT2_USE_MKL`` (1: Intel MKL, 0: its own kernels): the faster backend differs by compute type
  and processor, so both are measured. Each CTranslate2 configuration runs in a fresh process,
  since the backend is fixed when the library loads.

``--device cuda`` decodes on the GPU instead: fairseq-generate in fp32 and with ``--fp16``, and
CTranslate2 float32, float16 and int8_float16 (int8 weights, fp16 activations), each compared
with the fairseq run of its precision (float32 with fp32, the others with fp16).

Every configuration runs at each ``--threads`` count (``OMP_NUM_THREADS`` for fairseq,
``intra_threads`` for CTranslate2, through fairseq-rope-translate's engine and batching:
fairseq_rope_tools.deploy.ctranslate2_engine) ``--reps`` times; the table gives the median time as sentences
and target tokens per second, the speed-up over fairseq-generate at the same thread count, and
tokenized BLEU with compound splitting (fairseq-rope-score) against the test references.
``results.json`` and ``results.md`` are written to --out-dir. A line on stderr announces every
export and every repetition as it starts, with the time elapsed.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from fairseq_rope_files import outputs_over_inputs_problem, write_text_atomically
from fairseq_rope_tools.cli import UserError, add_version_argument, command, plugin_dir, progress_sayer
from fairseq_rope_tools.deploy.batching import translate_sorted
from fairseq_rope_tools.deploy.ctranslate2_engine import CTranslate2Engine, ctranslate2_cuda_problem
from fairseq_rope_tools.deploy.engine import Decoding
from fairseq_rope_tools.deploy.segmentation import remove_bpe as remove_bpe_from_line
from fairseq_rope_tools.deploy.work_dir import bpe_type_of
from fairseq_rope_tools.metrics import tokenized_bleu
from fairseq_rope_tools.research.machine import cpu_model

BEAM, LENPEN, BATCH = 4, 0.6, 64
# target tokens before </s>: fairseq-generate's default --max-len-b (with --max-len-a 0), and CTranslate2's
# max_decoding_length. A hypothesis that reaches it may differ: fairseq then forces </s> and adds its
# log-probability to the score, CTranslate2 stops without it.
MAX_LEN = 200
DEVICES = ("cpu", "cuda")
# per device: (CTranslate2 compute type, weights exported as, the fairseq precision it is compared with)
CT2_CONFIGS = {
    "cpu": (("float32", "none", "fp32"), ("int8", "int8", "fp32")),
    "cuda": (("float32", "none", "fp32"), ("float16", "none", "fp16"), ("int8_float16", "int8", "fp16")),
}
FAIRSEQ_PRECISIONS = {"cpu": ("fp32",), "cuda": ("fp32", "fp16")}
FAIRSEQ_COMPUTE_TYPES = {"fp32": "float32", "fp16": "float16"}  # a fairseq precision as the table names it
CPU_BACKENDS = (1, 0)  # CT2_USE_MKL: the CPU backend is chosen when the library loads

progress = progress_sayer("benchmark-ct2")  # timed from the start of the tool


def device_problem(device):
    """Why neither engine can decode on ``device``, as one line naming --device, or None."""
    if device != "cuda":
        return None
    import ctranslate2
    import torch

    if not torch.cuda.is_available():
        return "--device cuda: torch sees no CUDA device (is this a CUDA build of torch, and a GPU visible?)"
    problem = ctranslate2_cuda_problem()
    if problem:
        return f"--device cuda: {problem}"
    unsupported = [c for c, _, _ in CT2_CONFIGS[device] if c not in ctranslate2.get_supported_compute_types(device)]
    if unsupported:
        return f"--device cuda: CTranslate2 cannot compute {', '.join(unsupported)} on this GPU"
    return None


def backend_name(use_mkl):
    """A CTranslate2 CPU backend as the table names it; empty for None (cuda has one backend)."""
    return "" if use_mkl is None else ("MKL" if use_mkl else "CT2_USE_MKL=0")


def configuration_name(engine, compute_type, backend, threads):
    """``ctranslate2 int8 MKL, 2 thread(s)``: a configuration in the progress lines."""
    return f"{' '.join(filter(None, (engine, compute_type, backend)))}, {threads} thread(s)"


def repeated(reps, configuration, run, *args):
    """[run(*args) for each of ``reps`` repetitions], each announced as it starts:
    ``CONFIGURATION: rep 2/3``."""
    results = []
    for rep in range(1, reps + 1):
        progress(f"{configuration}: rep {rep}/{reps}")
        results.append(run(*args))
    return results


def identical_count(hypotheses, reference):
    """How many hypotheses (token lists) are the reference's, token for token."""
    return sum(h == r for h, r in zip(hypotheses, reference))


def remove_bpe(tokens, bpe_type):
    return remove_bpe_from_line(" ".join(tokens), bpe_type)


def fairseq_generate(checkpoint, data_bin, threads, device="cpu", precision="fp32", max_len=MAX_LEN):
    """(seconds, {id: source tokens}, {id: hypothesis tokens}, {id: reference tokens}) of the test
    set decoded on ``device`` in ``precision`` (fp32, or fp16 on cuda), at most ``max_len``
    target tokens before </s>."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    device_args = ["--cpu"] if device == "cpu" else (["--fp16"] if precision == "fp16" else [])
    proc = subprocess.run(
        # fairseq-generate as a module of this Python: its script need not sit beside the interpreter
        # (pip install --target, --user)
        [sys.executable, "-m", "fairseq_cli.generate", str(data_bin), "--user-dir", plugin_dir(),
         "--path", str(checkpoint), *device_args, "--beam", str(BEAM), "--lenpen", str(LENPEN),
         "--batch-size", str(BATCH), "--gen-subset", "test", "--max-len-a", "0", "--max-len-b", str(max_len)],
        capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise UserError(f"fairseq-generate failed:\n{proc.stderr[-3000:]}", status=1)
    # its time is printed to 0.1 s, its speed to 0.01 sentences/s: the time from the speed is exact enough
    # for a GPU's fraction of a second
    m = re.search(r"Translated ([\d,]+) sentences \([\d,]+ tokens\) in [\d.]+s \(([\d.]+) sentences/s",
                  proc.stderr + proc.stdout)
    seconds = int(m[1].replace(",", "")) / float(m[2])
    lines = {kind: {int(m[1]): m[2].split() for m in re.finditer(rf"^{kind}-(\d+)\t(?:\S+\t)?(.*)$", proc.stdout, re.M)}
             for kind in "SHT"}
    return seconds, lines["S"], lines["H"], lines["T"]


def ct2_worker(request):
    """Runs in its own process (the backend is read when ctranslate2 loads): the engine and batching
    of fairseq-rope-translate, decoding time only."""
    engine = CTranslate2Engine(request["model_dir"], Decoding(BEAM, LENPEN, request["max_len"]), request["device"],
                               request["compute_type"], request["threads"])
    results, seconds = translate_sorted(engine, request["sources"], BATCH)
    json.dump({"seconds": seconds, "hypotheses": [h[0].tokens if h else [] for h in results]}, sys.stdout)


def ct2_translate(model_dir, compute_type, use_mkl, threads, sources, device="cpu", max_len=MAX_LEN):
    """(seconds, hypotheses) of CTranslate2 in a fresh process; ``use_mkl`` None: its default
    backend (the only one on cuda)."""
    request = dict(model_dir=str(model_dir), compute_type=compute_type, threads=threads, sources=sources,
                   device=device, max_len=max_len)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if use_mkl is not None:
        env["CT2_USE_MKL"] = str(use_mkl)
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "--ct2-worker"], input=json.dumps(request),
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise UserError(f"CTranslate2 ({compute_type}, CT2_USE_MKL={use_mkl}) failed:\n{proc.stderr[-3000:]}",
                        status=1)
    reply = json.loads(proc.stdout)
    return reply["seconds"], reply["hypotheses"]


def export_dir(out_dir, quantization):
    """Where :func:`export` writes the model of ``quantization``: OUT_DIR/ct2_QUANTIZATION."""
    return out_dir / f"ct2_{quantization}"


def export(checkpoint, data_bin, out_dir, quantization):
    """OUT_DIR/ct2_QUANTIZATION, exported unless it holds this very checkpoint already. In this
    process: torch and fairseq are loaded once for all exports."""
    from fairseq_rope_tools.deploy import export_ctranslate2 as exporter

    model_dir = export_dir(out_dir, quantization)
    if not exporter.is_current(model_dir, checkpoint, quantization, data_bin=data_bin):
        progress(f"exporting {checkpoint} to {model_dir} ({'no' if quantization == 'none' else quantization} "
                 "quantization)")
        try:
            exporter.export(str(checkpoint), str(data_bin), str(model_dir), quantization, force=True)
        except (UserError, exporter.OptionError) as e:  # a step of the benchmark that failed: status 1
            raise UserError(str(e), status=1) from None
    return model_dir


# the files main writes into --out-dir, besides export's model directories
RESULTS = ("results.json", "results.md")


@command
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version_argument(p)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--data-bin", type=Path)
    p.add_argument("--out-dir", type=Path)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=3, help="repetitions of each configuration (median taken)")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="decode on the CPU (default) or on the first CUDA GPU")
    p.add_argument("--ct2-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ct2_worker:
        return ct2_worker(json.load(sys.stdin))
    for flag in ("checkpoint", "data_bin", "out_dir"):
        if getattr(args, flag) is None:
            p.error(f"--{flag.replace('_', '-')} is required")
    written = [args.out_dir / name for name in RESULTS] + [export_dir(args.out_dir, q)
                                                           for _, q, _ in CT2_CONFIGS[args.device]]
    problem = (outputs_over_inputs_problem({f"--out-dir's {path.name}": path for path in written},
                                           {"--checkpoint": args.checkpoint, "--data-bin": args.data_bin})
               or device_problem(args.device))
    if problem:
        raise UserError(problem)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    bpe_type = bpe_type_of(args.data_bin, None) or "subword_nmt"
    backends = CPU_BACKENDS if args.device == "cpu" else (None,)

    progress(f"benchmarking {args.checkpoint} on {args.device}: {args.reps} rep(s) of each configuration "
             f"at {' and '.join(map(str, args.threads))} thread(s)")
    rows = []
    models = {q: export(args.checkpoint, args.data_bin, args.out_dir, q) for _, q, _ in CT2_CONFIGS[args.device]}
    for threads in args.threads:
        fairseq = {}  # precision -> (seconds of each rep, hypotheses by id)
        for precision in FAIRSEQ_PRECISIONS[args.device]:
            name = configuration_name("fairseq-generate", FAIRSEQ_COMPUTE_TYPES[precision], "", threads)
            runs = repeated(args.reps, name, fairseq_generate, args.checkpoint, args.data_bin, threads, args.device,
                            precision)
            _, sources, hyps, refs = runs[0]
            fairseq[precision] = [seconds for seconds, *_ in runs], hyps
        ids = sorted(sources)
        references = [remove_bpe(refs[i], bpe_type) for i in ids]
        configs = [("fairseq-generate", FAIRSEQ_COMPUTE_TYPES[precision], None, precision, times,
                    [hyps[i] for i in ids]) for precision, (times, hyps) in fairseq.items()]
        for compute_type, quantization, precision in CT2_CONFIGS[args.device]:
            for use_mkl in backends:
                name = configuration_name("ctranslate2", compute_type, backend_name(use_mkl), threads)
                runs = repeated(args.reps, name, ct2_translate, models[quantization], compute_type, use_mkl, threads,
                                [sources[i] for i in ids], args.device)
                configs.append(("ctranslate2", compute_type, use_mkl, precision, [s for s, _ in runs], runs[0][1]))
        for engine, compute_type, use_mkl, precision, seconds, hypotheses in configs:
            times, hyps = fairseq[precision]  # compared with fairseq-generate in the same precision
            median = statistics.median(seconds)
            detok = [remove_bpe(h, bpe_type) for h in hypotheses]
            rows.append(dict(
                engine=engine, compute_type=compute_type,
                backend=backend_name(use_mkl),
                threads=threads, sentences=len(ids), seconds=[round(s, 3) for s in seconds],
                sentences_per_s=round(len(ids) / median, 1),
                tokens_per_s=round(sum(len(h) for h in hypotheses) / median, 1),
                speedup=round(statistics.median(times) / median, 2),
                bleu=round(tokenized_bleu(detok, references)[0].score, 2),
                identical_to_fairseq=identical_count(hypotheses, [hyps[i] for i in ids]),
            ))
            progress(f"{configuration_name(engine, compute_type, rows[-1]['backend'], threads)}: "
                     f"{rows[-1]['sentences_per_s']} sentences/s, {rows[-1]['speedup']}x fairseq-generate's, "
                     f"BLEU {rows[-1]['bleu']}")

    header = ("| engine | weights | backend | threads | sentences/s | tokens/s | speed-up | BLEU | "
              "identical to fairseq |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    table = header + "".join(
        f"| {r['engine']} | {r['compute_type']} | {r['backend'] or '-'} | {r['threads']} | {r['sentences_per_s']} | "
        f"{r['tokens_per_s']} | {r['speedup']}x | {r['bleu']} | {r['identical_to_fairseq']}/{r['sentences']} |\n"
        for r in rows)
    report = dict(checkpoint=str(args.checkpoint), data_bin=str(args.data_bin), beam=BEAM, lenpen=LENPEN,
                  batch_size=BATCH, reps=args.reps, device=args.device, cpu=cpu_model() or "unknown", rows=rows)
    for name, text in zip(RESULTS, (json.dumps(report, indent=1) + "\n", table)):
        write_text_atomically(args.out_dir / name, text)
    print(table)


if __name__ == "__main__":
    main()
