"""The length-bucket router: a --length-buckets export (fairseq-rope-export) as one engine. Each
sentence is translated by the model of its length
(:func:`~fairseq_rope_tools.deploy.exported.bucket_of`), as ``--rope-scaling dynamic-yarn``
would scale it: plain RoPE within the training length L, static YaRN at the next factor up from
its tokens / L beyond.

Batches hold one bucket's sentences (:meth:`LengthBuckets.group`), so that a file sorted by
bucket loads each model once; one bucket's model is held at a time unless ``keep_loaded`` (a
stream of lines, whose batches come mixed, keeps every model it has used).
"""

from pathlib import Path
from typing import Callable, Dict, List, Optional

from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy.engine import Decoding, Engine, Hypothesis, decode
from fairseq_rope_tools.deploy.exported import bucket_of, verified_bucket_manifest
from fairseq_rope_tools.deploy.segmentation import first_line


def bucket_manifest(directory) -> dict:
    """The manifest of the --length-buckets export ``directory``, every bucket checked against it
    (:func:`~fairseq_rope_tools.deploy.exported.verified_bucket_manifest`): a bucket swapped,
    edited or replaced by another export would translate with the wrong model without a word."""
    try:
        return verified_bucket_manifest(directory)
    except (OSError, ValueError) as e:
        raise UserError(f"--model-dir {directory}: {first_line(e)}: export it again with fairseq-rope-export "
                        "--length-buckets") from None


class LengthBuckets(Engine):
    """The export ``directory``; ``open_model(bucket_directory)`` builds the engine of one bucket
    (a CTranslate2Engine). The first bucket's model is loaded now, so that a bad device or compute
    type is refused before any text is read. ``max_source``: as the caller sets it (the manifest
    records the checkpoint's, :func:`~fairseq_rope_tools.deploy.exported.source_limit`)."""

    name = "ctranslate2"

    def __init__(self, directory, open_model: Callable[[Path], Engine], keep_loaded=False):
        directory = Path(directory)
        manifest = bucket_manifest(directory)
        self.open_model, self.keep_loaded = open_model, keep_loaded
        self.training_length = manifest["training_length"]
        self.factors = [float(b["factor"]) for b in manifest["buckets"]]
        self.labels = ["plain" if f == 1.0 else f"yarn x{f:g}" for f in self.factors]
        self.directories = [directory / b["directory"] for b in manifest["buckets"]]
        self.sentences = dict.fromkeys(self.labels, 0)
        self.loaded: Dict[int, Engine] = {0: open_model(self.directories[0])}

    def group(self, source: List[str]) -> int:
        return bucket_of(len(source), self.training_length, self.factors)

    def model(self, bucket: int) -> Engine:
        if bucket not in self.loaded:
            if not self.keep_loaded:
                self.loaded.clear()  # its weights are freed before the next bucket's are loaded
            self.loaded[bucket] = self.open_model(self.directories[bucket])
        return self.loaded[bucket]

    def translate(self, batch: List[List[str]], decoding: Optional[Decoding] = None) -> List[List[Hypothesis]]:
        by_bucket: Dict[int, List[int]] = {}
        for i, source in enumerate(batch):
            by_bucket.setdefault(self.group(source), []).append(i)
        results: List[List[Hypothesis]] = [[] for _ in batch]
        for bucket, ids in sorted(by_bucket.items()):
            self.sentences[self.labels[bucket]] += len(ids)
            for i, hypotheses in zip(ids, decode(self.model(bucket), [batch[i] for i in ids], decoding)):
                results[i] = hypotheses
        return results

    def report(self) -> dict:
        return {"length_buckets": dict(training_length=self.training_length, sentences=dict(self.sentences))}

    def summary(self) -> str:
        return f"length buckets (L = {self.training_length} tokens): " + ", ".join(
            f"{label} {n}" for label, n in self.sentences.items())
