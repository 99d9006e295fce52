"""``transformer_rope``: fairseq's Transformer with Rotary Position Embedding.

RoPE replaces the sinusoidal token positions: nothing is added to the token embeddings; the
encoder and decoder self-attention rotate queries and keys instead (and, with
``--rope-cross-attention``, the encoder-decoder attention too).
"""

import logging

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    base_architecture,
    tiny_architecture,
    transformer_iwslt_de_en,
    transformer_vaswani_wmt_en_de_big,
)

from ..model_options import (
    ROPE_INFERENCE_DEFAULTS,
    ROPE_RECORDED_DEFAULTS,
    ROPE_TRAINED_DEFAULTS,
    OptionError,
    check_finite_positive,
)
from ..modules.linear_rotary_attention import LinearRotaryAttention
from ..modules.rope_scaling import check_scaling, scaling_help, scaling_names, scaling_spec
from ..modules.rotary import LAYOUTS, check_layout, rotary_dim_for
from ..modules.rotary_embedding import shared_rotary_embedding
from ..modules.rotary_multihead_attention import RotaryMultiheadAttention
from ..training_lengths import TrainingLengths, recorded_training_length
from .positional_transformer import AttentionFactory, PositionalTransformerModel, define_architecture

ATTENTION_KINDS = ("softmax", "linear")
logger = logging.getLogger(__name__)


def check_rope_options(args) -> None:
    """Fail while the command line is parsed, naming the flag, before any layer is made."""
    check_finite_positive("--rope-theta", args.rope_theta)
    check_layout(args.rope_layout)
    check_scaling(args.rope_scaling, args.rope_scaling_factor, training_length(args))
    if args.attention_kind not in ATTENTION_KINDS:
        raise OptionError(f"--attention-kind must be one of {', '.join(ATTENTION_KINDS)}; got {args.attention_kind!r}")
    if args.rope_values and args.attention_kind == "linear":
        raise OptionError("--rope-values cannot be combined with --attention-kind linear")
    for side in ("encoder", "decoder"):
        rotary_dim_for(getattr(args, f"{side}_embed_dim") // getattr(args, f"{side}_attention_heads"), args.rope_fraction)


def training_length(args) -> int:
    """L of the length scalings: --rope-scaling-original-length, else what training recorded."""
    return args.rope_scaling_original_length or recorded_training_length(args)


class RotaryAttentions(AttentionFactory):
    @property
    def needs_source_lengths(self) -> bool:
        return scaling_spec(self.args.rope_scaling).per_sentence

    def rotary_embedding(self, embed_dim: int, num_heads: int):
        """The rotation of every attention with this head size: one object, shared."""
        a = self.args
        return shared_rotary_embedding(
            rotary_dim_for(embed_dim // num_heads, a.rope_fraction), float(a.rope_theta), a.rope_layout,
            a.rope_scaling, float(a.rope_scaling_factor), training_length(a),
        )

    def self_attention(self, side, embed_dim, num_heads, **kwargs):
        rotary = self.rotary_embedding(embed_dim, num_heads)
        if self.args.attention_kind == "linear":
            return LinearRotaryAttention(embed_dim, num_heads, causal=side == "decoder", rotary=rotary, **kwargs)
        return RotaryMultiheadAttention(embed_dim, num_heads, rope_values=self.args.rope_values, rotary=rotary, **kwargs)

    def encoder_decoder_attention(self, embed_dim, num_heads, **kwargs):
        if not self.args.rope_cross_attention:
            return None
        return RotaryMultiheadAttention(embed_dim, num_heads, rotary=self.rotary_embedding(embed_dim, num_heads), **kwargs)


def rope_options():
    """What transformer_rope adds to fairseq's Transformer. No defaults here: the architecture
    functions below set them (fairseq's convention)."""
    return (
        ("--rope-theta", dict(type=float, metavar="D",
                              help="RoPE base: theta_i = D^(-2(i-1)/d) (default: 10000)")),
        ("--rope-fraction", dict(type=float, metavar="F",
                                 help="share of each head's dimensions that rotate, in (0, 1]; the rest "
                                      "carry no position (default: 1.0)")),
        ("--rope-layout", dict(choices=LAYOUTS,
                               help="interleaved: adjacent pairs, the paper's block-diagonal R; half: "
                                    "GPT-NeoX rotate_half (default: interleaved)")),
        ("--rope-cross-attention", dict(action="store_true",
                                        help="also rotate encoder-decoder attention: queries by target "
                                             "position, keys by source position (off, as in the paper)")),
        ("--rope-values", dict(action="store_true",
                               help="RoPER: also rotate values by their key position and the self-attention "
                                    "output back by the query position, so value j enters query i as R(j-i) v_j")),
        ("--attention-kind", dict(choices=ATTENTION_KINDS,
                                  help="softmax, or linear: RoPE with linear attention (RoFormer eq. 19, elu+1 "
                                       "features) in encoder and decoder self-attention (default: softmax)")),
        ("--rope-scaling", dict(choices=scaling_names(), help=scaling_help() + " (default: none)")),
        ("--rope-scaling-factor", dict(type=float, metavar="S",
                                       help="length extension factor s >= 1 for --rope-scaling (default: 1)")),
        ("--rope-scaling-original-length", dict(type=int, metavar="L",
                                                help="L, the training length (tokens) of --rope-scaling yarn "
                                                     "and dynamic-*; overrides the one the checkpoint records: "
                                                     "the length 99%% of training sequences do not exceed "
                                                     "(default: 0, unset)")),
    )


@register_model("transformer_rope")
class TransformerRopeModel(PositionalTransformerModel):
    """Transformer (Vaswani et al., 2017) with rotary position embedding (Su et al., 2021)."""

    attention_factory = RotaryAttentions
    options = staticmethod(rope_options)

    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        model.training_lengths = TrainingLengths(args)  # saved by checkpoints.py
        if scaling_spec(args.rope_scaling).needs_training_length:
            source = ("--rope-scaling-original-length" if args.rope_scaling_original_length
                      else "recorded in training")
            logger.info(f"--rope-scaling {args.rope_scaling}: L = {training_length(args)} tokens ({source})")
        return model

    def forward(self, src_tokens, src_lengths, prev_output_tokens, *args, **kwargs):
        if self.training:  # src_lengths: the non-pad source tokens, as fairseq's datasets count them
            lengths = torch.cat([src_lengths, prev_output_tokens.ne(self.decoder.padding_idx).sum(1)])
            self.training_lengths.count(lengths, max(src_tokens.size(1), prev_output_tokens.size(1)))
        return super().forward(src_tokens, src_lengths, prev_output_tokens, *args, **kwargs)


def _rope_architecture(args, transformer_architecture):
    define_architecture(
        args, "transformer_rope", {**ROPE_TRAINED_DEFAULTS, **ROPE_INFERENCE_DEFAULTS, **ROPE_RECORDED_DEFAULTS},
        transformer_architecture,
        check_rope_options,
    )


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
