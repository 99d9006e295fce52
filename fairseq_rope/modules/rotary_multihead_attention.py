"""fairseq multi-head attention with Rotary Position Embedding on queries and keys (eq. 14)."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..config_values import check_finite_positive
from .attention import PositionalMultiheadAttention
from .position_scheme import AttentionCall, PositionScheme
from .rotary import positions_from_padding_mask, rotary_dim_for, sequence_lengths
from .rotary_embedding import RotaryEmbedding


class RotaryPositions(PositionScheme):
    """Queries and keys rotate after projection (eq. 14), with ``values`` (RoPER) values too.

    * Self-attention: queries and keys rotate by their column in the batch; left padding shifts a
      sentence's positions by a constant, which changes no score (eq. 16). New keys are rotated
      once and cached rotated; the new query's position is the cached length.
    * Encoder-decoder attention (``--rope-cross-attention``): queries rotate by target position,
      keys by source position within their own sentence.
    * RoPER (``--rope-values``): values rotate by their key position and the output rotates back
      by minus the query position, so value j reaches query i as R_{j - i} v_j.
    * Dynamic scaling: each row rotates with its sentence's factor s = max(1, n / L), n its source
      length, which the layer gives (``call.source_lengths``) or, for the encoder, its own keys'
      padding mask; the same s at every decoding step keeps the key cache consistent.
    * Randomized positions (``--rope-random-positions``): in training mode, self-attention rotates
      by the positions the model drew for the batch (:attr:`sampled`) instead of its columns.
    """

    #: ((batch, time) positions, a bound above them) that the model drew for its current training
    #: batch (``random_positions.sample_positions``); read by self-attention in training mode only,
    #: so that eval mode -- decoding, validation -- keeps 0 .. n - 1. Kept until the next batch's,
    #: for a backward pass that recomputes the forward (--checkpoint-activations).
    sampled: Optional[Tuple[Tensor, int]] = None

    def __init__(self, rotary: RotaryEmbedding, values: bool = False):
        self.rotary, self.values = rotary, bool(values)

    def attach(self, attention) -> None:
        if self.values and not attention.self_attention:
            raise ValueError("--rope-values applies to self-attention only")

    def describe(self) -> str:
        return f"{self.rotary}" + (", values=True" if self.values else "")

    def row_factors(self, call: AttentionCall) -> Optional[Tensor]:
        """s of each query row for a dynamic scaling (None: no row scaled)."""
        if not self.rotary.dynamic:
            return None
        lengths = call.source_lengths
        if lengths is None:  # encoder self-attention: the keys are the source
            lengths = sequence_lengths(call.key_padding_mask, call.src_len, call.bsz, call.query_positions.device)
        return self.rotary.row_factors(lengths)

    def use_sampled_positions(self, attention, call: AttentionCall) -> None:
        """The batch's drawn positions in place of ``call.query_positions`` (self-attention in
        training mode, when the model drew some)."""
        if self.sampled is None or not (attention.training and attention.self_attention):
            return
        positions, end = self.sampled
        if call.offset != 0 or positions.shape != (call.bsz, call.tgt_len):
            raise RuntimeError(f"positions drawn for a batch of shape {tuple(positions.shape)} met a self-attention "
                               f"call of {call.bsz} x {call.tgt_len} tokens at offset {call.offset}: the model's "
                               "forward draws them for the batch it is given")
        call.query_positions, call.positions_end = positions, end

    def encode(self, attention, call: AttentionCall) -> None:
        heads = (attention.num_heads, attention.head_dim)
        self.use_sampled_positions(attention, call)
        queries_and_length = (call.query_positions, call.query_positions_end)
        factors = call.factors = self.row_factors(call)
        if attention.self_attention:  # q and k rotate; with RoPER v too (and is cached rotated)
            rotated_heads = (3 if self.values else 2) * attention.num_heads
            (call.qkv,) = self.rotary.rotate(
                [call.qkv], *queries_and_length, (call.tgt_len, call.bsz, 3 * heads[0], heads[1]),
                overwrite=True, rotated_heads=rotated_heads, factors=factors,
            )
        else:
            (call.q,) = self.rotary.rotate(
                [call.q], *queries_and_length, (call.tgt_len, call.bsz, *heads), overwrite=True, factors=factors
            )
            if call.k is not None:
                if call.key_padding_mask is not None:
                    key_positions = positions_from_padding_mask(call.key_padding_mask)
                else:
                    key_positions = torch.arange(call.src_len, device=call.k.device)
                key_factors = None if factors is None else factors.view(call.kv_bsz, -1)[:, 0]  # beams share keys
                (call.k,) = self.rotary.rotate(
                    [call.k], key_positions, call.src_len, (call.src_len, call.kv_bsz, *heads), overwrite=True,
                    factors=key_factors,
                )
        call.split_projections()
        if factors is not None and self.rotary.scaling == "dynamic-yarn":  # per-row YaRN temperature
            scales = self.rotary.row_logit_scales(factors).to(call.q.device, call.q.dtype)
            call.q = (call.q.reshape(call.tgt_len, call.bsz, -1) * scales.view(1, -1, 1)).view(call.q.shape)
        elif self.rotary.logit_scale != 1.0:  # YaRN attention temperature
            call.q = call.q * self.rotary.logit_scale

    def decode(self, attention, call: AttentionCall, out: Tensor) -> Tensor:
        if not self.values:
            return out
        (out,) = self.rotary.rotate(
            [out], call.query_positions, call.query_positions_end, out.shape, inverse=True, factors=call.factors
        )
        return out


class RotaryMultiheadAttention(PositionalMultiheadAttention):
    """``MultiheadAttention`` with RoPE (:class:`RotaryPositions`); parameters and state-dict keys
    are exactly those of fairseq's ``MultiheadAttention``. ``rotary``: the model's shared
    :class:`RotaryEmbedding`; without it the layer makes its own from the ``rope_*`` options."""

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
        rotary: Optional[RotaryEmbedding] = None,
        **kwargs,
    ):
        if rotary is None:
            check_finite_positive("--rope-theta", rope_theta)
            rotary = RotaryEmbedding(
                rotary_dim_for(embed_dim // num_heads, rope_fraction), rope_theta, rope_layout,
                rope_scaling, rope_scaling_factor, rope_scaling_original_length,
            )
        super().__init__(embed_dim, num_heads, RotaryPositions(rotary, rope_values), **kwargs)

    @property
    def rotary(self) -> RotaryEmbedding:
        return self.positions.rotary
