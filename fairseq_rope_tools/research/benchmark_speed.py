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
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from fairseq_rope_files import outputs_over_inputs_problem, write_text_atomically
from fairseq_rope_tools.cli import UserError, add_version_argument, command, progress_sayer
from fairseq_rope_tools.research.machine import describe_cpu, page_faults, peak_resident_kib, status_kib, use_malloc

# page_faults, use_malloc and median_interval are imported from here by ablate_rotation_cost.py and the tests
from fairseq_rope_tools.research.models import DictionaryTask, build_model
from fairseq_rope_tools.research.paired_stats import alternate, pool_ratios, summarise, summarise_counts

ARCHS = {
    "tiny": ("transformer_tiny", "transformer_rope_tiny"),
    "d256": ("benchmark_transformer_d256", "benchmark_transformer_rope_d256"),
    "base": ("transformer", "transformer_rope"),
}
# d256: 256 dimensions, 4 heads, FFN 1,024, 3+3 layers -- registered by load_plugin()
D256 = dict(encoder_embed_dim=256, decoder_embed_dim=256, encoder_ffn_embed_dim=1024,
            decoder_ffn_embed_dim=1024, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_layers=3, decoder_layers=3)
# --clock: wall time, or the CPU seconds of this process (all its threads)
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
MODELS = ("baseline", "rope")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

progress = progress_sayer("benchmark-speed")  # timed from the start of the tool


# --------------------------------------------------------------------------------------------
# models and inputs


def load_plugin():
    """Import the plugin, which registers transformer_rope* with fairseq, register the d256
    architectures, and return its rotary attention layer: the one place this script imports the
    plugin's models and layers (``hardware`` reads the name of its kernel switch)."""
    from fairseq.models import ARCH_MODEL_REGISTRY, register_model_architecture
    from fairseq.models.transformer import base_architecture

    from fairseq_rope.models.transformer_rope import transformer_rope_base
    from fairseq_rope.modules.rotary_multihead_attention import RotaryMultiheadAttention

    for model, arch, defaults in zip(("transformer", "transformer_rope"), ARCHS["d256"],
                                     (base_architecture, transformer_rope_base)):
        if arch not in ARCH_MODEL_REGISTRY:
            def architecture(args, defaults=defaults):
                for name, value in D256.items():
                    setattr(args, name, getattr(args, name, None) or value)
                defaults(args)
            register_model_architecture(model, arch)(architecture)
    return RotaryMultiheadAttention


def build_on(device: torch.device, arch: str, task: DictionaryTask, dtype: torch.dtype = torch.float32):
    load_plugin()
    return build_model(arch, task)[0].to(device=device, dtype=dtype)


def parameter_dtypes(models) -> str:
    """The dtypes the models' weights really are in, for the report: ``bfloat16``."""
    return ", ".join(sorted({str(p.dtype).replace("torch.", "") for m in models for p in m.parameters()}))


def batch_sentences(tokens_per_batch: int, length: int) -> int:
    """Sentences of ``length`` tokens in a batch of about ``tokens_per_batch`` (at least one)."""
    return max(1, tokens_per_batch // length)


def make_batch(task: DictionaryTask, sentences: int, length: int, device: torch.device, seed: int = 0):
    d = task.source_dictionary
    g = torch.Generator().manual_seed(seed)
    low, high = d.nspecial, len(d)
    src = torch.randint(low, high, (sentences, length), generator=g)
    tgt = torch.randint(low, high, (sentences, length), generator=g)
    tgt[:, -1] = d.eos()
    prev = torch.cat([torch.full((sentences, 1), d.eos()), tgt[:, :-1]], dim=1)
    lengths = torch.full((sentences,), length, dtype=torch.long)
    return {
        "src_tokens": src.to(device),
        "src_lengths": lengths.to(device),
        "prev_output_tokens": prev.to(device),
        "target": tgt.to(device),
    }


def train_step(model, optimizer, batch):
    optimizer.zero_grad(set_to_none=True)
    logits, _ = model(batch["src_tokens"], batch["src_lengths"], batch["prev_output_tokens"])
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), batch["target"].view(-1))
    loss.backward()
    optimizer.step()
    return loss


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Stopwatch:
    """Times a call on ``device`` (waiting for its CUDA work) by ``clock``."""

    device: torch.device
    clock: Callable[[], float] = time.perf_counter

    def seconds(self, fn):
        sync(self.device)
        start = self.clock()
        fn()
        sync(self.device)
        return self.clock() - start

    def seconds_and_faults(self, fn):
        """Seconds of ``fn()`` and the minor page faults it caused."""
        before = page_faults()
        seconds = self.seconds(fn)
        return seconds, page_faults() - before


def announce_reps(label, reps):
    """``on_rep`` for alternate: ``LABEL: rep 2/7`` as each pair starts."""
    return lambda rep: progress(f"{label}: rep {rep}/{reps}")


