#!/usr/bin/env python3
"""Export a fairseq translation checkpoint to a CTranslate2 model directory.

    python scripts/export_ctranslate2.py --checkpoint checkpoints/avg_last5.pt \\
        --data-bin data-bin/wmt14_en_de --output-dir ct2/wmt14_en_de [--quantization int8]

Converts ``transformer_rope*`` checkpoints (either ``--rope-layout``, any ``--rope-fraction`` and
``--rope-theta``, ``--rope-scaling linear``) and stock fairseq ``transformer*`` checkpoints
(sinusoidal or learned positions), so that both can be compared in the same engine. The
encoder and decoder specs are built directly: CTranslate2 rotates queries and keys in
self-attention by ``rotary_dim`` channels, pairing adjacent channels (``rotary_interleave``,
our ``interleaved``) or halves (our ``half``), with base ``rotary_base`` (``--rope-theta``); the
layer weights are copied with CTranslate2's own fairseq converter helpers. Decoding starts from
fairseq's ``</s>`` and appends ``</s>`` to each source, as fairseq does, so
``ctranslate2.Translator(OUT).translate_batch([tokens, ...])`` takes sources as the fairseq
dictionary's tokens, with nothing added by the caller.

A model the engine cannot represent (rotary cross-attention, RoPER, linear attention, ntk or
yarn scaling, Shaw relative positions, ...) is refused before anything is written, with one line
that names the flag. The output directory is written to a hidden temporary directory beside it
and renamed when complete; ``export_info.json`` inside records the checkpoint it came from.
"""

import argparse
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fairseq_rope  # noqa: E402,F401  (registers the models, allow-lists checkpoint types)
from fairseq_rope.atomic_files import current_umask  # noqa: E402
from fairseq_rope.model_options import OptionError, model_config, registered_model_name  # noqa: E402
from fairseq_rope.modules.rotary import DYNAMIC_SCALINGS  # noqa: E402

QUANTIZATIONS = ("none", "int8", "int8_float32", "float16", "bfloat16")
EXPORT_INFO = "export_info.json"


class ExportRefused(ValueError):
    """The checkpoint's model has something CTranslate2 cannot compute; the message names it."""


def check_exportable(args) -> None:
    """Raise ExportRefused for the first option CTranslate2 cannot represent exactly."""
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
        (getattr(args, "rope_scaling", "none") in DYNAMIC_SCALINGS,
         f"--rope-scaling {getattr(args, 'rope_scaling', None)}: the factor is chosen per sentence, and CTranslate2 "
         "has one rotary scaling for every sentence (export with none or linear)"),
        (getattr(args, "rope_scaling", "none") not in ("none", "linear"),
         f"--rope-scaling {getattr(args, 'rope_scaling', None)}: CTranslate2's rotary scalings do not include it "
         "(linear is exported)"),
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
            raise ExportRefused(reason)


def _rotary_settings(args, head_dim):
    """The CTranslate2 spec arguments that reproduce our rotation (none for a stock model)."""
    if registered_model_name(args.arch) != "transformer_rope":
        return {}
    from ctranslate2.specs import attention_spec

    from fairseq_rope.modules.rotary import rotary_dim_for

    settings = dict(
        rotary_dim=rotary_dim_for(head_dim, args.rope_fraction),
        rotary_interleave=args.rope_layout == "interleaved",
        rotary_base=float(args.rope_theta),
    )
    if args.rope_scaling == "linear" and args.rope_scaling_factor != 1.0:
        settings.update(rotary_scaling_type=attention_spec.RotaryScalingType.Linear,
                        rotary_scaling_factor=float(args.rope_scaling_factor))
    return settings


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
    stat = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return {"checkpoint": os.path.realpath(path), "size": stat.st_size, "sha256": digest.hexdigest()}


