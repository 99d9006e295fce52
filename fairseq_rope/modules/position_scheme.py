"""What one attention call carries through the pipeline, and the hooks of a position scheme
(see ``attention.PositionalMultiheadAttention``)."""

from dataclasses import dataclass
from typing import Dict, Optional

from torch import Tensor


@dataclass
class AttentionCall:
    """One forward call after :meth:`PositionalMultiheadAttention._prepare_inputs`.

    ``q``, ``k``, ``v`` are projection outputs shaped (time * batch, embed_dim), time-major;
    ``k``/``v`` are None when encoder-decoder attention reuses its cached keys. Self-attention
    projects all three at once: ``qkv`` (time * batch, 3 * embed_dim) holds them until
    :meth:`split_projections`."""

    q: Optional[Tensor]
    k: Optional[Tensor]
    v: Optional[Tensor]
    qkv: Optional[Tensor]
    tgt_len: int
    bsz: int
    src_len: int
    kv_bsz: int
    key_padding_mask: Optional[Tensor]
    saved_state: Optional[Dict[str, Optional[Tensor]]]
    offset: int  # query positions already processed (cached) before this call
    query_positions: Tensor  # (tgt_len,) for the new tokens, or (bsz, tgt_len) per sentence
    static_kv: bool = False
    # (batch,) source length of each query row, where the layer gives it (dynamic --rope-scaling)
    source_lengths: Optional[Tensor] = None
    factors: Optional[Tensor] = None  # (batch,) s of a per-sentence scaling, once encode has chosen it
    # every query position is below this; None: offset + tgt_len (set where a scheme samples the
    # positions of a training batch, ``--rope-random-positions``, which replace query_positions)
    positions_end: Optional[int] = None

    @property
    def query_positions_end(self) -> int:
        return self.positions_end if self.positions_end is not None else self.offset + self.tgt_len

    def split_projections(self) -> None:
        if self.qkv is not None:
            self.q, self.k, self.v = self.qkv.chunk(3, dim=1)
            self.qkv = None


class PositionScheme:
    """How positions enter attention; the default changes nothing. Hooks, in call order:"""

    #: scores must be formed explicitly (no fused scaled_dot_product_attention)
    needs_explicit_scores = False

    def attach(self, attention) -> None:
        """Add the scheme's parameters to ``attention`` (after fairseq's own are made)."""

    def encode(self, attention, call: AttentionCall) -> None:
        """Change ``call.q``/``k``/``v`` (projection rows) before they are cached."""

    def score_bias(self, attention, call: AttentionCall, scaled_q: Tensor, src_len: int) -> Optional[Tensor]:
        """A term added to the (batch, heads, tgt, src) logits, from q already scaled."""
        return None

    def value_bias(self, attention, call: AttentionCall, probs: Tensor) -> Optional[Tensor]:
        """A term added to the (batch, heads, tgt, head_dim) output, from the probabilities."""
        return None

    def decode(self, attention, call: AttentionCall, out: Tensor) -> Tensor:
        """Change the time-first (tgt, batch, heads, head_dim) output before ``out_proj``."""
        return out

    def describe(self) -> str:
        return ""
