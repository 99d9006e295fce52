"""One Transformer for every position scheme of the plugin.

fairseq's encoder, decoder and layers, unchanged but for their attentions, which an
:class:`AttentionFactory` named by the model makes. ``transformer_rope`` and ``transformer_rpe``
are this model with a different factory and different options.
"""

from fairseq.distributed import fsdp_wrap
from fairseq.models import ARCH_CONFIG_REGISTRY, MODEL_REGISTRY
from fairseq.models.transformer import TransformerConfig, TransformerDecoder, TransformerEncoder, TransformerModel
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from ..config_values import OptionError
from ..initialization import drop_token_positions
from ..modules.rotary import sequence_lengths
from ..plugin_options import add_plugin_args, check_plugin_options, fill_plugin_defaults


class AttentionFactory:
    """Makes the attentions of one model from its options. ``kwargs`` are what fairseq passes
    to its own ``MultiheadAttention`` (dropout, self_attention, kdim, q_noise, ...)."""

    #: whether attentions need each row's source length (set on them by the decoder layer)
    needs_source_lengths = False

    def __init__(self, args):
        self.args = args

    def self_attention(self, side: str, embed_dim: int, num_heads: int, **kwargs):
        """Self-attention of the ``side`` ('encoder' or 'decoder')."""
        raise NotImplementedError

    def encoder_decoder_attention(self, embed_dim: int, num_heads: int, **kwargs):
        """Encoder-decoder attention, or None for fairseq's own."""
        return None


def wrap_layer(layer, cfg):
    """Activation checkpointing and FSDP wrapping, as fairseq applies them to its own layers."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


class PositionalEncoderLayer(TransformerEncoderLayerBase):
    def __init__(self, cfg, attentions: AttentionFactory, return_fc=False):
        self.attentions = attentions  # read by build_self_attention during the base constructor
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        return self.attentions.self_attention(
            "encoder", embed_dim, cfg.encoder.attention_heads, dropout=cfg.attention_dropout,
            self_attention=True, q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size,
        )


class PositionalDecoderLayer(TransformerDecoderLayerBase):
    def __init__(self, cfg, attentions: AttentionFactory, no_encoder_attn=False):
        self.attentions = attentions  # read by the build_* methods during the base constructor
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        return self.attentions.self_attention(
            "decoder", embed_dim, cfg.decoder.attention_heads, dropout=cfg.attention_dropout,
            add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, self_attention=True,
            q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size,
        )

    def build_encoder_attention(self, embed_dim, cfg):
        attention = self.attentions.encoder_decoder_attention(
            embed_dim, cfg.decoder.attention_heads, kdim=cfg.encoder.embed_dim, vdim=cfg.encoder.embed_dim,
            dropout=cfg.attention_dropout, encoder_decoder_attention=True,
            q_noise=self.quant_noise, qn_block_size=self.quant_noise_block_size,
        )
        return attention if attention is not None else super().build_encoder_attention(embed_dim, cfg)

    def forward(self, x, encoder_out=None, encoder_padding_mask=None, *args, **kwargs):
        if not (self.attentions.needs_source_lengths and encoder_out is not None):
            return super().forward(x, encoder_out, encoder_padding_mask, *args, **kwargs)
        # derived afresh at every call from the encoder output, which beam search reorders with
        # the decoder's cache: each row keeps its sentence's length from the first step to the last
        lengths = sequence_lengths(encoder_padding_mask, encoder_out.size(0), x.size(1), x.device)
        attentions = [a for a in (self.self_attn, self.encoder_attn) if hasattr(a, "source_lengths")]
        for attention in attentions:
            attention.source_lengths = lengths
        try:
            return super().forward(x, encoder_out, encoder_padding_mask, *args, **kwargs)
        finally:
            for attention in attentions:
                attention.source_lengths = None


class PositionalTransformerEncoder(TransformerEncoder):
    def __init__(self, args, dictionary, embed_tokens, attentions: AttentionFactory):
        self.attentions = attentions  # read by build_encoder_layer during the base constructor
        super().__init__(args, dictionary, embed_tokens)

    def build_encoder_layer(self, args):
        cfg = TransformerConfig.from_namespace(args)
        return wrap_layer(PositionalEncoderLayer(cfg, self.attentions, return_fc=self.return_fc), cfg)


class PositionalTransformerDecoder(TransformerDecoder):
    def __init__(self, args, dictionary, embed_tokens, attentions: AttentionFactory, no_encoder_attn=False):
        self.attentions = attentions  # read by build_decoder_layer during the base constructor
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn)

    def build_decoder_layer(self, args, no_encoder_attn=False):
        cfg = TransformerConfig.from_namespace(args)
        return wrap_layer(PositionalDecoderLayer(cfg, self.attentions, no_encoder_attn), cfg)


class PositionalTransformerModel(TransformerModel):
    """fairseq's Transformer whose attentions come from ``attention_factory``; nothing is added
    to the token embeddings."""

    attention_factory = AttentionFactory

    def upgrade_state_dict_named(self, state_dict, name):
        # weights of another model (--finetune-from-model): token positions have no place here
        sides = [side for side in ("encoder", "decoder") if getattr(self, side).embed_positions is None]
        drop_token_positions(state_dict, f"{name}." if name else "", sides)
        super().upgrade_state_dict_named(state_dict, name)

    @classmethod
    def registered_name(cls) -> str:
        return next(name for name, model in MODEL_REGISTRY.items() if model is cls)

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_plugin_args(parser, cls.registered_name())

    @classmethod
    def build_model(cls, args, task):
        # the model's default architecture function (registered under the model's own name)
        # fills what an older checkpoint lacks and checks the options after --model-overrides
        ARCH_CONFIG_REGISTRY[cls.registered_name()](args)
        return super().build_model(args, task)

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return PositionalTransformerEncoder(args, src_dict, embed_tokens, cls.attention_factory(args))

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return PositionalTransformerDecoder(
            args, tgt_dict, embed_tokens, cls.attention_factory(args),
            no_encoder_attn=getattr(args, "no_cross_attention", False),
        )


def define_architecture(args, model: str, fairseq_architecture):
    """An architecture function of a plugin model: fill the model's defaults, then fairseq's
    architecture, then check every option. fairseq's parser calls it before any data is read,
    and ``build_model`` again after ``--model-overrides``."""
    fill_plugin_defaults(args, model)
    # positions enter attention: nothing is added to the token embeddings
    args.no_token_positional_embeddings = True
    fairseq_architecture(args)
    check_plugin_options(args, model)
    if getattr(args, "cross_self_attention", False):
        raise OptionError(f"--cross-self-attention is not supported by {model}")