def is_current(output_dir, checkpoint, quantization="none", overrides=None) -> bool:
    """``output_dir`` is a complete export of this very checkpoint (size and sha256), with the same
    quantization and inference overrides."""
    info_path = os.path.join(output_dir, EXPORT_INFO)
    if not os.path.isfile(os.path.join(output_dir, "model.bin")) or not os.path.isfile(info_path):
        return False
    try:
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return False
    if (info.get("quantization"), info.get("overrides", {}), info.get("size")) != (
            quantization, overrides or {}, os.path.getsize(checkpoint)):
        return False
    return info.get("sha256") == _checkpoint_identity(checkpoint)["sha256"]


def export(checkpoint, data_bin, output_dir, quantization="none", force=False, overrides=None):
    """Convert ``checkpoint`` into the CTranslate2 directory ``output_dir``; returns its path.
    ``overrides``: inference options, as ``--model-overrides`` takes them at generate time."""
    import torch
    from ctranslate2.converters.converter import Converter
    from fairseq import checkpoint_utils, tasks

    output_dir = os.path.abspath(output_dir)
    if os.path.exists(output_dir) and not force:
        raise FileExistsError(f"--output-dir {output_dir} exists: pass --force to replace it")
    state = checkpoint_utils.load_checkpoint_to_cpu(checkpoint, arg_overrides={"data": data_bin, **(overrides or {})})
    args = model_config(state)
    check_exportable(args)
    task = tasks.setup_task(state["cfg"].task)
    model = task.build_model(args)
    model.load_state_dict(state["model"], strict=True)
    model.eval()

    class _Converter(Converter):
        def _load(self):
            with torch.no_grad():  # the helpers call .numpy() on the parameters
                return build_spec(args, model, task)

    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.", suffix=".tmp", dir=parent)
    try:
        _Converter().convert(tmp, quantization=None if quantization == "none" else quantization, force=True)
        info = dict(_checkpoint_identity(checkpoint), data_bin=os.path.realpath(data_bin),
                    quantization=quantization, arch=args.arch, overrides=overrides or {})
        with open(os.path.join(tmp, EXPORT_INFO), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1)
        os.chmod(tmp, 0o777 & ~current_umask())
        if os.path.exists(output_dir):  # --force: swap, then remove the old one
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.", suffix=".old", dir=parent)
            os.rename(output_dir, os.path.join(old, "model"))
            os.rename(tmp, output_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, output_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output_dir


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="fairseq checkpoint (.pt), e.g. an average of the last 5")
    p.add_argument("--data-bin", required=True, help="the fairseq data-bin the model was trained on (dictionaries)")
    p.add_argument("--output-dir", required=True, help="CTranslate2 model directory to write")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="weight type of the exported model (default: none, i.e. float32)")
    p.add_argument("--force", action="store_true", help="replace --output-dir if it exists")
    p.add_argument("--if-changed", action="store_true",
                   help="do nothing when --output-dir already holds an export of this checkpoint (size and "
                        "sha256) with the same --quantization and scaling; otherwise export (with --force: over it)")
    p.add_argument("--rope-scaling", help="decode with rescaled frequencies, as --model-overrides does at "
                                          "generate time (CTranslate2 has linear)")
    p.add_argument("--rope-scaling-factor", type=float)
    p.add_argument("--rope-scaling-original-length", type=int)
    args = p.parse_args(argv)
    overrides = {name: getattr(args, name) for name in
                 ("rope_scaling", "rope_scaling_factor", "rope_scaling_original_length") if getattr(args, name) is not None}
    if not os.path.isfile(args.checkpoint):
        p.exit(2, f"{p.prog}: error: --checkpoint {args.checkpoint} is not a file\n")
    if not os.path.isdir(args.data_bin):
        p.exit(2, f"{p.prog}: error: --data-bin {args.data_bin} is not a directory\n")
    if args.if_changed and is_current(args.output_dir, args.checkpoint, args.quantization, overrides):
        print(f"{args.output_dir} holds this checkpoint ({args.quantization}) already: nothing to do", file=sys.stderr)
        return
    # SIGTERM unwinds like Ctrl-C: the temporary directory is removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        out = export(args.checkpoint, args.data_bin, args.output_dir, args.quantization, args.force, overrides)
    except (ExportRefused, OptionError, FileExistsError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(f"wrote {out} ({args.quantization})", file=sys.stderr)


if __name__ == "__main__":
    main()
