"""The rotation of one model: its frequencies, its cos/sin tables, and the one ``rotate`` call
that every attention uses.

:meth:`RotaryEmbedding.rotate` picks the backend itself:

* CUDA with Triton (or CPU tensors under Triton's interpreter): one fused kernel launch for q
  and k together (``fused_rotary``);
* tensors the caller gives up (``overwrite=True``, fresh projection outputs): rotated in place,
  the backward pass rotating the gradient in place by -m, so RoPE allocates what the stock
  attention allocates;
* anything else: the reference :func:`~.rotary.apply_rotary`.
"""

from collections import OrderedDict
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .fused_rotary import fused_rotate, fused_rotate_, fused_runs_on
from .rope_scaling import check_scaling, scaling_spec
from .rotary import (
    RotateInPlace,
    apply_rotary,
    apply_rotary_,
    check_layout,
    dynamic_factors,
    next_power_of_two,
    rotation_angles,
)


class RotaryEmbedding:
    """RoPE of ``rotary_dim`` channels per head: theta_i (eq. 15, scaled by ``--rope-scaling``),
    fp32 tables of cos, sin and e^{i m theta_i} per device, grown on demand.

    A plain object rather than a module with buffers: it stays out of the state dict and is never
    cast by ``model.half()``; keying the tables by device means ``model.to(device)`` cannot leave
    a stale one behind. A model's layers share one (see :func:`shared_rotary_embedding`).

    A dynamic scaling (``dynamic-ntk``, ``dynamic-yarn``) keeps the plain tables and scales only
    the rows given a factor s > 1 (:meth:`row_factors`), from a table made for that s as a static
    scaling makes its own: a row with s == 1 uses the very numbers of plain RoPE, a row with
    s > 1 those of ``--rope-scaling-factor s``.
    """

    #: tables of this many factors s are kept (a decoding asks for the same ones at every step)
    scaled_tables_kept = 64

    def __init__(
        self,
        rotary_dim: int,
        theta: float = 10000.0,
        layout: str = "interleaved",
        scaling: str = "none",
        scaling_factor: float = 1.0,
        original_length: int = 0,
    ):
        check_layout(layout)
        self.rotary_dim, self.theta, self.layout = rotary_dim, float(theta), layout
        self.scaling, self.scaling_factor = scaling, float(scaling_factor)
        self.original_length = int(original_length)
        check_scaling(scaling, self.scaling_factor, self.original_length)  # once, here: the frequencies trust it
        self.dynamic = scaling_spec(scaling).per_sentence
        # a dynamic scaling keeps plain RoPE's tables and scales rows (:meth:`scaled`)
        self.inv_freq, self.logit_scale = scaling_spec("none" if self.dynamic else scaling).frequencies(
            rotary_dim, self.theta, self.scaling_factor, self.original_length
        )
        self._tables: Dict[torch.device, Tuple[Tensor, Tensor, Tensor]] = {}
        self._scaled_tables: "OrderedDict[Tuple[float, torch.device], Tensor]" = OrderedDict()

    def __repr__(self) -> str:
        scaling = f", scaling={self.scaling}x{self.scaling_factor:g}" if self.scaling != "none" else ""
        scaling = f", scaling={self.scaling}, L={self.original_length}" if self.dynamic else scaling
        return f"rotary_dim={self.rotary_dim}, theta={self.theta:g}, layout={self.layout}{scaling}"

    def clear_cache(self) -> None:
        self._tables.clear()
        self._scaled_tables.clear()

    def tables(self, length: int, device) -> Tuple[Tensor, Tensor, Tensor]:
        """cos, sin (fp32) and e^{i m theta_i} (complex64, eq. 12) for m < at least ``length``."""
        tables = self._tables.get(device)
        if tables is None or tables[0].size(0) < length:
            tables = _make_tables(self.inv_freq, length, device)
            self._tables[device] = tables
        return tables

    def scaled_table(self, factor: float, length: int, device) -> Tensor:
        """e^{i m theta_i(s)} of one row factor s for m < at least ``length``; the most recently
        used :attr:`scaled_tables_kept` are kept."""
        key = (factor, torch.device(device))
        table = self._scaled_tables.pop(key, None)
        if table is None or table.size(0) < length:
            table = _make_tables(self.scaled(factor)[0], length, device)[2]
        self._scaled_tables[key] = table
        while len(self._scaled_tables) > self.scaled_tables_kept:
            self._scaled_tables.popitem(last=False)
        return table

    def row_factors(self, source_lengths: Optional[Tensor]) -> Optional[Tensor]:
        """s = max(1, n / L) per row of a dynamic scaling; None when no row is scaled."""
        if not self.dynamic or source_lengths is None:
            return None
        factors = dynamic_factors(source_lengths, self.original_length)
        return factors if bool((factors > 1.0).any()) else None

    def scaled(self, factor: float) -> Tuple[Tensor, float]:
        """fp64 theta_i (not to be modified) and logit multiplier of this scaling for one row's
        factor s."""
        return _scaled_frequencies(self.scaling, self.rotary_dim, self.theta, factor, self.original_length)

    def row_logit_scales(self, factors: Tensor) -> Tensor:
        """The attention logit multiplier of each row (YaRN temperature; 1 for s == 1)."""
        values = factors.tolist()
        scale = {s: self.scaled(s)[1] for s in set(values)}
        return torch.tensor([scale[s] for s in values], dtype=torch.float64)

    def rotations(self, positions: Tensor, length: int, factors: Optional[Tensor] = None) -> Tensor:
        """e^{i m theta} (complex64) for ``positions`` -- (time,) shared by the batch or (batch,
        time) per sentence, all < ``length`` -- shaped to broadcast against time-first
        (time, batch, heads, rotary_dim / 2) pairs; rows with a ``factors`` s > 1 scaled by s."""
        table = self.tables(length, positions.device)[2]
        if factors is None and positions.dim() == 1:  # (T, r/2) -> (T, 1, 1, r/2)
            return table[positions].view(positions.size(0), 1, 1, -1)
        if positions.dim() == 1:
            positions = positions.expand(factors.size(0), -1)
        rotations = table[positions.t()]  # gathered time-first: (T, B, r/2)
        if factors is not None:
            # one gather per distinct factor, not per row: a batch of similar lengths has few
            for factor in torch.unique(factors[factors > 1.0]).tolist():
                rows = torch.nonzero(factors == factor).flatten()
                rotations[:, rows] = self.scaled_table(factor, length, table.device)[positions[rows].t()]
        return rotations.unsqueeze(2)

    def rotate(
        self,
        xs: Sequence[Tensor],
        positions: Tensor,
        length: int,
        heads_shape: Tuple[int, int, int, int],
        *,
        inverse: bool = False,
        overwrite: bool = False,
        rotated_heads: Optional[int] = None,
        factors: Optional[Tensor] = None,
    ) -> List[Tensor]:
        """R_m x (eq. 14), or R_{-m} x with ``inverse``, for each of ``xs`` seen as time-first
        ``heads_shape`` (time, batch, heads, head_dim), at ``positions`` ((time,) or (batch, time),
        all < ``length``). Returns tensors shaped like ``xs``.

        ``overwrite=True``: the caller gives ``xs`` up (projection outputs, not views, that
        nothing else reads), so they may be rotated in place. ``rotated_heads``: rotate only the
        first heads (q and k of a fused q/k/v projection), leave the others as they are.
        ``factors``: s per batch row of a dynamic scaling (:meth:`row_factors`).
        """
        heads = slice(None, rotated_heads)
        assert overwrite or rotated_heads is None, "rotated_heads needs overwrite=True"
        if not inverse and fused_runs_on(xs[0].device):
            cos, sin, _ = self.tables(length, positions.device)
            views = [x.view(heads_shape) for x in xs]
            # rows of a scaled sentence are rotated again from a copy of their input, so the
            # others keep the fused kernel's numbers whatever their batch
            scaled = None if factors is None else torch.nonzero(factors > 1.0).flatten()
            inputs = [] if scaled is None else [v[:, scaled, heads] for v in views]
            if overwrite:
                rotated = fused_rotate_(xs, cos, sin, positions, self.layout, heads_shape, heads)
            else:
                rotated = fused_rotate(views, cos, sin, positions, self.layout)
                rotated = [rotated] if len(xs) == 1 else list(rotated)
            if inputs:
                rotations = self.rotations(positions, length, factors)[:, scaled]
                for r, x in zip(rotated, inputs):
                    r.view(heads_shape)[:, scaled, heads] = apply_rotary(x, rotations.real, rotations.imag,
                                                                         self.layout)
            return [r.view(x.shape) for r, x in zip(rotated, xs)]
        rotations = self.rotations(positions, length, factors)
        if inverse:
            rotations = torch.conj_physical(rotations)
        if not overwrite:
            return [
                apply_rotary(x.view(heads_shape), rotations.real, rotations.imag, self.layout).view(x.shape)
                for x in xs
            ]
        rotate_ = reference_rotation_(rotations, self.layout)
        if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
            rotated = RotateInPlace.apply(rotate_, heads_shape, heads, *xs)
            return list(rotated) if len(xs) > 1 else [rotated]
        rotate_([x.view(heads_shape)[:, :, heads] for x in xs], False)  # decoding: no autograd Function to pass
        return list(xs)


