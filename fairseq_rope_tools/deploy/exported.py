"""What fairseq-rope-export writes, read without torch or fairseq: the one reader of an export's
records (and the writer of its bundle manifest), for fairseq-rope-export, fairseq-rope-translate,
fairseq-rope-serve and the benchmarks; their names are defined here, the export writes the others.

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

Either kind is a bundle (:data:`BUNDLE`, ``bundle.json``): beside the model(s) it holds the
source segmentation of the work directory the model was trained from (subword-nmt codes and
source vocabulary, or the sentencepiece model), and records the languages, the tokenisation, the
BPE kind and vocabulary threshold, and the sha256 of every file of the directory, which
:func:`verified_bundle` checks before a model is loaded. The length limit and L are those of
``export_info.json`` (``length_buckets.json``), which the bundle holds (:func:`source_limit`).
The format of its model(s) is CTranslate2's unless the manifest declares another
(``model_format``, :func:`model_format_of`): the engine that reads that format is the default one
(fairseq_rope_tools/deploy/engines.py).
"""

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from fairseq_rope_base.files import file_fingerprint
from fairseq_rope_tools.deploy.bundle_files import files_inside, is_directory_name, outside, read_record
from fairseq_rope_tools.deploy.segmentation import BPE_TYPES, MOSES_RECIPE, Segmentation

EXPORT_INFO = "export_info.json"
LENGTH_BUCKETS = "length_buckets.json"
CONFIG = "config.json"  # CTranslate2's
BUNDLE = "bundle.json"
BUNDLE_FORMAT = "fairseq-rope bundle"
BUNDLE_VERSION = 1
#: the format of a bundle's model(s) when its manifest declares none: what fairseq-rope-export has always
#: written, so that every bundle before the declaration reads as what it is
CTRANSLATE2_MODEL_FORMAT = "ctranslate2"
ONNX_MODEL_FORMAT = "onnx"
#: the files an export of each model format cannot do without: CTranslate2's model, or the ONNX
#: engine's two graphs and what it needs beside them (onnx_graphs.py writes them, onnx_engine.py reads them)
MODEL_FILES = {CTRANSLATE2_MODEL_FORMAT: ("model.bin",),
               ONNX_MODEL_FORMAT: ("encoder.onnx", "decoder.onnx", "onnx_model.json")}


def onnx_step_cache_names(layers: int) -> Tuple[List[str], List[str]]:
    """The ONNX decoding step's per-layer inputs, as onnx_graphs.py names them and onnx_engine.py
    feeds them: the self-attention caches and the encoder-decoder keys and values (each layer's
    keys, then its values)."""
    def per_layer(attention):
        return [f"{attention}_{kind}_{layer}" for layer in range(layers) for kind in ("keys", "values")]

    return per_layer("self"), per_layer("cross")


#: the segmentation files of a bundle, by role (the source vocabulary's name ends in the language)
BUNDLE_SEGMENTATION_FILES = {"codes": "bpe.codes", "vocabulary": "bpe.vocab", "model": "spm.model"}


def read_json_object(path) -> dict:
    """The JSON object in ``path``, a record of a few KB (:func:`~.bundle_files.read_record`);
    ValueError naming ``path`` (or OSError) if it is not one."""
    return read_record(path)


def read_export_info(model_dir) -> dict:
    """The ``export_info.json`` of one export; ValueError (or OSError) without a readable one."""
    return read_json_object(os.path.join(model_dir, EXPORT_INFO))


def is_bucket_export(directory) -> bool:
    return os.path.isfile(os.path.join(directory, LENGTH_BUCKETS))


def source_limit(directory) -> Optional[int]:
    """The longest source the export takes, in positions (its tokens and the ``</s>`` appended, as
    fairseq counts them): the model's max_source_positions as ``length_buckets.json`` of a
    --length-buckets export records it, else ``export_info.json``, else ``config.json`` (older
    exports); None when none records it (CTranslate2 itself has no limit for RoPE models).
    ValueError (or OSError) on a record that cannot be read."""
    for name in (LENGTH_BUCKETS,) if is_bucket_export(directory) else (EXPORT_INFO, CONFIG):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            limit = read_json_object(path).get("max_source_positions")
            if isinstance(limit, int) and limit > 1:
                return limit
    return None


