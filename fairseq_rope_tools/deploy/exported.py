"""What fairseq-rope-export writes, read without torch or fairseq (fairseq-rope-translate's
CTranslate2 path imports only this).

A plain export is one CTranslate2 model directory with ``export_info.json``. A
``--length-buckets`` export is a directory of such exports, one per length bucket, listed in
``length_buckets.json``: the plain model (factor 1) for sentences within the training length L,
and static YaRN at factor s_k for longer ones. A sentence of n tokens (its ``</s>`` counted, as
fairseq counts source lengths) gets dynamic-yarn's s = max(1, n / L), rounded up to the next
bucket's factor; a sentence beyond the largest factor gets the largest.

The manifest is verified, not trusted (:func:`verified_bucket_manifest`): each bucket's own
``export_info.json`` must record the manifest's checkpoint (sha256), its factor and L, and the
vocabularies its files hold; a bucket swapped, edited or replaced by another export is refused
by name.
"""

import hashlib
import json
import os
from typing import List, Optional

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


def bucket_overrides(factor: float, training_length: int) -> dict:
    """The inference options a bucket of ``factor`` is exported with: plain RoPE at factor 1,
    else static yarn; as its export_info.json records them."""
    return {"rope_scaling": "none" if factor == 1.0 else "yarn", "rope_scaling_factor": float(factor),
            "rope_scaling_original_length": training_length}


def read_vocabulary(model_dir, side):
    """(path, the export's source or target vocabulary as a list of tokens), or (None, None)
    without one; ValueError (or OSError) if the file is not a vocabulary list."""
    for name in (f"{side}_vocabulary.json", "shared_vocabulary.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                vocab = json.load(f)
            if not isinstance(vocab, list):
                raise ValueError(f"{path} is not a vocabulary list")
            return path, vocab
    return None, None


def vocabulary_digests(model_dir) -> dict:
    """{"source": sha256, "target": sha256} of the vocabularies the export's files hold (None for
    a side without one): what export_info.json records, to tell when they are replaced."""
    digests = {}
    for side in ("source", "target"):
        _, vocab = read_vocabulary(model_dir, side)
        digests[side] = None if vocab is None else hashlib.sha256(
            json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()
    return digests


def _describe(overrides) -> str:
    if not isinstance(overrides, dict) or not overrides:
        return "a model without bucket scaling"
    factor, length = overrides.get("rope_scaling_factor"), overrides.get("rope_scaling_original_length")
    factor = f"{factor:g}" if isinstance(factor, (int, float)) else repr(factor)
    kind = "plain RoPE" if overrides.get("rope_scaling") == "none" else f"{overrides.get('rope_scaling')} x{factor}"
    return f"{kind} at L = {length}"


def bucket_problem(directory, manifest: dict, bucket: dict) -> Optional[str]:
    """Why the bucket ``bucket`` of the manifest ``manifest`` (of the directory ``directory``) is
    not the model the manifest lists, as one line naming it, or None: its export_info.json must
    record the manifest's factor and L, everything else as the manifest does (the checkpoint's
    sha256 above all), and the vocabularies its files hold."""
    name = bucket["directory"]
    path = os.path.join(directory, name)
    try:
        with open(os.path.join(path, EXPORT_INFO), encoding="utf-8") as f:
            info = json.load(f)
        if not isinstance(info, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return f"the bucket {name} has no readable {EXPORT_INFO} ({getattr(e, 'strerror', None) or e})"
    if not os.path.isfile(os.path.join(path, "model.bin")):
        return f"the bucket {name} has no model.bin"
    if info.get("sha256") != manifest.get("sha256"):
        return (f"the bucket {name} is an export of another checkpoint (sha256 {str(info.get('sha256'))[:12]}..., "
                f"the manifest's {str(manifest.get('sha256'))[:12]}...)")
    expected = bucket_overrides(float(bucket["factor"]), manifest["training_length"])
    if info.get("overrides") != expected:
        return f"the bucket {name} holds {_describe(info.get('overrides'))}, the manifest lists {_describe(expected)}"
    differing = sorted(key for key in (info.keys() | manifest.keys()) - {"overrides", "training_length", "scaling",
                                                                            "buckets"}
                       if info.get(key) != manifest.get(key))
    if differing:
        key = differing[0]
        return f"the bucket {name}'s {EXPORT_INFO} records {key} {info.get(key)!r}, the manifest {manifest.get(key)!r}"
    try:
        held = vocabulary_digests(path)
    except (OSError, ValueError) as e:
        return f"the bucket {name}'s vocabulary cannot be read ({e})"
    if "vocabulary" in info and held != info["vocabulary"]:
        return f"the bucket {name}'s vocabulary files are not those it was exported with"
    return None


def verified_bucket_manifest(directory) -> dict:
    """:func:`read_bucket_manifest`, with every bucket checked against it (:func:`bucket_problem`):
    ValueError naming the first bucket that is not the model the manifest lists."""
    manifest = read_bucket_manifest(directory)
    for bucket in manifest["buckets"]:
        problem = bucket_problem(directory, manifest, bucket)
        if problem:
            raise ValueError(problem)
    return manifest


def bucket_of(source_tokens: int, training_length: int, factors: List[float]) -> int:
    """Index of the bucket of a source of ``source_tokens`` tokens before its ``</s>``: the first
    factor >= max(1, (source_tokens + 1) / L) (``factors`` ascending, the first 1), else the last."""
    needed = max(1.0, (source_tokens + 1) / training_length)
    for index, factor in enumerate(factors):
        if needed <= factor * (1 + 1e-12):
            return index
    return len(factors) - 1
