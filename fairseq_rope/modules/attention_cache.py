"""fairseq's incremental key/value cache of one attention, batch-first (batch, heads, time,
head_dim) as ``MultiheadAttention`` keeps it, with the beam reorder of self-attention keys and
values deferred to the next append: beam search then copies the cache once per step, not twice."""

from typing import Dict, Optional, Tuple

import torch
from fairseq.modules import MultiheadAttention
from torch import Tensor

# Cache key whose *shape* (batch, steps, 0) counts decoder steps where no key cache does
# (encoder-decoder and linear attention). It holds no data, and being batch-first it is
# reordered by beam search like every other entry.
QUERY_STEPS = "query_steps"
# Cache key of a beam reorder of the self-attention keys and values not applied yet (see
# ``defer_reorder``): (batch,) rows of the cached batch, in the new batch's order.
PENDING_ORDER = "pending_beam_order"
DEFERRED_BY_REORDER = ("prev_key", "prev_value", PENDING_ORDER)


def defer_reorder(buffer: Dict[str, Optional[Tensor]], new_order: Tensor) -> Dict[str, Optional[Tensor]]:
    """Beam reorder of a self-attention cache: every entry but the keys and values now, those
    by the next :func:`append_to_cache` (orders given in a row compose)."""
    pending = buffer.get(PENDING_ORDER)
    for name, value in buffer.items():
        if value is not None and name not in DEFERRED_BY_REORDER:
            buffer[name] = value.index_select(0, new_order)
    buffer[PENDING_ORDER] = new_order if pending is None else pending.index_select(0, new_order)
    return buffer


def append_along_time(cache: Tensor, new: Tensor, order: Optional[Tensor]) -> Tensor:
    """``torch.cat([cache[order], new], dim=2)`` on (batch, heads, time, head_dim), the gather
    written straight into the result (``index_select`` with ``out=`` takes strided outputs)."""
    if order is None:
        return torch.cat([cache, new], dim=2)
    needs_autograd = torch.is_grad_enabled() and (cache.requires_grad or new.requires_grad)  # out= has none
    # index_select writes through a strided out= on the CPU (tested) and CUDA (its kernel uses the
    # output strides); elsewhere, two copies
    if needs_autograd or cache.device.type not in ("cpu", "cuda"):
        return torch.cat([cache.index_select(0, order), new], dim=2)
    _, heads, steps, head_dim = cache.shape
    out = cache.new_empty(order.numel(), heads, steps + new.size(2), head_dim)
    torch.index_select(cache, 0, order, out=out[:, :, :steps])
    out[:, :, steps:] = new
    return out


def append_to_cache(
    saved_state: Dict[str, Optional[Tensor]],
    k: Optional[Tensor],
    v: Optional[Tensor],
    key_padding_mask: Optional[Tensor],
    static_kv: bool = False,
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Extend the cached keys and values, gathered first by a pending beam reorder, with the new
    ``k``/``v`` (or, for ``static_kv``, reuse the cached ones), store the result and the combined
    padding mask in ``saved_state``, and return them."""
    if "prev_key" in saved_state:
        prev_key, prev_value = saved_state["prev_key"], saved_state["prev_value"]
        order = saved_state.pop(PENDING_ORDER, None)
        if static_kv:
            assert order is None, "encoder-decoder caches are reordered at once"
            k, v = prev_key, prev_value
        else:
            k = append_along_time(prev_key, k, order)
            v = append_along_time(prev_value, v, order)
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
