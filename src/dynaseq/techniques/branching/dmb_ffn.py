"""DMB feed-forward layer (Tan et al. 2021, section III-C, eq. 24).

One gating unit g_f picks, per token, one of N feed-forward branches::

    FFN_DMB(x) = W2^(k) ReLU(W1^(k) x)        with g_f(x, k) = 1        (eq. 24)

(with biases, like the dense :class:`~dynaseq.nn.FeedForward`). Tokens are grouped by
branch once; both matrices of branch k run on its group only, and the results are put back
in token order. The output is not scaled by the gate, so a token's output is exactly the
dense FFN of its branch. Training and inference take the same path.
"""

from __future__ import annotations

from dynaseq.techniques.branching.branched_linear import BranchedLinear
from dynaseq.techniques.branching.routed import RoutedFeedForward
from dynaseq.techniques.branching.routing import Router


class BranchedFeedForward(RoutedFeedForward):
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
    :func:`dmb_feedforward`. The forward pass and the MAC count are
    :class:`~dynaseq.techniques.branching.routed.RoutedFeedForward`'s.
    """

    unit_attr = "router"
    unit_word = "branches"
    router: Router

    def __init__(self, router: Router, fc1: BranchedLinear, fc2: BranchedLinear,
                 activation_dropout: float = 0.0, name: str = "ffn") -> None:
        super().__init__(router, fc1, fc2, activation_dropout, name)


def dmb_feedforward(d_model: int, ffn_dim: int, n_branches: int = 4,
                    activation_dropout: float = 0.0, *, shared: bool = True,
                    name: str = "ffn", fast_paths: bool = True) -> BranchedFeedForward:
    """DMB FFN with ``n_branches`` branches of width ``ffn_dim`` (each as large as the dense
    FFN it replaces), shared-private parameters (``shared``) and one gate (``fast_paths``:
    see :class:`~dynaseq.techniques.branching.routing.Router`)."""
    return BranchedFeedForward(
        Router(d_model, n_branches, fast_paths=fast_paths),
        BranchedLinear(d_model, ffn_dim, n_branches, shared=shared),
        BranchedLinear(ffn_dim, d_model, n_branches, shared=shared),
        activation_dropout, name=name)
