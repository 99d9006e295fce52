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

Every ratio row also gets, in the JSON, a 95 % bootstrap interval of its median; ``--pool``
combines the pairs of several saved reports.

Example::

    python scripts/benchmark_speed.py --dims tiny base --reps 7 --json-out bench.json
    python scripts/benchmark_speed.py --pool run1.json run2.json run3.json
"""

import argparse
import json
import random
import resource
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ARCHS = {
    "tiny": ("transformer_tiny", "transformer_rope_tiny"),
    "base": ("transformer", "transformer_rope"),
}


# --------------------------------------------------------------------------------------------
# models and inputs


class _Task:
    """The two dictionaries are all that ``build_model`` reads from a translation task."""

    def __init__(self, vocab: int):
        from fairseq.data import Dictionary

        self.source_dictionary = Dictionary()
        for i in range(vocab - len(self.source_dictionary)):
            self.source_dictionary.add_symbol(f"w{i}")
        self.target_dictionary = self.source_dictionary


def build_model(arch: str, task: _Task, device: torch.device, seed: int = 1):
    import fairseq_rope  # noqa: F401  (registers transformer_rope)
    from fairseq import options
    from fairseq.models import ARCH_MODEL_REGISTRY

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, ["unused-data-dir", "--task", "translation", "--arch", arch, "--cpu"]
    )
    torch.manual_seed(seed)
    model = ARCH_MODEL_REGISTRY[arch].build_model(args, task)
    return model.to(device)


def make_batch(task: _Task, sentences: int, length: int, device: torch.device, seed: int = 0):
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


CLOCK = time.perf_counter  # --clock process: CPU seconds of this process (all its threads)

# --malloc retain: every allocation from the heap (no mmap), freed memory never trimmed
RETAIN_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"


def use_malloc(mode):
    """``--malloc retain``: restart this script under RETAIN_TUNABLES (glibc reads them only at
    process start); a no-op for ``default`` or once restarted."""
    if mode == "retain" and os.environ.get("GLIBC_TUNABLES") != RETAIN_TUNABLES:
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, GLIBC_TUNABLES=RETAIN_TUNABLES))


def page_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(fn, device):
    sync(device)
    start = CLOCK()
    fn()
    sync(device)
    return CLOCK() - start


# --------------------------------------------------------------------------------------------
# statistics


def median_interval(ratios, resamples=2000, seed=0):
    """95 % bootstrap percentile interval of the median of ``ratios`` (None below 5 of them):
    how well a run pins the median down on a noisy machine."""
    if len(ratios) < 5:
        return None
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def summarise(a_values, b_values, higher_is_better=True):
    """Medians of A and B and of the per-pair ratios B / A (pairs are adjacent repetitions)."""
    ratios = [b / a for a, b in zip(a_values, b_values) if a]  # no ratio to zero page faults
    return {
        "baseline": statistics.median(a_values),
        "rope": statistics.median(b_values),
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_min": min(ratios) if ratios else None,
        "ratio_max": max(ratios) if ratios else None,
        "ratio_median_ci95": median_interval(ratios),
        "baseline_all": a_values,
        "rope_all": b_values,
        "ratios": ratios,
        "higher_is_better": higher_is_better,
    }


def write_json(path, data):
    """Write ``data`` to ``path`` through a temporary file, so no half-written report is left."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def pool_reports(paths, json_out=None):
    """Pool the per-pair ratios of several saved reports (``--json-out``) row by row: the median
    of all their pairs and its bootstrap interval, for targets closer than one run resolves."""
    reports = []
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
            results = report["results"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SystemExit(f"--pool {path}: not a report written by --json-out ({err})")
        reports.append((path, report, results))
    pooled, rows = {}, []
    for key in dict.fromkeys(k for _, _, results in reports for k in results):
        ratios, runs = [], 0
        for _, _, results in reports:
            if key in results and results[key].get("ratios"):
                ratios += results[key]["ratios"]
                runs += 1
        if not ratios:
            continue
        interval = median_interval(ratios)
        pooled[key] = {"runs": runs, "pairs": len(ratios), "ratio_median": statistics.median(ratios),
                       "ratio_median_ci95": interval, "ratio_min": min(ratios), "ratio_max": max(ratios)}
        ci = f"{interval[0]:.3f} - {interval[1]:.3f}" if interval else "-"
        rows.append(f"| {key} | {runs} | {len(ratios)} | **{statistics.median(ratios):.3f}** | {ci} | "
                    f"{min(ratios):.3f} - {max(ratios):.3f} |")
    print("Pooled reports:")
    for path, report, _ in reports:
        settings = report.get("settings", {})
        print(f"- {path}: `{report.get('command', '?')}` ({settings.get('threads', '?')} threads, "
              f"{settings.get('clock', '?')} clock, malloc {settings.get('malloc', '?')})")
    print("\n| measurement | runs | pairs | RoPE / baseline (median of all pairs) | 95 % interval of "
          "that median (bootstrap) | pair range |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    if json_out:
        write_json(json_out, {"pooled": [str(p) for p in paths], "results": pooled})
        print(f"\nJSON written to {json_out}")


def fault_counts(faults, unit):
    """Medians of the page-fault counts of each model's repetitions. Counts, not speeds: their
    ratio means little (and nothing when one side is zero), so none is given."""
    result = summarise(faults["baseline"], faults["rope"], higher_is_better=False)
    result.update(unit=unit, ratio_median=None, ratio_min=None, ratio_max=None, ratio_median_ci95=None)
    return result


def alternate(fn_a, fn_b, reps):
    """A B A B ...; the order inside a pair flips every repetition (A B, B A, A B ...) so that
    neither model always runs second."""
    a_values, b_values = [], []
    for rep in range(reps):
        if rep % 2 == 0:
            a_values.append(fn_a())
            b_values.append(fn_b())
        else:
            b_values.append(fn_b())
            a_values.append(fn_a())
    return a_values, b_values


# --------------------------------------------------------------------------------------------
# benchmarks


def bench_training(dim, args, task, device):
    base_arch, rope_arch = ARCHS[dim]
    sentences = max(1, args.tokens_per_batch // args.length)
    batch = make_batch(task, sentences, args.length, device)
    tokens = sentences * args.length
    runs = {}
    for name, arch in (("baseline", base_arch), ("rope", rope_arch)):
        model = build_model(arch, task, device)
        model.train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        for _ in range(args.warmup):
            train_step(model, optimizer, batch)
        runs[name] = (model, optimizer)
    # enough steps per repetition to last --min-rep-seconds (timed on the baseline)
    step_seconds = timed(lambda: train_step(*runs["baseline"], batch), device)
    n_steps = max(args.steps, round(args.min_rep_seconds / step_seconds))

    faults = {"baseline": [], "rope": []}

    def run(name):
        model, optimizer = runs[name]

        def steps():
            for _ in range(n_steps):
                train_step(model, optimizer, batch)

        before = page_faults()
        seconds = timed(steps, device)
        faults[name].append((page_faults() - before) / n_steps)
        return tokens * n_steps / seconds

    a, b = alternate(lambda: run("baseline"), lambda: run("rope"), args.reps)
    result = summarise(a, b)
    result.update(unit="target tokens/s", tokens_per_batch=tokens, sentences=sentences, steps_per_rep=n_steps)
    if device.type == "cpu":
        result["page_faults"] = fault_counts(faults, "faults/step")
    return result


def bench_generation(dim, args, task, device):
    from fairseq.sequence_generator import SequenceGenerator

    base_arch, rope_arch = ARCHS[dim]
    length = args.gen_length
    batch = make_batch(task, args.gen_sentences, length, device, seed=1)
    sample = {"net_input": {"src_tokens": batch["src_tokens"], "src_lengths": batch["src_lengths"]}}
    runs = {}
    for name, arch in (("baseline", base_arch), ("rope", rope_arch)):
        model = build_model(arch, task, device)
        model.eval()
        generator = SequenceGenerator(
            [model], task.target_dictionary, beam_size=4,
            max_len_a=0, max_len_b=length, min_len=length,
        )
        runs[name] = generator
        for _ in range(args.warmup):
            generator.generate([model], sample)

    faults = {"baseline": [], "rope": []}

    def run(name):
        generator = runs[name]
        out = []
        before = page_faults()
        seconds = timed(lambda: out.append(generator.generate(generator.model.models, sample)), device)
        faults[name].append(page_faults() - before)
        hyp_lengths = {len(h[0]["tokens"]) for h in out[0]}
        assert hyp_lengths == {length + 1}, f"unequal hypothesis lengths {hyp_lengths}"
        return args.gen_sentences / seconds

    a, b = alternate(lambda: run("baseline"), lambda: run("rope"), args.reps)
    result = summarise(a, b)
    result.update(unit="sentences/s", sentences=args.gen_sentences, length=length, beam=4)
    if device.type == "cpu":
        result["page_faults"] = fault_counts(faults, "faults/generate call")
    return result


def bench_rotation(args, device):
    """q and k of one base-size self-attention layer rotated as the layer rotates them
    (``rotate_projections_``) against ``copy_`` of the same bytes; both alternate inside every
    repetition."""
    import fairseq_rope  # noqa: F401
    from fairseq_rope.modules.rotary_multihead_attention import RotaryMultiheadAttention

    embed, heads = 512, 8
    sentences = max(1, args.tokens_per_batch // args.length)
    attn = RotaryMultiheadAttention(embed, heads, self_attention=True).to(device)
    g = torch.Generator().manual_seed(0)
    # projection outputs: (time * batch, embed_dim), time-major
    q = torch.randn(args.length * sentences, embed, generator=g).to(device)
    k = torch.randn(args.length * sentences, embed, generator=g).to(device)
    positions = torch.arange(args.length, device=device)
    per_sentence = torch.arange(args.length, device=device).expand(sentences, -1).contiguous()
    src = torch.randn(2 * q.numel(), generator=g).to(device)
    dst = torch.empty_like(src)
    inner = args.rotation_inner

    def rot(pos):
        def fn():  # rotations preserve norms: rotating the same tensors again and again is safe
            for _ in range(inner):
                attn.rotate_projections_([q, k], args.length, sentences, pos, args.length)
        return fn

    def copy():
        for _ in range(inner):
            dst.copy_(src)

    for _ in range(args.warmup + 2):
        rot(positions)(); rot(per_sentence)(); copy()
    variants = [
        ("self-attention (positions shared by the batch)", rot(positions)),
        ("rotary cross-attention keys (per-sentence positions)", rot(per_sentence)),
    ]
    results = {}
    for label, fn in variants:
        a, b = alternate(
            lambda: timed(copy, device) / inner, lambda: timed(fn, device) / inner, args.rotation_reps
        )
        res = summarise(a, b, higher_is_better=False)
        res.update(unit="ms", shape=[args.length, sentences, embed], bytes=2 * q.numel() * q.element_size())
        for key in ("baseline", "rope"):
            res[key] *= 1e3
        res["baseline_all"] = [v * 1e3 for v in a]
        res["rope_all"] = [v * 1e3 for v in b]
        results[label] = res
    return results


# ------------------------------- peak memory: one fresh process per model


def _status_kib(field):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def memory_child(arch, args):
    """Build ``arch``, run training steps, print the memory high-water marks as JSON."""
    device = torch.device(args.device)
    task = _Task(args.vocab)
    sentences = max(1, args.tokens_per_batch // args.length)
    batch = make_batch(task, sentences, args.length, device)
    model = build_model(arch, task, device)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        for _ in range(args.memory_steps):
            train_step(model, optimizer, batch)
        sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        out = {"peak_mib": peak / 2**20, "peak_above_start_mib": (peak - before) / 2**20}
    else:
        import resource

        before = _status_kib("VmRSS")
        for _ in range(args.memory_steps):
            train_step(model, optimizer, batch)
        peak = _status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = {"peak_mib": peak / 1024}
        if before is not None:
            out["peak_above_start_mib"] = (peak - before) / 1024
    print("MEMORY_JSON " + json.dumps(out))


def bench_memory(dim, args):
    base_arch, rope_arch = ARCHS[dim]
    common = [
        "--device", args.device, "--vocab", str(args.vocab), "--length", str(args.length),
        "--tokens-per-batch", str(args.tokens_per_batch), "--threads", str(args.threads),
        "--memory-steps", str(args.memory_steps),
    ]

    def measure(arch):
        # A fixed glibc mmap threshold returns every large tensor to the OS when it is freed, so
        # the resident-set high-water mark follows the live tensors, not allocator reuse.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        env.pop("GLIBC_TUNABLES", None)  # --malloc retain is for timings only
        proc = subprocess.run(
            [sys.executable, __file__, "--memory-child", arch, *common],
            capture_output=True, text=True, check=True, env=env,
        )
        line = [x for x in proc.stdout.splitlines() if x.startswith("MEMORY_JSON ")][-1]
        return json.loads(line[len("MEMORY_JSON "):])

    results_a, results_b = alternate(lambda: measure(base_arch), lambda: measure(rope_arch), args.memory_reps)
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
    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
    else:
        model = None
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
            for line in out.splitlines():
                if line.startswith("Model name:"):
                    model = line.split(":", 1)[1].strip()
        except OSError:
            pass
        info["device"] = model or platform.processor() or "cpu"
        info["cpus"] = os.cpu_count()
    return info


def fmt(v):
    return f"{v:,.1f}" if v >= 100 else f"{v:.3g}"


def table(results):
    rows = [
        "| measurement | baseline | RoPE | RoPE / baseline (median of pairs) | pair range | target |",
        "|---|---|---|---|---|---|",
    ]
    for label, res, target in results:
        ratio, pair_range = "-", "-"
        if res["ratio_median"] is not None:
            ratio = f"**{res['ratio_median']:.3f}**"
            pair_range = f"{res['ratio_min']:.3f} - {res['ratio_max']:.3f}"
        rows.append(
            f"| {label} | {fmt(res['baseline'])} {res['unit']} | {fmt(res['rope'])} {res['unit']} | "
            f"{ratio} | {pair_range} | {target} |"
        )
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    p.add_argument("--clock", choices=["wall", "process"], default="wall",
                   help="wall: elapsed time; process: CPU time of this process, less sensitive to "
                        "other programs on a shared CPU (use with --threads 1; not for CUDA)")
    p.add_argument("--malloc", choices=["default", "retain"], default="default",
                   help="retain: rerun under GLIBC_TUNABLES that keep freed memory in the process "
                        "(no page faults after warm-up); CPU timings then show compute alone")
    p.add_argument("--json-out")
    p.add_argument("--pool", nargs="+", metavar="REPORT",
                   help="run nothing: pool the pairs of these --json-out reports row by row")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.pool:
        pool_reports(args.pool, args.json_out)
        return
    use_malloc(args.malloc)

    global CLOCK
    if args.clock == "process":
        CLOCK = time.process_time
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    if args.memory_child:
        memory_child(args.memory_child, args)
        return
    import logging

    logging.disable(logging.WARNING)
    device = torch.device(args.device)
    task = _Task(args.vocab)
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "hardware": hardware(device),
              "settings": {k: v for k, v in vars(args).items() if k != "memory_child"}, "results": {}}
    rows = []
    for dim in args.dims:
        if "train" not in args.skip:
            res = bench_training(dim, args, task, device)
            report["results"][f"train_{dim}"] = res
            rows.append((f"{dim}: training throughput", res, ">= 0.98" if dim == "base" else ""))
            if "page_faults" in res:
                rows.append((f"{dim}: page faults per training step", res["page_faults"], ""))
            print(f"[{dim}] training done: ratio {res['ratio_median']:.3f}", file=sys.stderr, flush=True)
        if "memory" not in args.skip:
            res = bench_memory(dim, args)
            report["results"][f"memory_{dim}"] = res
            target = "<= 1.02" if dim == "base" else ""
            rows.append((f"{dim}: peak training memory (process)", res["peak_mib"], target))
            if "peak_above_start_mib" in res:
                rows.append((f"{dim}: peak training memory (above model + batch)", res["peak_above_start_mib"], target))
            print(f"[{dim}] memory done", file=sys.stderr, flush=True)
        if "generate" not in args.skip:
            res = bench_generation(dim, args, task, device)
            report["results"][f"generate_{dim}"] = res
            rows.append((f"{dim}: beam-4 generation", res, ">= 0.98" if dim == "base" else ""))
            if "page_faults" in res:
                rows.append((f"{dim}: page faults per generation call", res["page_faults"], ""))
            print(f"[{dim}] generation done: ratio {res['ratio_median']:.3f}", file=sys.stderr, flush=True)
    if "rotation" not in args.skip:
        for label, res in bench_rotation(args, device).items():
            report["results"][f"rotation {label}"] = res
            rows.append((f"base: rotate q and k, {label} (baseline column: copy floor)", res, "<= 2"))

    hw = report["hardware"]
    print(f"\nCommand: `{report['command']}`")
    print(f"Hardware: {hw['device']}, torch {hw['torch']}, {hw['threads']} threads, {args.clock} clock, "
          f"malloc {args.malloc}\n")
    print(table(rows))
    if args.json_out:
        write_json(args.json_out, report)
        print(f"\nJSON written to {args.json_out}")


if __name__ == "__main__":
    main()
