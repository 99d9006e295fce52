#!/usr/bin/env python3
"""Translation speed and BLEU: fairseq-generate against the same model exported to CTranslate2
and to ONNX (the engines of --engines, from deploy/engines.py's registry).

    fairseq-rope-benchmark-ct2 --checkpoint work/quickstart/.../checkpoint.avg5.pt \\
        --data-bin work/quickstart/.../data-bin --out-dir work/bench_ct2 [--threads 1 2] [--reps 3] \\
        [--device cuda] [--engines ctranslate2 onnx]

The test set of --data-bin is decoded with beam 4 and length penalty 0.6 by
* ``fairseq-generate`` (its own timer: generation only, model loading excluded), and
* CTranslate2 (``translate_batch`` on the same sources, model loading excluded), float32 and
  int8 (exported by fairseq-rope-export), each with its CPU backend chosen by
  ``CT2_USE_MKL`` (1: Intel MKL, 0: its own kernels): the faster backend differs by compute type
  and processor, so both are measured. Each CTranslate2 configuration runs in a fresh process,
  since the backend is fixed when the library loads; and
* the ONNX Runtime engine (float32, ``fairseq-rope-export --format onnx``), on the CPU, also in
  a fresh process. A model CTranslate2 cannot take (``--rope-cross-attention``) is measured
  with ``--engines onnx``.

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
import statistics
from pathlib import Path

from fairseq_rope_base.files import outputs_over_inputs_problem, write_text_atomically
from fairseq_rope_tools.cli import ArgumentParser, UserError, command
from fairseq_rope_tools.deploy import engines
from fairseq_rope_tools.deploy.work_dir import bpe_type_of
from fairseq_rope_tools.metrics import tokenized_bleu
from fairseq_rope_tools.research.benchmarks.engine_timings import (
    BATCH,
    BEAM,
    CPU_BACKENDS,
    CT2_CONFIGS,
    DEVICES,
    FAIRSEQ_COMPUTE_TYPES,
    FAIRSEQ_PRECISIONS,
    LENPEN,
    backend_name,
    configuration_name,
    device_problem,
    engine_translate,
    export_dir,
    exported_model_dir,
    fairseq_generate,
    identical_count,
    progress,
    repeated,
    text_of_tokens,
)
from fairseq_rope_tools.research.machine import cpu_model

# the files main writes into --out-dir, besides export's model directories
RESULTS = ("results.json", "results.md")


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--data-bin", type=Path)
    p.add_argument("--out-dir", type=Path)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=3, help="repetitions of each configuration (median taken)")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="decode on the CPU (default) or on the first CUDA GPU")
    exported = [entry.name for entry in engines.served_engines()]  # the engines that read an export
    p.add_argument("--engines", nargs="+", choices=exported, default=exported,
                   help=f"the engines to measure beside fairseq-generate (default: {' '.join(exported)}; onnx on "
                        "the CPU only)")
    args = p.parse_args(argv)
    for engine in args.engines:
        if args.device not in engines.engine_named(engine).devices:
            p.error(f"--engines {engine} runs on the CPU: leave it out with --device {args.device}")
    for flag in ("checkpoint", "data_bin", "out_dir"):
        if getattr(args, flag) is None:
            p.error(f"--{flag.replace('_', '-')} is required")
    exports = [(engine, compute_type, quantization, precision) for engine in args.engines
               for compute_type, quantization, precision in (
                   CT2_CONFIGS[args.device] if engine == engines.CTRANSLATE2.name else (("float32", "none", "fp32"),))]
    export_format = {engine: engines.engine_named(engine).export_format for engine in args.engines}
    written = [args.out_dir / name for name in RESULTS] + [export_dir(args.out_dir, q, export_format[engine])
                                                           for engine, _, q, _ in exports]
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
    models = {(engine, q): exported_model_dir(args.checkpoint, args.data_bin, args.out_dir, q, export_format[engine])
              for engine, _, q, _ in exports}
    for threads in args.threads:
        fairseq = {}  # precision -> (seconds of each rep, hypotheses by id)
        for precision in FAIRSEQ_PRECISIONS[args.device]:
            name = configuration_name("fairseq-generate", FAIRSEQ_COMPUTE_TYPES[precision], "", threads)
            runs = repeated(args.reps, name, fairseq_generate, args.checkpoint, args.data_bin, threads, args.device,
                            precision)
            _, sources, hyps, refs = runs[0]
            fairseq[precision] = [seconds for seconds, *_ in runs], hyps
        ids = sorted(sources)
        references = [text_of_tokens(refs[i], bpe_type) for i in ids]
        configs = [("fairseq-generate", FAIRSEQ_COMPUTE_TYPES[precision], None, precision, times,
                    [hyps[i] for i in ids]) for precision, (times, hyps) in fairseq.items()]
        for engine, compute_type, quantization, precision in exports:
            for use_mkl in backends if engine == engines.CTRANSLATE2.name else (None,):  # CTranslate2's backends
                name = configuration_name(engine, compute_type, backend_name(use_mkl), threads)
                runs = repeated(args.reps, name, engine_translate, engine, models[engine, quantization], compute_type,
                                use_mkl, threads, [sources[i] for i in ids], args.device)
                configs.append((engine, compute_type, use_mkl, precision, [s for s, _ in runs], runs[0][1]))
        for engine, compute_type, use_mkl, precision, seconds, hypotheses in configs:
            times, hyps = fairseq[precision]  # compared with fairseq-generate in the same precision
            median = statistics.median(seconds)
            detok = [text_of_tokens(h, bpe_type) for h in hypotheses]
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
