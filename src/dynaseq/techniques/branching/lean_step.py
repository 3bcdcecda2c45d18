"""Lean decoding-step parts of the DMB sub-layers (see :mod:`dynaseq.nn.lean_step`).

The DMB router picks one branch per token (eq. 15-16); a step's token then runs that branch's
projections, as a dense model runs its own (eq. 24-30). The parts here do what the dense
parts of :mod:`dynaseq.nn.lean_dense` do, through the router's decision:

* self-attention (:class:`BranchedAttention`): each branch's q/k/v projections fused into one
  ``(3·d, d)`` matrix per branch (a copy; ``sources`` lists what it copies), so a token runs one
  product for its q, k and v; keys and values go into the layer's preallocated
  :class:`~dynaseq.nn.lean_step.StepCache`;
* cross-attention: the encoder output's keys and values projected once, at ``start``, each
  memory token through its own branch (the router run on the memory, as the module does),
  with one fused ``(2·d, d)`` k/v matrix per branch;
* feed-forward (:class:`BranchedFeedForward`): ``fc2_k(relu(fc1_k(x)))`` of the token's branch;
* an encoder's self-attention (role ``"encoder"``, :class:`DMBEncoderAttention`): the fused
  q/k/v product over whole sequences, padding keys masked, so a DMB model's source runs
  through :mod:`dynaseq.models.lean_encoder` too (its feed-forward rows through
  :class:`DMBFeedForward`).

A small step (up to :data:`ROW_RUNS` rows: batch 1, greedy or beam 4) scores the branches with
the router's weights, reads the decisions on the host once and runs each run of consecutive
rows that chose one branch as that branch's plain matmul, with each branch's weights kept as
views (copies while a shared part θ_S is unmerged). Larger calls (larger steps, the memory's
keys and values, an encoder's tokens) lay float projections' rows out in blocks by branch for
one batched matmul (:func:`~dynaseq.techniques.branching.blocks.block_dispatch`) while they
are few (one sentence's tokens), and otherwise go through the router's grouped layout
(:meth:`~dynaseq.techniques.branching.routing.Router.dispatch`): rows grouped by branch, each
group through its own branch only. A router built with ``fast_paths=False`` takes the grouped
path at every size. Outputs equal the modules' up to float rounding (the same
operations, q/k/v fused).

Projections may be float or int8 (:class:`Int8BranchedLinear`, ``dynaseq quantize``); the
router stays float, as quantization keeps it. The MoE baseline (top-k, outputs mixed by the
gate) has no lean part: its models keep the general step.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.nn.attention import padding_to_attn_mask
from dynaseq.nn.int8 import Int8Linear
from dynaseq.nn.lean_step import (
    CrossKeys,
    LinearFn,
    StepCache,
    StepTally,
    attend_keys,
    float_linear,
    linear_tensors,
    register_lean,
    split_heads,
)
from dynaseq.techniques.branching.blocks import block_dispatch
from dynaseq.techniques.branching.branched_linear import BranchedLinear, Int8BranchedLinear
from dynaseq.techniques.branching.dmb_attention import BranchedAttention
from dynaseq.techniques.branching.dmb_ffn import BranchedFeedForward
from dynaseq.techniques.branching.routing import Dispatch, Router

Projection = BranchedLinear | Int8BranchedLinear
"""A DMB projection the lean parts run: float, or quantized by ``dynaseq quantize``."""


def _usable(p: nn.Module) -> bool:
    """A float or int8 branched projection with a bias in every branch."""
    if type(p) is BranchedLinear:
        return p.bias is not None
    return type(p) is Int8BranchedLinear and all(b.bias is not None for b in p.branches)


def _fused(projections: tuple[Projection, ...]) -> Projection:
    """One projection whose branch k is branch k of every one of ``projections`` stacked
    along the outputs (a copy): float ``θ_S + θ_Pk`` concatenated (no shared part), or each
    branch's int8 rows and scales concatenated (one int8 product equals the separate ones
    exactly: the input is quantized per row)."""
    first = projections[0]
    if type(first) is Int8BranchedLinear:
        return Int8BranchedLinear([Int8Linear.stacked([p.branches[k] for p in projections])
                                   for k in range(first.n_branches)])
    weights, biases = zip(*(p.branch_parameters() for p in projections), strict=True)
    fused = BranchedLinear(first.in_features, sum(p.out_features for p in projections),
                           first.n_branches, shared=False).to(weights[0])  # device, dtype
    with torch.no_grad():
        fused.weight.copy_(torch.cat(weights, dim=1))  # (N, Σ out, in)
        assert fused.bias is not None and all(b is not None for b in biases)
        fused.bias.copy_(torch.cat(biases, dim=1))
    return fused.requires_grad_(False)


def _branches(p: Projection) -> list[LinearFn]:
    """Per branch of ``p``, its map as a function: float weights as views of a merged layer's
    parameters (copies of ``θ_S + θ_Pk`` while a shared part exists), int8 ones through
    their kernel."""
    if type(p) is Int8BranchedLinear:
        return [b.forward for b in p.branches]
    with torch.no_grad():
        weight, bias = p.branch_parameters()
    assert bias is not None, "lean parts take projections with biases"
    return [float_linear(w, b) for w, b in zip(weight.unbind(0), bias.unbind(0), strict=True)]


ROW_RUNS = 8
"""Steps of up to this many rows (batch 1, beam 4 at batch 1) run each run of consecutive
rows that chose one branch as one plain matmul against that branch; larger steps are laid
out in blocks or grouped by branch (:func:`block_dispatch`). At beam 4, runs measured 0.6x
the grouped path's time per sub-layer on this project's 2-core CPU (tiny and small);
blocks for 4 rows cost more to lay out than the runs' extra products."""


