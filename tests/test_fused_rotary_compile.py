"""Ahead-of-time compilation of the fused rotation kernel for sm_80 (A100) and sm_90 (H100), on
a machine without a GPU: ``triton.compile`` runs the whole pipeline down to ptxas, so a kernel
that the interpreter runs but a GPU cannot compile (an unsupported operation, a shape that does
not tile, a bad constexpr) fails here.

Every compile-time variant a model can ask for, as ``kernel_constexprs`` (the function the
launch itself uses) gives them:

* the tile: both layouts x every (BLOCK_HALF, BLOCK_REST) of head dims 16-256 with every
  rotary_dim a --rope-fraction can give (rotary_dim == head_dim: no rest); on sm_80 with the
  tile's largest rotation (HALF == BLOCK_HALF, no mask), on sm_90 with its smallest (the most
  masked), both real settings;
* dtype (fp32, fp16, bf16), SIGN (+1 forward, -1 backward) and BLOCK_H of the head counts the
  transformer_rope architectures launch (h, 2h for q/k of the fused projection, 3h with RoPER)
  are taken in turn along the tiles, so that each of their combinations meets each layout and
  each target.

Each tile is compiled once, for one of the two targets in turn (see ``compilations``): 130
compilations of 0.15-0.4 s; two processes compile them (about 15-30 s on 2 cores, depending on
the load). They write to a fresh cache directory, so nothing is reused.
"""

import argparse
import importlib.util
import itertools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from fairseq_rope.modules.fused_rotary import kernel_constexprs
from fairseq_rope.modules.rotary import LAYOUTS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed (scripts/setup_env.sh installs it)"
)

TARGETS = (80, 90)
DTYPES = ("fp32", "fp16", "bf16")
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
                block = kernel_constexprs(launched, 64, 64, "interleaved", 1.0)["BLOCK_H"]
                by_block.setdefault(block, launched)
    return [by_block[block] for block in sorted(by_block)]


def tiles():
    """(layout, BLOCK_HALF, BLOCK_REST) -> the (head_dim, rotary_dim) that give that tile."""
    found = {}
    for layout, head_dim in itertools.product(LAYOUTS, HEAD_DIMS):
        for rotary_dim in range(2, head_dim + 1, 2):
            c = kernel_constexprs(1, head_dim, rotary_dim, layout, 1.0)
            found.setdefault((layout, c["BLOCK_HALF"], c["BLOCK_REST"]), []).append((head_dim, rotary_dim))
    return found


def compilations():
    """(target, dtype, constexprs) of every compilation.

    Each tile once: its targets alternate along the sorted tiles, starting on sm_80 for one
    layout and sm_90 for the other, so that each target meets every (BLOCK_HALF, BLOCK_REST)
    (with one layout) and each layout meets it too (on one target). The (dtype, SIGN, BLOCK_H)
    combinations are taken in turn along the whole list: more than their number fall on each
    layout and on each target, so each meets all of them."""
    turns = list(itertools.product(DTYPES, SIGNS, architecture_launch_heads()))
    jobs = []
    for layout_index, layout in enumerate(LAYOUTS):
        for tile_index, ((_, _, _), dims) in enumerate(sorted((k, d) for k, d in tiles().items() if k[0] == layout)):
            target = TARGETS[(tile_index + layout_index) % len(TARGETS)]
            # the tile's largest rotation (no mask) on sm_80, its smallest (the most masked) on sm_90
            head_dim, rotary_dim = (max if target == 80 else min)(dims, key=lambda d: (d[1], d[0]))
            jobs.append((target, layout, head_dim, rotary_dim))
    jobs.sort(key=lambda job: (job[1], job[0]))  # runs of one layout and one target
    compiles = []
    for turn, (target, layout, head_dim, rotary_dim) in enumerate(jobs):
        dtype, sign, heads = turns[turn % len(turns)]
        compiles.append((target, dtype, kernel_constexprs(heads, head_dim, rotary_dim, layout, sign)))
    return compiles


_KERNEL = None


def compile_one(target, dtype, constexprs):
    """Compile one variant; returns (ptx, cubin size) or raises the compiler's error."""
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
        fn=_KERNEL, signature=signature, constexprs={(names.index(c),): v for c, v in constexprs.items()}
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", target, 32))
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
    blocks_h = {kernel_constexprs(h, 64, 64, "interleaved", 1.0)["BLOCK_H"] for h in architecture_launch_heads()}
    assert blocks_h == {2, 4, 8, 16, 32, 64}  # tiny (2 heads) to big (16 heads) with RoPER (48)
    every_tile = {(half, rest) for _, half, rest in tiles()}
    assert {half for half, _ in every_tile} == {1, 2, 4, 8, 16, 32, 64, 128}
    assert {rest for _, rest in every_tile} == {0, 1, 2, 4, 8, 16, 32, 64, 128, 256}
    every_argument = set(itertools.product(DTYPES, SIGNS, blocks_h))
    groups = [("target", t, lambda v, t=t: v[0] == t) for t in TARGETS]
    groups += [("layout", layout, lambda v, layout=layout: v[2]["INTERLEAVED"] == (layout == "interleaved"))
               for layout in LAYOUTS]
    for kind, name, member in groups:
        group = [v for v in variants if member(v)]
        assert {(c["BLOCK_HALF"], c["BLOCK_REST"]) for _, _, c in group} == every_tile, f"{kind} {name}"
        assert {(d, c["SIGN"], c["BLOCK_H"]) for _, d, c in group} == every_argument, f"{kind} {name}"
