"""What fairseq-rope-benchmark-speed and fairseq-rope-ablate-rotation measure with: the two models
of each size (fairseq's registry, with the plugin's), their inputs, one training step, a stopwatch,
and the paired A/B measurements of training, generation, the rotation and peak memory."""

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from fairseq_rope_tools.cli import progress_sayer
from fairseq_rope_tools.research.machine import describe_cpu, page_faults, peak_resident_kib, status_kib
from fairseq_rope_tools.research.models import DictionaryTask, build_model
from fairseq_rope_tools.research.paired_stats import alternate, summarise, summarise_counts

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


@dataclass(frozen=True)
class MemoryRun:
    """What a peak-memory measurement trains, in a fresh process of its own (:func:`bench_memory`)."""

    device: str
    vocab: int
    sentences: int
    length: int
    steps: int
    dtype: str       # a key of DTYPES
    threads: int


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


def bench_memory(archs, run: MemoryRun, reps, label="memory"):
    """Peak training memory of each model of ``archs`` trained as ``run`` says, each in a fresh
    process (this module run as a program); ``reps`` pairs, announced as ``LABEL: rep 2/3``."""

    def measure(arch):
        # A fixed glibc mmap threshold returns every large tensor to the OS when it is freed, so
        # the resident-set high-water mark follows the live tensors, not allocator reuse.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        env.pop("GLIBC_TUNABLES", None)  # --malloc retain is for timings only
        proc = subprocess.run(
            [sys.executable, "-m", __spec__.name, arch, json.dumps(run.__dict__)],
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


if __name__ == "__main__":  # bench_memory's fresh process: ARCH and a MemoryRun as JSON
    arch, settings = sys.argv[1], MemoryRun(**json.loads(sys.argv[2]))
    torch.set_num_threads(settings.threads)
    torch.set_num_interop_threads(1)
    memory_child(arch, torch.device(settings.device), settings.vocab, settings.sentences, settings.length,
                 settings.steps, DTYPES[settings.dtype])
