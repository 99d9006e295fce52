"""Relative position representations (Shaw, Uszkoreit and Vaswani, 2018, arXiv:1803.02155).

    e_ij = q_i (k_j + a^K_ij)^T / sqrt(d),   z_i = sum_j alpha_ij (v_j + a^V_ij),

with a^K_ij = w^K_clip(j - i, k) and a^V_ij = w^V_clip(j - i, k): 2k + 1 learned vectors per
table, shared by all heads (the paper's setting). Positions count from the first column of the
batch, as for RoPE: left padding shifts a sentence by a constant, which no j - i sees.
"""

import torch
from torch import Tensor, nn

from ..config_values import OptionError
from .attention import PositionalMultiheadAttention
from .position_scheme import AttentionCall, PositionScheme


def relative_position_index(query_positions: Tensor, key_positions: Tensor, max_distance: int) -> Tensor:
    """clip(j - i, -k, k) + k for query positions i (..., T) and key positions j (..., S):
    an index (..., T, S) into tables of 2k + 1 rows."""
    relative = key_positions.unsqueeze(-2) - query_positions.unsqueeze(-1)
    return relative.clamp(-max_distance, max_distance) + max_distance


class RelativePositions(PositionScheme):
    """Shaw et al.'s a^K term in the logits and a^V term in the output. The tables are the
    attention's own ``relative_keys`` / ``relative_values`` embeddings (state-dict keys
    ``self_attn.relative_keys.weight``, ...)."""

    needs_explicit_scores = True

    def __init__(self, max_distance: int):
        check_max_distance(max_distance)
        self.max_distance = int(max_distance)

    def attach(self, attention) -> None:
        if not attention.self_attention:
            raise ValueError("relative position attention applies to self-attention only")
        rows = 2 * self.max_distance + 1
        attention.relative_keys = nn.Embedding(rows, attention.head_dim)
        attention.relative_values = nn.Embedding(rows, attention.head_dim)
        nn.init.normal_(attention.relative_keys.weight, std=attention.head_dim ** -0.5)
        nn.init.normal_(attention.relative_values.weight, std=attention.head_dim ** -0.5)

    def describe(self) -> str:
        return f"max_distance={self.max_distance}"

    def _index(self, attention, call: AttentionCall, shape) -> Tensor:
        """Bucket of every query-key pair, expanded to the (batch, heads, T, S) ``shape``."""
        key_positions = attention.self_attention_positions(0, shape[-1], call.query_positions.device)
        index = relative_position_index(call.query_positions, key_positions, self.max_distance)
        return index.expand(shape)

    def score_bias(self, attention, call, scaled_q, src_len):
        # q_i a^K_ij: score every query against the 2k + 1 table rows once, then gather
        table_scores = torch.matmul(scaled_q, attention.relative_keys.weight.t().to(scaled_q.dtype))
        return torch.gather(table_scores, -1, self._index(attention, call, (*table_scores.shape[:-1], src_len)))

    def value_bias(self, attention, call, probs):
        # sum_j alpha_ij a^V_ij: add each pair's weight into its bucket, then one matmul
        buckets = probs.new_zeros(*probs.shape[:-1], 2 * self.max_distance + 1)
        buckets.scatter_add_(-1, self._index(attention, call, probs.shape), probs)
        return torch.matmul(buckets, attention.relative_values.weight.to(probs.dtype))


class RelativePositionMultiheadAttention(PositionalMultiheadAttention):
    """Self-attention with Shaw et al. relative key and value embeddings (``transformer_rpe``)."""

    def __init__(self, embed_dim, num_heads, max_distance: int = 16, **kwargs):
        super().__init__(embed_dim, num_heads, RelativePositions(max_distance), **kwargs)


def check_max_distance(max_distance) -> None:
    if int(max_distance) != max_distance or max_distance < 1:
        raise OptionError(f"--rpe-max-distance must be a positive integer, got {max_distance}")
