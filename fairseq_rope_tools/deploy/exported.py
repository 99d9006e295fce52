"""What fairseq-rope-export writes, read without torch or fairseq (fairseq-rope-translate's
CTranslate2 path imports only this).

A plain export is one CTranslate2 model directory with ``export_info.json``. A
``--length-buckets`` export is a directory of such exports, one per length bucket, listed in
``length_buckets.json``: the plain model (factor 1) for sentences within the training length L,
and static YaRN at factor s_k for longer ones. A sentence of n tokens (its ``</s>`` counted, as
fairseq counts source lengths) gets dynamic-yarn's s = max(1, n / L), rounded up to the next
bucket's factor; a sentence beyond the largest factor gets the largest.
"""

import json
import os
from typing import List

EXPORT_INFO = "export_info.json"
LENGTH_BUCKETS = "length_buckets.json"


def read_bucket_manifest(directory) -> dict:
    """The manifest of a --length-buckets export; ValueError (or OSError) if it is none. The
    buckets come sorted by factor, the first one the plain model (factor 1)."""
    path = os.path.join(directory, LENGTH_BUCKETS)
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    buckets = manifest.get("buckets") if isinstance(manifest, dict) else None
    if not (isinstance(buckets, list) and buckets and isinstance(manifest.get("training_length"), int)
            and manifest["training_length"] > 0
            and all(isinstance(b, dict) and isinstance(b.get("factor"), (int, float))
                    and isinstance(b.get("directory"), str) and b["directory"] not in ("", ".", "..")
                    and "/" not in b["directory"] and os.sep not in b["directory"] for b in buckets)
            and buckets[0]["factor"] == 1.0
            and all(a["factor"] < b["factor"] for a, b in zip(buckets, buckets[1:]))):
        raise ValueError(f"{path} is not a length-bucket manifest written by fairseq-rope-export")
    return manifest


def bucket_of(source_tokens: int, training_length: int, factors: List[float]) -> int:
    """Index of the bucket of a source of ``source_tokens`` tokens before its ``</s>``: the first
    factor >= max(1, (source_tokens + 1) / L) (``factors`` ascending, the first 1), else the last."""
    needed = max(1.0, (source_tokens + 1) / training_length)
    for index, factor in enumerate(factors):
        if needed <= factor * (1 + 1e-12):
            return index
    return len(factors) - 1
