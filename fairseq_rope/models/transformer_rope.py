"""``transformer_rope``: fairseq's Transformer with Rotary Position Embedding.

RoPE replaces the sinusoidal token positions: nothing is added to the token embeddings; the
encoder and decoder self-attention rotate queries and keys instead (and, with
``--rope-cross-attention``, the encoder-decoder attention too).
"""

from dataclasses import dataclass

from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoder,
    TransformerEncoder,
    TransformerModel,
    base_architecture,
    tiny_architecture,
    transformer_iwslt_de_en,
    transformer_vaswani_wmt_en_de_big,
)
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper

from ..model_options import ROPE_INFERENCE_DEFAULTS, ROPE_TRAINED_DEFAULTS, OptionError, fill_defaults
from ..modules.linear_rotary_attention import LinearRotaryAttention
from ..modules.rotary import LAYOUTS, SCALINGS, check_scaling, rotary_dim_for
from ..modules.rotary_multihead_attention import RotaryMultiheadAttention, check_rope_options

ATTENTION_KINDS = ("softmax", "linear")


@dataclass(frozen=True)
class RopeOptions:
    theta: float = 10000.0
    fraction: float = 1.0
    layout: str = "interleaved"
    cross_attention: bool = False
    values: bool = False
    attention_kind: str = "softmax"
    scaling: str = "none"
    scaling_factor: float = 1.0
    scaling_original_length: int = 0

    @classmethod
    def from_args(cls, args) -> "RopeOptions":
        return cls(
            theta=args.rope_theta,
            fraction=args.rope_fraction,
            layout=args.rope_layout,
            cross_attention=bool(args.rope_cross_attention),
            values=bool(args.rope_values),
            attention_kind=args.attention_kind,
            scaling=args.rope_scaling,
            scaling_factor=float(args.rope_scaling_factor),
            scaling_original_length=int(args.rope_scaling_original_length),
        )

    def attention_kwargs(self, values: bool = False):
        return dict(
            rope_theta=self.theta,
            rope_fraction=self.fraction,
            rope_layout=self.layout,
            rope_values=values and self.values,
            rope_scaling=self.scaling,
            rope_scaling_factor=self.scaling_factor,
            rope_scaling_original_length=self.scaling_original_length,
        )

    def self_attention_class(self):
        return LinearRotaryAttention if self.attention_kind == "linear" else RotaryMultiheadAttention

    def validate(self, args) -> None:
        """Fail at model build, naming the flag, before any layer is made."""
        check_rope_options(self.theta, self.layout)
        check_scaling(self.scaling, self.scaling_factor, self.scaling_original_length)
        if self.attention_kind not in ATTENTION_KINDS:
            raise OptionError(
                f"--attention-kind must be one of {', '.join(ATTENTION_KINDS)}; got {self.attention_kind!r}"
            )
        if self.values and self.attention_kind == "linear":
            raise OptionError("--rope-values cannot be combined with --attention-kind linear")
        if getattr(args, "cross_self_attention", False):
            raise OptionError("--cross-self-attention is not supported by transformer_rope")
        for side in ("encoder", "decoder"):
            embed_dim = getattr(args, f"{side}_embed_dim")
            heads = getattr(args, f"{side}_attention_heads")
            rotary_dim_for(embed_dim // heads, self.fraction)


def _wrap_layer(layer, cfg):
    """Activation checkpointing and FSDP wrapping, as fairseq applies them to its own layers."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


class RotaryTransformerEncoderLayer(TransformerEncoderLayerBase):
    def __init__(self, cfg, rope: RopeOptions, return_fc=False):
        self.rope = rope  # read by build_self_attention during the base constructor
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        kwargs = dict(causal=False) if self.rope.attention_kind == "linear" else {}
        return self.rope.self_attention_class()(
            embed_dim,
            cfg.encoder.attention_heads,
            dropout=cfg.attention_dropout,
            self_attention=True,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
            **kwargs,
            **self.rope.attention_kwargs(values=True),
        )


class RotaryTransformerDecoderLayer(TransformerDecoderLayerBase):
    def __init__(self, cfg, rope: RopeOptions, no_encoder_attn=False):
        self.rope = rope  # read by the build_* methods during the base constructor
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        kwargs = dict(causal=True) if self.rope.attention_kind == "linear" else {}
        return self.rope.self_attention_class()(
            embed_dim,
            cfg.decoder.attention_heads,
            dropout=cfg.attention_dropout,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
            self_attention=True,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
            **kwargs,
            **self.rope.attention_kwargs(values=True),
        )

    def build_encoder_attention(self, embed_dim, cfg):
        if not self.rope.cross_attention:
            return super().build_encoder_attention(embed_dim, cfg)
        return RotaryMultiheadAttention(
            embed_dim,
            cfg.decoder.attention_heads,
            kdim=cfg.encoder.embed_dim,
            vdim=cfg.encoder.embed_dim,
            dropout=cfg.attention_dropout,
            encoder_decoder_attention=True,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
            **self.rope.attention_kwargs(),
        )


class RotaryTransformerEncoder(TransformerEncoder):
    def build_encoder_layer(self, args):
        cfg = TransformerConfig.from_namespace(args)
        layer = RotaryTransformerEncoderLayer(cfg, RopeOptions.from_args(self.args), return_fc=self.return_fc)
        return _wrap_layer(layer, cfg)


class RotaryTransformerDecoder(TransformerDecoder):
    def build_decoder_layer(self, args, no_encoder_attn=False):
        cfg = TransformerConfig.from_namespace(args)
        layer = RotaryTransformerDecoderLayer(cfg, RopeOptions.from_args(self.args), no_encoder_attn)
        return _wrap_layer(layer, cfg)


@register_model("transformer_rope")
class TransformerRopeModel(TransformerModel):
    """Transformer (Vaswani et al., 2017) with rotary position embedding (Su et al., 2021)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        # No defaults here: the architecture functions below set them (fairseq's convention).
        parser.add_argument("--rope-theta", type=float, metavar="D",
                            help="RoPE base: theta_i = D^(-2(i-1)/d) (default: 10000)")
        parser.add_argument("--rope-fraction", type=float, metavar="F",
                            help="share of each head's dimensions that rotate, in (0, 1]; "
                                 "the rest carry no position (default: 1.0)")
        parser.add_argument("--rope-layout", choices=LAYOUTS,
                            help="interleaved: adjacent pairs, the paper's block-diagonal R; "
                                 "half: GPT-NeoX rotate_half (default: interleaved)")
        parser.add_argument("--rope-cross-attention", action="store_true",
                            help="also rotate encoder-decoder attention: queries by target "
                                 "position, keys by source position (off, as in the paper)")
        parser.add_argument("--rope-values", action="store_true",
                            help="RoPER: also rotate values by their key position and the "
                                 "self-attention output back by the query position, so value j "
                                 "enters query i as R(j-i) v_j")
        parser.add_argument("--attention-kind", choices=ATTENTION_KINDS,
                            help="softmax, or linear: RoPE with linear attention (RoFormer eq. 19, "
                                 "elu+1 features) in encoder and decoder self-attention "
                                 "(default: softmax)")
        parser.add_argument("--rope-scaling", choices=SCALINGS,
                            help="frequency scaling to run on inputs longer than in training: "
                                 "linear (position interpolation), ntk, yarn; usually set at "
                                 "generate time with --model-overrides (default: none)")
        parser.add_argument("--rope-scaling-factor", type=float, metavar="S",
                            help="length extension factor s >= 1 for --rope-scaling (default: 1)")
        parser.add_argument("--rope-scaling-original-length", type=int, metavar="L",
                            help="longest sequence (tokens) seen in training; needed by "
                                 "--rope-scaling yarn (default: 0, unset)")

    @classmethod
    def build_model(cls, args, task):
        transformer_rope_base(args)  # fills what an older checkpoint may lack, checks overrides
        return super().build_model(args, task)

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return RotaryTransformerEncoder(args, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return RotaryTransformerDecoder(
            args, tgt_dict, embed_tokens, no_encoder_attn=getattr(args, "no_cross_attention", False)
        )


def _rope_architecture(args, transformer_architecture):
    """Fill the RoPE defaults, then fairseq's architecture, then check every RoPE option: fairseq's
    parser calls this before any data is read, and build_model again after --model-overrides."""
    fill_defaults(args, {**ROPE_TRAINED_DEFAULTS, **ROPE_INFERENCE_DEFAULTS})
    # RoPE replaces absolute positions: nothing is added to the token embeddings.
    args.no_token_positional_embeddings = True
    transformer_architecture(args)
    RopeOptions.from_args(args).validate(args)


@register_model_architecture("transformer_rope", "transformer_rope")
def transformer_rope_base(args):
    _rope_architecture(args, base_architecture)


@register_model_architecture("transformer_rope", "transformer_rope_wmt_en_de")
def transformer_rope_wmt_en_de(args):
    transformer_rope_base(args)


@register_model_architecture("transformer_rope", "transformer_rope_vaswani_wmt_en_de_big")
def transformer_rope_vaswani_wmt_en_de_big(args):
    _rope_architecture(args, transformer_vaswani_wmt_en_de_big)


@register_model_architecture("transformer_rope", "transformer_rope_iwslt_de_en")
def transformer_rope_iwslt_de_en(args):
    _rope_architecture(args, transformer_iwslt_de_en)


@register_model_architecture("transformer_rope", "transformer_rope_tiny")
def transformer_rope_tiny(args):
    _rope_architecture(args, tiny_architecture)
