"""N linear maps with one chosen per token, and shared-private reparameterization.

:class:`BranchedLinear` holds N weight matrices and applies, to each row, the one its branch
id selects: ``g(X, {W^(k)}) = [W^(i_1) x_1, ..., W^(i_n) x_n]`` (Tan et al. 2021, eq. 25).
Rows are grouped by branch (:class:`~dynaseq.techniques.branching.routing.BranchGroups`) and each
branch runs one matmul over its contiguous group; no row meets a weight it was not routed to.

Shared-private reparameterization (eq. 21-23): with ``shared=True`` branch k's parameters
are ``θ_k = θ_S + θ_Pk``, θ_S zero-initialised (the paper initialises "all shared
parameters to zero"), θ_Pk initialised like a dense layer. θ_S is used by every branch and
so gets gradient from every token (eq. 22); θ_Pk only from the tokens routed to k (eq. 23).
The sum ``θ_S + θ_Pk`` is formed once per call (``N·in·out`` additions, independent of the
number of tokens). After training :meth:`BranchedLinear.merge_` (or :func:`merge_shared_`
over a model) folds θ_S into every θ_Pk and deletes θ_S: the merged layer computes exactly
the same outputs with no shared parameters left (zero inference overhead).

A branch that receives no rows still runs its (empty) matmul, so its parameters get a zero
gradient rather than none: every parameter takes part in every step, which DDP needs
(without ``find_unused_parameters``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.nn.int8 import Int8Linear, int8_linear, quantize_rows, register_int8
from dynaseq.techniques.branching.routing import BranchGroups, run_used_groups

#: dtypes ``F.grouped_mm`` takes for inference (float32 on CPU, bf16/fp16 on either)
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def branched_forward(layer: nn.Module, x: Tensor, branch: Tensor) -> Tensor:
    """``x`` ``(..., in)``, ``branch`` ``(...)`` long -> ``(..., out)``: each row through its
    branch of ``layer`` (a :class:`BranchedLinear` or its int8 version), rows grouped by
    branch for ``layer.grouped`` and put back in order."""
    if branch.shape != x.shape[:-1]:
        raise ValueError(f"branch {tuple(branch.shape)} must match the rows of x "
                         f"{tuple(x.shape[:-1])}")
    if x.size(-1) != layer.in_features:
        raise ValueError(f"x has width {x.size(-1)}, expected {layer.in_features}")
    groups = BranchGroups.of(branch.reshape(-1), layer.n_branches)
    flat = x.reshape(-1, layer.in_features)
    out = groups.scatter(layer.grouped(groups.gather(flat), groups))
    return out.view(*x.shape[:-1], layer.out_features)


class BranchedLinear(nn.Module):
    """``y_m = x_m W_{k_m}ᵀ + b_{k_m}`` with ``k_m`` the branch of row m (eq. 25).

    Args:
        in_features, out_features: sizes of each branch's ``nn.Linear``.
        n_branches: N.
        bias: whether each branch has a bias.
        shared: add a zero-initialised shared part θ_S to every branch (eq. 21).

    Parameters: ``weight`` ``(N, out, in)`` and ``bias`` ``(N, out)`` are the private parts
    θ_Pk (the whole θ_k without ``shared``); ``shared_weight`` ``(out, in)`` and
    ``shared_bias`` ``(out,)`` are θ_S (``None`` without ``shared`` or after :meth:`merge_`).

    ``forward(x, branch)``: x ``(..., in)``, branch ``(...)`` long -> ``(..., out)``.
    :meth:`grouped` runs rows that are already sorted by branch. MACs per row:
    ``in · out``, as for one dense ``nn.Linear``.

    Example::

        lin = BranchedLinear(8, 16, n_branches=4)
        y = lin(torch.randn(2, 5, 8), torch.randint(0, 4, (2, 5)))   # (2, 5, 16)
    """

    def __init__(self, in_features: int, out_features: int, n_branches: int = 4, *,
                 bias: bool = True, shared: bool = True) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features),
                            ("n_branches", n_branches)):
            if value < 1:
                raise ValueError(f"BranchedLinear {name} must be >= 1, got {value}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(n_branches, out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(n_branches, out_features)) if bias else None
        self.shared_weight: nn.Parameter | None = None
        self.shared_bias: nn.Parameter | None = None
        if shared:
            self.shared_weight = nn.Parameter(torch.zeros(out_features, in_features))
            if bias:
                self.shared_bias = nn.Parameter(torch.zeros(out_features))
        for k in range(n_branches):
            nn.init.xavier_uniform_(self.weight.data[k])

    @property
    def n_branches(self) -> int:
        return self.weight.size(0)

    @property
    def has_shared(self) -> bool:
        """True while a shared part θ_S exists (``shared=True`` and not merged)."""
        return self.shared_weight is not None

    def branch_parameters(self) -> tuple[Tensor, Tensor | None]:
        """Effective ``θ_k = θ_S + θ_Pk`` of all branches: weight ``(N, out, in)``, bias
        ``(N, out)`` or None (with their graph to θ_S and θ_Pk)."""
        weight, bias = self.weight, self.bias
        if self.shared_weight is not None:
            weight = weight + self.shared_weight
        if self.shared_bias is not None and bias is not None:
            bias = bias + self.shared_bias
        return weight, bias

    def _branch(self, k: int) -> tuple[Tensor, Tensor | None]:
        """Effective ``(weight (out, in), bias (out,) or None)`` of branch ``k`` for inference.

        Merged layers return views kept across calls (:meth:`_branch_views`); while a shared
        part exists, ``θ_S + θ_Pk`` is formed for branch ``k`` alone (a call whose tokens all
        chose one branch then adds ``in·out`` numbers, not ``N·in·out``).
        """
        if not self.has_shared:
            return self._branch_views()[k]
        weight = self.weight[k] + self.shared_weight
        bias = None if self.bias is None else self.bias[k]
        if bias is not None and self.shared_bias is not None:
            bias = bias + self.shared_bias
        return weight, bias

    def _branch_views(self) -> list[tuple[Tensor, Tensor | None]]:
        """Per-branch ``(weight_k, bias_k)`` of a merged layer (no shared part), without
        re-slicing at every call.

        The views are kept while the parameters keep their storage: in-place updates
        (:meth:`merge_`, ``load_state_dict``, an optimizer step) show through the views,
        and ``.to()`` or assigning ``.data`` changes the storage, which rebuilds them.
        Indexing ``weight[k]`` at every call costs as much as the matmul of a decoding step
        at d=128.
        """
        assert not self.has_shared, "views of θ_Pk alone are the branches only once merged"
        bias = self.bias
        key = (self.weight.data_ptr(), None if bias is None else bias.data_ptr())
        cached = self.__dict__.get("_views")
        if cached is None or cached[0] != key:
            biases = [None] * self.n_branches if bias is None else bias.unbind(0)
            cached = (key, list(zip(self.weight.unbind(0), biases, strict=True)))
            self.__dict__["_views"] = cached
        return cached[1]

    def grouped(self, xs: Tensor, groups: BranchGroups) -> Tensor:
        """``(M, in)`` rows sorted by branch as ``groups`` lays them out -> ``(M, out)``.

        Training: one ``F.linear`` per branch over its contiguous rows, empty groups
        included (see the module docstring). Inference: a single used branch runs one
        ``F.linear`` on ``xs`` directly; several run as one grouped matmul
        (``F.grouped_mm``, each group against its own weight only) plus the bias row of
        each group; where the kernel does not apply (widths not a multiple of 16 bytes, an
        unsupported dtype) one ``F.linear`` per non-empty group.
        """
        if len(groups.sizes) != self.n_branches:
            raise ValueError(f"got {len(groups.sizes)} group sizes for {self.n_branches} "
                             f"branches")
        if not torch.is_grad_enabled():
            if groups.ends is not None and self._grouped_mm_applies(xs):
                weight, bias = self.branch_parameters()  # (N, out, in), (N, out)
                y = F.grouped_mm(xs, weight.transpose(1, 2), offs=groups.ends)
                return y if bias is None else y.add_(bias.index_select(0,
                                                                       groups.branch_sorted))
            return run_used_groups(xs, groups, lambda k, rows: F.linear(rows, *self._branch(k)),
                                   self.out_features)
        weight, bias = self.branch_parameters()
        outs = [F.linear(part, weight[k], None if bias is None else bias[k])
                for k, part in enumerate(xs.split(groups.sizes))]
        return torch.cat(outs)

    def blocked(self, blocks: Tensor) -> Tensor:
        """``(N, P, in)`` rows, block k for branch k -> ``(N, P, out)``: ``x W_kᵀ + b_k`` for
        every block in one batched matmul (``torch.baddbmm`` against the ``(N, in, out)``
        transposed view; see :mod:`~dynaseq.techniques.branching.blocks`). Inference."""
        if blocks.dim() != 3 or blocks.size(0) != self.n_branches:
            raise ValueError(f"blocks must be (N={self.n_branches}, P, in), got "
                             f"{tuple(blocks.shape)}")
        weight, bias = self.branch_parameters()  # (N, out, in), (N, out)
        if bias is None:
            return torch.bmm(blocks, weight.transpose(1, 2))
        return torch.baddbmm(bias.unsqueeze(1), blocks, weight.transpose(1, 2))

    def _grouped_mm_applies(self, xs: Tensor) -> bool:
        """The CPU/GPU grouped-matmul kernel takes these rows: a floating dtype it supports,
        matching the weights, and row widths that are multiples of 16 bytes."""
        if xs.dtype not in _GROUPED_MM_DTYPES or xs.dtype != self.weight.dtype:
            return False
        size = xs.element_size()
        return (self.in_features * size) % 16 == 0 and (self.out_features * size) % 16 == 0

    def forward(self, x: Tensor, branch: Tensor) -> Tensor:
        return branched_forward(self, x, branch)

    @torch.no_grad()
    def merge_(self) -> BranchedLinear:
        """Fold θ_S into every branch (θ_Pk <- θ_S + θ_Pk) and delete θ_S, in place.

        Outputs are unchanged (the same sum the unmerged layer forms at each call). A no-op
        without a shared part. Returns ``self``.
        """
        if self.shared_weight is not None:
            self.weight.add_(self.shared_weight)
            self.shared_weight = None
        if self.shared_bias is not None:
            assert self.bias is not None
            self.bias.add_(self.shared_bias)
            self.shared_bias = None
        return self

    def macs(self, n_tokens: int) -> int:
        """Multiply-adds of ``n_tokens`` rows (each runs one branch)."""
        return n_tokens * self.in_features * self.out_features

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"n_branches={self.n_branches}, bias={self.bias is not None}, "
                f"shared={self.has_shared}")


class Int8BranchedLinear(nn.Module):
    """Int8 :class:`BranchedLinear` for CPU inference: one :class:`~dynaseq.nn.int8.Int8Linear`
    per branch (weights per output channel, activations per token).

    Same interface as the float layer at inference: ``forward(x, branch)`` (x ``(..., in)``,
    branch ``(...)`` long -> ``(..., out)``), :meth:`grouped` over rows sorted by branch,
    ``n_branches``, ``in_features``, ``out_features`` and :meth:`macs`. Rows are grouped by
    branch and each non-empty group runs one int8 matmul against its own branch only. Build
    it with :meth:`from_float` (the effective ``θ_S + θ_Pk`` of each branch is quantized, so
    merging first is not needed).
    """

    def __init__(self, branches: list[Int8Linear]) -> None:
        super().__init__()
        if not branches:
            raise ValueError("Int8BranchedLinear needs at least one branch")
        shapes = {(b.in_features, b.out_features) for b in branches}
        if len(shapes) != 1:
            raise ValueError(f"branches must all have one shape, got {sorted(shapes)}")
        self.branches = nn.ModuleList(branches)
        self.in_features, self.out_features = shapes.pop()

    @classmethod
    @torch.no_grad()
    def from_float(cls, mod: nn.Module) -> Int8BranchedLinear:
        """Quantize each branch of a :class:`BranchedLinear` (shared part included)."""
        if not isinstance(mod, BranchedLinear):
            raise TypeError(f"expected a BranchedLinear, got {type(mod).__name__}")
        weight, bias = mod.branch_parameters()  # (N, out, in), (N, out)
        branches = []
        for k in range(mod.n_branches):
            q, scale = quantize_rows(weight[k])
            branches.append(Int8Linear(q, scale, None if bias is None
                                       else bias[k].detach().float().clone()))
        return cls(branches)

    @property
    def n_branches(self) -> int:
        return len(self.branches)

    @property
    def has_shared(self) -> bool:
        return False

    def grouped(self, xs: Tensor, groups: BranchGroups) -> Tensor:
        """``(M, in)`` rows sorted by branch as ``groups`` lays them out -> ``(M, out)``.

        One int8 matmul per non-empty group (an empty group computes nothing); a single
        group runs on ``xs`` directly (no split, no concatenation).
        """
        if len(groups.sizes) != self.n_branches:
            raise ValueError(f"got {len(groups.sizes)} group sizes for {self.n_branches} "
                             f"branches")
        branches = self.branches

        def apply(k: int, rows: Tensor) -> Tensor:  # the kernel itself: no module call
            b = branches[k]
            bufs = b._buffers  # not b.weight_int8 &c.: Module.__getattr__ costs per call
            return int8_linear(rows, bufs["weight_int8"], bufs["weight_scale"], bufs["bias"],
                               b.packed())

        return run_used_groups(xs, groups, apply, self.out_features)

    def forward(self, x: Tensor, branch: Tensor) -> Tensor:
        return branched_forward(self, x, branch)

    def macs(self, n_tokens: int) -> int:
        """Multiply-adds of ``n_tokens`` rows (each runs one branch)."""
        return n_tokens * self.in_features * self.out_features

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"n_branches={self.n_branches}, dtype=int8")


register_int8(BranchedLinear, Int8BranchedLinear.from_float)


def merge_shared_(model: nn.Module) -> int:
    """Merge the shared part into every :class:`BranchedLinear` of ``model`` (in place).

    Call after training, before inference or export; a merged model's state dict has no
    ``shared_weight`` / ``shared_bias`` entries. Returns how many layers were merged.
    """
    n = 0
    for m in model.modules():
        if isinstance(m, BranchedLinear) and m.has_shared:
            m.merge_()
            n += 1
    return n
