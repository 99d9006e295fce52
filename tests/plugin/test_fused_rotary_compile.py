"""Ahead-of-time compilation of the fused rotation kernel for sm_80 (A100) and sm_90 (H100), on
a machine without a GPU: ``triton.compile`` runs the whole pipeline down to ptxas, so a kernel
that the interpreter runs but a GPU cannot compile (an unsupported operation, a shape that does
not tile, a bad constexpr) fails here.

Every compile-time variant a model can ask for, as ``kernel_constexprs`` (the function the
launch itself uses) gives them:

* on each target (sm_80, sm_90), every combination of dtype (fp32, fp16, bf16), SIGN (+1
  forward, -1 backward) and BLOCK_H of the head counts the transformer_rope architectures launch
  (h, 2h for q/k of the fused projection, 3h with RoPER) once, in one layout or the other; and
  with each layout, every pair of them (each dtype with each BLOCK_H, the SIGN alternating);
* the tiles (BLOCK_D of head dims 16-256) taken in turn along them, each at its largest rotation
  (head_dim == BLOCK_D, nothing masked) and at its smallest (the smallest head_dim of the tile
  with 2 channels rotated: the most masked), so that each target and layout meets both.

72 compilations of 0.15-0.4 s; two processes compile them. They write to a fresh cache directory,
so nothing is reused.
"""

import argparse
import importlib.util
import itertools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from fairseq_rope.modules.fused_rotary import kernel_constexprs, launch_tile
from fairseq_rope.modules.rotary import LAYOUTS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed (scripts/setup_env.sh installs it)"
)

TARGETS = (80, 90)
DTYPES = ("fp32", "fp16", "bf16")
ELEMENT_SIZE = {"fp32": 4, "fp16": 2, "bf16": 2}
SIGNS = (1.0, -1.0)
HEAD_DIMS = range(16, 257)
POINTERS = ("x_ptr", "ox_ptr", "y_ptr", "oy_ptr")


