"""The structure predictor and RevPC (ALBERTa, paper 004 "Structure Predictor"), and the exit
rule of inference.

After the first group of layers, the first token's state is pooled and an MLP gives a
softmax over how many of the K adaptive layers the input needs (0 .. K):

    S = H_IG[:, 0],   probs = softmax(MLP(S))                        (B, K+1)

RevPC (reverse, cumulative sum, reverse back) turns it into monotone keep probabilities

    p_i = Σ_{j >= i} probs_j = P(depth >= i),   i = 1 .. K            (B, K)

that scale layer i's residual branches in training. At inference a row stops at the first
adaptive layer with p_i < γ: it runs ``exit_depths(p, γ)`` of them.

Example::

    pred = StructurePredictor(d_model=256, hidden=128, n_adaptive=6, first_group=2)
    p = pred(h)                    # h (B, S, 256) after the first group -> (B, 6)
    exit_depths(p, 0.5)            # (B,) adaptive layers each row runs
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def revpc(probs: Tensor) -> Tensor:
    """(..., K+1) probabilities of depths 0..K -> (..., K) P(depth >= i) for i = 1..K:
    reverse, cumulative sum, reverse back (dropping i = 0, which is always 1)."""
    return probs.flip(-1).cumsum(-1).flip(-1)[..., 1:]


def exit_depths(p: Tensor, gamma: float | Tensor) -> Tensor:
    """(B, K) keep probabilities, γ (one, or (B,) per row) -> (B,) long: the number of
    leading adaptive layers with p_i >= γ (a row stops at the first p_i < γ)."""
    g = gamma if isinstance(gamma, Tensor) else torch.tensor(float(gamma))
    g = g.to(p.device, p.dtype).reshape(-1, 1)  # (B or 1, 1)
    return (p >= g).long().cumprod(-1).sum(-1)


class StructurePredictor(nn.Module):
    """h (B, S, d) after the first group -> keep probabilities p (B, K) of the K adaptive
    layers: first-token pooling, ``Linear(d, hidden) -> tanh -> Linear(hidden, K+1)``,
    softmax and :func:`revpc` (``use_revpc=False``: K independent sigmoids instead).

    ``first_group``: how many layers run before it (read by the encoder that holds it).
    The output layer starts at zero weights and a bias favouring full depth, so a fresh
    predictor keeps every layer (p_i near 1) and training starts from the plain model."""

    def __init__(self, d_model: int, hidden: int, n_adaptive: int, first_group: int,
                 use_revpc: bool = True) -> None:
        super().__init__()
        if n_adaptive < 1:
            raise ValueError(f"an adaptive-depth encoder needs at least one layer after the "
                             f"first group, got {n_adaptive}")
        self.first_group = first_group
        self.n_adaptive = n_adaptive
        self.use_revpc = use_revpc
        self.norm = nn.LayerNorm(d_model)
        self.hidden = nn.Linear(d_model, hidden)
        self.out = nn.Linear(hidden, n_adaptive + 1 if use_revpc else n_adaptive)
        nn.init.zeros_(self.out.weight)
        with torch.no_grad():
            self.out.bias.zero_()
            if use_revpc:
                self.out.bias[-1] = 3.0  # softmax mass on full depth: p_i ~ 0.8 at start
            else:
                self.out.bias.fill_(2.0)  # sigmoid(2) ~ 0.88

    def logits(self, pooled: Tensor) -> Tensor:
        """(B, d) first-token states -> (B, K+1) depth logits (RevPC) or (B, K) per-layer
        logits (sigmoids)."""
        return self.out(torch.tanh(self.hidden(self.norm(pooled))))

    def forward(self, h: Tensor) -> Tensor:
        logits = self.logits(h[:, 0])  # first-token pooling
        if self.use_revpc:
            return revpc(torch.softmax(logits, -1))  # (B, K)
        return torch.sigmoid(logits)  # (B, K)

    def macs(self) -> int:
        """Per sequence."""
        return (self.hidden.in_features * self.hidden.out_features
                + self.out.in_features * self.out.out_features)
