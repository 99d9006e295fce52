"""RoPE with linear attention (RoFormer, arXiv:2104.09864v5, Section 3.3, eq. 19).

    Attention(Q, K, V)_m = sum_n (R_m phi(q_m))^T (R_n phi(k_n)) v_n / sum_n phi(q_m)^T phi(k_n)

with the feature map phi(x) = elu(x) + 1 (Katharopoulos et al. 2020). The rotation acts after the
feature map and only in the numerator; the denominator stays unrotated so it remains positive.

* Encoder (non-causal): S = sum_n (R_n phi(k_n)) v_n^T and z = sum_n phi(k_n) are computed once,
  O(N d^2) instead of O(N^2 d).
* Decoder (causal): prefix sums S_m, z_m over n <= m (taken chunk by chunk, O(N C d + N d^2)
  for chunks of C positions). Incremental decoding keeps only the
  running S (batch, heads, d, d), z (batch, heads, d) and the step count, batch-first, so
  fairseq's ``reorder_incremental_state`` (``index_select`` on dim 0) reorders beams.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention_cache import QUERY_STEPS
from .position_scheme import AttentionCall
from .rotary_multihead_attention import RotaryMultiheadAttention

EPS = 1e-6


def feature_map(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1 > 0, in fp32."""
    return F.elu(x.float()) + 1.0


def linear_attention(
    rq: Tensor, rk: Tensor, fq: Tensor, fk: Tensor, v: Tensor
) -> Tensor:
    """Non-causal eq. (19) on batch-first heads (batch, heads, time, d): rotated features
    ``rq``/``rk`` in the numerator, plain features ``fq``/``fk`` in the denominator."""
    kv = torch.einsum("bhnd,bhne->bhde", rk, v)
    num = torch.einsum("bhmd,bhde->bhme", rq, kv)
    den = torch.einsum("bhmd,bhd->bhm", fq, fk.sum(dim=2))
    return num / (den.unsqueeze(-1) + EPS)


def causal_linear_attention(
    rq: Tensor,
    rk: Tensor,
    fq: Tensor,
    fk: Tensor,
    v: Tensor,
    prev_kv: Optional[Tensor] = None,
    prev_k: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Causal eq. (19): sums over n <= m, continuing from running sums ``prev_kv``
    (batch, heads, d, d) and ``prev_k`` (batch, heads, d). Returns the output and the new sums.

    The prefix sums are taken chunk by chunk: inside a chunk of C positions the causal terms are
    a masked C x C product, and the sums of all earlier chunks enter through the carried state --
    the same numbers as a cumulative sum of outer products, without its (time, d, d) memory.
    """
    bsz, heads, length, dim = rq.shape
    if prev_kv is None:
        prev_kv = rk.new_zeros(bsz, heads, dim, v.size(-1))
        prev_k = fk.new_zeros(bsz, heads, dim)
    outputs = []
    for start in range(0, length, chunk_size):
        s = slice(start, min(start + chunk_size, length))
        rq_c, rk_c, fq_c, fk_c, v_c = rq[:, :, s], rk[:, :, s], fq[:, :, s], fk[:, :, s], v[:, :, s]
        causal = torch.ones(rq_c.size(2), rq_c.size(2), dtype=torch.bool, device=rq.device).tril()
        num = torch.matmul(rq_c, prev_kv) + torch.matmul(
            torch.matmul(rq_c, rk_c.transpose(-1, -2)).masked_fill(~causal, 0.0), v_c
        )
        den = torch.matmul(fq_c, prev_k.unsqueeze(-1)).squeeze(-1) + torch.matmul(
            fq_c, fk_c.transpose(-1, -2)
        ).masked_fill(~causal, 0.0).sum(-1)
        outputs.append(num / (den.unsqueeze(-1) + EPS))
        prev_kv = prev_kv + torch.matmul(rk_c.transpose(-1, -2), v_c)
        prev_k = prev_k + fk_c.sum(dim=2)
    return torch.cat(outputs, dim=2), prev_kv, prev_k


class LinearRotaryAttention(RotaryMultiheadAttention):
    """Self-attention of eq. (19): linear attention with RoPE (``--attention-kind linear``).

    Same parameters and state-dict keys as fairseq's ``MultiheadAttention``; the projections and
    positions come from the shared pipeline, only the attention step differs. ``causal=True``
    for the decoder; there the future mask fairseq passes is implied by the prefix sums.
    Attention dropout does not apply (there are no attention probabilities).
    """

    def __init__(self, embed_dim, num_heads, causal: bool = False, **kwargs):
        if kwargs.get("rope_values"):
            raise ValueError("--rope-values cannot be combined with --attention-kind linear")
        if not kwargs.get("self_attention"):
            raise ValueError("--attention-kind linear applies to self-attention only")
        super().__init__(embed_dim, num_heads, **kwargs)
        self.causal = causal

    def extra_repr(self) -> str:
        return super().extra_repr() + f", linear=True, causal={self.causal}"

    def _compute_attention(self, call: AttentionCall, attn_mask: Optional[Tensor], need_weights: bool):
        call.split_projections()
        shape = (call.tgt_len, call.bsz, self.num_heads, self.head_dim)
        fq, fk = feature_map(call.q.view(shape)), feature_map(call.k.view(shape))
        v = call.v.view(shape).float()
        if call.key_padding_mask is not None and call.key_padding_mask.dim() == 2:
            # pads contribute nothing to either sum
            fk = fk.masked_fill(call.key_padding_mask.bool().t()[:, :, None, None], 0.0)
        state = call.saved_state
        if state is not None and not self.causal:
            raise ValueError("incremental linear attention must be causal")
        # rotation after phi (eq. 19); the unrotated features stay for the denominator
        rq, rk = self.rotary.rotate(
            [fq, fk], call.query_positions, call.offset + call.tgt_len, shape, factors=self.positions.row_factors(call)
        )

        rq, rk, fq, fk, v = (t.permute(1, 2, 0, 3) for t in (rq, rk, fq, fk, v))
        if self.causal:
            prev_kv = state.get("prev_sum_kv") if state else None
            prev_k = state.get("prev_sum_k") if state else None
            out, kv, k_sum = causal_linear_attention(rq, rk, fq, fk, v, prev_kv, prev_k)
            if state is not None:
                state["prev_sum_kv"], state["prev_sum_k"] = kv, k_sum
                state[QUERY_STEPS] = kv.new_empty(call.bsz, call.offset + call.tgt_len, 0)
        else:
            out = linear_attention(rq, rk, fq, fk, v)
        return out.to(call.q.dtype).permute(2, 0, 1, 3), None
