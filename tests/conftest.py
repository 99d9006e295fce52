"""Shared fixtures: a tiny parallel corpus binarized once per session, and a CLI runner that
calls fairseq's console scripts from this environment exactly as a user would."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run_cli(args, cwd=REPO, timeout=600, env=None, check=True):
    """Run a console script (``fairseq-train`` ...) or command; return CompletedProcess."""
    exe = BIN / args[0]
    cmd = [str(exe) if exe.exists() else args[0], *map(str, args[1:])]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    full_env["PATH"] = f"{BIN}{os.pathsep}{full_env.get('PATH', '')}"
    full_env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
            f"\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def write_reversal_corpus(directory: Path, seed: int = 0, sizes=(("train", 1500), ("valid", 60), ("test", 43))):
    """A toy task that needs positions: the target is the source reversed."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(40)]
    for split, n in sizes:
        with open(directory / f"{split}.en", "w") as src, open(directory / f"{split}.de", "w") as tgt:
            for _ in range(n):
                sentence = [rng.choice(vocab) for _ in range(rng.randint(2, 10))]
                src.write(" ".join(sentence) + "\n")
                tgt.write(" ".join(reversed(sentence)) + "\n")


@pytest.fixture(scope="session")
def tiny_data_bin(tmp_path_factory):
    """Raw text and a fairseq data-bin of the reversal corpus (en -> de)."""
    root = tmp_path_factory.mktemp("tiny_corpus")
    write_reversal_corpus(root)
    run_cli([
        "fairseq-preprocess", "--source-lang", "en", "--target-lang", "de",
        "--trainpref", root / "train", "--validpref", root / "valid", "--testpref", root / "test",
        "--destdir", root / "data-bin", "--joined-dictionary", "--workers", "1",
    ])
    return root


def build_model(arch="transformer_rope_tiny", *extra_args, vocab_size=30, seed=0):
    """Build a model in-process exactly as fairseq-train would, from command-line style args."""
    import torch
    from fairseq import options
    from fairseq.data import Dictionary

    import fairseq_rope  # noqa: F401  (registers transformer_rope)

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, ["unused-data-dir", "--arch", arch, "--task", "translation", *map(str, extra_args)]
    )
    dictionary = Dictionary()
    for i in range(vocab_size):
        dictionary.add_symbol(f"w{i}")

    class Task:
        source_dictionary = target_dictionary = dictionary

    torch.manual_seed(seed)
    from fairseq import models

    model = models.build_model(args, Task())
    return model, dictionary, args


def table_cos_sin(rotary, positions, length):
    """fp32 cos and sin of m * theta_i from a RotaryEmbedding's tables, for integer ``positions``."""
    cos, sin, _ = rotary.tables(length, positions.device)
    return cos[positions], sin[positions]


def rotate(attn, x, positions, length):
    """R_m x for a time-first (time, batch, heads, head_dim) ``x``, through the layer's rotation."""
    return attn.rotary.rotate([x], positions, length, x.shape)[0]
