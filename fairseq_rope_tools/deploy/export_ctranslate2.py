#!/usr/bin/env python3
"""Export a fairseq translation checkpoint to a CTranslate2 model directory: a bundle that holds
everything fairseq-rope-translate needs.

    fairseq-rope-export --checkpoint checkpoints/avg_last5.pt \\
        --data-bin work/wmt14_en_de/data-bin --output-dir ct2/wmt14_en_de [--quantization int8]

The bundle (fairseq_rope_tools.deploy.exported): the model, and, from the work directory
prepare.sh wrote (``--work-dir``, by default the data-bin's parent when prepare.sh wrote it), the
source segmentation -- subword-nmt ``bpe.codes`` and ``bpe.vocab.SRC`` with the vocabulary
threshold, or sentencepiece ``spm.model`` -- and ``bundle.json``: the languages, the
tokenisation and BPE settings, and the sha256 of every file, which fairseq-rope-translate
verifies before it loads anything. Without a work dir the bundle holds the model only (raw text
then needs fairseq-rope-translate --work-dir). The BPE must be the one the data-bin was binarized
with (as data-bin/.done records it).

Converts ``transformer_rope*`` checkpoints (either ``--rope-layout``, any ``--rope-fraction`` and
``--rope-theta``, and the ``--rope-scaling`` kinds CTranslate2 can compute: ``linear``, and ``yarn``
as CTranslate2's ``Su`` scaling with its logit temperature folded into the query and key
projections; see fairseq_rope_tools.deploy.ctranslate2_scaling) and stock fairseq ``transformer*``
checkpoints (sinusoidal or learned positions), so that both can be compared in the same engine. The
encoder and decoder specs are built directly: CTranslate2 rotates queries and keys in
self-attention by ``rotary_dim`` channels, pairing adjacent channels (``rotary_interleave``,
our ``interleaved``) or halves (our ``half``), with base ``rotary_base`` (``--rope-theta``); the
layer weights are copied with CTranslate2's own fairseq converter helpers. Decoding starts from
fairseq's ``</s>`` and appends ``</s>`` to each source, as fairseq does, so
``ctranslate2.Translator(OUT).translate_batch([tokens, ...])`` takes sources as the fairseq
dictionary's tokens, with nothing added by the caller.

``--length-buckets [S ...]`` writes, for inputs longer than in training, the plain model and one
static-yarn model per factor S (default 1.5 2 3 4) at the training length L the checkpoint recorded,
each an export of its own, into one directory with ``length_buckets.json``; fairseq-rope-translate
sends each sentence to the model of its length, as ``--rope-scaling dynamic-yarn`` would scale it.

A model the engine cannot represent (rotary cross-attention, RoPER, linear attention, ntk or
the per-sentence scalings, Shaw relative positions, ...) is refused before anything is written, with one line
that names the flag; so is a checkpoint that cannot be loaded, or a data-bin whose dictionaries
do not fit its embeddings.

The output rule: the export replaces only what it wrote. ``--output-dir`` must be a new path;
with ``--force`` it may also be an empty directory or an earlier export, recognised by its
``export_info.json`` and ``model.bin`` (and no file an export does not write). Any other
directory, one that holds the checkpoint or the data-bin above all, is refused in one line and
left as it is. The model is written into a hidden directory beside the output
(``.NAME.XXXXXXXX.tmp``) that takes its place in one rename when complete, as every tool here
replaces a directory (``fairseq_rope_files.replace_directory``); the export it replaces is
deleted last, and what a killed export left is removed by the next one to the same name.

``export_info.json`` records the checkpoint the model came from: its real path, and the size and
sha256 of the bytes that were converted (hashed before and after loading; a checkpoint replaced
meanwhile is refused), which ``--if-changed`` compares; the model's ``max_source_positions``,
``max_target_positions`` and training length L; and the sha256 of the vocabularies written.
``--if-changed`` also exports again a directory without a bundle (older versions), one whose
files do not match its manifest, and one whose segmentation is not the work dir's. Of a --length-buckets
export, ``--if-changed`` also checks every bucket's own ``export_info.json`` against the manifest
(fairseq_rope_tools.deploy.exported.verified_bucket_manifest): a bucket of another checkpoint, or
at another factor or L, is exported again, never kept.
"""

