"""The toy corpora of the tests: the reversal task and a prepared work directory of it."""

import random
import shutil
from pathlib import Path


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


def subword_work_dir(root: Path, tiny_data_bin: Path) -> Path:
    """``root/work`` as prepare.sh leaves it for the tiny corpus: its data-bin and subword-nmt codes
    that keep the corpus' words whole."""
    work = root / "work"
    (work / "bpe").mkdir(parents=True)
    (work / "bpe" / "codes").write_text("#version: 0.2\n" + "".join(f"w {i}</w>\n" for i in range(10)))
    (work / "bpe" / "vocab.en").write_text("".join(f"w{i} 100\n" for i in range(40)))
    (work / "bpe" / ".done").write_text("# prepare.sh step record v1\noption BPE=subword-nmt\n"
                                        "option BPE_VOCAB_THRESHOLD=1\n")
    shutil.copytree(tiny_data_bin / "data-bin", work / "data-bin")
    return work