def reference_rotation_(rotations: Tensor, layout: str):
    """``rotate_(views, inverse)`` for :class:`~.rotary.RotateInPlace`: the complex ``rotations``
    (or their conjugates, e^{-i m theta}) applied in place."""
    def rotate_(views, inverse):
        factors = torch.conj_physical(rotations) if inverse else rotations
        for view in views:
            apply_rotary_(view, factors, layout)
    return rotate_


@lru_cache(maxsize=256)
def _scaled_frequencies(scaling: str, rotary_dim: int, theta: float, factor: float, original_length: int):
    # kept: every attention call of a dynamic-yarn decoding asks for the logit scale of each factor
    return scaling_spec(scaling).frequencies(rotary_dim, theta, factor, original_length)


def _make_tables(inv_freq: Tensor, length: int, device) -> Tuple[Tensor, Tensor, Tensor]:
    """cos, sin and cos + i sin of m theta_i for m < a power of two >= ``length``; the angles in
    fp64 on the CPU, exact for any realistic m."""
    angles = rotation_angles(torch.arange(next_power_of_two(max(length, 2))), inv_freq)
    cos = torch.cos(angles).to(device=device, dtype=torch.float32)
    sin = torch.sin(angles).to(device=device, dtype=torch.float32)
    return cos, sin, torch.complex(cos, sin)


@lru_cache(maxsize=None)
def shared_rotary_embedding(
    rotary_dim: int, theta: float, layout: str, scaling: str, scaling_factor: float, original_length: int
) -> RotaryEmbedding:
    """One :class:`RotaryEmbedding` for every layer (and model) with the same settings: the same
    numbers, one set of tables."""
    return RotaryEmbedding(rotary_dim, theta, layout, scaling, scaling_factor, original_length)
