"""A fairseq model as a CTranslate2 ``TransformerSpec``: what the engine can represent (every
other option refused in one line naming its flag), our rotation as the spec's rotary settings and
scaling, and the weights copied with CTranslate2's own fairseq converter helpers."""

from fairseq_rope.model_options import registered_model_name
from fairseq_rope.modules.rotary import rotary_dim_for
from fairseq_rope.training_lengths import training_length
from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy.ctranslate2_scaling import (
    ExportedScaling,
    ctranslate2_rotary_scaling,
    set_rotary_scaling,
)


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
        rotary_scaling(args)


def rotary_scaling(args) -> ExportedScaling:
    """The model's --rope-scaling as CTranslate2 computes it; UserError where it cannot."""
    rotary_dim = rotary_dim_for(args.encoder_embed_dim // args.encoder_attention_heads, args.rope_fraction)
    return ctranslate2_rotary_scaling(args.rope_scaling, args.rope_scaling_factor, rotary_dim, args.rope_theta,
                                      training_length(args))


def rotary_settings(args, head_dim):
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
        **rotary_settings(args, args.encoder_embed_dim // args.encoder_attention_heads),
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
        set_rotary_scaling(spec, rotary_scaling(args))
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
