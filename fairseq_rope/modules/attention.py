"""One multi-head attention for every position scheme of the plugin.

:class:`PositionalMultiheadAttention` is fairseq's ``MultiheadAttention`` (same parameters,
state-dict keys and cache layout; the beam reorder of self-attention keys and values waits for the
next step's append, ``attention_cache``) with a forward pass in two steps:

* :meth:`~PositionalMultiheadAttention._prepare_inputs` -- projections, beam-shared encoder keys,
  the incremental cache's offset and the positions of the new tokens;
* :meth:`~PositionalMultiheadAttention._compute_attention` -- the position scheme's changes to
  q, k and v, the key/value cache, the masks, softmax attention and the scheme's change to the
  output. Linear attention replaces this step (``linear_rotary_attention``).

What a position scheme does is a small strategy object (``position_scheme.PositionScheme``):
rotary (``rotary_multihead_attention``) or Shaw relative (``relative_position_attention``). fairseq
left-pads sources and takes a fused ``F.multi_head_attention_forward`` path when there is no
incremental state, so ``forward`` is overridden as a whole.
"""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.modules import MultiheadAttention
from torch import Tensor

from .attention_cache import QUERY_STEPS, append_to_cache, defer_reorder
from .position_scheme import AttentionCall, PositionScheme