def first_max(logits: list[float]) -> int:
    """The index :func:`torch.argmax` gives for one row of logits read to the host: the
    first of the largest, a NaN counting as larger than any number (its first one).

    Why by hand: a small step reads its router's few logits to the host anyway (the branch
    decides which weights run); comparing them there saves the ``argmax`` op per
    sub-layer: DMB greedy at batch 1 took 0.83x (tiny) and 0.95x (small) the time with it,
    beam 4 0.98x (11 interleaved rounds, 2 threads, this project's AVX-512 EPYC)."""
    best = 0
    for i, v in enumerate(logits):
        if v != v:  # NaN
            return i
        if v > logits[best]:
            best = i
    return best


class _Pick:
    """A router's decisions for a small step: ``__call__(x)`` with x ``(B, 1, d)`` -> the
    branch of each row (the logits read to the host once, :func:`first_max`), or None for
    more than :data:`ROW_RUNS` rows or a router without fast paths (:func:`block_dispatch`
    runs then)."""

    def __init__(self, router: Router) -> None:
        self.weight, self.bias = router.proj.weight, router.proj.bias  # live, no copies
        assert self.bias is not None, "a Router's projection has a bias"
        self.fast = router.fast_paths

    def __call__(self, x: Tensor) -> list[int] | None:
        b = x.size(0)
        if b > ROW_RUNS or not self.fast:
            return None
        if b == 1:  # one matrix-vector product: ~2 us less than F.linear's (1, N) at d=128
            return [first_max(torch.addmv(self.bias, self.weight, x.view(-1)).tolist())]
        logits = F.linear(x.view(b, -1), self.weight, self.bias)  # (B, N)
        return [first_max(row) for row in logits.tolist()]


def _runs(rows: Tensor, picks: list[int], fns: Sequence[LinearFn]) -> Tensor:
    """``fns[k](part)`` over each run of consecutive ``rows`` ``(B, ...)`` whose branch
    ``picks`` is k (slices: no copies), concatenated back in row order; one call when all
    agree (batch 1 included)."""
    if len(picks) == 1 or all(k == picks[0] for k in picks):
        return fns[picks[0]](rows)
    parts, start = [], 0
    for i in range(1, len(picks) + 1):
        if i == len(picks) or picks[i] != picks[start]:
            parts.append(fns[picks[start]](rows[start:i]))
            start = i
    return torch.cat(parts)


def _sources(*projections: Projection) -> list[Tensor]:
    """The tensors a part copied or viewed (their version counters tell it went stale)."""
    return [t for p in projections for t in (
        [u for b in p.branches for u in linear_tensors(b)] if type(p) is Int8BranchedLinear
        else (p.weight, p.bias, p.shared_weight, p.shared_bias)) if t is not None]


def _all_float(*projections: Projection) -> bool:
    """Whether every one of ``projections`` is a float :class:`BranchedLinear` (calls of
    several rows may then lay them out in blocks; int8 ones keep groups)."""
    return all(type(p) is BranchedLinear for p in projections)