def read_bucket_manifest(directory) -> dict:
    """The manifest of a --length-buckets export; ValueError (or OSError) if it is none. The
    buckets come sorted by factor, the first one the plain model (factor 1)."""
    path = os.path.join(directory, LENGTH_BUCKETS)
    manifest = read_json_object(path)
    buckets = manifest.get("buckets")
    for bucket in buckets if isinstance(buckets, list) else ():
        name = bucket.get("directory") if isinstance(bucket, dict) else None
        if isinstance(name, str) and not is_directory_name(name):
            raise ValueError(f"{path} lists the bucket directory {name!r}, which is not a directory name inside "
                             "the export")
    if not (isinstance(buckets, list) and buckets and isinstance(manifest.get("training_length"), int)
            and manifest["training_length"] > 0
            and all(isinstance(b, dict) and isinstance(b.get("factor"), (int, float))
                    and is_directory_name(b.get("directory")) for b in buckets)
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
        info = read_export_info(path)
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


# --- the bundle: everything translation needs, verified on load -----------------------------------
def is_bundle_entry(name: str) -> bool:
    """Whether a bundle holds an entry of this name beside its model(s)."""
    return name in (BUNDLE, BUNDLE_SEGMENTATION_FILES["codes"], BUNDLE_SEGMENTATION_FILES["model"]) or (
        name.startswith(BUNDLE_SEGMENTATION_FILES["vocabulary"] + ".") and "/" not in name)


def bundle_file_names(segmentation: Segmentation) -> Dict[str, Path]:
    """{name in the bundle: the file it is copied from} of ``segmentation``'s files."""
    names = {}
    for role, path in segmentation.files().items():
        name = BUNDLE_SEGMENTATION_FILES[role]
        names[f"{name}.{segmentation.source}" if role == "vocabulary" else name] = path
    return names


def segmentation_record(segmentation: Segmentation) -> dict:
    """How ``segmentation`` is recorded in bundle.json (its files by their names in the bundle)."""
    record = {"tokenizer": dict(MOSES_RECIPE) if segmentation.tokenize else None, "bpe": segmentation.bpe_type}
    for role, path in segmentation.files().items():
        record[role] = next(name for name, source in bundle_file_names(segmentation).items() if source == path)
    if segmentation.bpe_type == "subword_nmt":
        record["vocabulary_threshold"] = segmentation.vocabulary_threshold
    return record


def bundled_files(directory) -> List[str]:
    """The relative paths of every file under ``directory`` but its bundle.json, sorted; ValueError
    naming a symbolic link or a special file (:func:`~.bundle_files.files_inside`)."""
    return [name for name in files_inside(directory) if name != BUNDLE]


def file_digests(directory) -> Dict[str, str]:
    """{relative path: sha256} of :func:`bundled_files`."""
    return {name: file_fingerprint(os.path.join(directory, name))[1] for name in bundled_files(directory)}


def write_bundle(directory, source: str, target: str, segmentation: Optional[Segmentation],
                 model_format: Optional[str] = None) -> dict:
    """Into the export ``directory``, whose model files are written: ``segmentation``'s files (None:
    a model-only export, whose raw input needs a work dir) and bundle.json, which records the
    languages, the segmentation, the sha256 of every file and ``model_format`` (None: CTranslate2's,
    declared by leaving it out, as every bundle before the declaration does); returns what it records."""
    record = None
    if segmentation is not None:
        for name, path in bundle_file_names(segmentation).items():
            shutil.copyfile(path, os.path.join(directory, name))
        record = segmentation_record(segmentation)
    manifest = dict(format=BUNDLE_FORMAT, version=BUNDLE_VERSION, source_language=source, target_language=target,
                    segmentation=record, files=file_digests(directory))
    if model_format is not None:
        manifest["model_format"] = model_format
    with open(os.path.join(directory, BUNDLE), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def read_bundle(directory) -> Optional[dict]:
    """The bundle.json of an export, or None without one (exported before bundles); ValueError (or
    OSError) when it is not a bundle manifest this version reads."""
    path = os.path.join(directory, BUNDLE)
    if not os.path.isfile(path):
        return None
    manifest = read_json_object(path)
    if manifest.get("format") != BUNDLE_FORMAT:
        raise ValueError(f"{path} is not a bundle manifest written by fairseq-rope-export")
    if manifest.get("version") != BUNDLE_VERSION:
        raise ValueError(f"{path} is a bundle of version {manifest.get('version')!r}; this fairseq-rope-translate "
                         f"reads version {BUNDLE_VERSION}: install the version that exported it")
    files, record = manifest.get("files"), manifest.get("segmentation")
    for name in files if isinstance(files, dict) else ():
        if outside(name):  # never opened (only listed files that are there are), but no export writes one
            raise ValueError(f"{path} lists {name!r}, a path outside the bundle (absolute, or with ..)")
    well_formed = (
        isinstance(files, dict) and all(isinstance(v, str) for v in files.values())
        and isinstance(manifest.get("model_format", CTRANSLATE2_MODEL_FORMAT), str)
        and all(isinstance(manifest.get(key), str) for key in ("source_language", "target_language"))
        and (record is None or (isinstance(record, dict) and record.get("bpe") in BPE_TYPES
                                and all(record.get(role) in files for role in _roles(record["bpe"])))))
    if not well_formed:
        raise ValueError(f"{path} is not a complete bundle manifest")
    if record is not None and record.get("tokenizer") not in (None, MOSES_RECIPE):
        raise ValueError(f"{path} records a tokenizer this version does not apply ({record.get('tokenizer')!r})")
    return manifest


def model_format_of(manifest: Optional[dict]) -> str:
    """The format of the model(s) of a bundle, as its manifest (None: a --length-buckets export
    before bundles) declares it: CTranslate2's when it declares none."""
    return (manifest or {}).get("model_format", CTRANSLATE2_MODEL_FORMAT)


def declared_model_format(directory) -> str:
    """The model format the bundle.json of ``directory`` declares, read before the bundle is
    verified: only to choose the engine whose check then verifies it. A manifest that cannot be
    read, or is a symbolic link (a bundle is read only inside itself), declares CTranslate2's: its
    check says what is wrong with it."""
    if os.path.islink(os.path.join(directory, BUNDLE)):
        return CTRANSLATE2_MODEL_FORMAT
    try:
        return model_format_of(read_bundle(directory))
    except (OSError, ValueError):
        return CTRANSLATE2_MODEL_FORMAT


def _roles(bpe_type):
    return ("codes", "vocabulary") if bpe_type == "subword_nmt" else ("model",)


def bundle_problem(directory, manifest: dict) -> Optional[str]:
    """Why the files of ``directory`` are not those its manifest lists, as one line, or None: a
    file missing, changed, or not listed (CTranslate2 loads the vocabulary files it finds, so an
    added one changes the model)."""
    listed, held = manifest["files"], set(bundled_files(directory))
    for name in sorted(listed.keys() - held):
        return f"{name}, which {BUNDLE} lists, is missing"
    for name in sorted(held - listed.keys()):
        return f"{name} is not one of the files {BUNDLE} lists"
    for name, digest in sorted(listed.items()):
        if file_fingerprint(os.path.join(directory, name))[1] != digest:
            return f"{name} is not the file it was exported with (its sha256 is not the one {BUNDLE} records)"
    return None


def verified_bundle(directory) -> Optional[dict]:
    """:func:`read_bundle`, its buckets checked against their manifest (:func:`verified_bucket_manifest`,
    which names the bucket) and every file against its sha256; ValueError naming the first
    difference, or a symbolic link or special file inside it. Nothing is loaded unverified: a
    directory without bundle.json is refused, but for a --length-buckets export of a version
    before bundles, verified by its own manifest (then None)."""
    files_inside(directory)  # before any file of it is opened: none may lead outside it
    manifest = read_bundle(directory)
    if manifest is None:
        if not is_bucket_export(directory):
            raise ValueError(f"not a fairseq-rope-export bundle (no {BUNDLE})")
        verified_bucket_manifest(directory)
        return None
    if is_bucket_export(directory):
        verified_bucket_manifest(directory)
    problem = bundle_problem(directory, manifest)
    if problem:
        raise ValueError(f"the bundle does not match its manifest: {problem}")
    return manifest


def bundle_segmentation(directory, manifest: dict, flag="--model-dir") -> Optional[Segmentation]:
    """The segmentation a bundle holds (its files inside ``directory``), or None for a model-only one."""
    record = manifest["segmentation"]
    if record is None:
        return None
    paths = {role: Path(directory) / record[role] for role in _roles(record["bpe"])}
    threshold = record.get("vocabulary_threshold", 50)
    return Segmentation(source=manifest["source_language"], target=manifest["target_language"],
                        tokenize=record["tokenizer"] is not None, bpe_type=record["bpe"], codes=paths.get("codes"),
                        vocabulary=paths.get("vocabulary"), spm_model=paths.get("model"),
                        vocabulary_threshold=threshold if isinstance(threshold, int) else 50,
                        origin=f"{flag} {directory}", remedy="export the bundle again with fairseq-rope-export")


def bundle_holds(manifest: Optional[dict], source: str, target: str, segmentation: Optional[Segmentation]) -> bool:
    """Whether ``manifest`` records these languages and this very segmentation (its files' sha256
    included): what an export of the same checkpoint from the same work dir would write."""
    if manifest is None or (manifest["source_language"], manifest["target_language"]) != (source, target):
        return False
    if segmentation is None:
        return manifest["segmentation"] is None
    return manifest["segmentation"] == segmentation_record(segmentation) and all(
        manifest["files"].get(name) == file_fingerprint(path)[1]
        for name, path in bundle_file_names(segmentation).items())
