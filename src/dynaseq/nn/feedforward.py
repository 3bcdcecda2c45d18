"""Position-wise feed-forward sub-layer."""

from __future__ import annotations

from torch import Tensor, nn

from dynaseq.nn.outputs import AuxOutputs


class FeedForward(nn.Module):
    """FFN(x) = W2 · dropout(ReLU(W1 x + b1)) + b2  (Vaswani et al. 2017, eq. 2).

    x: (..., d_model) -> (..., d_model). MACs per token: 2 · d_model · ffn_dim.
    """

    def __init__(self, d_model: int, ffn_dim: int, activation_dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.dropout = nn.Dropout(activation_dropout)
        nn.init.xavier_uniform_(self.fc1.weight)
        nn.init.xavier_uniform_(self.fc2.weight)
        nn.init.zeros_(self.fc1.bias)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, x: Tensor, aux: AuxOutputs | None = None) -> Tensor:
        return self.fc2(self.dropout(self.fc1(x).relu_()))

    def macs(self, n_tokens: int) -> dict[str, int]:
        """Multiply-adds for ``n_tokens`` tokens, per matrix."""
        return {
            "ffn_in": n_tokens * self.fc1.in_features * self.fc1.out_features,
            "ffn_out": n_tokens * self.fc2.in_features * self.fc2.out_features,
        }
