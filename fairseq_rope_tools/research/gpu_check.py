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
7. ctranslate2: the RoPE model exported (float32 and int8 weights, fairseq-rope-export)
   and decoded on the device with the same beam, length penalty and length limit: per compute type
   the lines identical to fairseq-generate's (float16 and int8_float16 against fairseq's fp16) and
   the speed-up over it. float32 must give fairseq's output on every line.

Without CUDA it stops with one line, exit status 2, unless --tiny: then every step runs on the CPU
with tiny sizes, so that the plumbing is tested anywhere (tests/test_gpu_check.py): the kernel
under Triton's interpreter (TRITON_INTERPRET=1, in a child process), fp32 training only, for a
few updates (fp16 is reported as skipped), CTranslate2 float32 and int8 on the CPU, and steps that
time nothing run two at a time. Its timings mean nothing. ``--data-bin`` trains on a binarized
corpus of your own instead of the quickstart one (joined dictionary, en->de unless --src/--tgt).

Exit status: 0 when every verdict passes, 1 when one fails or a step fails (the report says which
and why), 2 for bad arguments or no CUDA device.
"""

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from fairseq_rope.modules.fused_rotary import FUSED_SWITCH
from fairseq_rope_tools.cli import (
    ArgumentParser,
    CommandFailed,
    UserError,
    children_end_with_this_process,
    command,
    run_logged,
    sayer,
)
from fairseq_rope_tools.files import output_dir_problem, outputs_over_inputs_problem, write_text_atomically
from fairseq_rope_tools.recipes import recipe_step
from fairseq_rope_tools.research import benchmark_ctranslate2 as ct2_bench
from fairseq_rope_tools.research import compare_data
from fairseq_rope_tools.research.machine import cpu_model
from fairseq_rope_tools.training_log import parse_train_log

TRAIN_SH = recipe_step("wmt14_en_de", "train.sh")
MODELS = ("rope", "sinusoidal")
PRECISIONS = ("fp32", "fp16", "bf16")
BF16_SKIPPED = "skipped: fairseq 0.12's --bf16 implies --tpu (torch_xla), so fairseq-train cannot train in bf16 on CUDA"
FP16_SKIPPED = "skipped: needs CUDA"
# RoPE in fp16 once more with FAIRSEQ_ROPE_FUSED=0: the fused kernel's share of training speed
REFERENCE_ROTATION_RUN = "rope fp16 reference rotation"
# specified memory bandwidth (GB/s) by a part of torch.cuda.get_device_name(); the first match wins,
# so the more specific names come first
PEAK_BANDWIDTH = (
    ("GH200", 4000), ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350), ("H800", 3350),
    ("A100 80GB PCIe", 1935), ("A100-SXM4-80GB", 2039), ("A100", 1555), ("A800", 2039), ("L40S", 864), ("L40", 864),
    ("L4", 300), ("A10G", 600), ("A10", 600), ("A40", 696), ("A6000", 768), ("V100", 900), ("T4", 320),
    ("RTX 4090", 1008), ("RTX 3090", 936),
)


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
             max_len=ct2_bench.MAX_LEN, kernel_shapes=((64, 8, 8, 64), (33, 5, 12, 80), (17, 3, 16, 128)),
             kernel_cases="all", bandwidth_shape=(1024, 64, 16, 64), bandwidth_reps=20, copy_bytes=1 << 30, lanes=1)
TINY = Sizes(corpus=(300, 20, 20), bpe_merges=200,
             archs={"rope": "transformer_rope_tiny", "sinusoidal": "transformer_tiny"},
             model_args=("--encoder-layers", "1", "--decoder-layers", "1"), updates=60, max_tokens=1024, lr=3e-3,
             log_interval=10, validations=2, max_len=ct2_bench.MAX_LEN, kernel_shapes=((3, 2, 3, 16),),
             kernel_cases="covering",
             bandwidth_shape=(4, 2, 2, 16), bandwidth_reps=3, copy_bytes=1 << 20, lanes=2)


say = sayer("gpu_check")


def run_lanes(jobs, lanes):
    """Run the callables ``jobs`` (a dict name -> fn), ``lanes`` at a time; {name: result}."""
    if lanes <= 1:
        return {name: fn() for name, fn in jobs.items()}
    with ThreadPoolExecutor(lanes) as pool:
        futures = {name: pool.submit(fn) for name, fn in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


# --------------------------------------------------------------------------------------------
# 1. environment


def package_version(*names):
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            pass
    return None


def environment_section(device):
    import torch

    info = {"device": device, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": package_version("triton"),
            "ctranslate2": package_version("ctranslate2"), "fairseq": package_version("fairseq-fixed", "fairseq"),
            "cpu": cpu_model() or platform.processor() or "unknown"}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                       "memory_gib": round(props.total_memory / 2 ** 30, 1), "visible_gpus": torch.cuda.device_count()}
        import ctranslate2

        info["ctranslate2_cuda_devices"] = ctranslate2.get_cuda_device_count()
    return info


# --------------------------------------------------------------------------------------------
# 2. kernel and 6. bandwidth: in a child process, so that Triton's interpreter can be switched on
# before Triton is imported (TRITON_INTERPRET is read at import time)


def kernel_cases(sizes):
    """(dtype name, shape, layout, rotary fraction, per-sentence positions, pair launch) to check:
    every combination, or (tiny) a covering set: each option of each dtype at least once."""
    import itertools

    dtypes, layouts = ("float32", "float16", "bfloat16"), ("interleaved", "half")
    if sizes.kernel_cases == "all":
        return list(itertools.product(dtypes, sizes.kernel_shapes, layouts, (1.0, 0.5), (False, True), (False, True)))
    shape = sizes.kernel_shapes[0]
    return [(dtype, shape, layout, fraction, per_sentence, pair) for dtype in dtypes
            for layout, fraction, per_sentence, pair in (("interleaved", 1.0, False, True), ("half", 0.5, True, False))]


def check_kernel_case(device, dtype_name, shape, layout, fraction, per_sentence, pair, seed):
    """{forward/backward: {absolute, ulps, pass}} of one launch (or q/k pair) against the rotation
    from its definition (``rotation_reference``: the kernel tests' reference and tolerances)."""
    import torch

    from fairseq_rope.modules.fused_rotary import fused_rotate
    from fairseq_rope.modules.rotary import rotary_dim_for
    from fairseq_rope.modules.rotary_embedding import RotaryEmbedding
    from fairseq_rope.modules.rotation_reference import kernel_error, time_first_rows

    dtype = getattr(torch, dtype_name)
    T, B, H, D = shape
    g = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding(rotary_dim_for(D, fraction), layout=layout)
    cos_table, sin_table, _ = rotary.tables(T + 8, device)
    if per_sentence:  # left padding shifts each sentence's positions
        positions = (torch.arange(T) + torch.randint(0, 8, (B, 1), generator=g)).to(device)
    else:
        positions = torch.arange(T, device=device)
    cos, sin = time_first_rows(cos_table, sin_table, positions)
    # q and k as views of a fused projection: strided, the last dimension contiguous
    qkv = torch.randn(T, B, 3 * H * D, generator=g).to(device=device, dtype=dtype)
    xs = [qkv[..., i * H * D:(i + 1) * H * D].unflatten(-1, (H, D)).detach().requires_grad_()
          for i in range(2 if pair else 1)]
    outs = fused_rotate(xs, cos_table, sin_table, positions, layout)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn(x.shape, generator=g).to(device=device, dtype=dtype) for x in xs]
    torch.autograd.backward(outs, grads)
    errors = {"forward": [], "backward": []}
    for x, out, grad in zip(xs, outs, grads):
        errors["forward"].append(kernel_error(out, x, cos, sin, layout))
        # d(R x)/dx applied to a gradient is R^T, the rotation by -m
        errors["backward"].append(kernel_error(x.grad, grad, cos, -sin, layout))
    return {kind: {"absolute": max(e["absolute"] for e in found), "ulps": max(e["ulps"] for e in found),
                   "pass": all(e["pass"] for e in found)} for kind, found in errors.items()}