import argparse
import errno
import glob
import json
import math
import os
import sys
from typing import Optional

import fairseq_rope  # noqa: F401  (registers the models, allow-lists checkpoint types)
from fairseq_rope.checkpoints import is_readable_checkpoint
from fairseq_rope.config_values import OptionError
from fairseq_rope.initialization import ORIGIN
from fairseq_rope.model_options import model_config, registered_model_name
from fairseq_rope.modules.rotary import rotary_dim_for
from fairseq_rope.plugin_options import INFERENCE, PLUGIN_OPTIONS, options_with_role
from fairseq_rope.training_lengths import training_length
from fairseq_rope_files import file_fingerprint, outputs_over_inputs_problem, replace_directory
from fairseq_rope_tools.cli import UserError, add_version_argument, command
from fairseq_rope_tools.deploy.ctranslate2_scaling import (
    ExportedScaling,
    ctranslate2_rotary_scaling,
    set_rotary_scaling,
)
from fairseq_rope_tools.deploy.exported import (
    EXPORT_INFO,
    LENGTH_BUCKETS,
    bucket_overrides,
    bundle_file_names,
    bundle_holds,
    is_bundle_entry,
    read_bucket_manifest,
    read_bundle,
    read_export_info,
    verified_bucket_manifest,
    verified_bundle,
    vocabulary_digests,
    write_bundle,
)
from fairseq_rope_tools.deploy.segmentation import Segmentation
from fairseq_rope_tools.deploy.work_dir import (
    bpe_type_of,
    data_bin_bpe_problem,
    has_bpe_step,
    languages_of,
    segmentation_of,
)

QUANTIZATIONS = ("none", "int8", "int8_float32", "float16", "bfloat16")
DEFAULT_BUCKET_FACTORS = (1.5, 2.0, 3.0, 4.0)
PLAIN_BUCKET = "plain"
# what an export holds: CTranslate2's files for a translation model (.txt: older versions), and ours
EXPORT_FILES = frozenset({"model.bin", "config.json", EXPORT_INFO} | {
    f"{kind}vocabulary.{ext}" for kind in ("", "shared_", "source_", "target_") for ext in ("json", "txt")})


def check_exportable(args) -> None:
    """Raise UserError for the first option CTranslate2 cannot represent exactly."""
    from ctranslate2.converters.fairseq import _SUPPORTED_ACTIVATIONS

    name = registered_model_name(args.arch)
    refusals = [
        (name not in ("transformer", "transformer_rope"),
         f"--arch {args.arch} ({name}): only transformer and transformer_rope models can be exported "
         "(CTranslate2 has no Shaw relative positions and no other fairseq model here)"),
        (getattr(args, "rope_cross_attention", False),
         "--rope-cross-attention: CTranslate2 applies rotary embeddings in self-attention only"),
        (getattr(args, "rope_values", False), "--rope-values: CTranslate2 does not rotate values (RoPER)"),
        (getattr(args, "attention_kind", "softmax") != "softmax",
         f"--attention-kind {getattr(args, 'attention_kind', None)}: CTranslate2 has softmax attention only"),
        (name == "transformer" and getattr(args, "no_token_positional_embeddings", False),
         "--no-token-positional-embeddings: CTranslate2 would add sinusoidal positions to this model"),
        (getattr(args, "activation_fn", "relu") not in _SUPPORTED_ACTIVATIONS,
         f"--activation-fn {getattr(args, 'activation_fn', None)}: CTranslate2 supports "
         f"{', '.join(_SUPPORTED_ACTIVATIONS)}"),
        (args.encoder_normalize_before != args.decoder_normalize_before,
         "--encoder-normalize-before and --decoder-normalize-before differ: CTranslate2 takes one setting for both"),
        (args.encoder_attention_heads != args.decoder_attention_heads,
         "--encoder-attention-heads and --decoder-attention-heads differ: CTranslate2 takes one number for both"),
        (getattr(args, "decoder_output_dim", args.decoder_embed_dim) != args.decoder_embed_dim
         or getattr(args, "decoder_input_dim", args.decoder_embed_dim) != args.decoder_embed_dim,
         "--decoder-output-dim / --decoder-input-dim differ from --decoder-embed-dim: not exported"),
        (bool(getattr(args, "adaptive_softmax_cutoff", None)), "--adaptive-softmax-cutoff: not exported"),
        (getattr(args, "cross_self_attention", False), "--cross-self-attention: not exported"),
        (getattr(args, "no_cross_attention", False), "--no-cross-attention: not exported"),
    ]
    for refused, reason in refusals:
        if refused:
            raise UserError(reason)
    if name == "transformer_rope":
        _rotary_scaling(args)


