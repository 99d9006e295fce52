"""Relative position representations (Shaw, Uszkoreit and Vaswani, 2018, arXiv:1803.02155).

    e_ij = q_i (k_j + a^K_ij)^T / sqrt(d),   z_i = sum_j alpha_ij (v_j + a^V_ij),

with a^K_ij = w^K_clip(j - i, k) and a^V_ij = w^V_clip(j - i, k): 2k + 1 learned vectors per
table, shared by all heads (the paper's setting). Positions count from the first column of the
batch, as for RoPE: left padding shifts a sentence by a constant, which no j - i sees.
"""

from typing import Dict, Optional, Tuple

import torch
from fairseq import utils
from fairseq.modules import MultiheadAttention
from torch import Tensor, nn

from ..model_options import OptionError
from .rotary import new_token_positions
from .rotary_multihead_attention import append_to_cache

POSITIONS = "rpe_prev_positions"


def relative_position_index(query_positions: Tensor, key_positions: Tensor, max_distance: int) -> Tensor:
    """clip(j - i, -k, k) + k for query positions i (..., T) and key positions j (..., S):
    an index (..., T, S) into tables of 2k + 1 rows."""
    relative = key_positions.unsqueeze(-2) - query_positions.unsqueeze(-1)
    return relative.clamp(-max_distance, max_distance) + max_distance


class RelativePositionMultiheadAttention(MultiheadAttention):
    """Self-attention with Shaw et al. relative key and value embeddings (``transformer_rpe``)."""

    def __init__(self, embed_dim, num_heads, max_distance: int = 16, **kwargs):
        if not kwargs.get("self_attention"):
            raise ValueError("relative position attention applies to self-attention only")
        if kwargs.get("add_bias_kv") or kwargs.get("add_zero_attn"):
            raise ValueError("relative position attention does not support add_bias_kv / add_zero_attn")
        if kwargs.get("xformers_att_config"):
            raise ValueError("--*-xformers-att-config cannot be combined with transformer_rpe")
        super().__init__(embed_dim, num_heads, **kwargs)
        check_max_distance(max_distance)
        self.max_distance = int(max_distance)
        self.relative_keys = nn.Embedding(2 * self.max_distance + 1, self.head_dim)
        self.relative_values = nn.Embedding(2 * self.max_distance + 1, self.head_dim)
        nn.init.normal_(self.relative_keys.weight, std=self.head_dim ** -0.5)
        nn.init.normal_(self.relative_values.weight, std=self.head_dim ** -0.5)

    def extra_repr(self) -> str:
        return f"max_distance={self.max_distance}, head_dim={self.head_dim}"

    def self_attention_positions(self, offset: int, length: int, device) -> Tensor:
        """Positions (time,) of the new tokens; left padding shifts them by a constant, which no
        relative distance sees."""
        return new_token_positions(offset, length, device)

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        if before_softmax:
            raise NotImplementedError("before_softmax is not supported by relative position attention")
        need_weights = need_weights or need_head_weights
        tgt_len, bsz, embed_dim = query.size()
        heads, head_dim = self.num_heads, self.head_dim

        def heads_first(x):  # (T, B, E) -> (B, H, T, d)
            return x.view(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)

        q = heads_first(self.q_proj(query)) * self.scaling
        k = heads_first(self.k_proj(query))
        v = heads_first(self.v_proj(query))

        saved_state = self._get_input_buffer(incremental_state) if incremental_state is not None else None
        offset = saved_state["prev_key"].size(2) if saved_state and "prev_key" in saved_state else 0
        positions = self.self_attention_positions(offset, tgt_len, query.device)
        positions = positions.expand(bsz, tgt_len) if positions.dim() == 1 else positions
        query_positions = key_positions = positions
        if saved_state is not None:
            if offset:
                key_positions = torch.cat([saved_state[POSITIONS], positions], dim=1)
            k, v, key_padding_mask = append_to_cache(saved_state, k, v, key_padding_mask)
            saved_state[POSITIONS] = key_positions
            self._set_input_buffer(incremental_state, saved_state)
        src_len = k.size(2)

        # (B, 1, T, S) bucket of every query-key pair, shared by the heads
        index = relative_position_index(query_positions, key_positions, self.max_distance).unsqueeze(1)
        index = index.expand(bsz, heads, tgt_len, src_len)
        scores = torch.matmul(q, k.transpose(-1, -2))
        # q_i a^K_ij: score every query against the 2k + 1 table rows once, then gather
        scores = scores + torch.gather(torch.matmul(q, self.relative_keys.weight.t()), -1, index)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros_like(attn_mask, dtype=scores.dtype).masked_fill(attn_mask, float("-inf"))
            scores = scores + attn_mask.to(scores.dtype)
        if key_padding_mask is not None and key_padding_mask.dim() == 2:
            scores = scores.masked_fill(key_padding_mask.bool()[:, None, None, :], float("-inf"))
        weights = utils.softmax(scores, dim=-1)
        probs = self.dropout_module(weights.type_as(scores))

        out = torch.matmul(probs, v)
        # sum_j alpha_ij a^V_ij: add each pair's weight into its bucket, then one matmul
        buckets = probs.new_zeros(bsz, heads, tgt_len, 2 * self.max_distance + 1)
        buckets.scatter_add_(-1, index, probs)
        out = out + torch.matmul(buckets, self.relative_values.weight.to(probs.dtype))

        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim))
        attn_weights = None
        if need_weights:
            attn_weights = weights.transpose(0, 1)  # (heads, batch, tgt, src), as fairseq
            if not need_head_weights:
                attn_weights = attn_weights.mean(dim=0)
        return out, attn_weights


def check_max_distance(max_distance) -> None:
    if int(max_distance) != max_distance or max_distance < 1:
        raise OptionError(f"--rpe-max-distance must be a positive integer, got {max_distance}")