def architecture_launch_heads():
    """One head count per distinct BLOCK_H among the launches of every transformer_rope
    architecture: h heads (a query or key of cross-attention, linear attention's pair), 2h (q and
    k of the fused q/k/v projection) and 3h (q, k and v with --rope-values)."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_INV_REGISTRY

    import fairseq_rope  # noqa: F401  (registers the architectures)

    by_block = {}
    for arch in ARCH_MODEL_INV_REGISTRY["transformer_rope"]:
        args = argparse.Namespace()
        ARCH_CONFIG_REGISTRY[arch](args)
        for heads in (args.encoder_attention_heads, args.decoder_attention_heads):
            for launched in (heads, 2 * heads, 3 * heads):
                block = kernel_constexprs(launched, 64, 64, "interleaved", 1.0, 2)["BLOCK_H"]
                by_block.setdefault(block, launched)
    return [by_block[block] for block in sorted(by_block)]


def tiles():
    """(layout, BLOCK_D) -> the (head_dim, rotary_dim) that give that tile."""
    found = {}
    for layout, head_dim in itertools.product(LAYOUTS, HEAD_DIMS):
        for rotary_dim in range(2, head_dim + 1, 2):
            c = kernel_constexprs(1, head_dim, rotary_dim, layout, 1.0, 2)
            found.setdefault((layout, c["BLOCK_D"]), []).append((head_dim, rotary_dim))
    return found


def tile_extremes(layout):
    """(head_dim, rotary_dim) of each tile of ``layout``: its largest rotation, then its smallest."""
    shapes = []
    for (_, _), dims in sorted((k, d) for k, d in tiles().items() if k[0] == layout):
        shapes += [max(dims, key=lambda d: (d[1], d[0])), min(dims, key=lambda d: (d[0], d[1]))]
    return shapes


def compilations():
    """(target, dtype, constexprs) of every compilation: per target and layout, each (dtype, heads)
    once with the SIGN alternating, so that the target's two layouts take each (dtype, SIGN, heads)
    between them (the SIGN is a constant factor: pairs meet every interaction the tiles can have,
    at half the compilations of every triple in every layout), with the tile extremes in turn."""
    turns = list(itertools.product(enumerate(DTYPES), enumerate(architecture_launch_heads())))
    compiles = []
    for group, (target, layout) in enumerate(itertools.product(TARGETS, LAYOUTS)):
        shapes = tile_extremes(layout)
        for turn, ((dtype_index, dtype), (heads_index, heads)) in enumerate(turns):
            sign = SIGNS[(group + dtype_index + heads_index) % 2]
            head_dim, rotary_dim = shapes[turn % len(shapes)]
            compiles.append((target, dtype, kernel_constexprs(heads, head_dim, rotary_dim, layout, sign, ELEMENT_SIZE[dtype])))
    return compiles


_KERNEL = None


def compile_one(target, dtype, constexprs, aligned=()):
    """Compile one variant; returns (ptx, cubin size) or raises the compiler's error. ``aligned``:
    the arguments a launch finds divisible by 16 (Triton specialises on it: pointers to 16-byte
    aligned tensors, strides and sizes that are multiples of 16)."""
    global _KERNEL
    import triton
    from triton.backends.compiler import GPUTarget

    from fairseq_rope.modules import fused_rotary

    if _KERNEL is None:
        _KERNEL = fused_rotary._build_kernel()
    names = _KERNEL.arg_names
    signature = {name: "i32" for name in names}  # the scalar arguments
    signature.update({name: f"*{dtype}" for name in POINTERS})
    signature.update(cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64")
    signature.update({name: "constexpr" for name in constexprs})
    source = triton.compiler.ASTSource(
        fn=_KERNEL, signature=signature, constexprs={(names.index(c),): v for c, v in constexprs.items()},
        attrs={(names.index(name),): [["tt.divisibility", 16]] for name in aligned},
    )
    layout = "interleaved" if constexprs["INTERLEAVED"] else "half"
    options = {"num_warps": launch_tile(layout, ELEMENT_SIZE[dtype])[1]}  # as the launch asks
    compiled = triton.compile(source, target=GPUTarget("cuda", target, 32), options=options)
    return compiled.asm.get("ptx", ""), len(compiled.asm.get("cubin", b""))


def compile_safely(target, dtype, constexprs):
    try:
        return compile_one(target, dtype, constexprs)
    except Exception as error:  # reported with its variant by the test
        return f"{type(error).__name__}: {str(error)[-2000:]}", 0


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """[(target, dtype, constexprs, ptx, cubin size)] of every compilation."""
    jobs = compilations()
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TRITON_INTERPRET", raising=False)  # the real compiler, not the interpreter
        patch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default (a*b+c fused), stated
        patch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))  # compile, never reuse
        # spawn: fresh interpreters that start with the environment above (a fork would copy a
        # process with torch's and pytest-xdist's threads; it is no faster here)
        with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(compile_safely, *zip(*jobs)))
    return [(*job, *result) for job, result in zip(jobs, results)]


@pytest.mark.e2e
def test_every_variant_compiles_to_ptx_and_cubin(compiled):
    failures = [
        f"sm_{target} {dtype} {constexprs}: {ptx if not cubin_size else 'PTX without the target or the kernel'}"
        for target, dtype, constexprs, ptx, cubin_size in compiled
        if not (cubin_size > 0 and f".target sm_{target}" in ptx and ".entry rotary_kernel" in ptx)
    ]
    assert not failures, f"{len(failures)} of {len(compiled)} variants failed:\n" + "\n".join(failures[:5])


def test_the_variants_cover_every_tile_and_argument():
    variants = compilations()
    assert len({(t, d, tuple(sorted(c.items()))) for t, d, c in variants}) == len(variants)  # no duplicate
    blocks_h = {kernel_constexprs(h, 64, 64, "interleaved", 1.0, 2)["BLOCK_H"] for h in architecture_launch_heads()}
    assert blocks_h == {2, 4, 8, 16, 32, 64}  # tiny (2 heads) to big (16 heads) with RoPER (48)
    blocks_d = {16, 32, 64, 128, 256}
    assert {block for _, block in tiles()} == blocks_d
    every_argument = set(itertools.product(DTYPES, SIGNS, blocks_h))
    for target in TARGETS:
        assert {(d, c["SIGN"], c["BLOCK_H"]) for t, d, c in variants if t == target} == every_argument, target
    for target, layout in itertools.product(TARGETS, LAYOUTS):
        group = [c | {"dtype": d} for t, d, c in variants
                 if t == target and c["INTERLEAVED"] == (layout == "interleaved")]
        arguments = {(c["dtype"], c["SIGN"], c["BLOCK_H"]) for c in group}
        for i, j in itertools.combinations(range(3), 2):  # (dtype, SIGN), (dtype, BLOCK_H), (SIGN, BLOCK_H)
            assert {(a[i], a[j]) for a in arguments} == {(a[i], a[j]) for a in every_argument}, (target, layout, i, j)
        # every tile unmasked (rotary_dim == head_dim == BLOCK_D) and with its fewest channels
        assert {c["BLOCK_D"] for c in group if 2 * c["HALF"] == c["BLOCK_D"]} == blocks_d, (target, layout)
        assert {c["BLOCK_D"] for c in group if c["HALF"] == 1} == blocks_d, (target, layout)


# what a launch of the base models finds divisible by 16: the tensors (torch allocates them 16-byte
# aligned) and, with head_dim 64, every stride of a (time, batch, heads, head_dim) view of the q/k/v
# projection, head_dim and the table's row stride
ALIGNED_AT_BASE_SIZE = POINTERS + ("cos_ptr", "sin_ptr", "pos_ptr", "sx_t", "sx_b", "sx_h", "sox_t", "sox_b", "sox_h",
                                   "sy_t", "sy_b", "sy_h", "soy_t", "soy_b", "soy_h", "head_dim", "table_stride")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_base_size_reads_and_writes_16_byte_vectors(layout, dtype, monkeypatch, tmp_path):
    """An H200 measured the first kernel of the interleaved layout at 10 % of the device's bandwidth:
    it read x1 and x2 as two strided gathers of 2-byte elements. Every access to q and k must be a
    16-byte vector: the outputs written with st.global.v4 only, and no 2-byte load in fp16/bf16."""
    import re

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    for heads in (8, 16):  # transformer_rope (q and k as one launch of 2 x 8 heads, or one tensor)
        ptx, _ = compile_one(90, dtype, kernel_constexprs(heads, 64, 64, layout, 1.0, ELEMENT_SIZE[dtype]), ALIGNED_AT_BASE_SIZE)
        stores = set(re.findall(r"st\.global(?:\.\w+)+", ptx))
        loads = set(re.findall(r"ld\.global(?:\.\w+)+", ptx))
        assert stores == {"st.global.v4.b32"}, (heads, stores)
        assert "ld.global.v4.b32" in loads and not {"ld.global.b16", "ld.global.u16"} & loads, (heads, loads)


def specialization_keys(launches):
    """The distinct compiled variants Triton's launcher would pick for ``launches`` (lists of
    ``launch_arguments``), computed as its binder does for sm_90, without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    from fairseq_rope.modules import fused_rotary

    kernel = fused_rotary._build_kernel()
    binder = create_function_from_signature(kernel.signature, kernel.params, CUDABackend(GPUTarget("cuda", 90, 32)))
    return {str(binder(*arguments, **options)[1]) for _, arguments, options in launches}


