"""Run work only on selected tokens: gather the selected rows, pack them per sequence, scatter back.

A selection is a ``(B, T)`` bool mask. Position-wise work (projections, feed-forward) runs
on the ``N`` selected rows of the flattened ``(B·T, d)`` tokens (``index_select`` →
compute → ``index_copy``). Work that mixes tokens of one sequence (attention) runs on a
``(B', W, d)`` packed layout: the ``B'`` sequences with a selected token, their selected
tokens moved to the left in order, padded to the widest (``W``). Nothing is computed for
unselected tokens, except padding slots of the packed layout, which are counted as run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Packing:
    """Selected tokens of a ``(B, T)`` mask, packed to the left per sequence.

    flat: ``(N,)`` indices of the selected tokens in the flattened ``(B·T)`` order.
    rows: ``(B',)`` the sequences that are packed (ascending).
    slot: ``(N,)`` index of each selected token in the flattened ``(B'·W)`` packed layout.
    pos: ``(B', W)`` original position ``t`` of each packed slot (0 in padding slots).
    valid: ``(B', W)`` True at real slots, False at padding slots.
    """

    flat: Tensor
    rows: Tensor
    slot: Tensor
    pos: Tensor
    valid: Tensor

    @classmethod
    def of(cls, selected: Tensor, rows: Tensor | None = None) -> Packing:
        """Pack ``selected`` ``(B, T)`` bool; ``rows`` restricts to some sequences.

        Without ``rows`` the packed sequences are those with at least one selected token.
        """
        if selected.dim() != 2 or selected.dtype != torch.bool:
            raise ValueError(f"selected must be a (B, T) bool tensor, got {tuple(selected.shape)} "
                             f"{selected.dtype}")
        t = selected.size(1)
        if rows is None:
            rows = selected.any(1).nonzero().squeeze(1)
        sel = selected.index_select(0, rows)  # (B', T)
        counts = sel.sum(1)  # (B',)
        width = int(counts.max()) if rows.numel() else 0
        b_idx, t_idx = sel.nonzero(as_tuple=True)  # row-major: sequence by sequence, in order
        rank = sel.cumsum(1)[b_idx, t_idx] - 1
        slot = b_idx * width + rank
        pos = torch.zeros(rows.numel() * width, dtype=torch.long, device=selected.device)
        pos = pos.index_copy_(0, slot, t_idx).view(rows.numel(), width)
        valid = torch.arange(width, device=selected.device) < counts[:, None]
        return cls(rows[b_idx] * t + t_idx, rows, slot, pos, valid)

    @property
    def width(self) -> int:
        return self.pos.size(1)

    @property
    def n_rows(self) -> int:
        return self.pos.size(0)

    def pack(self, values: Tensor) -> Tensor:
        """``(N, d)`` values of the selected tokens (in ``flat`` order) -> ``(B', W, d)``."""
        out = values.new_zeros(self.n_rows * self.width, values.size(-1))
        return out.index_copy_(0, self.slot, values).view(self.n_rows, self.width, -1)

    def unpack(self, packed: Tensor) -> Tensor:
        """``(B', W, d)`` -> ``(N, d)`` rows of the selected tokens, in ``flat`` order."""
        return packed.reshape(self.n_rows * self.width, -1).index_select(0, self.slot)

    def select(self, full: Tensor) -> Tensor:
        """Packed slots of ``full`` ``(B, T, d)`` -> ``(B', W, d)`` with one ``index_select``
        of whole rows; padding slots hold position 0's row (mask them)."""
        b, t, d = full.shape
        index = (self.rows[:, None] * t + self.pos).reshape(-1)  # (B'·W,)
        return full.reshape(b * t, d).index_select(0, index).view(self.n_rows, self.width, d)

    def gather(self, full: Tensor, dim: int, *, rows_selected: bool = False) -> Tensor:
        """Pick the packed slots out of ``full`` ``(B, ..., T, ...)`` along ``dim`` (T's dim).

        Returns ``full`` restricted to ``rows`` with dim ``dim`` of size ``W``; padding slots
        hold position 0's values (mask them). ``rows_selected``: ``full`` already holds only
        the ``B'`` packed sequences.
        """
        dim = dim % full.dim()
        assert dim > 0, "dim 0 is the batch"
        sub = full if rows_selected else full.index_select(0, self.rows)
        shape = [self.n_rows] + [1] * (full.dim() - 1)
        shape[dim] = self.width
        index = self.pos.view(shape).expand(*sub.shape[:dim], self.width, *sub.shape[dim + 1:])
        return sub.gather(dim, index)


def scatter_rows(values: Tensor, flat: Tensor, n_total: int) -> Tensor:
    """``(N, d)`` rows at flat indices ``flat`` -> ``(n_total, d)``, zeros elsewhere."""
    return values.new_zeros(n_total, values.size(-1)).index_copy_(0, flat, values)
