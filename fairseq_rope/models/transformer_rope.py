"""``transformer_rope``: fairseq's Transformer with Rotary Position Embedding.

RoPE replaces the sinusoidal token positions: nothing is added to the token embeddings; the
encoder and decoder self-attention rotate queries and keys instead (and, with
``--rope-cross-attention``, the encoder-decoder attention too). Its options are declared in
``plugin_options``. With ``--rope-random-positions R`` the training forward draws each
sentence's self-attention positions (``modules/random_positions.py``).
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

from ..modules.linear_rotary_attention import LinearRotaryAttention
from ..modules.random_positions import sample_positions
from ..modules.rope_scaling import scaling_spec
from ..modules.rotary import rotary_dim_for
from ..modules.rotary_embedding import shared_rotary_embedding
from ..modules.rotary_multihead_attention import RotaryMultiheadAttention
from ..training_lengths import TrainingLengths, training_length
from .positional_transformer import AttentionFactory, PositionalTransformerModel, define_architecture

logger = logging.getLogger(__name__)


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
        return RotaryMultiheadAttention(embed_dim, num_heads, rope_values=self.args.rope_values, rotary=rotary,
                                        **kwargs)

    def encoder_decoder_attention(self, embed_dim, num_heads, **kwargs):
        if not self.args.rope_cross_attention:
            return None
        rotary = self.rotary_embedding(embed_dim, num_heads)
        return RotaryMultiheadAttention(embed_dim, num_heads, rotary=rotary, **kwargs)


@register_model("transformer_rope")
class TransformerRopeModel(PositionalTransformerModel):
    """Transformer (Vaswani et al., 2017) with rotary position embedding (Su et al., 2021)."""

    attention_factory = RotaryAttentions

    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        model.training_lengths = TrainingLengths(args)  # saved by checkpoints.py
        # R of --rope-random-positions; None: the columns' contiguous positions
        model.random_positions_range = args.rope_random_positions if args.rope_random_positions != 1.0 else None
        if scaling_spec(args.rope_scaling).needs_training_length:
            source = ("--rope-scaling-original-length" if args.rope_scaling_original_length
                      else "recorded in training")
            logger.info(f"--rope-scaling {args.rope_scaling}: L = {training_length(args)} tokens ({source})")
        return model

    def forward(self, src_tokens, src_lengths, prev_output_tokens, *args, **kwargs):
        if self.training:  # src_lengths: the non-pad source tokens, as fairseq's datasets count them
            lengths = torch.cat([src_lengths, prev_output_tokens.ne(self.decoder.padding_idx).sum(1)])
            self.training_lengths.count(lengths, max(src_tokens.size(1), prev_output_tokens.size(1)))
            if self.random_positions_range is not None:
                self.draw_positions(src_tokens, prev_output_tokens, self.random_positions_range)
        return super().forward(src_tokens, src_lengths, prev_output_tokens, *args, **kwargs)

    def draw_positions(self, src_tokens, prev_output_tokens, range_factor: float) -> None:
        """Positions for this training batch's self-attention: one draw for the sources, shared by
        the encoder's layers, one for the targets, shared by the decoder's."""
        for side, tokens in ((self.encoder, src_tokens), (self.decoder, prev_output_tokens)):
            drawn = sample_positions(tokens.eq(side.padding_idx), range_factor)
            for module in side.modules():
                if isinstance(module, RotaryMultiheadAttention) and module.self_attention:
                    module.positions.sampled = drawn


def _rope_architecture(args, transformer_architecture):
    define_architecture(args, "transformer_rope", transformer_architecture)


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
