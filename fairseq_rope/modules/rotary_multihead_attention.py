"""fairseq multi-head attention with Rotary Position Embedding on queries and keys."""

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.modules import MultiheadAttention
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..model_options import OptionError, check_finite_positive
from .fused_rotary import can_fuse, fused_available, fused_rotate
from .rotary import (
    LAYOUTS,
    apply_rotary,
    apply_rotary_,
    attention_temperature,
    cos_sin,
    new_token_positions,
    positions_from_padding_mask,
    rotary_dim_for,
    rotation_angles,
    scaled_inverse_frequencies,
)

# Cache key whose *shape* (batch, steps, 0) counts decoder steps for rotary cross-attention. It
# holds no data, and being batch-first it is reordered by beam search like every other entry.
QUERY_STEPS = "rope_query_steps"


class RotaryTable:
    """fp32 cos/sin of m * theta_i for positions 0..length-1, per device, grown on demand.

    A plain attribute rather than a registered buffer: it stays out of the state dict and is
    never cast by ``model.half()``; keying by device means ``model.to(device)`` cannot leave a
    stale table behind.
    """

    def __init__(
        self,
        rotary_dim: int,
        theta: float,
        scaling: str = "none",
        factor: float = 1.0,
        original_length: int = 0,
    ):
        self.rotary_dim = rotary_dim
        self.theta = theta
        # --rope-scaling: frequencies for inputs longer than in training (see
        # scaled_inverse_frequencies); "none" or factor 1 is plain RoPE.
        self.scaling = scaling
        self.factor = float(factor)
        self.original_length = int(original_length)
        self.inv_freq = scaled_inverse_frequencies(
            rotary_dim, theta, scaling, self.factor, self.original_length, dtype=torch.float64
        )
        self.attention_factor = attention_temperature(scaling, self.factor)
        self._tables: Dict[torch.device, Tuple[Tensor, Tensor]] = {}

    def angles(self, length: int) -> Tensor:
        """m * theta_i for m < length, computed in fp64 on the CPU (exact for any realistic m)."""
        return rotation_angles(torch.arange(length), self.inv_freq)

    def tables(self, max_position: int, device) -> Tuple[Tensor, Tensor, Tensor]:
        """cos, sin (fp32) and e^{i m theta_i} (complex64, eq. 12) for m < at least ``max_position``,
        on ``device``."""
        tables = self._tables.get(device)
        if tables is None or tables[0].size(0) < max_position:
            length = 1 << max(int(max_position) - 1, 1).bit_length()
            cos, sin = cos_sin(self.angles(length))
            cos = cos.to(device=device, dtype=torch.float32)
            sin = sin.to(device=device, dtype=torch.float32)
            tables = (cos, sin, torch.complex(cos, sin))
            self._tables[device] = tables
        return tables

    def lookup(self, positions: Tensor, max_position: int, gather: bool = True) -> Tuple[Tensor, Tensor]:
        """cos, sin (fp32) for integer ``positions`` (any shape, all < ``max_position``); with
        ``gather=False``, the whole tables (length >= ``max_position``) on their device."""
        cos, sin, _ = self.tables(max_position, positions.device)
        if not gather:
            return cos, sin
        return cos[positions], sin[positions]

    def factors(self, positions: Tensor, max_position: int) -> Tensor:
        """e^{i m theta_i} (complex64) for integer ``positions`` (any shape, all < ``max_position``):
        one gather where :meth:`lookup` needs two."""
        return self.tables(max_position, positions.device)[2][positions]


class RotateProjectionsInPlace(torch.autograd.Function):
    """R_m (eq. 14) written into fresh projection outputs; backward rotates the incoming
    gradient in place by -m (R_m^T = R_{-m}).

    Each input is a linear layer's (time * batch, embed_dim) output -- not a view, so autograd
    needs no copy to track the in-place change -- rotated as ``heads_shape`` (time, batch, heads,
    head_dim) by the complex ``factor`` e^{i m theta}. In place because a projection output is not
    kept for backward, and the rotated tensors and their gradients live only inside one attention
    call: no activation-sized tensor is made in either direction, so RoPE allocates what the stock
    attention allocates.
    """

    @staticmethod
    def forward(ctx, factor: Tensor, layout: str, heads_shape: Tuple[int, ...], *xs: Tensor):
        for x in xs:
            apply_rotary_(x.view(heads_shape), factor, layout)
        ctx.mark_dirty(*xs)
        ctx.save_for_backward(factor)
        ctx.layout, ctx.heads_shape = layout, heads_shape
        return xs if len(xs) > 1 else xs[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Tensor):
        (factor,) = ctx.saved_tensors
        inverse = torch.conj_physical(factor)  # e^{-i m theta}
        rotated = []
        for grad in grads:
            grad = grad.contiguous()  # a no-op for the dense gradients attention produces
            apply_rotary_(grad.view(ctx.heads_shape), inverse, ctx.layout)
            rotated.append(grad)
        return (None, None, None, *rotated)


