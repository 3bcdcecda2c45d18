"""CCT conditional feed-forward layer (Bapna, Arivazhagan, Firat 2020, section 3.2, eq. 15).

The feed-forward layer of width ``ffn_dim`` is split into M independently gated pieces of
width ``ffn_dim / M``, each with its own input and output LayerNorm::

    out_t = Σ_{i=1..M} g_Fi(x_t) · LN_out_i(FF_i(LN_in_i(x_t)))        (eq. 15)

``g_F`` is one control network with M outputs. ``x`` already is LN(x) of the pre-LN layer
(the per-piece input LayerNorms are the paper's "separate layer-normalization for the input
of every independently gated feed-forward sub-network"); the layer adds the residual.

Training: every piece runs on every token, scaled by its soft noisy gate. Inference: hard
0/1 gates; piece i runs only on the tokens whose gate i is on (``index_select`` → piece →
``index_add``); a token with every gate off gets exactly 0. Tokens with every gate on (all
of them at budget 1) take one fused pass instead of M small ones: the input LayerNorms share
their statistics, so their affine parts fold into the first matrices,

    W1_i LN_in_i(x) + b1_i = (W1_i diag γ_i) x̂ + (W1_i β_i + b1_i),   x̂ = (x − μ) / σ,

the M input LayerNorms become one normalization and the M first matrices one ``(ffn_dim,
d)`` matmul; the second matrices run piece by piece on slices of the hidden activations
(each into its output LayerNorm), or as one ``(d, ffn_dim)`` matmul without output
LayerNorms. The same multiply-adds as the M pieces, in fewer kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.adaptive.gating import (
    GATE_TRACE,
    MACS_TRACE,
    ControlNet,
    Gate,
    GateTrace,
    MacsRecord,
    NoiseSchedule,
    control_trace,
)
from dynaseq.nn.feedforward import FeedForward
from dynaseq.nn.outputs import AuxOutputs

# Tokens per block of the fused pass: its (N, ffn_dim) hidden activations stay in cache (at
# ffn_dim 1024 one block is 1 MiB): on this project's 2-core CPU one 1280-token block ran
# 1.14x the time of the M pieces, while up to 256 tokens ran 0.8-0.9x.
FUSED_ROWS = 256


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
        fuse: at inference, run the tokens with every gate on as one folded pass (module
            docstring); False runs them piece by piece like the others (same outputs up to
            float rounding; for timing the fold).

    ``forward(x, aux=None)``: x ``(B, T, d)`` -> ``(B, T, d)``. Build it with
    :func:`conditional_feedforward`.
    """

    def __init__(self, pieces: list[FeedForwardPiece], control: ControlNet, gate: Gate,
                 name: str = "ffn", fuse: bool = True) -> None:
        super().__init__()
        if not pieces:
            raise ValueError("ConditionalFeedForward needs at least one piece")
        if control.n_gates != len(pieces):
            raise ValueError(f"the control net gives {control.n_gates} gates for "
                             f"{len(pieces)} pieces")
        self.pieces = nn.ModuleList(pieces)
        self.control, self.gate = control, gate
        self.name, self.fuse = name, fuse
        # (parameter versions, folded weights): a plain attribute, never in a state dict
        self._fused_cache: tuple[tuple, _Fused | None] | None = None

    @property
    def n_pieces(self) -> int:
        return len(self.pieces)

    def forward(self, x: Tensor, aux: AuxOutputs | None = None) -> Tensor:
        logits = self.control(x)
        g = self.gate(logits)  # (B, T, M)
        if self.training:
            out = sum(g[..., i, None] * piece(x) for i, piece in enumerate(self.pieces))
        else:
            out = self._forward_hard(x, g.bool())
        if aux is not None:
            aux.add_trace(GATE_TRACE, GateTrace(self.name, "ffn", self.gate.for_budget(logits, g),
                                                self._piece_costs(g), "input"))
            aux.add_trace(GATE_TRACE, control_trace(self.name, self.control, g, "input"))
            if not self.training:
                aux.add_trace(MACS_TRACE, MacsRecord(self.name, self.realized_macs(g.bool())))
        return out

    def _forward_hard(self, x: Tensor, on: Tensor) -> Tensor:
        b, t, d = x.shape
        flat_x = x.reshape(b * t, d)
        flat_on = on.reshape(b * t, -1)  # (B·T, M)
        fused = self._fused_weights() if self.fuse else None
        if fused is not None and self.n_pieces > 1:
            all_on = flat_on.all(1)
            n_all = int(all_on.sum())
            if n_all == b * t:
                return self._forward_fused(flat_x, fused).view(b, t, d)
            if n_all:
                idx = all_on.nonzero().squeeze(1)
                out = x.new_zeros(b * t, d)
                out.index_add_(0, idx, self._forward_fused(flat_x.index_select(0, idx), fused))
                return self._forward_pieces(flat_x, flat_on & ~all_on[:, None], out).view(b, t, d)
        return self._forward_pieces(flat_x, flat_on, x.new_zeros(b * t, d)).view(b, t, d)

    def _forward_pieces(self, flat_x: Tensor, flat_on: Tensor, out: Tensor) -> Tensor:
        """Add piece i's output on the tokens whose ``flat_on[:, i]`` is set to ``out``
        ``(N, d)``; ``flat_x`` ``(N, d)``."""
        n = flat_x.size(0)
        for i, piece in enumerate(self.pieces):
            idx = flat_on[:, i].nonzero().squeeze(1)
            if idx.numel() == n:  # every token: no gather/scatter
                out += piece(flat_x)
            elif idx.numel():
                out.index_add_(0, idx, piece(flat_x.index_select(0, idx)))
        return out

    def _fused_weights(self) -> _Fused | None:
        """The pieces' weights folded for :meth:`_forward_fused`, rebuilt when a parameter
        changes (in place or replaced); None where the pieces are not the standard
        LayerNorm → :class:`FeedForward` → LayerNorm / Identity the fold is exact for."""
        key = tuple((p.data_ptr(), p._version) for p in self.pieces.parameters())
        if self._fused_cache is None or self._fused_cache[0] != key:
            self._fused_cache = (key, _fold(list(self.pieces)))
        return self._fused_cache[1]

    def _forward_fused(self, x: Tensor, w: _Fused) -> Tensor:
        """Σ_i LN_out_i(FF_i(LN_in_i(x))) in one pass: ``x`` ``(N, d)`` -> ``(N, d)``, in
        blocks of :data:`FUSED_ROWS` tokens."""
        if x.size(0) > FUSED_ROWS:
            return torch.cat([self._forward_fused(b, w) for b in x.split(FUSED_ROWS)])
        h = F.linear(F.layer_norm(x, x.shape[-1:], eps=w.in_eps), w.w1, w.b1).relu_()
        if w.w2 is not None:  # no output LayerNorms: the pieces' fc2 side by side
            return F.linear(h, w.w2, w.b2)
        out = None
        widths = [p.ffn.fc1.out_features for p in self.pieces]
        for h_i, piece in zip(h.split(widths, 1), self.pieces, strict=True):
            fc2, norm = piece.ffn.fc2, piece.out_norm
            y = F.layer_norm(F.linear(h_i, fc2.weight, fc2.bias), norm.normalized_shape,
                             norm.weight, norm.bias, norm.eps)
            out = y if out is None else out.add_(y)
        return out

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