def _rotary_scaling(args) -> ExportedScaling:
    """The model's --rope-scaling as CTranslate2 computes it; UserError where it cannot."""
    rotary_dim = rotary_dim_for(args.encoder_embed_dim // args.encoder_attention_heads, args.rope_fraction)
    return ctranslate2_rotary_scaling(args.rope_scaling, args.rope_scaling_factor, rotary_dim, args.rope_theta,
                                      training_length(args))


def _rotary_settings(args, head_dim):
    """The CTranslate2 spec arguments of our rotation without its scaling (none for a stock model)."""
    if registered_model_name(args.arch) != "transformer_rope":
        return {}
    return dict(
        rotary_dim=rotary_dim_for(head_dim, args.rope_fraction),
        rotary_interleave=args.rope_layout == "interleaved",
        rotary_base=float(args.rope_theta),
    )


def build_spec(args, model, task):
    from ctranslate2.converters import fairseq as ct2_fairseq
    from ctranslate2.specs import transformer_spec

    activation = ct2_fairseq._SUPPORTED_ACTIVATIONS[getattr(args, "activation_fn", "relu")]
    common = dict(
        pre_norm=args.encoder_normalize_before,
        activation=activation,
        layernorm_embedding=getattr(args, "layernorm_embedding", False),
        **_rotary_settings(args, args.encoder_embed_dim // args.encoder_attention_heads),
    )
    spec = transformer_spec.TransformerSpec(
        transformer_spec.TransformerEncoderSpec(args.encoder_layers, args.encoder_attention_heads, **common),
        transformer_spec.TransformerDecoderSpec(args.decoder_layers, args.decoder_attention_heads, **common),
    )
    for side_spec, module in ((spec.encoder, model.encoder), (spec.decoder, model.decoder)):
        _set_inputs(side_spec, module, ct2_fairseq)
        for layer_spec, layer in zip(side_spec.layer, module.layers):
            if module is model.encoder:
                ct2_fairseq.set_transformer_encoder_layer(layer_spec, layer)
            else:
                ct2_fairseq.set_transformer_decoder_layer(layer_spec, layer)
        if module.layer_norm is not None:
            ct2_fairseq.set_layer_norm(side_spec.layer_norm, module.layer_norm)
        if module.layernorm_embedding is not None:
            ct2_fairseq.set_layer_norm(side_spec.layernorm_embedding, module.layernorm_embedding)
    if registered_model_name(args.arch) == "transformer_rope":  # after the weights: the logit multiplier is in them
        set_rotary_scaling(spec, _rotary_scaling(args))
    ct2_fairseq.set_linear(spec.decoder.projection, model.decoder.output_projection)
    spec.register_source_vocabulary(ct2_fairseq._get_vocab(task.source_dictionary))
    spec.register_target_vocabulary(ct2_fairseq._get_vocab(task.target_dictionary))
    spec.config.decoder_start_token = spec.config.eos_token  # fairseq starts decoding from </s>
    spec.config.add_source_eos = True  # and ends every source with </s>
    return spec


def _set_inputs(spec, module, ct2_fairseq):
    """The converter's set_input_layers, except that a RoPE model has no position table."""
    ct2_fairseq.set_embeddings(spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings,
                               module.embed_tokens)
    spec.scale_embeddings = module.embed_scale
    if module.embed_positions is not None:
        ct2_fairseq.set_position_encodings(spec.position_encodings, module.embed_positions)


def _checkpoint_identity(path):
    """The file's real path, and the size and sha256 of the bytes read now."""
    size, sha256 = file_fingerprint(path)
    return {"checkpoint": os.path.realpath(path), "size": int(size), "sha256": sha256}


def is_current(output_dir, checkpoint, quantization="none", overrides=None, length_buckets=None, data_bin=None,
               work_dir=None) -> bool:
    """``output_dir`` is a complete export of this very checkpoint (size and sha256), with the same
    quantization, inference overrides and length buckets, and records the model's length limits (an
    export from before they were recorded is not current). Of a --length-buckets export, every
    bucket's own export_info.json must agree with the manifest (a bucket from another checkpoint, or
    at another factor, is not current). Given ``data_bin``, the export must also be a bundle whose
    files match its manifest and which holds the segmentation an export would bundle now
    (:func:`bundled_segmentation`): an export from before bundles, or of another BPE, is not current."""
    try:
        if length_buckets:
            manifest = verified_bucket_manifest(output_dir)
            if [b["factor"] for b in manifest["buckets"]] != [1.0, *length_buckets]:
                return False
            info, complete = manifest, True
        else:
            info = read_export_info(output_dir)
            complete = os.path.isfile(os.path.join(output_dir, "model.bin"))
        if data_bin is not None:
            src, tgt = languages_of(data_bin)
            expected = bundled_segmentation(data_bin, work_dir, src, tgt) if src else None
            if src is None or not bundle_holds(verified_bundle(output_dir), src, tgt, expected):
                return False
    except (OSError, ValueError, UserError):  # UserError: no segmentation to compare with; export to say why
        return False
    if not complete or "max_source_positions" not in info:
        return False
    if (info.get("quantization"), info.get("overrides", {}), info.get("size")) != (
            quantization, overrides or {}, os.path.getsize(checkpoint)):
        return False
    return info.get("sha256") == _checkpoint_identity(checkpoint)["sha256"]


# --- the output rule: replace only an earlier export ------------------------------------------
def _is_export(directory) -> bool:
    """An export this tool wrote: export_info.json and model.bin, and no file it does not write
    (its bundle's included); or a --length-buckets export: its manifest and the exports it lists,
    nothing else."""
    try:
        entries = list(os.scandir(directory))
        if os.path.isfile(os.path.join(directory, LENGTH_BUCKETS)):
            buckets = {b["directory"] for b in read_bucket_manifest(directory)["buckets"]}
            return all(e.name == LENGTH_BUCKETS or (is_bundle_entry(e.name) and e.is_file(follow_symlinks=False))
                       or (e.name in buckets and e.is_dir(follow_symlinks=False) and _is_export(e.path))
                       for e in entries)
        info = read_export_info(directory)
    except (OSError, ValueError):  # read_bucket_manifest checks the manifest's shape: a ValueError
        return False
    return ("sha256" in info and os.path.isfile(os.path.join(directory, "model.bin"))
            and all((e.name in EXPORT_FILES or is_bundle_entry(e.name)) and e.is_file(follow_symlinks=False)
                    for e in entries))


def check_output_dir(output_dir, inputs: dict, force) -> None:
    """Raise UserError unless ``output_dir`` may be written: a new path; with ``force``, an
    empty directory or an earlier export. Never an input (``inputs``: flag -> path), or a
    directory that holds one."""
    flag = f"--output-dir {output_dir}"
    problem = outputs_over_inputs_problem({"--output-dir": output_dir}, inputs)
    if problem:
        raise UserError(problem)
    target = os.path.realpath(output_dir)
    if not os.path.lexists(target):
        return
    if not os.path.isdir(target):
        raise UserError(f"{flag} is a file, not a directory: choose a new directory or an earlier export")
    if os.listdir(target) and not _is_export(target):
        raise UserError(f"{flag} is not an export (one holds export_info.json, model.bin and CTranslate2's "
                        "files, nothing else): nothing in it is replaced; choose a new or empty directory")
    if not force:
        raise UserError(f"{flag} exists: pass --force to replace it")


def _write_failure(output_dir, error: OSError) -> str:
    advice = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space",
              errno.EACCES: "make its parent writable", errno.EPERM: "make its parent writable",
              errno.EROFS: "choose a writable file system"}.get(error.errno, "check it")
    reason = error.strerror or str(error)
    return f"--output-dir {output_dir}: cannot write it ({reason}): {advice}, or choose another --output-dir"


def write_model_dir(model_dir, write_model, info) -> None:
    """One export in the new directory ``model_dir``: CTranslate2's files and export_info.json,
    which records the vocabularies written (``vocabulary``); returns what it records."""
    converted = os.path.join(model_dir, "model")  # CTranslate2 makes the directory it writes
    write_model(converted)
    for name in os.listdir(converted):
        os.rename(os.path.join(converted, name), os.path.join(model_dir, name))
    os.rmdir(converted)
    info = dict(info, vocabulary=vocabulary_digests(model_dir))
    with open(os.path.join(model_dir, EXPORT_INFO), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    return info


def write_export(output_dir, write_all, inputs, force) -> str:
    """What ``write_all(dir)`` writes, as one directory that takes ``output_dir``'s place when
    complete (:func:`~fairseq_rope_files.replace_directory`): an export it replaces is kept
    until then. Returns the real path."""

    def write(tmp):
        write_all(tmp)
        check_output_dir(output_dir, inputs, force)  # again: the conversion took a while

    try:
        replace_directory(output_dir, write)
    except OSError as e:
        raise UserError(_write_failure(output_dir, e)) from e
    return os.path.realpath(output_dir)


# --- the inputs -------------------------------------------------------------------------------
def bundled_segmentation(data_bin, work_dir, src, tgt) -> Optional[Segmentation]:
    """The segmentation the export bundles: prepare.sh's in ``work_dir`` (--work-dir), by default
    in the data-bin's parent when prepare.sh wrote it there (bpe/.done); None when there is none.
    UserError when it is incomplete, or not the BPE the data-bin was binarized with."""
    flag = "--work-dir"
    if work_dir is None:
        work_dir = os.path.dirname(os.path.realpath(data_bin))
        if not has_bpe_step(work_dir):
            return None
        flag = "--data-bin's work dir"
    bpe_type = bpe_type_of(data_bin, work_dir)
    if bpe_type is None and has_bpe_step(work_dir):  # (without the step, segmentation_of says so)
        raise UserError(f"{flag} {work_dir}: cannot tell the BPE kind (no bpe_type in --data-bin {data_bin}, no BPE "
                        "in bpe/.done): rerun prepare.sh")
    segmentation = segmentation_of(work_dir, src, tgt, bpe_type, flag=flag)
    problem = data_bin_bpe_problem(data_bin, segmentation)
    if problem:
        raise UserError(problem)
    return segmentation


def export_inputs(checkpoint, data_bin, segmentation: Optional[Segmentation]) -> dict:
    """What the export reads, by flag: no output may be one of them, or hold one."""
    inputs = {"--checkpoint": checkpoint, "--data-bin": data_bin}
    for path in bundle_file_names(segmentation).values() if segmentation else ():
        inputs[f"the work dir's bpe/{os.path.basename(path)}"] = path
    return inputs


def load_checkpoint(checkpoint, data_bin, overrides):
    """The checkpoint's state and the identity of the bytes it was loaded from: hashed before and
    after loading, refused if they differ (replaced while it was read)."""
    from fairseq import checkpoint_utils

    flag = f"--checkpoint {checkpoint}"
    try:
        identity = _checkpoint_identity(checkpoint)
        state = checkpoint_utils.load_checkpoint_to_cpu(checkpoint,
                                                        arg_overrides={"data": data_bin, **(overrides or {})})
        unchanged = _checkpoint_identity(checkpoint)["sha256"] == identity["sha256"]
    except OptionError:
        raise
    except Exception as e:  # noqa: BLE001 - torch and fairseq raise anything on a bad file
        raise UserError(f"{flag} {_why_unloadable(checkpoint, e)}: pass a checkpoint written by fairseq-train "
                        "or fairseq-rope-average") from e
    if not unchanged:
        raise UserError(f"{flag} changed while it was read (is a training writing it?): export again "
                        "once it is written")
    if not isinstance(state.get("model"), dict) or model_config(state) is None:
        raise UserError(f"{flag} is not a fairseq checkpoint (no model weights or configuration)")
    return state, identity


def _why_unloadable(checkpoint, error) -> str:
    if isinstance(error, OSError) and error.strerror:
        return f"cannot be read ({error.strerror})"
    if not is_readable_checkpoint(checkpoint):  # a torch zip archive lacks its directory
        return "is not a complete checkpoint (empty, truncated, or not written by torch.save)"
    detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"cannot be loaded ({type(error).__name__}{': ' + detail if detail else ''})"


def setup_task(state, checkpoint, data_bin):
    """The translation task with the dictionaries of ``data_bin``, checked against the weights."""
    from fairseq import tasks

    flag, advice = f"--data-bin {data_bin}", f"pass the data-bin {checkpoint} was trained on"
    task_cfg = state["cfg"].task
    if not glob.glob(os.path.join(glob.escape(data_bin), "dict.*.txt")):
        raise UserError(f"{flag} holds no dictionary (dict.*.txt): {advice}")
    try:
        task = tasks.setup_task(task_cfg)
    except Exception as e:  # noqa: BLE001 - fairseq raises plain Exceptions on a bad data-bin
        raise UserError(f"{flag}: cannot read its dictionaries ({str(e).splitlines()[0]}): {advice}") from e
    for side, lang, dictionary in (("encoder", task.cfg.source_lang, task.source_dictionary),
                                   ("decoder", task.cfg.target_lang, task.target_dictionary)):
        rows = state["model"].get(f"{side}.embed_tokens.weight")
        if rows is not None and rows.shape[0] != len(dictionary):
            raise UserError(f"{flag} does not belong to --checkpoint {checkpoint}: its dict.{lang}.txt gives "
                            f"{len(dictionary)} tokens, the {side}'s embeddings have {rows.shape[0]}: {advice}")
    return task


def check_bucket_factors(factors) -> tuple:
    """--length-buckets' factors, sorted: each a finite number > 1, none twice."""
    for factor in factors:
        if not (math.isfinite(factor) and factor > 1.0):
            raise UserError(f"--length-buckets: each factor must be a number > 1 (sentences within the training "
                            f"length use the plain model), got {factor:g}")
    if len(set(factors)) != len(factors):
        raise UserError(f"--length-buckets: a factor is given twice ({' '.join(f'{f:g}' for f in factors)})")
    return tuple(sorted(factors))


def bucket_models(args, overrides, factors) -> list:
    """(factor, directory name, model configuration) of each bucket: plain RoPE, then static yarn
    at each factor with the training length L the checkpoint recorded (or --rope-scaling-original-length)."""
    flag_scaling = (overrides or {}).get("rope_scaling")
    if registered_model_name(args.arch) != "transformer_rope":
        raise UserError(f"--length-buckets: --arch {args.arch} has no rotary positions to scale")
    if flag_scaling not in (None, "dynamic-yarn") or (overrides or {}).get("rope_scaling_factor") is not None:
        raise UserError("--length-buckets exports plain RoPE and static yarn per bucket, as dynamic-yarn chooses "
                        "per sentence: drop --rope-scaling and --rope-scaling-factor (or give --rope-scaling "
                        "dynamic-yarn)")
    if flag_scaling is None and args.rope_scaling not in ("none", "dynamic-yarn"):
        raise UserError(f"--length-buckets: the checkpoint decodes with --rope-scaling {args.rope_scaling}; "
                        "buckets replace it by plain RoPE and static yarn: pass --rope-scaling dynamic-yarn to "
                        "mean that")
    length = training_length(args)
    if length <= 0:
        raise UserError("--length-buckets needs the training length L, which the checkpoint does not record: "
                        "pass --rope-scaling-original-length L")
    return [(factor, PLAIN_BUCKET if factor == 1.0 else f"yarn_x{factor:g}",
             _Overridden(args, **bucket_overrides(factor, length))) for factor in (1.0, *factors)]


def check_original_length(overrides) -> None:
    """--rope-scaling-original-length, when given, is a length: 0 (unset) or more tokens."""
    length = (overrides or {}).get("rope_scaling_original_length")
    if length is not None and length < 0:
        raise UserError(f"--rope-scaling-original-length {length} is not a valid length: give L, the training "
                        "length in tokens (> 0), or leave it out to use the one the checkpoint records")


class _Overridden:
    """A model configuration with some options replaced, the rest read from it."""

    def __init__(self, base, **values):
        self.__dict__.update(values, _base=base)

    def __getattr__(self, name):
        return getattr(self.__dict__["_base"], name)


def export(checkpoint, data_bin, output_dir, quantization="none", force=False, overrides=None, length_buckets=None,
           work_dir=None):
    """Convert ``checkpoint`` into the CTranslate2 directory ``output_dir``; returns its real path.
    ``overrides``: inference options, as ``--model-overrides`` takes them at generate time.
    ``force`` replaces an earlier export (or an empty directory), nothing else. ``length_buckets``:
    factors s > 1; the directory then holds the plain model and one static-yarn model per factor
    (:func:`bucket_models`) and their manifest, ``length_buckets.json``. Either is a bundle with
    the segmentation of ``work_dir`` (default: the data-bin's parent, when prepare.sh wrote it;
    :func:`bundled_segmentation`)."""
    import torch
    from ctranslate2.converters.converter import Converter

    factors = check_bucket_factors(length_buckets) if length_buckets else ()
    check_original_length(overrides)
    src, tgt = languages_of(data_bin)
    segmentation = bundled_segmentation(data_bin, work_dir, src, tgt) if src else None  # refused before loading
    check_output_dir(output_dir, export_inputs(checkpoint, data_bin, segmentation), force)
    state, identity = load_checkpoint(checkpoint, data_bin, overrides)
    args = model_config(state)
    buckets = bucket_models(args, overrides, factors) if factors else [(None, None, args)]
    for _, _, bucket_args in buckets:
        check_exportable(bucket_args)
    task = setup_task(state, checkpoint, data_bin)
    if src is None:  # a data-bin that records no languages: the task's
        src, tgt = task.cfg.source_lang, task.cfg.target_lang
        segmentation = bundled_segmentation(data_bin, work_dir, src, tgt)
    inputs = export_inputs(checkpoint, data_bin, segmentation)
    model = task.build_model(args)
    try:
        model.load_state_dict(state["model"], strict=True)
    except RuntimeError as e:
        raise UserError(f"--checkpoint {checkpoint}: its weights do not fit the model its configuration "
                        f"describes ({str(e).splitlines()[0]})") from e
    model.eval()
    weights = None if quantization == "none" else quantization

    def writer(model_args):
        class _Converter(Converter):
            def _load(self):
                with torch.no_grad():  # the helpers call .numpy() on the parameters
                    return build_spec(model_args, model, task)

        return lambda model_dir: _Converter().convert(model_dir, quantization=weights)

    info = dict(identity, data_bin=os.path.realpath(data_bin), quantization=quantization, arch=args.arch,
                overrides=overrides or {}, max_source_positions=args.max_source_positions,
                max_target_positions=args.max_target_positions, init_from=getattr(args, ORIGIN, None),
                training_length=training_length(args) if registered_model_name(args.arch) == "transformer_rope"
                else None)

    def write_single(tmp):
        write_model_dir(tmp, writer(args), info)
        write_bundle(tmp, src, tgt, segmentation)

    if not factors:
        return write_export(output_dir, write_single, inputs, force)

    def write_buckets(tmp):
        written = []
        for factor, name, bucket_args in buckets:
            os.mkdir(os.path.join(tmp, name))
            written.append(write_model_dir(os.path.join(tmp, name), writer(bucket_args), dict(
                info, overrides=bucket_overrides(factor, bucket_args.rope_scaling_original_length))))
        # every bucket holds the plain model's vocabularies: the manifest records them, as each bucket does
        manifest = dict(info, vocabulary=written[0]["vocabulary"],
                        training_length=buckets[0][2].rope_scaling_original_length, scaling="yarn",
                        buckets=[{"factor": factor, "directory": name} for factor, name, _ in buckets])
        with open(os.path.join(tmp, LENGTH_BUCKETS), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
        write_bundle(tmp, src, tgt, segmentation)

    return write_export(output_dir, write_buckets, inputs, force)


@command
def main(argv=None):
    p = argparse.ArgumentParser(prog="fairseq-rope-export", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version_argument(p)
    p.add_argument("--checkpoint", required=True, help="fairseq checkpoint (.pt), e.g. an average of the last 5")
    p.add_argument("--data-bin", required=True, help="the fairseq data-bin the model was trained on (dictionaries)")
    p.add_argument("--work-dir",
                   help="the directory prepare.sh wrote for the model, whose segmentation (tok/ and bpe/ steps) the "
                        "export bundles (default: the data-bin's parent, when prepare.sh wrote it; else the export "
                        "holds the model only)")
    p.add_argument("--output-dir", required=True,
                   help="CTranslate2 model directory to write: a new path (or, with --force, an empty directory "
                        "or an earlier export)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="weight type of the exported model (default: none, i.e. float32)")
    p.add_argument("--force", action="store_true",
                   help="replace --output-dir if it is an earlier export (export_info.json) or empty; any "
                        "other directory is refused")
    p.add_argument("--length-buckets", nargs="*", type=float, metavar="S",
                   help="export plain RoPE for sentences within the training length L and one static yarn model "
                        "per factor S for longer ones (default factors: "
                        f"{' '.join(f'{f:g}' for f in DEFAULT_BUCKET_FACTORS)}), into one directory with a manifest; "
                        "fairseq-rope-translate sends each sentence to the model of its length")
    p.add_argument("--if-changed", action="store_true",
                   help="do nothing when --output-dir already holds an export of this checkpoint (size and "
                        "sha256) with the same --quantization and scaling; otherwise export (with --force: over it)")
    # the plugin's inference options, as --model-overrides sets them at generate time
    rescaled = p.add_argument_group("decoding with rescaled frequencies (default: the checkpoint's)")
    inference_options = sorted(options_with_role(INFERENCE))
    for name in inference_options:
        rescaled.add_argument(PLUGIN_OPTIONS[name].flag, **PLUGIN_OPTIONS[name].argparse_kwargs(), default=None)
    args = p.parse_args(argv)
    overrides = {name: getattr(args, name) for name in inference_options if getattr(args, name) is not None}
    buckets = None
    if args.length_buckets is not None:
        buckets = check_bucket_factors(args.length_buckets or DEFAULT_BUCKET_FACTORS)
    check_original_length(overrides)
    if not os.path.isfile(args.checkpoint):
        raise UserError(f"--checkpoint {args.checkpoint} is not a file")
    if not os.path.isdir(args.data_bin):
        raise UserError(f"--data-bin {args.data_bin} is not a directory")
    if args.work_dir is not None and not os.path.isdir(args.work_dir):
        raise UserError(f"--work-dir {args.work_dir} is not a directory")
    if args.if_changed and is_current(args.output_dir, args.checkpoint, args.quantization, overrides, buckets,
                                      args.data_bin, args.work_dir):
        print(f"{args.output_dir} holds this checkpoint ({args.quantization}) already: nothing to do", file=sys.stderr)
        return
    out = export(args.checkpoint, args.data_bin, args.output_dir, args.quantization, args.force, overrides, buckets,
                 args.work_dir)
    kind = f", plain and yarn x{' x'.join(f'{f:g}' for f in buckets)}" if buckets else ""
    held = read_bundle(out)["segmentation"]
    print(f"wrote {out} ({args.quantization}{kind}): " + (
        f"a bundle with its segmentation ({held['bpe']})" if held else
        "the model only, no work dir of prepare.sh beside --data-bin: raw text will need fairseq-rope-translate "
        "--work-dir (or export with --work-dir)"), file=sys.stderr)


if __name__ == "__main__":
    main()