def compare(run, reps, device, faults_unit, label, **details):
    """Alternate ``run("baseline")`` and ``run("rope")`` -- each returns (speed, page faults) --
    ``reps`` times, announced as ``LABEL: rep 2/7``: the summary of the speeds with ``details``,
    and on the CPU the fault counts."""
    faults = {name: [] for name in MODELS}

    def measure(name):
        speed, count = run(name)
        faults[name].append(count)
        return speed

    result = summarise(*alternate(lambda: measure("baseline"), lambda: measure("rope"), reps,
                                  on_rep=announce_reps(label, reps)))
    result.update(details)
    if device.type == "cpu":
        result["page_faults"] = summarise_counts(faults["baseline"], faults["rope"], faults_unit)
    return result


# --------------------------------------------------------------------------------------------
# benchmarks


def bench_training(archs, task, batch, stopwatch, reps, warmup, min_steps, min_rep_seconds, label="training",
                   dtype=torch.float32):
    """Target tokens per second of training steps of the two models of ``archs``, weights and
    activations in ``dtype`` (Adam on the weights themselves: fairseq's ``--fp16`` keeps fp32
    copies besides, the same work for both models); every repetition runs enough steps to last
    ``min_rep_seconds`` (timed on the baseline)."""
    runs = {}
    for name, arch in zip(MODELS, archs):
        model = build_on(stopwatch.device, arch, task, dtype)
        model.train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        for _ in range(warmup):
            train_step(model, optimizer, batch)
        runs[name] = (model, optimizer)
    step_seconds = stopwatch.seconds(lambda: train_step(*runs["baseline"], batch))
    n_steps = max(min_steps, round(min_rep_seconds / step_seconds))
    sentences, length = batch["target"].shape
    tokens = sentences * length

    def run(name):
        model, optimizer = runs[name]

        def steps():
            for _ in range(n_steps):
                train_step(model, optimizer, batch)

        seconds, faults = stopwatch.seconds_and_faults(steps)
        return tokens * n_steps / seconds, faults / n_steps

    return compare(run, reps, stopwatch.device, "faults/step", label, unit="target tokens/s",
                   tokens_per_batch=tokens, sentences=sentences, steps_per_rep=n_steps,
                   weights_dtype=parameter_dtypes(model for model, _ in runs.values()))


def bench_generation(archs, task, sentences, length, stopwatch, reps, warmup, beam=4, label="generation",
                     dtype=torch.float32):
    """Sentences per second of beam search with incremental decoding, models in ``dtype``, every
    hypothesis forced to ``length`` tokens so that both models do the same work."""
    from fairseq.sequence_generator import SequenceGenerator

    batch = make_batch(task, sentences, length, stopwatch.device, seed=1)
    sample = {"net_input": {"src_tokens": batch["src_tokens"], "src_lengths": batch["src_lengths"]}}
    generators = {}
    for name, arch in zip(MODELS, archs):
        model = build_on(stopwatch.device, arch, task, dtype)
        model.eval()
        generator = SequenceGenerator(
            [model], task.target_dictionary, beam_size=beam,
            max_len_a=0, max_len_b=length, min_len=length,
        )
        generators[name] = generator
        for _ in range(warmup):
            generator.generate([model], sample)

    def run(name):
        generator = generators[name]
        out = []
        seconds, faults = stopwatch.seconds_and_faults(
            lambda: out.append(generator.generate(generator.model.models, sample)))
        hyp_lengths = {len(h[0]["tokens"]) for h in out[0]}
        assert hyp_lengths == {length + 1}, f"unequal hypothesis lengths {hyp_lengths}"
        return sentences / seconds, faults

    return compare(run, reps, stopwatch.device, "faults/generate call", label, unit="sentences/s",
                   sentences=sentences, length=length, beam=beam,
                   weights_dtype=parameter_dtypes(g.model.models[0] for g in generators.values()))


