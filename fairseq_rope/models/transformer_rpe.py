"""``transformer_rpe``: fairseq's Transformer with Shaw et al. (2018) relative position
representations in encoder and decoder self-attention -- the "RPE" baseline of RoFormer.

Nothing is added to the token embeddings; the relative key/value tables carry all position
information (clipped at ``--rpe-max-distance``).
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoder,
    TransformerEncoder,
    TransformerModel,
    base_architecture,
    tiny_architecture,
)
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from ..model_options import RPE_TRAINED_DEFAULTS, OptionError, fill_defaults
from ..modules.relative_position_attention import RelativePositionMultiheadAttention, check_max_distance
from .transformer_rope import _wrap_layer


class RelativeTransformerEncoderLayer(TransformerEncoderLayerBase):
    def __init__(self, cfg, max_distance: int, return_fc=False):
        self.max_distance = max_distance  # read by build_self_attention during the base constructor
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        return RelativePositionMultiheadAttention(
            embed_dim,
            cfg.encoder.attention_heads,
            max_distance=self.max_distance,
            dropout=cfg.attention_dropout,
            self_attention=True,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
        )


class RelativeTransformerDecoderLayer(TransformerDecoderLayerBase):
    def __init__(self, cfg, max_distance: int, no_encoder_attn=False):
        self.max_distance = max_distance
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        return RelativePositionMultiheadAttention(
            embed_dim,
            cfg.decoder.attention_heads,
            max_distance=self.max_distance,
            dropout=cfg.attention_dropout,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
            self_attention=True,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
        )


class RelativeTransformerEncoder(TransformerEncoder):
    def build_encoder_layer(self, args):
        cfg = TransformerConfig.from_namespace(args)
        layer = RelativeTransformerEncoderLayer(cfg, self.args.rpe_max_distance, return_fc=self.return_fc)
        return _wrap_layer(layer, cfg)


class RelativeTransformerDecoder(TransformerDecoder):
    def build_decoder_layer(self, args, no_encoder_attn=False):
        cfg = TransformerConfig.from_namespace(args)
        layer = RelativeTransformerDecoderLayer(cfg, self.args.rpe_max_distance, no_encoder_attn)
        return _wrap_layer(layer, cfg)


@register_model("transformer_rpe")
class TransformerRpeModel(TransformerModel):
    """Transformer with relative position representations (Shaw et al., 2018)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--rpe-max-distance", type=int, metavar="K",
                            help="relative distances are clipped to [-K, K]; 2K+1 learned key "
                                 "and value vectors per layer (default: 16)")

    @classmethod
    def build_model(cls, args, task):
        transformer_rpe_base(args)  # fills what an older checkpoint may lack, checks overrides
        return super().build_model(args, task)

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return RelativeTransformerEncoder(args, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return RelativeTransformerDecoder(
            args, tgt_dict, embed_tokens, no_encoder_attn=getattr(args, "no_cross_attention", False)
        )


def _rpe_architecture(args, transformer_architecture):
    """Defaults, fairseq's architecture, then the check (as for transformer_rope)."""
    fill_defaults(args, RPE_TRAINED_DEFAULTS)
    # relative representations replace absolute positions
    args.no_token_positional_embeddings = True
    transformer_architecture(args)
    check_max_distance(args.rpe_max_distance)
    if getattr(args, "cross_self_attention", False):
        raise OptionError("--cross-self-attention is not supported by transformer_rpe")


@register_model_architecture("transformer_rpe", "transformer_rpe")
def transformer_rpe_base(args):
    _rpe_architecture(args, base_architecture)


@register_model_architecture("transformer_rpe", "transformer_rpe_wmt_en_de")
def transformer_rpe_wmt_en_de(args):
    transformer_rpe_base(args)


@register_model_architecture("transformer_rpe", "transformer_rpe_tiny")
def transformer_rpe_tiny(args):
    _rpe_architecture(args, tiny_architecture)
