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

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .rotary_multihead_attention import RotaryMultiheadAttention

EPS = 1e-6
STEPS = "linear_rope_steps"  # shape (batch, steps, 0): counts decoded positions, holds no data


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

    Same parameters and state-dict keys as fairseq's ``MultiheadAttention``. ``causal=True``
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
            raise NotImplementedError("before_softmax is not supported by linear attention")
        tgt_len, bsz, embed_dim = query.size()
        heads, head_dim = self.num_heads, self.head_dim
        shape = (tgt_len, bsz, heads, head_dim)
        fq = feature_map(self.q_proj(query).view(shape))
        fk = feature_map(self.k_proj(query).view(shape))
        v = self.v_proj(query).view(shape).float()
        if key_padding_mask is not None and key_padding_mask.dim() == 2:
            # pads contribute nothing to either sum
            fk = fk.masked_fill(key_padding_mask.bool().t()[:, :, None, None], 0.0)

        saved_state = None
        offset = 0
        if incremental_state is not None:
            if not self.causal:
                raise ValueError("incremental linear attention must be causal")
            saved_state = self._get_input_buffer(incremental_state)
            if STEPS in saved_state:
                offset = saved_state[STEPS].size(1)
        positions = self.self_attention_positions(offset, tgt_len, query.device)
        rq, rk = self.rotate_together([fq, fk], positions, offset + tgt_len)  # after phi (eq. 19)

        rq, rk, fq, fk, v = (t.permute(1, 2, 0, 3) for t in (rq, rk, fq, fk, v))
        if self.causal:
            prev_kv = saved_state.get("prev_sum_kv") if saved_state else None
            prev_k = saved_state.get("prev_sum_k") if saved_state else None
            out, kv, k_sum = causal_linear_attention(rq, rk, fq, fk, v, prev_kv, prev_k)
            if saved_state is not None:
                saved_state["prev_sum_kv"] = kv
                saved_state["prev_sum_k"] = k_sum
                saved_state[STEPS] = kv.new_empty(bsz, offset + tgt_len, 0)
                self._set_input_buffer(incremental_state, saved_state)
        else:
            out = linear_attention(rq, rk, fq, fk, v)

        out = out.to(query.dtype).permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed_dim)
        return self.out_proj(out), None
