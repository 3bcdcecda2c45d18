"""Lean decoding-step parts of the DMB sub-layers (see :mod:`dynaseq.nn.lean_step`).

The DMB router picks one branch per token (eq. 15-16); a step's token then runs that branch's
projections, as a dense model runs its own (eq. 24-30). The parts here do what the dense
parts of :mod:`dynaseq.nn.lean_dense` do, through the router's decision:

* self-attention (:class:`BranchedAttention`): each branch's q/k/v projections fused into one
  ``(3·d, d)`` matrix per branch (a copy, listed in ``sources``), so a step's token runs one
  product for its q, k and v; keys and values go into the layer's preallocated
  :class:`~dynaseq.nn.lean_step.StepCache`;
* cross-attention: the encoder output's keys and values projected once, at ``start``, each
  memory token through its own branch (the router run on the memory, as the module does),
  with one fused ``(2·d, d)`` k/v matrix per branch;
* feed-forward (:class:`BranchedFeedForward`): ``fc2_k(relu(fc1_k(x)))`` of the token's branch.

Routing goes through the router's own :meth:`~dynaseq.techniques.branching.routing.Router.dispatch`,
so its ``fast_paths`` hold here too: when every row of a step chose one branch (always at
batch 1 greedy) that branch's plain matmul runs, with one host read for the decision; rows
that chose different branches are grouped by branch, and each group runs its own branch only.
Outputs equal the modules' up to float rounding (the same operations, q/k/v fused).

The MoE baseline (top-k, outputs mixed by the gate) and int8 DMB layers have no lean part:
their models keep the general step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dynaseq.nn.attention import padding_to_attn_mask
from dynaseq.nn.lean_step import CrossKeys, StepCache, register_lean, split_heads
from dynaseq.techniques.branching.branched_linear import BranchedLinear
from dynaseq.techniques.branching.dmb_attention import BranchedAttention
from dynaseq.techniques.branching.dmb_ffn import BranchedFeedForward
from dynaseq.techniques.branching.routing import Router


def _fused(projections: tuple[BranchedLinear, ...]) -> BranchedLinear:
    """One :class:`BranchedLinear` whose branch k is branch k of every projection stacked
    along the outputs (a copy of their effective ``θ_S + θ_Pk``; no shared part)."""
    first = projections[0]
    weights, biases = zip(*(p.branch_parameters() for p in projections), strict=True)
    fused = BranchedLinear(first.in_features, sum(p.out_features for p in projections),
                           first.n_branches, shared=False)
    with torch.no_grad():
        fused.weight.copy_(torch.cat(weights, dim=1))  # (N, Σ out, in)
        assert fused.bias is not None and all(b is not None for b in biases)
        fused.bias.copy_(torch.cat(biases, dim=1))
    return fused.requires_grad_(False)


def _sources(*projections: BranchedLinear) -> list[Tensor]:
    """The tensors a fused copy was made from (their version counters tell it went stale)."""
    return [t for p in projections for t in (p.weight, p.bias, p.shared_weight, p.shared_bias)
            if t is not None]


class DMBSelfAttention:
    """Self-attention of one new token per row over the cached keys, each row through the
    branch its router picks (see the module doc)."""

    def __init__(self, m: BranchedAttention) -> None:
        self.router: Router = m.router
        self.qkv = _fused((m.q_proj, m.k_proj, m.v_proj))
        self.sources = _sources(m.q_proj, m.k_proj, m.v_proj)
        self.out = m.out_proj
        self.n_heads, self.d_head = m.n_heads, m.d_head

    def step(self, x: Tensor, cache: StepCache, offset: object) -> Tensor:
        """x ``(B, 1, d)`` -> ``(B, 1, d)``; appends this step's keys and values to ``cache``."""
        b, h, d = x.size(0), self.n_heads, self.d_head
        route = self.router.dispatch(x)
        qkv = route.project(self.qkv, route.input_rows())  # (B, 3·H·hd), token order
        q, k, v = qkv.view(b, 3, h, 1, d).unbind(1)  # each (B, H, 1, hd)
        keys, values = cache.append(k, v)  # (B, H, t+1, hd)
        a = torch.nn.functional.scaled_dot_product_attention(q, keys, values)  # (B, H, 1, hd)
        return route.project(self.out, route.gather(a.reshape(b, h * d))).view(b, 1, h * d)


class DMBCrossAttention:
    """Cross-attention of one new token per row over the encoder output's keys and values,
    projected once by :meth:`start`, each memory token through its own branch."""

    def __init__(self, m: BranchedAttention) -> None:
        self.router: Router = m.router
        self.q, self.out = m.q_proj, m.out_proj
        self.kv = _fused((m.k_proj, m.v_proj))
        self.sources = _sources(m.k_proj, m.v_proj)
        self.n_heads, self.d_head = m.n_heads, m.d_head

    def start(self, memory: Tensor, pad_mask: Tensor, offset: object) -> CrossKeys:
        """memory ``(B, S, d)``, pad_mask ``(B, S)`` bool (True at padding) -> the keys."""
        route = self.router.dispatch(memory)
        kv = route.project(self.kv, route.input_rows()).view(*memory.shape[:2], -1)
        k, v = (t.contiguous() for t in kv.chunk(2, dim=-1))  # each (B, S, d)
        mask = padding_to_attn_mask(pad_mask) if bool(pad_mask.any()) else None
        return CrossKeys(split_heads(k, self.n_heads), split_heads(v, self.n_heads), mask)

    def step(self, x: Tensor, keys: CrossKeys, offset: object) -> Tensor:
        b, h, d = x.size(0), self.n_heads, self.d_head
        route = self.router.dispatch(x)
        q = route.project(self.q, route.input_rows()).view(b, h, 1, d)
        a = torch.nn.functional.scaled_dot_product_attention(q, keys.k, keys.v,
                                                             attn_mask=keys.mask)
        return route.project(self.out, route.gather(a.reshape(b, h * d))).view(b, 1, h * d)


class DMBFeedForward:
    """``fc2_k(relu(fc1_k(x)))`` with k each row's branch."""

    def __init__(self, m: BranchedFeedForward) -> None:
        self.sources: list[Tensor] = []
        self.router: Router = m.router
        self.fc1, self.fc2 = m.fc1, m.fc2

    def step(self, x: Tensor, offset: object) -> Tensor:
        route = self.router.dispatch(x)
        hidden = route.run(self.fc1, route.input_rows()).relu_()  # (B, ffn_dim), grouped
        return route.combine(route.run(self.fc2, hidden)).view(x.shape)


def _attention_part(m: nn.Module, role: str) -> DMBSelfAttention | DMBCrossAttention | None:
    assert isinstance(m, BranchedAttention)
    if role == "ffn" or type(m.router) is not Router or any(
            type(p) is not BranchedLinear or p.bias is None
            for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj)):
        return None
    return DMBSelfAttention(m) if role == "self" else DMBCrossAttention(m)


def _ffn_part(m: nn.Module, role: str) -> DMBFeedForward | None:
    assert isinstance(m, BranchedFeedForward)
    ok = (role == "ffn" and type(m.router) is Router
          and all(type(p) is BranchedLinear for p in (m.fc1, m.fc2)))
    return DMBFeedForward(m) if ok else None


register_lean(BranchedAttention, _attention_part)
register_lean(BranchedFeedForward, _ffn_part)