class _Fused(NamedTuple):
    """Folded weights of M pieces (module docstring): ``w1`` ``(ffn_dim, d)``, ``b1``
    ``(ffn_dim,)``; without output LayerNorms also the pieces' second matrices side by side,
    ``w2`` ``(d, ffn_dim)`` and ``b2`` ``(d,)`` (else None: each piece's own run)."""

    w1: Tensor
    b1: Tensor
    in_eps: float
    w2: Tensor | None
    b2: Tensor | None


def _plain_ln(m: nn.Module) -> bool:
    return (type(m) is nn.LayerNorm and m.elementwise_affine and m.bias is not None
            and len(m.normalized_shape) == 1)


def _plain_ffn(m: nn.Module) -> bool:  # not e.g. a dynamically quantized copy
    return type(m) is FeedForward and type(m.fc1) is nn.Linear and type(m.fc2) is nn.Linear


def _fold(pieces: list[FeedForwardPiece]) -> _Fused | None:
    """The pieces' weights folded; None unless every piece is LayerNorm → ReLU FeedForward →
    LayerNorm (or every one → Identity), where the fold is exact."""
    ins, outs = [p.in_norm for p in pieces], [p.out_norm for p in pieces]
    if not (all(_plain_ffn(p.ffn) for p in pieces) and all(map(_plain_ln, ins))
            and len({m.eps for m in ins}) == 1):
        return None
    no_out = all(type(m) is nn.Identity for m in outs)
    if not no_out and not all(map(_plain_ln, outs)):
        return None
    with torch.no_grad():
        w1 = torch.cat([p.ffn.fc1.weight * p.in_norm.weight for p in pieces], 0)
        b1 = torch.cat([p.ffn.fc1.weight @ p.in_norm.bias + p.ffn.fc1.bias for p in pieces])
        if not no_out:
            return _Fused(w1, b1, ins[0].eps, None, None)
        return _Fused(w1, b1, ins[0].eps, torch.cat([p.ffn.fc2.weight for p in pieces], 1),
                      sum(p.ffn.fc2.bias for p in pieces))


def conditional_feedforward(d_model: int, ffn_dim: int, n_pieces: int = 4,
                            activation_dropout: float = 0.0, *, control_hidden: int = 128,
                            schedule: NoiseSchedule | None = None, hard_budget: bool = False,
                            out_norms: bool = True,
                            name: str = "ffn") -> ConditionalFeedForward:
    """CCT feed-forward: ``n_pieces`` (M) pieces of width ``ffn_dim // n_pieces``, each with
    an input and (``out_norms``) an output LayerNorm, and one control net with M gates."""
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
                                  Gate(schedule, hard_budget), name=name)
