"""DMB feed-forward layer (Tan et al. 2021, section III-C, eq. 24).

One gating unit g_f picks, per token, one of N feed-forward branches::

    FFN_DMB(x) = W2^(k) ReLU(W1^(k) x)        with g_f(x, k) = 1        (eq. 24)

(with biases, like the dense :class:`~dynaseq.nn.FeedForward`). Tokens are grouped by
branch once; both matrices of branch k run on its group only, and the results are put back
in token order. The output is not scaled by the gate, so a token's output is exactly the
dense FFN of its branch. Training and inference take the same path.
"""

from __future__ import annotations

from torch import Tensor, nn

from dynaseq.nn.outputs import MACS_TRACE, AuxOutputs, MacsRecord
from dynaseq.techniques.branching.branched_linear import BranchedLinear
from dynaseq.techniques.branching.routing import BranchGroups, Router
from dynaseq.techniques.branching.traces import ROUTE_TRACE, RouteTrace


class BranchedFeedForward(nn.Module):
    """N feed-forward branches, one per token (eq. 24); drop-in for ``FeedForward``.

    Args:
        router: the gating unit g_f (N branches, width d_model).
        fc1: :class:`BranchedLinear` ``d_model -> ffn_dim``.
        fc2: :class:`BranchedLinear` ``ffn_dim -> d_model``.
        activation_dropout: dropout after the ReLU (training only).
        name: sub-layer name carried by its traces.

    ``forward(x, aux=None)``: x ``(..., d_model)`` -> ``(..., d_model)``. With ``aux`` it
    records a :class:`~dynaseq.techniques.branching.traces.RouteTrace` (the auxiliary losses come from
    it) and, at inference, a ``MacsRecord`` of what ran. MACs per token: one branch,
    ``2·d_model·ffn_dim``, plus the gate's ``d_model·N``. Build it with
    :func:`dmb_feedforward`.
    """

    def __init__(self, router: Router, fc1: BranchedLinear, fc2: BranchedLinear,
                 activation_dropout: float = 0.0, name: str = "ffn") -> None:
        super().__init__()
        n = router.n_branches
        if fc1.n_branches != n or fc2.n_branches != n:
            raise ValueError(f"the router has {n} branches but fc1/fc2 have "
                             f"{fc1.n_branches}/{fc2.n_branches}")
        if fc1.in_features != router.d_model or fc2.out_features != router.d_model:
            raise ValueError(f"fc1 must read and fc2 must write d_model={router.d_model}, got "
                             f"fc1 {fc1.in_features}->{fc1.out_features}, fc2 "
                             f"{fc2.in_features}->{fc2.out_features}")
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"fc1 writes {fc1.out_features} features but fc2 reads "
                             f"{fc2.in_features}")
        if not 0.0 <= activation_dropout < 1.0:
            raise ValueError(f"activation_dropout must lie in [0, 1), got {activation_dropout}")
        self.router, self.fc1, self.fc2 = router, fc1, fc2
        self.dropout = nn.Dropout(activation_dropout)
        self.name = name

    @property
    def n_branches(self) -> int:
        return self.router.n_branches

    def forward(self, x: Tensor, aux: AuxOutputs | None = None) -> Tensor:
        d = x.size(-1)
        route = self.router(x)  # logits (..., N), branch (...)
        groups = BranchGroups.of(route.branch.reshape(-1), self.n_branches, validate=False)
        xs = groups.gather(x.reshape(-1, d))  # (M, d) sorted by branch
        h = self.dropout(self.fc1.grouped(xs, groups).relu_())  # (M, ffn_dim)
        out = groups.scatter(self.fc2.grouped(h, groups)).view(x.shape)
        if aux is not None:
            aux.add_trace(ROUTE_TRACE, RouteTrace(self.name, "ffn", "input", route.logits,
                                                  route.branch, id(self.router)))
            if not self.training:
                aux.add_trace(MACS_TRACE, MacsRecord(self.name, self.macs(groups.n_tokens)))
        return out

    def macs(self, n_tokens: int) -> dict[str, int]:
        """Multiply-adds for ``n_tokens`` tokens: the keys of ``FeedForward.macs`` (one branch
        per token) plus ``gate_ffn``. What runs does not depend on the routing."""
        return {"ffn_in": self.fc1.macs(n_tokens), "ffn_out": self.fc2.macs(n_tokens),
                "gate_ffn": self.router.macs(n_tokens)}


def dmb_feedforward(d_model: int, ffn_dim: int, n_branches: int = 4,
                    activation_dropout: float = 0.0, *, shared: bool = True,
                    name: str = "ffn") -> BranchedFeedForward:
    """DMB FFN with ``n_branches`` branches of width ``ffn_dim`` (each as large as the dense
    FFN it replaces), shared-private parameters (``shared``) and one gate."""
    return BranchedFeedForward(
        Router(d_model, n_branches),
        BranchedLinear(d_model, ffn_dim, n_branches, shared=shared),
        BranchedLinear(ffn_dim, d_model, n_branches, shared=shared),
        activation_dropout, name=name)
