"""fairseq-rope-gpu-check, section 3: transformer_rope and transformer trained by the recipe
(examples/wmt14_en_de/train.sh) in fp32 and fp16, same seed and batches; the losses side by side
and the verdict on RoPE's fp16 loss."""

import math
import os
import shutil
import statistics
import time
from types import SimpleNamespace

from fairseq_rope_tools.cli import run_logged
from fairseq_rope_tools.recipes import recipe_step
from fairseq_rope_tools.research.compare import data as compare_data
from fairseq_rope_tools.research.gpu_check.common import guarded, run_lanes, say
from fairseq_rope_tools.training_log import parse_train_log

TRAIN_SH = recipe_step("wmt14_en_de", "train.sh")
MODELS = ("rope", "sinusoidal")
PRECISIONS = ("fp32", "fp16", "bf16")
BF16_SKIPPED = "skipped: fairseq 0.12's --bf16 implies --tpu (torch_xla), so fairseq-train cannot train in bf16 on CUDA"
FP16_SKIPPED = "skipped: needs CUDA"
# RoPE in fp16 once more with FAIRSEQ_ROPE_FUSED=0: the fused kernel's share of training speed
REFERENCE_ROTATION_RUN = "rope fp16 reference rotation"


def quickstart_data_bin(work_dir, sizes, threads):
    """The quickstart corpus, generated and prepared by prepare.sh (fairseq_rope_tools/research/compare/data.py)."""
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
    from fairseq_rope_tools.research.loss_plots import plot_loss_curves

    curves = [(name, dict(run["train_curve"]), {u: loss for u, loss, _ in run["valid_curve"]})
              for name, run in runs.items() if "train_curve" in run]
    plot_loss_curves(curves, output, title)


def training_section(data_bin, langs, work_dir, out_dir, device, sizes, updates, threads, tolerance):
    from fairseq_rope.modules.fused_rotary import FUSED_SWITCH  # here: the plugin loads torch and fairseq
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