def test_batches_and_decoding_steps_share_one_compiled_variant(monkeypatch):
    """On an H200, RoPE decoded 4.6x (fp32) and 12x (fp16) slower than sinusoidal: Triton compiled
    the kernel anew for each class of batch size, token count and position stride it met (== 1, a
    multiple of 16, other). Launches of one model (q and k of the fused projection, fp16, 8 heads
    of 64) at any batch size, decoding step and position kind must map to one variant."""
    import torch

    from fairseq_rope.modules.fused_rotary import launch_arguments
    from fairseq_rope.modules.rotary_embedding import RotaryEmbedding

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cos, sin, _ = RotaryEmbedding(64).tables(300, "cpu")
    launches = []
    for batch in (1, 17, 148, 256):  # beam 4 x 64 sentences, the last batch, a single sentence
        for time in (1, 2, 16, 33):  # an incremental step, prefixes, training lengths
            qkv = torch.randn(time, batch, 3 * 8, 64, dtype=torch.float16)
            xs = [qkv[:, :, :8], qkv[:, :, 8:16]]
            outs = [torch.empty(x.shape, dtype=x.dtype) for x in xs]
            for positions in (torch.arange(time), torch.randint(0, 100, (batch, time))):
                launches.append(launch_arguments(xs, outs, cos, sin, positions, "interleaved", 1.0))
    assert len(specialization_keys(launches)) == 1
