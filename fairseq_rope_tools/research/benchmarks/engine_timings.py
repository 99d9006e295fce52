"""fairseq-generate and the engines that read an export (CTranslate2, ONNX Runtime: deploy/engines.py)
on a data-bin's test set, timed and compared: what fairseq-rope-benchmark-ct2 and
fairseq-rope-gpu-check's sections measure with. Each engine runs in a fresh process (``python -m``
this module, the request on stdin), since CTranslate2's CPU backend is chosen when the library
loads."""

import argparse
import json
import os
import re
import subprocess
import sys

from fairseq_rope_tools.cli import UserError, plugin_dir, progress_sayer
from fairseq_rope_tools.deploy import engines
from fairseq_rope_tools.deploy.batching import translate_sorted
from fairseq_rope_tools.deploy.ctranslate2_engine import ctranslate2_cuda_problem
from fairseq_rope_tools.deploy.engine import Decoding
from fairseq_rope_tools.deploy.exported import CTRANSLATE2_MODEL_FORMAT, ONNX_MODEL_FORMAT
from fairseq_rope_tools.deploy.model_setup import ModelSetup
from fairseq_rope_tools.deploy.segmentation import remove_bpe

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


def text_of_tokens(tokens, bpe_type):
    """The line of BPE ``tokens`` with the BPE removed."""
    return remove_bpe(" ".join(tokens), bpe_type)


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


def engine_worker(request):
    """Runs in its own process (CTranslate2's backend is read when it loads): the engine, opened
    through the registry, and the batching of fairseq-rope-translate; decoding time only."""
    setup = ModelSetup(request["engine"], "bpe", "bpe", model_dir=request["model_dir"])
    flags = argparse.Namespace(device=request["device"], compute_type=request["compute_type"],
                               threads=request["threads"], max_source_positions=None)
    engine = engines.engine_named(request["engine"]).open(setup, flags, Decoding(BEAM, LENPEN, request["max_len"]),
                                                          False)
    results, seconds = translate_sorted(engine, request["sources"], BATCH)
    json.dump({"seconds": seconds, "hypotheses": [h[0].tokens if h else [] for h in results]}, sys.stdout)


def engine_translate(engine, model_dir, compute_type, use_mkl, threads, sources, device="cpu", max_len=MAX_LEN):
    """(seconds, hypotheses) of ``engine`` (a name in the registry) in a fresh process; ``use_mkl``:
    CTranslate2's CPU backend (None: its default, the only one on cuda)."""
    request = dict(engine=engine, model_dir=str(model_dir), compute_type=compute_type, threads=threads,
                   sources=sources, device=device, max_len=max_len)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if use_mkl is not None:
        env["CT2_USE_MKL"] = str(use_mkl)
    proc = subprocess.run([sys.executable, "-m", __spec__.name], input=json.dumps(request),
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise UserError(f"{engine} ({compute_type}, CT2_USE_MKL={use_mkl}) failed:\n{proc.stderr[-3000:]}", status=1)
    reply = json.loads(proc.stdout)
    return reply["seconds"], reply["hypotheses"]


def export_dir(out_dir, quantization, model_format=CTRANSLATE2_MODEL_FORMAT):
    """Where :func:`export` writes the model of ``quantization``: OUT_DIR/ct2_QUANTIZATION (an ONNX
    export: OUT_DIR/onnx)."""
    return out_dir / (ONNX_MODEL_FORMAT if model_format == ONNX_MODEL_FORMAT else f"ct2_{quantization}")


def exported_model_dir(checkpoint, data_bin, out_dir, quantization, model_format=CTRANSLATE2_MODEL_FORMAT):
    """OUT_DIR/ct2_QUANTIZATION (or OUT_DIR/onnx), exported unless it holds this very checkpoint
    already. In this process: torch and fairseq are loaded once for all exports."""
    from fairseq_rope_tools.deploy import checkpoint_export as exporter

    model_dir = export_dir(out_dir, quantization, model_format)
    if not exporter.is_current(model_dir, checkpoint, quantization, data_bin=data_bin, model_format=model_format):
        progress(f"exporting {checkpoint} to {model_dir} ({model_format}, "
                 f"{'no' if quantization == 'none' else quantization} quantization)")
        try:
            exporter.export(str(checkpoint), str(data_bin), str(model_dir), quantization, force=True,
                            model_format=model_format)
        except (UserError, exporter.OptionError) as e:  # a step of the benchmark that failed: status 1
            raise UserError(str(e), status=1) from None
    return model_dir


if __name__ == "__main__":  # engine_translate's fresh process
    engine_worker(json.load(sys.stdin))
