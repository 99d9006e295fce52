"""``transformer_rpe``: fairseq's Transformer with Shaw et al. (2018) relative position
representations in encoder and decoder self-attention -- the "RPE" baseline of RoFormer.

Nothing is added to the token embeddings; the relative key/value tables carry all position
information (clipped at ``--rpe-max-distance``).
"""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import base_architecture, tiny_architecture

from ..modules.relative_position_attention import RelativePositionMultiheadAttention
from .positional_transformer import AttentionFactory, PositionalTransformerModel, define_architecture


class RelativeAttentions(AttentionFactory):
    def self_attention(self, side, embed_dim, num_heads, **kwargs):
        return RelativePositionMultiheadAttention(embed_dim, num_heads, max_distance=self.args.rpe_max_distance,
                                                  **kwargs)


@register_model("transformer_rpe")
class TransformerRpeModel(PositionalTransformerModel):
    """Transformer with relative position representations (Shaw et al., 2018)."""

    attention_factory = RelativeAttentions


@register_model_architecture("transformer_rpe", "transformer_rpe")
def transformer_rpe_base(args):
    define_architecture(args, "transformer_rpe", base_architecture)


@register_model_architecture("transformer_rpe", "transformer_rpe_wmt_en_de")
def transformer_rpe_wmt_en_de(args):
    transformer_rpe_base(args)


@register_model_architecture("transformer_rpe", "transformer_rpe_tiny")
def transformer_rpe_tiny(args):
    define_architecture(args, "transformer_rpe", tiny_architecture)