def kernel_section(device, sizes):
    import torch

    from fairseq_rope.modules.fused_rotary import fused_runs_on, interpreting
    from fairseq_rope.modules.rotation_reference import KERNEL_TOLERANCE

    if not fused_runs_on(device):
        raise RuntimeError(f"the fused kernel does not run on {device}: is Triton installed (pip install triton)?")
    results = {}
    for seed, case in enumerate(kernel_cases(sizes)):
        dtype_name = case[0]
        errors = check_kernel_case(device, *case, seed=seed)
        row = results.setdefault(dtype_name, {"cases": 0, "forward_abs": 0.0, "forward_ulps": 0.0,
                                              "backward_abs": 0.0, "backward_ulps": 0.0, "pass": True})
        row["cases"] += 1
        for kind, error in errors.items():
            row[f"{kind}_abs"] = max(row[f"{kind}_abs"], error["absolute"])
            row[f"{kind}_ulps"] = max(row[f"{kind}_ulps"], error["ulps"])
            row["pass"] = row["pass"] and error["pass"]
    for dtype_name, row in results.items():
        measure, limit = KERNEL_TOLERANCE[getattr(torch, dtype_name)]
        row["tolerance"] = f"{limit:g} {measure}"
    return {"backend": "Triton interpreter (TRITON_INTERPRET=1)" if interpreting() else "compiled Triton",
            "shapes": [list(s) for s in sizes.kernel_shapes], "dtypes": results,
            "pass": all(row["pass"] for row in results.values())}