class RotaryMultiheadAttention(MultiheadAttention):
    """``MultiheadAttention`` whose queries and keys are rotated after projection (eq. 14).

    Parameters and state-dict keys are exactly those of fairseq's ``MultiheadAttention``.

    * Self-attention: queries and keys rotate by their column in the batch; left padding shifts a
      sentence's positions by a constant, which changes no score (eq. 16).
    * Encoder-decoder attention (``--rope-cross-attention``): queries rotate by target position,
      keys by source position.
    * Incremental decoding: each new key is rotated once and cached rotated; the new query's
      position is the cached length.
    * Without requested attention weights, attention runs through
      ``F.scaled_dot_product_attention``; with them, an explicit softmax gives the same output.
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        rope_theta: float = 10000.0,
        rope_fraction: float = 1.0,
        rope_layout: str = "interleaved",
        rope_values: bool = False,
        rope_scaling: str = "none",
        rope_scaling_factor: float = 1.0,
        rope_scaling_original_length: int = 0,
        **kwargs,
    ):
        if kwargs.get("add_bias_kv") or kwargs.get("add_zero_attn"):
            raise ValueError("rotary attention does not support add_bias_kv / add_zero_attn")
        if kwargs.get("xformers_att_config"):
            raise ValueError(
                "--encoder/decoder-xformers-att-config cannot be combined with rotary attention"
            )
        super().__init__(embed_dim, num_heads, **kwargs)
        check_rope_options(rope_theta, rope_layout)
        self.rope_theta = float(rope_theta)
        self.rope_layout = rope_layout
        self.rotary_dim = rotary_dim_for(self.head_dim, rope_fraction)
        self.rotary_table = RotaryTable(
            self.rotary_dim,
            self.rope_theta,
            rope_scaling,
            rope_scaling_factor,
            rope_scaling_original_length,
        )
        # RoPER (--rope-values): values rotate by their key position and the output rotates back
        # by minus the query position, so value j reaches query i as R_{j - i} v_j.
        if rope_values and not self.self_attention:
            raise ValueError("--rope-values applies to self-attention only")
        self.rope_values = bool(rope_values)

    def extra_repr(self) -> str:
        return (
            f"rotary_dim={self.rotary_dim}, head_dim={self.head_dim}, "
            f"theta={self.rope_theta:g}, layout={self.rope_layout}"
            + (", values=True" if self.rope_values else "")
            + (
                f", scaling={self.rotary_table.scaling}x{self.rotary_table.factor:g}"
                if self.rotary_table.scaling != "none"
                else ""
            )
        )

    def self_attention_positions(self, offset: int, length: int, device) -> Tensor:
        """Positions (time,) of the new tokens of a self-attention call, ``offset`` of them cached."""
        return new_token_positions(offset, length, device)

    def time_first_cos_sin(self, positions: Tensor, max_position: int) -> Tuple[Tensor, Tensor]:
        """fp32 cos/sin for ``positions`` -- (time,) shared by the batch or (batch, time) per
        sentence -- shaped to broadcast against time-first (time, batch, heads, rotary_dim/2)."""
        factor = self.time_first_factors(positions, max_position)
        return factor.real, factor.imag

    def rotate(self, x: Tensor, positions: Tensor, max_position: int) -> Tensor:
        """R_m x (eq. 14) for time-first ``x`` (time, batch, heads, head_dim) at ``positions``."""
        return self.rotate_together([x], positions, max_position)[0]

    def rotate_together(self, xs: List[Tensor], positions: Tensor, max_position: int) -> List[Tensor]:
        """Rotate several time-first tensors (q and k) by the same positions: one cos/sin lookup,
        and on CUDA with Triton one fused kernel launch for all of them (forward and backward)."""
        if can_fuse(xs[0]):
            cos_table, sin_table = self.rotary_table.lookup(positions, max_position, gather=False)
            rotated = fused_rotate(xs, cos_table, sin_table, positions, self.rope_layout)
            return [rotated] if len(xs) == 1 else list(rotated)
        cos, sin = self.time_first_cos_sin(positions, max_position)
        return [apply_rotary(x, cos, sin, self.rope_layout) for x in xs]

    def time_first_factors(self, positions: Tensor, max_position: int) -> Tensor:
        """e^{i m theta} (complex64) for ``positions`` -- (time,) shared by the batch or (batch,
        time) per sentence -- shaped to broadcast against time-first (time, batch, heads,
        rotary_dim/2) pairs."""
        if positions.dim() == 1:  # (T, r/2) -> (T, 1, 1, r/2)
            return self.rotary_table.factors(positions, max_position).view(positions.size(0), 1, 1, -1)
        # gathered time-first, (T, B, r/2) -> (T, B, 1, r/2): a contiguous factor to multiply by
        return self.rotary_table.factors(positions.t(), max_position).unsqueeze(2)

    def rotate_projections_(
        self, xs: List[Tensor], length: int, batch: int, positions: Tensor, max_position: int
    ) -> List[Tensor]:
        """Rotate projection outputs, each (length * batch, embed_dim) in time-major order, by
        ``positions``: in place on the CPU, with the fused kernel on CUDA with Triton."""
        heads_shape = (length, batch, self.num_heads, self.head_dim)
        if xs[0].is_cuda and fused_available():
            rotated = self.rotate_together([x.view(heads_shape) for x in xs], positions, max_position)
            return [x.view(length * batch, -1) for x in rotated]
        factor = self.time_first_factors(positions, max_position)
        if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
            rotated = RotateProjectionsInPlace.apply(factor, self.rope_layout, heads_shape, *xs)
            return list(rotated) if len(xs) > 1 else [rotated]
        for x in xs:
            apply_rotary_(x.view(heads_shape), factor, self.rope_layout)
        return xs

    def rotate_back(self, x: Tensor, positions: Tensor, max_position: int) -> Tensor:
        """R_{-m} x, the inverse rotation, for time-first ``x`` (RoPER's output rotation)."""
        cos, sin = self.time_first_cos_sin(positions, max_position)
        return apply_rotary(x, cos, -sin, self.rope_layout)

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
            raise NotImplementedError("before_softmax is not supported by rotary attention")
        need_weights = need_weights or need_head_weights
        tgt_len, bsz, embed_dim = query.size()
        assert embed_dim == self.embed_dim, f"query dim {embed_dim} != {self.embed_dim}"
        heads, head_dim = self.num_heads, self.head_dim

        saved_state = self._get_input_buffer(incremental_state) if incremental_state is not None else None
        cached = saved_state is not None and "prev_key" in saved_state

        # Projections are made from 2-D inputs: (time * batch, embed_dim) outputs, not views,
        # that the rotation may overwrite.
        query_rows = query.reshape(-1, embed_dim)
        q = self.q_proj(query_rows)
        k = v = None
        src_len, kv_bsz = tgt_len, bsz
        if self.self_attention:
            k = self.k_proj(query_rows)
            v = self.v_proj(query_rows)
        elif not (static_kv and cached):
            assert key is not None and value is not None
            if self.encoder_decoder_attention and self.beam_size > 1 and bsz == key.size(1):
                # the encoder output is identical across a sentence's beams: keep one copy
                key = key.view(key.size(0), -1, self.beam_size, key.size(2))[:, :, 0, :]
                value = value.view(value.size(0), -1, self.beam_size, value.size(2))[:, :, 0, :]
                if key_padding_mask is not None:
                    key_padding_mask = key_padding_mask.view(
                        -1, self.beam_size, key_padding_mask.size(1)
                    )[:, 0, :]
            src_len, kv_bsz = key.size(0), key.size(1)
            k = self.k_proj(key.reshape(-1, embed_dim))
            v = self.v_proj(value.reshape(-1, embed_dim))

        # Positions and rotation (eq. 14): new keys are rotated here, once, before caching.
        device = query.device
        if self.self_attention:
            offset = saved_state["prev_key"].size(2) if cached else 0
            positions = self.self_attention_positions(offset, tgt_len, device)
            if self.rope_values:  # values are cached rotated, like the keys
                q, k, v = self.rotate_projections_([q, k, v], tgt_len, bsz, positions, offset + tgt_len)
            else:
                q, k = self.rotate_projections_([q, k], tgt_len, bsz, positions, offset + tgt_len)
        else:
            steps = saved_state.get(QUERY_STEPS) if saved_state is not None else None
            offset = steps.size(1) if steps is not None else 0
            query_positions = torch.arange(offset, offset + tgt_len, device=device)
            (q,) = self.rotate_projections_([q], tgt_len, bsz, query_positions, offset + tgt_len)
            if k is not None:
                if key_padding_mask is not None:
                    key_positions = positions_from_padding_mask(key_padding_mask)
                else:
                    key_positions = torch.arange(src_len, device=device)
                (k,) = self.rotate_projections_([k], src_len, kv_bsz, key_positions, src_len)

        if self.rotary_table.attention_factor != 1.0:  # YaRN attention temperature
            q = q * self.rotary_table.attention_factor

        # Batch-first heads: (batch, heads, time, head_dim), the layout fairseq caches.
        q = q.view(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)
        if k is not None:
            k = k.view(src_len, kv_bsz, heads, head_dim).permute(1, 2, 0, 3)
            v = v.view(src_len, kv_bsz, heads, head_dim).permute(1, 2, 0, 3)

        if saved_state is not None:
            k, v, key_padding_mask = append_to_cache(saved_state, k, v, key_padding_mask, static_kv)
            if not self.self_attention:
                saved_state[QUERY_STEPS] = k.new_empty(k.size(0), offset + tgt_len, 0)
            self._set_input_buffer(incremental_state, saved_state)

        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None
        attn, attn_weights = self.attend(q, k, v, key_padding_mask, attn_mask, need_weights)
        attn = attn.permute(2, 0, 1, 3)
        if self.rope_values:
            attn = self.rotate_back(attn, positions, offset + tgt_len)
        attn = self.out_proj(attn.reshape(tgt_len, bsz, embed_dim))
        if attn_weights is not None and not need_head_weights:
            attn_weights = attn_weights.mean(dim=0)
        return attn, attn_weights

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Optional[Tensor],
        attn_mask: Optional[Tensor],
        need_weights: bool,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """softmax(q k^T / sqrt(d) + masks) v on batch-first heads.

        Returns the output (batch, heads, tgt, head_dim) and, if ``need_weights``, the fp32
        attention probabilities (heads, batch, tgt, src) as fairseq does.
        """
        bsz, heads, tgt_len, head_dim = q.size()
        kv_bsz, src_len = k.size(0), k.size(2)
        group = bsz // kv_bsz
        if group > 1:
            # beams share one copy of the encoder keys: fold them into extra query rows
            q = q.reshape(kv_bsz, group, heads, tgt_len, head_dim).transpose(1, 2)
            q = q.reshape(kv_bsz, heads, group * tgt_len, head_dim)

        mask: Optional[Tensor] = None
        if key_padding_mask is not None:
            mask = torch.zeros(kv_bsz, 1, 1, src_len, dtype=q.dtype, device=q.device)
            mask = mask.masked_fill(key_padding_mask.bool().view(kv_bsz, 1, 1, src_len), float("-inf"))
        if attn_mask is not None:
            assert group == 1, "an attention mask cannot be combined with beam-shared keys"
            if attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(attn_mask, float("-inf"))
            attn_mask = attn_mask.to(q.dtype)
            mask = attn_mask if mask is None else mask + attn_mask

        dropout_p = (
            self.dropout_module.p
            if self.training or self.dropout_module.apply_during_inference
            else 0.0
        )
        weights = None
        # A single query row (an incremental decoding step) on the CPU runs about twice as fast
        # as two batched matmuls than through SDPA's flash kernel (torch 2.13, beam-search batches).
        single_query_on_cpu = q.size(2) == 1 and q.device.type == "cpu"
        if not need_weights and not single_query_on_cpu:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        else:
            rows = q.size(2)
            scores = torch.bmm((q * self.scaling).flatten(0, 1), k.flatten(0, 1).transpose(1, 2))
            if mask is not None:
                scores = (scores.view(kv_bsz, heads, rows, src_len) + mask).flatten(0, 1)
            probs = utils.softmax(scores, dim=-1)  # fp32, as fairseq returns them
            if dropout_p > 0:
                probs_for_values = F.dropout(probs.type_as(scores), dropout_p, training=True)
            else:
                probs_for_values = probs if probs.dtype == scores.dtype else probs.type_as(scores)
            out = torch.bmm(probs_for_values, v.flatten(0, 1)).view(kv_bsz, heads, rows, head_dim)
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


def append_to_cache(
    saved_state: Dict[str, Optional[Tensor]],
    k: Optional[Tensor],
    v: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    static_kv: bool = False,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Extend fairseq's batch-first key/value cache (batch, heads, time, head_dim) with the new
    ``k``/``v`` (or, for ``static_kv``, reuse the cached ones), store the result and the combined
    padding mask in ``saved_state``, and return them."""
    if "prev_key" in saved_state:
        prev_key, prev_value = saved_state["prev_key"], saved_state["prev_value"]
        if static_kv:
            k, v = prev_key, prev_value
        else:
            k = torch.cat([prev_key, k], dim=2)
            v = torch.cat([prev_value, v], dim=2)
    key_padding_mask = MultiheadAttention._append_prev_key_padding_mask(
        key_padding_mask=key_padding_mask,
        prev_key_padding_mask=saved_state.get("prev_key_padding_mask"),
        batch_size=k.size(0),
        src_len=k.size(2),
        static_kv=static_kv,
    )
    saved_state["prev_key"], saved_state["prev_value"] = k, v
    saved_state["prev_key_padding_mask"] = key_padding_mask
    return k, v, key_padding_mask


def check_rope_options(theta: float, layout: str) -> None:
    check_finite_positive("--rope-theta", theta)
    if layout not in LAYOUTS:
        raise OptionError(f"--rope-layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