class _AttentionPart:
    """What every DMB attention part holds: the router, the output projection, the tensors
    it copied or viewed, the heads, and whether its projections are float."""

    def __init__(self, m: BranchedAttention) -> None:
        self.router: Router = m.router
        self.out = m.out_proj
        self.sources = _sources(m.q_proj, m.k_proj, m.v_proj, m.out_proj)
        self.n_heads, self.d_head = m.n_heads, m.d_head
        self.blocks = _all_float(m.out_proj)  # the four projections share one type
        self.out_k: list[LinearFn] = []  # a step part's output projection per branch

    def _step_in(self, x: Tensor, picks: list[int] | None, proj: nn.Module,
                 proj_k: Sequence[LinearFn]) -> tuple[Tensor, Dispatch | None]:
        """A step's rows x ``(B, 1, d)`` through each row's branch of ``proj`` -> ``(B, out)``
        in row order, and the dispatch that ran it: runs of rows by ``picks``
        (``proj_k``, its branches), or, where ``picks`` is None, laid out by the router
        (:func:`block_dispatch`; returned, for :meth:`_step_out` to gather by)."""
        if picks is not None:
            return _runs(x.view(x.size(0), -1), picks, proj_k), None
        route = block_dispatch(self.router, x, self.blocks)
        return route.project(proj, route.input_rows()), route

    def _step_out(self, a: Tensor, picks: list[int] | None, route: Dispatch | None) -> Tensor:
        """The attention output ``a`` ``(B, H·hd)`` through each row's branch of the output
        projection, as :meth:`_step_in` routed the rows -> ``(B, 1, H·hd)``."""
        y = (_runs(a, picks, self.out_k) if route is None
             else route.project(self.out, route.gather(a)))
        return y.view(a.size(0), 1, -1)


class _FusedSelfAttention(_AttentionPart):
    """A DMB self-attention part: each branch's q/k/v projections fused into one
    ``(3·d, d)`` matrix per branch (a copy)."""

    def __init__(self, m: BranchedAttention) -> None:
        super().__init__(m)
        self.qkv = _fused((m.q_proj, m.k_proj, m.v_proj))


class DMBSelfAttention(_FusedSelfAttention):
    """Self-attention of one new token per row over the cached keys, each row through the
    branch its router picks (see the module doc)."""

    def __init__(self, m: BranchedAttention) -> None:
        super().__init__(m)
        self.pick = _Pick(m.router)
        self.qkv_k, self.out_k = _branches(self.qkv), _branches(m.out_proj)

    def step(self, x: Tensor, cache: StepCache, offset: object,
             tally: StepTally | None = None) -> Tensor:
        """x ``(B, 1, d)`` -> ``(B, 1, d)``; appends this step's keys and values to ``cache``."""
        b, h, d = x.size(0), self.n_heads, self.d_head
        picks = self.pick(x)
        qkv, route = self._step_in(x, picks, self.qkv, self.qkv_k)  # (B, 3·H·hd)
        q, key, value = qkv.view(b, 3, h, 1, d).unbind(1)  # each (B, H, 1, hd)
        keys, values = cache.append(key, value)  # (B, H, t+1, hd)
        a = F.scaled_dot_product_attention(q, keys, values, attn_mask=cache.mask
                                           ).reshape(b, h * d)  # (B, H·hd)
        return self._step_out(a, picks, route)


class DMBEncoderAttention(_FusedSelfAttention):
    """Bidirectional self-attention over whole sequences (an encoder layer): each token's
    q/k/v and output projections through the branch its router picks, the tokens of a call
    laid out in blocks (:mod:`~dynaseq.techniques.branching.blocks`) or grouped by branch."""

    def encode(self, x: Tensor, valid: Tensor | None, offset: object,
               tally: StepTally | None = None) -> Tensor:
        """x ``(B, S, d)``, valid ``(B, S)`` True at the tokens (None: no padding) ->
        ``(B, S, d)``. Padding tokens are routed and projected too (no query attends to
        them); their states, which the lean pass leaves as they come, may route them
        otherwise than the module's would: outputs at valid tokens are the same."""
        b, s, _ = x.shape
        h, d = self.n_heads, self.d_head
        route = block_dispatch(self.router, x, self.blocks)
        qkv = route.project(self.qkv, route.input_rows())  # (B·S, 3·H·hd), token order
        q, k, v = qkv.view(b, s, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)  # (B,H,S,hd)
        mask = None if valid is None else valid[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, S, hd)
        a = a.transpose(1, 2).reshape(b * s, h * d)
        return route.project(self.out, route.gather(a)).view(b, s, h * d)

    def encode_first(self, x: Tensor, valid: Tensor | None, offset: object) -> Tensor:
        """:meth:`encode` at each row's first token, ``(B, 1, d)`` (a first-token head)."""
        return self.encode(x, valid, offset)[:, :1]