def known_peak_bandwidth(gpu_name):
    """(GB/s, the table's entry) for a known GPU, else (None, None)."""
    for part, gb_per_s in PEAK_BANDWIDTH:
        if part in (gpu_name or ""):
            return gb_per_s, part
    return None, None


def seconds_per_call(fn, device, reps, inner):
    """Median over ``reps`` of the wall time of ``inner`` calls, divided by ``inner``."""
    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    fn()  # warm-up: compilation, allocation
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def bandwidth_section(device, sizes):
    import torch

    from fairseq_rope.modules.fused_rotary import fused_rotate
    from fairseq_rope.modules.rotary_embedding import RotaryEmbedding

    T, B, H, D = sizes.bandwidth_shape
    q, k = (torch.randn(T, B, H, D, device=device, dtype=torch.float16) for _ in range(2))
    cos_table, sin_table, _ = RotaryEmbedding(D).tables(T, device)
    positions = torch.arange(T, device=device)
    inner = 10 if device == "cuda" else 1
    rotation = seconds_per_call(lambda: fused_rotate([q, k], cos_table, sin_table, positions), device,
                                sizes.bandwidth_reps, inner)
    moved = 2 * 2 * q.numel() * q.element_size()  # q and k, each read and written (the tables are noise)
    src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = seconds_per_call(lambda: dst.copy_(src), device, sizes.bandwidth_reps, inner)
    copy_gb_per_s = 2 * sizes.copy_bytes / copy / 1e9
    name = torch.cuda.get_device_name(0) if device == "cuda" else None
    spec, entry = known_peak_bandwidth(name)
    peak, source = (spec, f"specified bandwidth of {entry} (table in gpu_check.py)") if spec else (
        copy_gb_per_s, f"measured: a {sizes.copy_bytes / 2 ** 20:g} MiB device copy")
    gb_per_s = moved / rotation / 1e9
    return {"shape": [T, B, H, D], "dtype": "float16", "bytes_moved": moved, "seconds": rotation,
            "gb_per_s": gb_per_s, "copy_gb_per_s": copy_gb_per_s, "peak_gb_per_s": peak,
            "peak_source": source, "percent_of_peak": 100 * gb_per_s / peak}


def device_worker(request):
    """The child process: the kernel and bandwidth sections as JSON on stdout."""
    sizes = TINY if request["tiny"] else FULL
    out = {}
    for name, section in (("kernel", kernel_section), ("bandwidth", bandwidth_section)):
        out[name] = guarded(name, lambda section=section: section(request["device"], sizes))
    json.dump(out, sys.stdout)


