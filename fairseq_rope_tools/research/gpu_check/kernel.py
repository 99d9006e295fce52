"""fairseq-rope-gpu-check, sections 2 and 6: the fused Triton rotation against its definition
(forward and backward, every dtype and layout) and its bandwidth. Run in a child process of its
own (``python -m fairseq_rope_tools.research.gpu_check.kernel REQUEST``), so that Triton's
interpreter can be switched on before Triton is imported (TRITON_INTERPRET is read at import
time)."""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fairseq_rope_tools.research.gpu_check.common import FULL, TINY, guarded

# specified memory bandwidth (GB/s) by a part of torch.cuda.get_device_name(); the first match wins,
# so the more specific names come first
PEAK_BANDWIDTH = (
    ("GH200", 4000), ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350), ("H800", 3350),
    ("A100 80GB PCIe", 1935), ("A100-SXM4-80GB", 2039), ("A100", 1555), ("A800", 2039), ("L40S", 864), ("L40", 864),
    ("L4", 300), ("A10G", 600), ("A10", 600), ("A40", 696), ("A6000", 768), ("V100", 900), ("T4", 320),
    ("RTX 4090", 1008), ("RTX 3090", 936),
)



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
    peak, source = (spec, f"specified bandwidth of {entry} (table in gpu_check/kernel.py)") if spec else (
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
    from fairseq_rope.modules.fused_rotary import FUSED_SWITCH  # here: the plugin loads torch and fairseq
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
    env.pop("TRITON_INTERPRET", None)
    env.pop(FUSED_SWITCH, None)  # the kernel is what this process checks
    if tiny:
        env["TRITON_INTERPRET"] = "1"
    request = json.dumps({"device": device, "tiny": tiny})
    proc = subprocess.run([sys.executable, "-m", __spec__.name, request],
                          capture_output=True, text=True, env=env)
    Path(log_path).write_text(proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise RuntimeError(f"the kernel check's process failed: {tail[0]} (log: {log_path})")
    return json.loads(proc.stdout)



if __name__ == "__main__":
    device_worker(json.loads(sys.argv[1]))