class DMBCrossAttention(_AttentionPart):
    """Cross-attention of one new token per row over the encoder output's keys and values,
    projected once by :meth:`start`, each memory token through its own branch."""

    def __init__(self, m: BranchedAttention) -> None:
        super().__init__(m)
        self.pick = _Pick(m.router)
        self.q = m.q_proj
        self.q_k, self.out_k = _branches(m.q_proj), _branches(m.out_proj)
        self.kv = _fused((m.k_proj, m.v_proj))

    def start(self, memory: Tensor, pad_mask: Tensor, offset: object,
              tally: StepTally | None = None) -> CrossKeys:
        """memory ``(B, S, d)``, pad_mask ``(B, S)`` bool (True at padding) -> the keys."""
        route = block_dispatch(self.router, memory, self.blocks)
        kv = route.project(self.kv, route.input_rows()).view(*memory.shape[:2], -1)
        k, v = (t.contiguous() for t in kv.chunk(2, dim=-1))  # each (B, S, d)
        mask = padding_to_attn_mask(pad_mask) if bool(pad_mask.any()) else None
        return CrossKeys(split_heads(k, self.n_heads), split_heads(v, self.n_heads), mask)

    shares_keys = True
    """Its step attends keys shared by groups of rows (:func:`attend_keys`)."""

    def step(self, x: Tensor, keys: CrossKeys, offset: object,
             tally: StepTally | None = None) -> Tensor:
        b, h, d = x.size(0), self.n_heads, self.d_head
        picks = self.pick(x)
        q, route = self._step_in(x, picks, self.q, self.q_k)  # (B, H·hd)
        a = attend_keys(q.view(b, h, 1, d), keys).reshape(b, h * d)
        return self._step_out(a, picks, route)


class DMBFeedForward:
    """``fc2_k(relu(fc1_k(x)))`` with k each row's branch."""

    def __init__(self, m: BranchedFeedForward) -> None:
        self.sources = _sources(m.fc1, m.fc2)
        self.router: Router = m.router
        self.pick = _Pick(m.router)
        self.fc1, self.fc2 = m.fc1, m.fc2
        self.fc1_k, self.fc2_k = _branches(m.fc1), _branches(m.fc2)
        self.branch_k = [partial(self._branch, k) for k in range(len(self.fc1_k))]
        self.blocks = _all_float(m.fc1, m.fc2)

    def step(self, x: Tensor, offset: object, tally: StepTally | None = None) -> Tensor:
        picks = self.pick(x)
        if picks is not None:  # (B, 1, d): rows as they are, runs of the batch's first dim
            return _runs(x, picks, self.branch_k)
        route = block_dispatch(self.router, x, self.blocks)
        hidden = route.run(self.fc1, route.input_rows()).relu_()  # (R, ffn_dim), laid out
        return route.combine(route.run(self.fc2, hidden)).view(x.shape)

    def _branch(self, k: int, rows: Tensor) -> Tensor:
        """rows ``(..., d)`` -> ``(..., d)`` through branch ``k``."""
        return self.fc2_k[k](self.fc1_k[k](rows).relu_())


_ATTENTION_PARTS = {"self": DMBSelfAttention, "cross": DMBCrossAttention,
                    "encoder": DMBEncoderAttention}
"""The lean attention part of each role."""


def _attention_part(m: nn.Module, role: str
                    ) -> DMBSelfAttention | DMBCrossAttention | DMBEncoderAttention | None:
    assert isinstance(m, BranchedAttention)
    projections = (m.q_proj, m.k_proj, m.v_proj, m.out_proj)
    if (role not in _ATTENTION_PARTS or type(m.router) is not Router
            or not all(map(_usable, projections)) or len({type(p) for p in projections}) > 1):
        return None
    return _ATTENTION_PARTS[role](m)


def _ffn_part(m: nn.Module, role: str) -> DMBFeedForward | None:
    assert isinstance(m, BranchedFeedForward)
    ok = role == "ffn" and type(m.router) is Router and _usable(m.fc1) and _usable(m.fc2)
    return DMBFeedForward(m) if ok else None


register_lean(BranchedAttention, _attention_part)
register_lean(BranchedFeedForward, _ffn_part)
