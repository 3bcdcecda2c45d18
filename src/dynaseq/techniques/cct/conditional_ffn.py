"""CCT conditional feed-forward layer (Bapna, Arivazhagan, Firat 2020, section 3.2, eq. 15).

The feed-forward layer of width ``ffn_dim`` is split into M independently gated pieces of
width ``ffn_dim / M``, each with its own input and output LayerNorm::

    out_t = Σ_{i=1..M} g_Fi(x_t) · LN_out_i(FF_i(LN_in_i(x_t)))        (eq. 15)

``g_F`` is one control network with M outputs. ``x`` already is LN(x) of the pre-LN layer
(the per-piece input LayerNorms are the paper's "separate layer-normalization for the input
of every independently gated feed-forward sub-network"); the layer adds the residual.

Training: every piece runs on every token, scaled by its soft noisy gate. Inference: hard
0/1 gates ``g_Fi = 1[G(x)_i + δ_b >= 0]`` (δ_b: the call's gate offset of row b, 0 if none);
piece i runs only on the tokens whose gate i is on (``index_select`` → piece →
``index_add``); a token with every gate off gets exactly 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor, nn

from dynaseq.nn.feedforward import FeedForward
from dynaseq.nn.outputs import MACS_TRACE, AuxOutputs, MacsRecord
from dynaseq.techniques.cct.gating import ControlNet, Gate, NoiseSchedule, trace_gate


class FeedForwardPiece(nn.Module):
    """LN_out(FF(LN_in(x))): one gated piece of eq. 15. ``(N, d)`` -> ``(N, d)``."""

    def __init__(self, ffn: FeedForward, in_norm: nn.Module, out_norm: nn.Module) -> None:
        super().__init__()
        self.in_norm, self.ffn, self.out_norm = in_norm, ffn, out_norm

    def forward(self, x: Tensor) -> Tensor:
        return self.out_norm(self.ffn(self.in_norm(x)))


class ConditionalFeedForward(nn.Module):
    """M gated feed-forward pieces (CCT eq. 15); drop-in for :class:`~dynaseq.nn.FeedForward`.

    Args:
        pieces: the M :class:`FeedForwardPiece` (all of input/output width ``d_model``).
        control: :class:`ControlNet` with M gates.
        gate: logits -> gates (noise schedule, hard threshold, override).
        name: sub-layer name carried by its traces.
        fast_paths: at inference, skip pieces whose gate is off for every token and run
            pieces open for every token without gather/scatter (see the module docstring);
            False forces the general gather/scatter path.

    ``forward(x, aux=None, gate_offset=None)``: x ``(B, T, d)`` -> ``(B, T, d)``;
    ``gate_offset``: ``(B,)`` per-row inference offsets of the gates (see
    :class:`~dynaseq.techniques.cct.gating.Gate`). Build it with :func:`conditional_feedforward`.
    """

    def __init__(self, pieces: list[FeedForwardPiece], control: ControlNet, gate: Gate,
                 name: str = "ffn", *, fast_paths: bool = True) -> None:
        super().__init__()
        if not pieces:
            raise ValueError("ConditionalFeedForward needs at least one piece")
        if control.n_gates != len(pieces):
            raise ValueError(f"the control net gives {control.n_gates} gates for "
                             f"{len(pieces)} pieces")
        self.pieces = nn.ModuleList(pieces)
        self.control, self.gate = control, gate
        self.name = name
        self.fast_paths = fast_paths

    @property
    def n_pieces(self) -> int:
        return len(self.pieces)

    def forward(self, x: Tensor, aux: AuxOutputs | None = None,
                gate_offset: Tensor | None = None) -> Tensor:
        logits = self.control(x)
        g = self.gate(logits, gate_offset)  # (B, T, M)
        if self.training:
            out = sum(g[..., i, None] * piece(x) for i, piece in enumerate(self.pieces))
        else:
            out = self._forward_hard(x, g.bool())
        if aux is not None:
            trace_gate(aux, self.name, "ffn", self.gate.for_budget(logits, g),
                       self._piece_costs(g), self.control)
            if not self.training:
                on = g.bool()
                rows = partial(self._valid_rows, on)
                aux.add_trace(MACS_TRACE, MacsRecord(
                    self.name, self.realized_macs(on), self.realized_macs_per_row(on),
                    rows(None, None, True), rows=rows))
        return out

    def _forward_hard(self, x: Tensor, on: Tensor) -> Tensor:
        """Hard-gated eq. 15: x ``(B, T, d)``, on ``(B, T, M)`` bool -> ``(B, T, d)``; piece i
        runs on the tokens whose gate i is on, every other token gets 0 from it."""
        b, t, d = x.shape
        flat_on = on.reshape(b * t, -1)  # (B·T, M)
        if self.fast_paths:
            counts = flat_on.sum(0).tolist()  # open tokens per piece: one host sync
            if not any(counts):  # every gate off: no piece is entered
                return x.new_zeros(b, t, d)
            if all(n == b * t for n in counts):  # every gate on: dense, no gather/scatter
                return sum(piece(x) for piece in self.pieces)
        else:
            counts = [None] * self.n_pieces
        flat_x = x.reshape(b * t, d)
        out = x.new_zeros(b * t, d)
        for i, (piece, n) in enumerate(zip(self.pieces, counts, strict=True)):
            if n == 0:
                continue
            if n == b * t:  # every token: no gather/scatter
                out += piece(flat_x)
                continue
            idx = flat_on[:, i].nonzero().squeeze(1)  # (N_i,)
            if idx.numel():
                out.index_add_(0, idx, piece(flat_x.index_select(0, idx)).to(out.dtype))
        return out.view(b, t, d)

    def _piece_costs(self, g: Tensor) -> Tensor:
        """``(M,)`` MACs one open gate i spends on one token (budget costs C_l)."""
        costs = [sum(p.ffn.macs(1).values()) for p in self.pieces]
        return torch.tensor(costs, dtype=g.dtype, device=g.device)

    def macs(self, n_tokens: int) -> dict[str, int]:
        """Dense maximum (every piece on), keys as ``FeedForward.macs`` plus ``control_ffn``."""
        out = {"ffn_in": 0, "ffn_out": 0}
        for p in self.pieces:
            for k, v in p.ffn.macs(n_tokens).items():
                out[k] += v
        out["control_ffn"] = self.control.macs(n_tokens)
        return out

    def realized_macs(self, on: Tensor) -> dict[str, int]:
        """MACs the inference path executes for a hard gate pattern ``on`` ``(B, T, M)`` bool.

        Piece i runs on its open tokens only; the control net runs on all ``B·T`` tokens.
        """
        if on.size(-1) != self.n_pieces:
            raise ValueError(f"gate pattern has {on.size(-1)} gates, layer has {self.n_pieces}")
        counts = on.reshape(-1, self.n_pieces).sum(0).tolist()
        out = {"ffn_in": 0, "ffn_out": 0}
        for p, n in zip(self.pieces, counts, strict=True):
            for k, v in p.ffn.macs(int(n)).items():
                out[k] += v
        out["control_ffn"] = self.control.macs(on.numel() // self.n_pieces)
        return out

    def realized_macs_per_row(self, on: Tensor) -> Tensor:
        """``(B,)`` long: the MACs of :meth:`realized_macs` that each row's tokens ran, for a
        hard gate pattern ``on`` ``(B, T, M)`` bool (they sum to its total)."""
        if on.size(-1) != self.n_pieces:
            raise ValueError(f"gate pattern has {on.size(-1)} gates, layer has {self.n_pieces}")
        costs = torch.tensor(self._token_macs(), device=on.device)  # (M,)
        ran = (on.sum(1) * costs).sum(1)  # (B,)
        return ran + on.size(1) * self.control.macs(1)

    def pieces_row_macs(self, piece_tokens: Tensor | Sequence[int], n_tokens: Tensor | int
                        ) -> Tensor | int:
        """``(B,)`` long: the MACs of rows whose pieces ran on ``piece_tokens`` ``(B, M)``
        tokens each, over ``n_tokens`` ``(B,)`` tokens (the control network's), as
        :meth:`realized_macs_per_row` counts them; or one row's, from its M numbers and
        one number (no tensor work: a few rows at a time)."""
        if not isinstance(piece_tokens, Tensor):
            return (sum(n * c for n, c in zip(piece_tokens, self._token_macs(), strict=True))
                    + n_tokens * self.control.macs(1))
        costs = torch.tensor(self._token_macs(), device=piece_tokens.device)
        return (piece_tokens * costs).sum(1) + n_tokens * self.control.macs(1)

    def _token_macs(self) -> list[int]:
        """MACs of piece i on one token, per piece."""
        return [sum(p.ffn.macs(1).values()) for p in self.pieces]

    def all_on_row_macs(self, n_tokens: int | Tensor) -> int | Tensor:
        """What one row of ``n_tokens`` tokens (a number, or ``(B,)``, one per row) runs with
        every piece open (:meth:`realized_macs_per_row`; no forward pass needed)."""
        return n_tokens * (sum(self._token_macs()) + self.control.macs(1))

    def _valid_rows(self, on: Tensor, q_valid: Tensor | None, k_valid: Tensor | None,
                    all_on: bool) -> Tensor:
        """:data:`~dynaseq.nn.outputs.RowCounter`: :meth:`realized_macs_per_row` of the
        tokens where ``q_valid`` ``(B, T)`` is True (``k_valid`` is not used: no keys)."""
        if all_on:
            on = torch.ones_like(on)
        if q_valid is None:
            return self.realized_macs_per_row(on)
        return (self.realized_macs_per_row(on & q_valid[..., None])
                - (on.size(1) - q_valid.sum(1)) * self.control.macs(1))


def conditional_feedforward(d_model: int, ffn_dim: int, n_pieces: int = 4,
                            activation_dropout: float = 0.0, *, control_hidden: int = 128,
                            schedule: NoiseSchedule | None = None, hard_budget: bool = False,
                            out_norms: bool = True, name: str = "ffn",
                            fast_paths: bool = True) -> ConditionalFeedForward:
    """CCT feed-forward: ``n_pieces`` (M) pieces of width ``ffn_dim // n_pieces``, each with
    an input and (``out_norms``) an output LayerNorm, and one control net with M gates
    (``fast_paths``: see :class:`ConditionalFeedForward`)."""
    if n_pieces < 1:
        raise ValueError(f"n_pieces must be >= 1, got {n_pieces}")
    if ffn_dim % n_pieces:
        raise ValueError(f"ffn_dim={ffn_dim} is not divisible by n_pieces={n_pieces}: each "
                         "gated piece must have the same width ffn_dim / n_pieces")
    pieces = [FeedForwardPiece(FeedForward(d_model, ffn_dim // n_pieces, activation_dropout),
                               nn.LayerNorm(d_model),
                               nn.LayerNorm(d_model) if out_norms else nn.Identity())
              for _ in range(n_pieces)]
    return ConditionalFeedForward(pieces, ControlNet(d_model, n_pieces, control_hidden),
                                  Gate(schedule, hard_budget), name=name, fast_paths=fast_paths)