def bench_rotation(sentences, length, stopwatch, reps, inner, warmup, dtype=torch.float32):
    """q and k in ``dtype`` of one base-size self-attention layer rotated as the layer rotates them
    (``RotaryEmbedding.rotate`` with ``overwrite=True``) against ``copy_`` of the same bytes; both
    alternate inside every repetition."""
    rotary_attention = load_plugin()
    device = stopwatch.device
    embed, heads = 512, 8
    attn = rotary_attention(embed, heads, self_attention=True).to(device)
    g = torch.Generator().manual_seed(0)
    # projection outputs: (time * batch, embed_dim), time-major
    q = torch.randn(length * sentences, embed, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(length * sentences, embed, generator=g).to(device=device, dtype=dtype)
    positions = torch.arange(length, device=device)
    per_sentence = torch.arange(length, device=device).expand(sentences, -1).contiguous()
    src = torch.randn(2 * q.numel(), generator=g).to(device=device, dtype=dtype)
    dst = torch.empty_like(src)

    def rot(pos):
        def fn():  # rotations preserve norms: rotating the same tensors again and again is safe
            for _ in range(inner):
                attn.rotary.rotate([q, k], pos, length, (length, sentences, heads, embed // heads), overwrite=True)
        return fn

    def copy():
        for _ in range(inner):
            dst.copy_(src)

    for _ in range(warmup + 2):
        rot(positions)()
        rot(per_sentence)()
        copy()
    variants = [
        ("self-attention (positions shared by the batch)", rot(positions)),
        ("rotary cross-attention keys (per-sentence positions)", rot(per_sentence)),
    ]
    results = {}
    for label, fn in variants:
        progress(f"rotation, {label}: {reps} reps of {inner} call(s)")
        a, b = alternate(lambda: stopwatch.seconds(copy) / inner, lambda fn=fn: stopwatch.seconds(fn) / inner, reps)
        res = summarise(a, b, higher_is_better=False)
        res.update(unit="ms", shape=[length, sentences, embed], bytes=2 * q.numel() * q.element_size())
        for key in MODELS:
            res[key] *= 1e3
        res["baseline_all"] = [v * 1e3 for v in a]
        res["rope_all"] = [v * 1e3 for v in b]
        results[label] = res
    return results


# ------------------------------- peak memory: one fresh process per model


def memory_child(arch, device, vocab, sentences, length, steps, dtype=torch.float32):
    """Build ``arch`` in ``dtype``, run training steps, print the memory high-water marks as JSON."""
    task = DictionaryTask(vocab)
    batch = make_batch(task, sentences, length, device)
    model = build_on(device, arch, task, dtype)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        for _ in range(steps):
            train_step(model, optimizer, batch)
        sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        out = {"peak_mib": peak / 2**20, "peak_above_start_mib": (peak - before) / 2**20}
    else:
        before = status_kib("VmRSS")
        for _ in range(steps):
            train_step(model, optimizer, batch)
        peak = peak_resident_kib()
        out = {"peak_mib": peak / 1024}
        if before is not None:
            out["peak_above_start_mib"] = (peak - before) / 1024
    print("MEMORY_JSON " + json.dumps(out))


def bench_memory(archs, child_args, reps, label="memory"):
    """Peak training memory of each model of ``archs``, each in a fresh process run with
    ``--memory-child ARCH`` and ``child_args``; ``reps`` pairs, announced as ``LABEL: rep 2/3``."""

    def measure(arch):
        # A fixed glibc mmap threshold returns every large tensor to the OS when it is freed, so
        # the resident-set high-water mark follows the live tensors, not allocator reuse.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        env.pop("GLIBC_TUNABLES", None)  # --malloc retain is for timings only
        proc = subprocess.run(
            [sys.executable, "-m", __spec__.name, "--memory-child", arch, *child_args],
            capture_output=True, text=True, check=True, env=env,
        )
        line = [x for x in proc.stdout.splitlines() if x.startswith("MEMORY_JSON ")][-1]
        return json.loads(line[len("MEMORY_JSON "):])

    base_arch, rope_arch = archs
    results_a, results_b = alternate(lambda: measure(base_arch), lambda: measure(rope_arch), reps,
                                     on_rep=announce_reps(label, reps))
    out = {}
    for key in ("peak_mib", "peak_above_start_mib"):
        if key in results_a[0]:
            res = summarise([r[key] for r in results_a], [r[key] for r in results_b], higher_is_better=False)
            res["unit"] = "MiB"
            out[key] = res
    return out


# --------------------------------------------------------------------------------------------
# report


def hardware(device):
    from fairseq_rope.modules.fused_rotary import FUSED_SWITCH

    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            # the fused kernel on or off (docs/gpu.md): the same command measures either
            "fused_rotation_switch": f"{FUSED_SWITCH}={os.environ.get(FUSED_SWITCH, '1')}"}
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
    else:
        info.update(describe_cpu())
    return info


def fmt(v):
    return f"{v:,.1f}" if v >= 100 else f"{v:.3g}"


def table(rows):
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
            f"| {label} | {fmt(res['baseline'])} {res['unit']} | {fmt(res['rope'])} {res['unit']} | "
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version_argument(p)
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
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def memory_child_args(args):
    """The options a ``--memory-child`` process needs, as a command line."""
    return ["--device", args.device, "--vocab", str(args.vocab), "--length", str(args.length),
            "--tokens-per-batch", str(args.tokens_per_batch), "--threads", str(args.threads),
            "--memory-steps", str(args.memory_steps), "--dtype", args.dtype]


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
            res = bench_memory(archs, memory_child_args(args), args.memory_reps, label=f"{dim} memory")
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
    if args.memory_child:
        memory_child(args.memory_child, device, args.vocab, batch_sentences(args.tokens_per_batch, args.length),
                     args.length, args.memory_steps, DTYPES[args.dtype])
        return
    logging.disable(logging.WARNING)
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "hardware": hardware(device),
              "settings": {k: v for k, v in vars(args).items() if k != "memory_child"}, "results": {}}
    report["results"], rows = run_benchmarks(args, device, Stopwatch(device, CLOCKS[args.clock]))

    hw = report["hardware"]
    print(f"\nCommand: `{report['command']}`")
    print(f"Hardware: {hw['device']}, torch {hw['torch']}, {hw['threads']} threads, {args.clock} clock, "
          f"malloc {args.malloc}, {args.dtype}, {hw['fused_rotation_switch']}\n")
    print(table(rows))
    if args.json_out:
        write_json(args.json_out, report)
        print(f"\nJSON written to {args.json_out}")


if __name__ == "__main__":
    main()
