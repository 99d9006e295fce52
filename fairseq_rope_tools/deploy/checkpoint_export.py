"""What fairseq-rope-export does, as a library: a checkpoint and its data-bin read and checked, the
model converted to a CTranslate2 directory (or one per length bucket) or to the ONNX engine's graphs,
bundled with the work dir's segmentation (:func:`export`); and whether a directory already holds
that export (:func:`is_current`). The command's documentation says the rules (export_ctranslate2.py)."""

import glob
import json
import math
import os
from typing import Optional

import fairseq_rope  # noqa: F401  (registers the models, allow-lists checkpoint types)
from fairseq_rope.checkpoint_files import is_readable_checkpoint, model_config
from fairseq_rope.config_values import OptionError
from fairseq_rope.initialization import ORIGIN
from fairseq_rope.model_options import registered_model_name
from fairseq_rope.training_lengths import training_length
from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy.ctranslate2_spec import build_spec, check_exportable
from fairseq_rope_tools.deploy.export_output import (
    check_output_dir,
    checkpoint_identity,
    has_model_files,
    write_export,
    write_model_dir,
)
from fairseq_rope_tools.deploy.exported import (
    CTRANSLATE2_MODEL_FORMAT,
    LENGTH_BUCKETS,
    MODEL_FILES,
    ONNX_MODEL_FORMAT,
    bucket_overrides,
    bundle_file_names,
    bundle_holds,
    read_export_info,
    verified_bucket_manifest,
    verified_bundle,
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
#: what fairseq-rope-export writes: a model for the engine that reads that format (engines.py)
FORMATS = tuple(MODEL_FILES)
DEFAULT_BUCKET_FACTORS = (1.5, 2.0, 3.0, 4.0)
PLAIN_BUCKET = "plain"


def is_current(output_dir, checkpoint, quantization="none", overrides=None, length_buckets=None, data_bin=None,
               work_dir=None, model_format=CTRANSLATE2_MODEL_FORMAT) -> bool:
    """``output_dir`` is a complete export of this very checkpoint (size and sha256), in the same
    format, with the same quantization, inference overrides and length buckets, and records the
    model's length limits (an export from before they were recorded is not current). Of a
    --length-buckets export, every bucket's own export_info.json must agree with the manifest (a
    bucket from another checkpoint, or at another factor, is not current). Given ``data_bin``,
    the export must also be a bundle whose files match its manifest and which holds the
    segmentation an export would bundle now (:func:`bundled_segmentation`): an export from before
    bundles, or of another BPE, is not current."""
    try:
        if length_buckets:
            manifest = verified_bucket_manifest(output_dir)
            if [b["factor"] for b in manifest["buckets"]] != [1.0, *length_buckets]:
                return False
            info, complete = manifest, True
        else:
            info = read_export_info(output_dir)
            complete = has_model_files(output_dir, info)
        if data_bin is not None:
            src, tgt = languages_of(data_bin)
            expected = bundled_segmentation(data_bin, work_dir, src, tgt) if src else None
            if src is None or not bundle_holds(verified_bundle(output_dir), src, tgt, expected):
                return False
    except (OSError, ValueError, UserError):  # UserError: no segmentation to compare with; export to say why
        return False
    if not complete or "max_source_positions" not in info:
        return False
    recorded = (info.get("format", CTRANSLATE2_MODEL_FORMAT), info.get("quantization"), info.get("overrides", {}),
                info.get("size"))
    if recorded != (model_format, quantization, overrides or {}, os.path.getsize(checkpoint)):
        return False
    return info.get("sha256") == checkpoint_identity(checkpoint)["sha256"]


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


def load_identified_checkpoint(checkpoint, data_bin, overrides):
    """The checkpoint's state and the identity of the bytes it was loaded from: hashed before and
    after loading, refused if they differ (replaced while it was read)."""
    from fairseq import checkpoint_utils

    flag = f"--checkpoint {checkpoint}"
    try:
        identity = checkpoint_identity(checkpoint)
        state = checkpoint_utils.load_checkpoint_to_cpu(checkpoint,
                                                        arg_overrides={"data": data_bin, **(overrides or {})})
        unchanged = checkpoint_identity(checkpoint)["sha256"] == identity["sha256"]
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


def check_format(model_format, quantization="none", length_buckets=None) -> None:
    """UserError for what the ONNX export does not write: quantized weights, length buckets."""
    if model_format == ONNX_MODEL_FORMAT and quantization != "none":
        raise UserError(f"--quantization {quantization}: the ONNX export writes float32 weights; leave it out with "
                        "--format onnx")
    if model_format == ONNX_MODEL_FORMAT and length_buckets:
        raise UserError("--length-buckets: the ONNX export writes one model; export length buckets with --format "
                        "ctranslate2")


def check_exportable_as(model_format, args) -> None:
    """UserError for the options of the model the format cannot represent (ONNX: all of them at once)."""
    if model_format == CTRANSLATE2_MODEL_FORMAT:
        check_exportable(args)
        return
    from fairseq_rope_tools.deploy.onnx_graphs import onnx_export_refusals

    refusals = onnx_export_refusals(args)
    if refusals:
        raise UserError("cannot export to ONNX: " + "; ".join(refusals))


def export(checkpoint, data_bin, output_dir, quantization="none", force=False, overrides=None, length_buckets=None,
           work_dir=None, model_format=CTRANSLATE2_MODEL_FORMAT):
    """Convert ``checkpoint`` into the CTranslate2 directory (``model_format`` "onnx": the ONNX
    engine's graphs) ``output_dir``; returns its real path.
    ``overrides``: inference options, as ``--model-overrides`` takes them at generate time.
    ``force`` replaces an earlier export (or an empty directory), nothing else. ``length_buckets``:
    factors s > 1; the directory then holds the plain model and one static-yarn model per factor
    (:func:`bucket_models`) and their manifest, ``length_buckets.json``. Either is a bundle with
    the segmentation of ``work_dir`` (default: the data-bin's parent, when prepare.sh wrote it;
    :func:`bundled_segmentation`)."""
    import torch

    check_format(model_format, quantization, length_buckets)
    factors = check_bucket_factors(length_buckets) if length_buckets else ()
    check_original_length(overrides)
    src, tgt = languages_of(data_bin)
    segmentation = bundled_segmentation(data_bin, work_dir, src, tgt) if src else None  # refused before loading
    check_output_dir(output_dir, export_inputs(checkpoint, data_bin, segmentation), force)
    state, identity = load_identified_checkpoint(checkpoint, data_bin, overrides)
    args = model_config(state)
    buckets = bucket_models(args, overrides, factors) if factors else [(None, None, args)]
    for _, _, bucket_args in buckets:
        check_exportable_as(model_format, bucket_args)
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
        if model_format == ONNX_MODEL_FORMAT:
            from fairseq_rope_tools.deploy.onnx_graphs import write_onnx_model

            def write_onnx(model_dir):
                os.mkdir(model_dir)
                write_onnx_model(model, model_args, task, model_dir)

            return write_onnx
        from ctranslate2.converters.converter import Converter

        class _Converter(Converter):
            def _load(self):
                with torch.no_grad():  # the helpers call .numpy() on the parameters
                    return build_spec(model_args, model, task)

        return lambda model_dir: _Converter().convert(model_dir, quantization=weights)

    info = dict(identity, format=model_format, data_bin=os.path.realpath(data_bin), quantization=quantization,
                arch=args.arch, overrides=overrides or {}, max_source_positions=args.max_source_positions,
                max_target_positions=args.max_target_positions, init_from=getattr(args, ORIGIN, None),
                training_length=training_length(args) if registered_model_name(args.arch) == "transformer_rope"
                else None)

    def write_single(tmp):
        write_model_dir(tmp, writer(args), info)
        # CTranslate2's bundles declare no format, as before the declaration: older versions read them
        write_bundle(tmp, src, tgt, segmentation, None if model_format == CTRANSLATE2_MODEL_FORMAT else model_format)

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