class PositionalMultiheadAttention(MultiheadAttention):
    """fairseq's ``MultiheadAttention`` with positions handled by ``positions``, a
    :class:`PositionScheme`. Without requested attention weights, attention runs through
    ``F.scaled_dot_product_attention``; with them, an explicit softmax gives the same output."""

    #: (batch,) source length of each row during a layer's call, set by the layer where the
    #: position scheme needs it (a per-sentence --rope-scaling); a plain attribute, not state
    source_lengths: Optional[Tensor] = None

    def __init__(self, embed_dim, num_heads, positions: PositionScheme, **kwargs):
        if kwargs.get("add_bias_kv") or kwargs.get("add_zero_attn"):
            raise ValueError(f"{type(self).__name__} does not support add_bias_kv / add_zero_attn")
        if kwargs.get("xformers_att_config"):
            raise ValueError(f"--*-xformers-att-config cannot be combined with {type(self).__name__}")
        super().__init__(embed_dim, num_heads, **kwargs)
        self.positions = positions
        positions.attach(self)

    def train(self, mode: bool = True):
        self.__dict__.pop("_inference_projection_cache", None)  # see _inference_projection
        return super().train(mode)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, {self.positions.describe()}"

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """fairseq's beam reorder, except that self-attention keys and values are gathered by the
        next step's append to the cache (``append_to_cache``), in the same copy: each decoding
        step copies the cache once instead of twice."""
        buffer = self._get_input_buffer(incremental_state)
        if not (self.self_attention and "prev_key" in buffer):
            return super().reorder_incremental_state(incremental_state, new_order)
        return self._set_input_buffer(incremental_state, defer_reorder(buffer, new_order))

    def self_attention_positions(self, offset: int, length: int, device) -> Tensor:
        """Positions (time,) of ``length`` tokens of one sequence, ``offset`` before them, shared by
        the batch. Counting from the first column even with left padding is exact for relative
        schemes: padding shifts every position of a sentence by the same amount."""
        return torch.arange(offset, offset + length, device=device)

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
            raise NotImplementedError(f"before_softmax is not supported by {type(self).__name__}")
        need_weights = need_weights or need_head_weights
        call = self._prepare_inputs(query, key, value, key_padding_mask, incremental_state, static_kv)
        out, weights = self._compute_attention(call, attn_mask, need_weights)
        if call.saved_state is not None:
            self._set_input_buffer(incremental_state, call.saved_state)
        out = self.out_proj(out.reshape(call.tgt_len, call.bsz, self.embed_dim))
        if weights is not None and not need_head_weights:
            weights = weights.mean(dim=0)
        return out, weights

    def _prepare_inputs(self, query, key, value, key_padding_mask, incremental_state, static_kv) -> AttentionCall:
        tgt_len, bsz, embed_dim = query.size()
        assert embed_dim == self.embed_dim, f"query dim {embed_dim} != {self.embed_dim}"
        saved_state = self._get_input_buffer(incremental_state) if incremental_state is not None else None
        cached = saved_state is not None and "prev_key" in saved_state

        # Projections are made from 2-D inputs: (time * batch, embed_dim) outputs, not views,
        # that a position scheme may overwrite.
        query_rows = query.reshape(-1, embed_dim)
        q = k = v = qkv = None
        src_len, kv_bsz = tgt_len, bsz
        if self.self_attention:
            qkv = self._project_self_attention(query_rows)
        else:
            q = self.q_proj(query_rows)
        if not self.self_attention and not (static_kv and cached):
            assert key is not None and value is not None
            if self.encoder_decoder_attention and self.beam_size > 1 and bsz == key.size(1):
                # the encoder output is identical across a sentence's beams: keep one copy
                key = key.view(key.size(0), -1, self.beam_size, key.size(2))[:, :, 0, :]
                value = value.view(value.size(0), -1, self.beam_size, value.size(2))[:, :, 0, :]
                if key_padding_mask is not None:
                    key_padding_mask = key_padding_mask.view(-1, self.beam_size, key_padding_mask.size(1))[:, 0, :]
            src_len, kv_bsz = key.size(0), key.size(1)
            k = self.k_proj(key.reshape(-1, key.size(-1)))
            v = self.v_proj(value.reshape(-1, value.size(-1)))

        if self.self_attention and cached:
            offset = saved_state["prev_key"].size(2)
        else:  # encoder-decoder attention (and linear attention) count their steps apart
            steps = saved_state.get(QUERY_STEPS) if saved_state is not None else None
            offset = steps.size(1) if steps is not None else 0
        return AttentionCall(
            q, k, v, qkv, tgt_len, bsz, src_len, kv_bsz, key_padding_mask, saved_state, offset,
            self.self_attention_positions(offset, tgt_len, query.device), static_kv, self.source_lengths,
        )

    def _project_self_attention(self, rows: Tensor) -> Tensor:
        """q, k and v side by side, (rows, 3 * embed_dim), from one GEMM with [W_q; W_k; W_v] as
        fairseq's own full-sequence path does."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if any(p._forward_pre_hooks for p in projections):  # quant-noise acts through these hooks
            return torch.cat([p(rows) for p in projections], dim=1)
        params = [p for m in projections for p in (m.weight, m.bias)]
        if self.training or (torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in params)):
            return F.linear(rows, *_concatenate(params))
        weight_t, bias = self._inference_projection(params)
        return torch.addmm(bias, rows, weight_t) if bias is not None else rows.mm(weight_t)

    def _inference_projection(self, params) -> Tuple[Tensor, Optional[Tensor]]:
        """[W_q; W_k; W_v] transposed to (embed_dim, 3 * embed_dim) and the biases, kept between
        inference calls: a copy of the weights, laid out (input-major) so that a decoding step's
        GEMM runs faster on the CPU than from the concatenated weights or as three GEMMs (128 rows,
        512 dims, 2 threads: 3.13 ms against 3.43 and 3.23 ms).
        It is remade when a weight changes visibly or the mode changes: optimizers (fairseq's Adam
        among them) update ``p.data``, which moves neither the pointer nor the version of ``p``,
        and they run in train mode."""
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params if p is not None)
        cached = self.__dict__.get("_inference_projection_cache")
        if cached is None or cached[0] != key:
            weight, bias = _concatenate(params)
            cached = (key, (weight.t().contiguous(), bias))
            self.__dict__["_inference_projection_cache"] = cached  # a plain attribute: not in the state dict
        return cached[1]

    def _compute_attention(self, call: AttentionCall, attn_mask: Optional[Tensor], need_weights: bool):
        """Softmax attention; returns the time-first (tgt, batch, heads, head_dim) output and, if
        ``need_weights``, the fp32 probabilities (heads, batch, tgt, src) as fairseq does."""
        self.positions.encode(self, call)
        call.split_projections()
        heads, head_dim = self.num_heads, self.head_dim
        # Batch-first heads: (batch, heads, time, head_dim), the layout fairseq caches.
        q = call.q.view(call.tgt_len, call.bsz, heads, head_dim).permute(1, 2, 0, 3)
        k, v, key_padding_mask = call.k, call.v, call.key_padding_mask
        if k is not None:
            k = k.view(call.src_len, call.kv_bsz, heads, head_dim).permute(1, 2, 0, 3)
            v = v.view(call.src_len, call.kv_bsz, heads, head_dim).permute(1, 2, 0, 3)
        if call.saved_state is not None:
            k, v, key_padding_mask = append_to_cache(call.saved_state, k, v, key_padding_mask, call.static_kv)
            if not self.self_attention:
                call.saved_state[QUERY_STEPS] = k.new_empty(k.size(0), call.offset + call.tgt_len, 0)
        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None
        out, weights = self._attend(call, q, k, v, key_padding_mask, attn_mask, need_weights)
        return self.positions.decode(self, call, out.permute(2, 0, 1, 3)), weights

    def _attend(self, call, q, k, v, key_padding_mask, attn_mask, need_weights):
        """softmax(q k^T / sqrt(d) + position terms + masks) v on batch-first heads."""
        bsz, heads, tgt_len, head_dim = q.size()
        kv_bsz, src_len = k.size(0), k.size(2)
        group = bsz // kv_bsz
        if group > 1:
            # beams share one copy of the encoder keys: fold them into extra query rows
            q = q.reshape(kv_bsz, group, heads, tgt_len, head_dim).transpose(1, 2)
            q = q.reshape(kv_bsz, heads, group * tgt_len, head_dim)
        mask = attention_mask(key_padding_mask, attn_mask, kv_bsz, src_len, q.dtype, group)

        dropout_p = self.dropout_module.p if self.training or self.dropout_module.apply_during_inference else 0.0
        weights = None
        if not (need_weights or explicit_scores_for_step(tgt_len) or self.positions.needs_explicit_scores):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        else:
            rows = q.size(2)
            scaled_q = q * self.scaling
            scores = torch.matmul(scaled_q, k.transpose(-1, -2))
            bias = self.positions.score_bias(self, call, scaled_q, src_len)
            if bias is not None:
                scores = scores + bias
            if mask is not None:
                scores = scores + mask
            probs = utils.softmax(scores, dim=-1)  # fp32, as fairseq returns them
            if dropout_p > 0:
                probs_for_values = F.dropout(probs.type_as(scores), dropout_p, training=True)
            else:
                probs_for_values = probs if probs.dtype == scores.dtype else probs.type_as(scores)
            out = torch.matmul(probs_for_values, v)
            bias = self.positions.value_bias(self, call, probs_for_values)
            if bias is not None:
                out = out + bias
            if need_weights:
                weights = probs.view(kv_bsz, heads, rows, src_len)

        if group > 1:
            out = out.view(kv_bsz, heads, group, tgt_len, head_dim).transpose(1, 2)
            if weights is not None:
                weights = weights.view(kv_bsz, heads, group, tgt_len, src_len).transpose(1, 2)
        out = out.reshape(bsz, heads, tgt_len, head_dim)
        if weights is not None:
            weights = weights.reshape(bsz, heads, tgt_len, src_len).transpose(0, 1)
        return out, weights


def explicit_scores_for_step(tgt_len: int) -> bool:
    """Whether attention forms its scores with two batched matmuls rather than SDPA: for an
    incremental decoding step (one query per sentence or beam), as fairseq's own attention does.
    On the CPU that runs about twice as fast as SDPA's flash kernel (torch 2.13, beam-search
    batches); on a Hopper GPU in fp16, SDPA's cuDNN backend built a graph for each new key length
    and RoPE decoded at half the speed of sinusoidal (docs/gpu.md)."""
    return tgt_len == 1


def _concatenate(weights_and_biases) -> Tuple[Tensor, Optional[Tensor]]:
    weights, biases = weights_and_biases[0::2], weights_and_biases[1::2]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None
    return torch.cat(weights), bias


def attention_mask(key_padding_mask, attn_mask, kv_bsz, src_len, dtype, group=1) -> Optional[Tensor]:
    """fairseq's boolean key padding mask and its float or boolean ``attn_mask`` as one additive
    mask (0 or -inf), broadcasting against (batch, heads, tgt, src) logits."""
    mask: Optional[Tensor] = None
    if key_padding_mask is not None:
        mask = torch.zeros(kv_bsz, 1, 1, src_len, dtype=dtype, device=key_padding_mask.device)
        mask = mask.masked_fill(key_padding_mask.bool().view(kv_bsz, 1, 1, src_len), float("-inf"))
    if attn_mask is not None:
        assert group == 1, "an attention mask cannot be combined with beam-shared keys"
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=dtype).masked_fill(attn_mask, float("-inf"))
        attn_mask = attn_mask.to(dtype)
        mask = attn_mask if mask is None else mask + attn_mask
    return mask