def device_sections(device, tiny, log_path):
    """{kernel, bandwidth} from a child process: under Triton's interpreter with --tiny, on
    CUDA with Triton's compiler otherwise."""
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
    env.pop("TRITON_INTERPRET", None)
    env.pop(FUSED_SWITCH, None)  # the kernel is what this process checks
    if tiny:
        env["TRITON_INTERPRET"] = "1"
    request = json.dumps({"device": device, "tiny": tiny})
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "--device-worker", request],
                          capture_output=True, text=True, env=env)
    Path(log_path).write_text(proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise RuntimeError(f"the kernel check's process failed: {tail[0]} (log: {log_path})")
    return json.loads(proc.stdout)


# --------------------------------------------------------------------------------------------
# 3. training


def quickstart_data_bin(work_dir, sizes, threads):
    """The quickstart corpus, generated and prepared by prepare.sh (fairseq_rope_tools/research/compare_data.py)."""
    train, valid, test = sizes.corpus
    args = SimpleNamespace(out_dir=work_dir, corpus_train_size=train, corpus_bpe_size=sizes.bpe_merges, corpus_seed=1,
                           source_lang="en", target_lang="de", threads=threads)
    return compare_data.quickstart_corpus(args, say, valid_size=valid, test_size=test) / "data-bin"


def precision_status(precision, device):
    """None when ``precision`` can be trained on ``device``, else why it is skipped."""
    if precision == "bf16":
        return BF16_SKIPPED
    if precision == "fp16" and device != "cuda":
        return FP16_SKIPPED
    return None


def device_env(device, threads):
    """The environment of a training or decoding: one GPU (fairseq would take every visible one),
    or the CPU with ``threads`` threads."""
    if device == "cuda":
        first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        return {"CUDA_VISIBLE_DEVICES": first, "CPU": "0", "GPUS": "1"}
    return {"CPU": "1", "GPUS": "0", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def train(run_dir, data_bin, langs, arch, precision, device, sizes, updates, threads, extra_env=None):
    """One training by the recipe, from scratch; what its log says."""
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "checkpoints").mkdir(parents=True)
    env = {**device_env(device, threads), **(extra_env or {}),
           "DATA_BIN": data_bin, "SAVE_DIR": run_dir / "checkpoints", "ARCH": arch,
           "SRC": langs[0], "TGT": langs[1], "MAX_TOKENS": sizes.max_tokens, "TOKENS_PER_UPDATE": sizes.max_tokens,
           "UPDATE_FREQ": 1, "LR": sizes.lr, "WARMUP_UPDATES": max(1, updates // 4), "MAX_UPDATE": updates,
           "SAVE_INTERVAL_UPDATES": updates, "KEEP_INTERVAL_UPDATES": 1, "LOG_INTERVAL": sizes.log_interval,
           "SEED": 1, "NUM_WORKERS": 0, "FP16": "1" if precision == "fp16" else "0", "LOG_FILE": os.devnull}
    flags = [*sizes.model_args, "--validate-interval-updates", max(1, updates // sizes.validations)]
    started = time.time()
    # through env(1), so that train.log's first line is the whole command, to rerun by hand
    run_logged(["env", *(f"{k}={v}" for k, v in env.items()), "bash", TRAIN_SH, *flags], run_dir / "train.log",
               name=f"train.sh ({arch}, {precision})")
    with open(run_dir / "train.log", encoding="utf-8", errors="replace") as f:
        parsed = parse_train_log(f)
    speeds = parsed["speed_curve"][1:] or parsed["speed_curve"]  # the first interval holds start-up and compilation
    train_curve = parsed["train_curve"]
    return {"arch": arch, "precision": precision, "seconds": round(time.time() - started, 1),
            "params": parsed["params"], "final_train_loss": train_curve[-1][1] if train_curve else math.nan,
            "final_valid_loss": parsed["valid_loss"], "train_curve": train_curve, "valid_curve": parsed["valid_curve"],
            "words_per_second": statistics.median(w for _, w, _ in speeds) if speeds else math.nan,
            "updates_per_second": statistics.median(u for _, _, u in speeds) if speeds else math.nan,
            "checkpoint": str(run_dir / "checkpoints" / "checkpoint_last.pt"), "log": str(run_dir / "train.log")}


def fp16_excess(runs, model):
    """(fp16 - fp32) / fp32 of ``model``'s final validation losses (above 0: fp16 is worse), or None."""
    fp32, fp16 = runs.get(f"{model} fp32", {}), runs.get(f"{model} fp16", {})
    if "final_valid_loss" not in fp16 or "final_valid_loss" not in fp32:
        return None
    return (fp16["final_valid_loss"] - fp32["final_valid_loss"]) / fp32["final_valid_loss"]


def loss_verdict(runs, tolerance):
    """RoPE loses no more to fp16 than the stock transformer does: its final fp16 validation loss
    exceeds its fp32 one by at most ``tolerance`` (relative) plus sinusoidal's own excess. After a
    few hundred updates two runs' losses differ by a few percent whatever the precision (an H200
    saw 3 % between sinusoidal's fp16 and fp32 runs); the baseline's pair measures that, and an fp16
    problem of RoPE's own (overflow, angles) shows above it."""
    rope = fp16_excess(runs, "rope")
    if rope is None:
        fp32, fp16 = runs.get("rope fp32", {}), runs.get("rope fp16", {})
        failed = "failed" in (fp16.get("status"), fp32.get("status"))  # else skipped: no GPU
        return {"pass": False if failed else None, "status": fp16.get("status", "no fp16 run"), "tolerance": tolerance}
    baseline = fp16_excess(runs, "sinusoidal")
    allowed = tolerance + max(0.0, baseline or 0.0)
    return {"pass": bool(rope <= allowed), "rope_excess": round(rope, 4),
            "sinusoidal_excess": None if baseline is None else round(baseline, 4), "allowed": round(allowed, 4),
            "tolerance": tolerance, "fp32": runs["rope fp32"]["final_valid_loss"],
            "fp16": runs["rope fp16"]["final_valid_loss"]}


def plot_runs(runs, output, title):
    """losses.png with fairseq-rope-plot-losses's plot."""
    from fairseq_rope_tools.research.plot_losses import plot

    curves = [(name, dict(run["train_curve"]), {u: loss for u, loss, _ in run["valid_curve"]})
              for name, run in runs.items() if "train_curve" in run]
    plot(curves, output, title)


def training_section(data_bin, langs, work_dir, out_dir, device, sizes, updates, threads, tolerance):
    jobs, runs = {}, {}
    for precision in PRECISIONS:  # fp32 first: the others are compared with it
        for model in MODELS:
            name = f"{model} {precision}"
            skipped = precision_status(precision, device)
            if skipped:
                runs[name] = {"arch": sizes.archs[model], "precision": precision, "status": skipped}
                continue
            # one run's failure (fp16's loss scale at its minimum, ...) keeps the others' results
            jobs[name] = (lambda model=model, precision=precision, name=name: guarded(name, lambda: train(
                work_dir / "runs" / name.replace(" ", "-"), data_bin, langs, sizes.archs[model], precision, device,
                sizes, updates, threads)))
    if device == "cuda":
        jobs[REFERENCE_ROTATION_RUN] = lambda: guarded(REFERENCE_ROTATION_RUN, lambda: train(
            work_dir / "runs" / REFERENCE_ROTATION_RUN.replace(" ", "-"), data_bin, langs, sizes.archs["rope"], "fp16",
            device, sizes, updates, threads, extra_env={FUSED_SWITCH: "0"}))
    else:
        runs[REFERENCE_ROTATION_RUN] = {"arch": sizes.archs["rope"], "precision": "fp16",
                                        "status": "skipped: the fused kernel runs on CUDA only"}
    for name, result in run_lanes(jobs, sizes.lanes).items():
        runs[name] = {"status": "ok", **result}
    plot_runs(runs, out_dir / "losses.png", f"{updates} updates on {device}")
    return {"updates": updates, "device": device, "runs": runs, "plot": "losses.png",
            "fp16_verdict": loss_verdict(runs, tolerance)}


# --------------------------------------------------------------------------------------------
# 4. generation, 5. speed


def generation_section(training, data_bin, device, sizes, threads, decodes):
    """Beam-4 decodes of the test set by each fp32-trained model, per precision of fairseq-generate;
    the hypotheses go into ``decodes`` {(model, precision): (seconds, sources, hypotheses)}."""
    jobs = {}
    for model in MODELS:
        checkpoint = training["runs"][f"{model} fp32"]["checkpoint"]
        for precision in ct2_bench.FAIRSEQ_PRECISIONS[device]:
            jobs[(model, precision)] = (lambda checkpoint=checkpoint, precision=precision: ct2_bench.fairseq_generate(
                checkpoint, data_bin, threads, device, precision, sizes.max_len))
    rows = {}
    for (model, precision), (seconds, sources, hyps, _) in run_lanes(jobs, sizes.lanes).items():
        decodes[model, precision] = seconds, sources, hyps
        rows[f"{model} {precision}"] = {"sentences": len(hyps), "seconds": round(seconds, 3),
                                        "sentences_per_second": round(len(hyps) / seconds, 1),
                                        "tokens_per_second": round(sum(map(len, hyps.values())) / seconds, 1)}
    return {"beam": ct2_bench.BEAM, "lenpen": ct2_bench.LENPEN, "max_len": sizes.max_len,
            "batch_size": ct2_bench.BATCH, "runs": rows}


def speed_section(training, generation):
    """RoPE / sinusoidal ratios (above 1: RoPE is faster)."""
    def ratio(rows, key, suffix):
        rope, sinusoidal = rows.get(f"rope {suffix}", {}), rows.get(f"sinusoidal {suffix}", {})
        if key not in rope or key not in sinusoidal:
            return None
        return round(rope[key] / sinusoidal[key], 3)

    out = {}
    for precision in PRECISIONS:
        out[f"training {precision} words/s"] = ratio(training["runs"], "words_per_second", precision)
        out[f"training {precision} updates/s"] = ratio(training["runs"], "updates_per_second", precision)
    for precision in ("fp32", "fp16"):
        out[f"generation {precision} sentences/s"] = ratio(generation["runs"], "sentences_per_second", precision)
    fused, reference = training["runs"].get("rope fp16", {}), training["runs"].get(REFERENCE_ROTATION_RUN, {})
    kernel = {}
    if "words_per_second" in fused and "words_per_second" in reference:
        kernel["training fp16 words/s"] = round(fused["words_per_second"] / reference["words_per_second"], 3)
    return {"rope_over_sinusoidal": {k: v for k, v in out.items() if v is not None},
            "fused_over_reference_rotation": kernel}


# --------------------------------------------------------------------------------------------
# 7. CTranslate2


def ctranslate2_section(training, data_bin, work_dir, device, sizes, threads, decodes):
    problem = ct2_bench.device_problem(device)  # a CTranslate2 wheel without CUDA, a GPU without float16, ...
    if problem:
        raise RuntimeError(problem)
    checkpoint = training["runs"]["rope fp32"]["checkpoint"]
    configs = ct2_bench.CT2_CONFIGS[device]
    models = {q: ct2_bench.export(checkpoint, data_bin, work_dir / "ct2", q)
              for q in dict.fromkeys(q for _, q, _ in configs)}
    rows = []
    for compute_type, quantization, precision in configs:
        fairseq_seconds, sources, reference = decodes["rope", precision]
        ids = sorted(sources)
        seconds, hyps = ct2_bench.ct2_translate(models[quantization], compute_type, None, threads,
                                                [sources[i] for i in ids], device, sizes.max_len)
        rows.append({"compute_type": compute_type, "weights": "float32" if quantization == "none" else quantization,
                     "compared_with": f"fairseq-generate {precision}", "sentences": len(ids),
                     "identical": ct2_bench.identical_count(hyps, [reference[i] for i in ids]),
                     # fairseq forces and scores </s> after the last token there, CTranslate2 stops: may differ
                     "fairseq_at_length_limit": sum(len(reference[i]) >= sizes.max_len for i in ids),
                     "sentences_per_second": round(len(ids) / seconds, 1),
                     "speedup": round(fairseq_seconds / seconds, 2)})
    float32 = next(r for r in rows if r["compute_type"] == "float32")
    return {"device": device, "rows": rows, "float32_identical_verdict": float32["identical"] == float32["sentences"]}


# --------------------------------------------------------------------------------------------
# the report


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


def verdicts(report):
    """{check: True / False / None (not run, or not reached yet)} over the report; a step that
    failed fails its check."""
    def verdict(section, value):
        return None if section not in report else bool(value(report[section]))

    return {"kernel within tolerance": verdict("kernel", lambda kernel: kernel.get("pass")),
            "RoPE fp16 loss within tolerance of fp32": None if "training" not in report else
            report["training"].get("fp16_verdict", {}).get("pass", False),
            "CTranslate2 float32 identical to fairseq": verdict(
                "ctranslate2", lambda ct2: ct2.get("float32_identical_verdict")),
            # None while the check runs: the steps not reached yet may still fail
            "every step ran": False if failed_steps(report) else (True if report.get("complete") else None)}


def failed_steps(report):
    """The names of the sections, and of the training runs, that failed."""
    sections = {name: s for name, s in report.items() if isinstance(s, dict)}
    runs = sections.get("training", {}).get("runs", {})
    return [name for name, step in {**sections, **runs}.items() if step.get("status") == "failed"]


def fmt(value, digits=4):
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}g}"
    return "-" if value is None else str(value)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def failed_md(section):
    return f"**failed**: {section['error']}" if section.get("status") == "failed" else None


def environment_md(env):
    gpu = env.get("gpu", {})
    rows = [("device", env["device"]), ("GPU", gpu.get("name")), ("compute capability", gpu.get("capability")),
            ("GPU memory (GiB)", gpu.get("memory_gib")), ("CUDA", env["cuda"]), ("torch", env["torch"]),
            ("Triton", env["triton"]), ("CTranslate2", env["ctranslate2"]), ("fairseq", env["fairseq"]),
            ("Python", env["python"]), ("CPU", env["cpu"])]
    return table(("", ""), rows)


def kernel_md(kernel):
    rows = [(dtype, r["cases"], r["forward_abs"], r["forward_ulps"], r["backward_abs"], r["backward_ulps"],
             r["tolerance"], "pass" if r["pass"] else "**FAIL**") for dtype, r in kernel["dtypes"].items()]
    return (f"{kernel['backend']}, shapes (T, B, H, head_dim) {kernel['shapes']}; largest errors against "
            "the rotation computed in fp64 and rounded once to the dtype, in ulps of the dtype at the reference "
            "value (fp32 is judged by its absolute error: results near zero make its ulps large).\n\n"
            + table(("dtype", "cases", "forward abs", "forward ulps", "backward abs", "backward ulps", "tolerance",
                     "verdict"), rows))


def training_md(training):
    runs = {name: run for name, run in training["runs"].items() if "valid_curve" in run}
    updates = sorted({u for run in runs.values() for u, *_ in run["valid_curve"]})

    def at(run, update):  # valid loss at a validation, and the last train loss logged by then
        valid = {u: loss for u, loss, _ in run["valid_curve"]}.get(update)
        logged = [loss for u, loss in run["train_curve"] if u <= update]
        return f"{fmt(valid)} / {fmt(logged[-1]) if logged else '-'}"

    curves = table(("update", *runs), [(u, *(at(run, u) for run in runs.values())) for u in updates])
    skipped = [f"- {name}: {run.get('error', run['status'])}" for name, run in training["runs"].items()
               if "valid_curve" not in run]
    summary = table(("run", "arch", "final valid loss", "final train loss", "words/s", "updates/s", "seconds"),
                    [(name, r["arch"], r["final_valid_loss"], r["final_train_loss"], r["words_per_second"],
                      r["updates_per_second"], r["seconds"]) for name, r in runs.items()])
    v = training["fp16_verdict"]
    verdict = (f"RoPE fp16 final validation loss {fmt(v['fp16'])} vs fp32 {fmt(v['fp32'])}: fp16 higher by "
               f"{fmt(v['rope_excess'])} (relative; sinusoidal: {fmt(v['sinusoidal_excess'])}), allowed "
               f"{fmt(v['allowed'])} (tolerance {v['tolerance']} plus sinusoidal's excess): "
               f"**{'pass' if v['pass'] else 'FAIL'}**"
               if v["pass"] is not None else f"RoPE fp16 vs fp32: {v['status']}")
    return "\n\n".join([f"{training['updates']} updates on {training['device']}; validation / train loss "
                        f"(label-smoothed cross-entropy, base 2); plot: {training['plot']}", curves, summary,
                        "\n".join(skipped), verdict])


def generation_md(generation):
    rows = [(name, r["sentences"], r["seconds"], r["sentences_per_second"], r["tokens_per_second"])
            for name, r in generation["runs"].items()]
    return (f"fairseq-generate, beam {generation['beam']}, lenpen {generation['lenpen']}, at most "
            f"{generation['max_len']} tokens, batch {generation['batch_size']}; decoding time only.\n\n"
            + table(("model and precision", "sentences", "seconds", "sentences/s", "tokens/s"), rows))


def speed_md(speed):
    parts = [table(("RoPE / sinusoidal", "ratio"), speed["rope_over_sinusoidal"].items())]
    if speed.get("fused_over_reference_rotation"):
        parts.append(table((f"RoPE, fused kernel / reference rotation ({FUSED_SWITCH}=0)", "ratio"),
                           speed["fused_over_reference_rotation"].items()))
    return "\n\n".join(parts)


def bandwidth_md(bw):
    return table(("", ""), [("q and k (T, B, H, head_dim)", bw["shape"]), ("dtype", bw["dtype"]),
                            ("bytes read + written", bw["bytes_moved"]), ("GB/s", bw["gb_per_s"]),
                            ("device copy GB/s", bw["copy_gb_per_s"]), ("peak GB/s", bw["peak_gb_per_s"]),
                            ("peak from", bw["peak_source"]), ("% of peak", bw["percent_of_peak"])])


def ctranslate2_md(ct2):
    rows = [(r["compute_type"], r["weights"], r["compared_with"], f"{r['identical']}/{r['sentences']}",
             r["fairseq_at_length_limit"], r["sentences_per_second"], f"{r['speedup']}x") for r in ct2["rows"]]
    return ("The RoPE model, exported by fairseq-rope-export, decoded with fairseq-generate's settings. A "
            "hypothesis that reaches the length limit may differ: fairseq forces and scores </s> after it, "
            "CTranslate2 stops.\n\n"
            + table(("compute type", "weights", "compared with", "identical lines", "fairseq lines at the length "
                     "limit", "sentences/s", "speed-up"), rows))


SECTIONS = (("environment", "Environment", environment_md), ("kernel", "Fused rotation kernel", kernel_md),
            ("training", "Training", training_md), ("generation", "Generation", generation_md),
            ("speed", "Speed: RoPE / sinusoidal", speed_md), ("bandwidth", "Fused rotation bandwidth", bandwidth_md),
            ("ctranslate2", "CTranslate2", ctranslate2_md))


def markdown(report):
    mode = "tiny (CPU plumbing check: the numbers mean nothing)" if report["tiny"] else "full"
    if not report["complete"]:
        mode += f"; **incomplete**: written {report['seconds']} s into the check, which has not finished"
    parts = [f"# GPU check ({mode})", "## Verdicts", table(("check", "result"), [
        (k, {True: "pass", False: "**FAIL**", None: "not run"}[v]) for k, v in report["verdicts"].items()])]
    for key, title, render in SECTIONS:
        section = report.get(key)
        parts += [f"## {title}", "not reached yet" if section is None else failed_md(section) or render(section)]
    return "\n\n".join(parts) + "\n"


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
    p.add_argument("--device-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device_worker:
        return p, args
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
    return p, args


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
    say("CTranslate2")
    report["ctranslate2"] = guarded("ctranslate2", lambda: ctranslate2_section(
        training, data_bin, work_dir, device, sizes, args.threads, decodes))


@command
def main(argv=None):
    p, args = parse_args(argv)
    if args.device_worker:
        return device_worker(json.loads(args.device_worker))
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
    report = {"tiny": args.tiny, "complete": False,
              "command": [sys.executable, "-m", __spec__.name, *(sys.argv[1:] if argv is None else argv)]}

    def write_report():
        report.update(verdicts=verdicts(report), seconds=round(time.time() - started, 1))
        write_text_atomically(out_dir / "report.json", json.dumps(report, indent=1) + "\n")
        write_text_atomically(out_dir / "report.md", markdown(report))

    with children_end_with_this_process():  # its trainings and decodes, also if it is killed
        run_checks(args, device, sizes, out_dir, data_bin_ready, report, write_report)
    report["complete"] = True
    write_report()
    say(f"report: {out_dir / 'report.md'} ({report['seconds']} s)")
    return 1 if False in report["verdicts"].values() else 0  # None: not run here (fp16 on a CPU)


if __name__ == "__main__":
    raise SystemExit(main())
