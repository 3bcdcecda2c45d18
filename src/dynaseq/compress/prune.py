"""Sensitivity-guided gradual magnitude pruning (MicroNet §4.2; Zhu & Gupta 2017).

The pipeline, over the model's prunable weight matrices Φ = {φ_1 … φ_p}:

1. :func:`sensitivity_analysis` — for each φ alone, magnitude-prune it to each sparsity ρ
   of a grid, evaluate the model (a callable returning validation perplexity), restore.
   This gives the empirical curves ξ_φ = f_φ(ρ_φ).
2. :func:`thresholds_for_target` — binary search on a perplexity threshold ξ* such that
   pruning every φ to ρ_φ = f_φ⁻¹(ξ*) (the largest grid sparsity whose perplexity is ≤ ξ*)
   reaches the target overall sparsity ρ = Σ|φ|ρ_φ / Σ|φ| (parameter-count weighted);
   where the grid steps past the target, the curves are read as piecewise linear between
   their points, so the plan meets it.
3. :class:`GradualPruner` — automated gradual pruning towards those per-matrix targets while
   training: s_t = s_f + (s_i − s_f)·(1 − (t − t_0)/(nΔt))³, a fresh magnitude mask every
   Δt steps, kept as a ``torch.nn.utils.parametrize`` parametrization w = w_orig · mask
   (:class:`WeightMask`), so masked weights stay zero whatever the optimizer does;
   :meth:`GradualPruner.finalize` bakes the masks in (``remove_parametrizations``) so the
   state dict is plain again.

Why a parametrization and not ``torch.nn.utils.prune``'s forward pre-hook: the hook only
refreshes ``module.weight`` when that module's ``forward`` runs, but the LM reads some weights
directly (the tied adaptive input uses the adaptive softmax's head/tail Linear layers as its
embedding tables, through ``table.weight`` in ``F.embedding``); with the hook those reads see
the previous step's tensor (stale values and an already freed autograd graph). A
parametrization recomputes ``module.weight`` on every access. Masks are computed here by
magnitude (the ranking of ``prune.l1_unstructured``) and held in the ``mask`` buffer.

Matrices are named by their parameter's qualified name (``"layers.0.ff.fc1.weight"``); by
default every ``nn.Linear`` weight is prunable (:func:`prunable_parameters`; embeddings only
with ``include_embeddings=True``). Magnitude pruning at sparsity s zeroes the
round(s·n) smallest-|w| entries of an n-element matrix (the count ``torch.nn.utils.prune``
uses for a float ``amount``). With the tied adaptive input/softmax, the softmax head and tail
Linear layers are the embedding tables and are listed as ``embed.tables.<i>.weight``.

Example::

    names = prunable_parameters(model)
    sens = sensitivity_analysis(model, lambda: evaluate_ppl(model), [0.1, 0.2, ..., 0.9])
    plan = thresholds_for_target(sens.curves, sens.sizes, target_sparsity=0.358)
    pruner = GradualPruner(model, plan.sparsities, start_step=0, end_step=175_000,
                           frequency=1000, initial_sparsity=0.16)
    for step in range(total):
        pruner.step(step)          # before the forward pass of that step
        ...train...
    pruner.finalize()
    print(sparsity_report(model, names).overall)
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

from dynaseq.core.errors import DynaseqError

__all__ = [
    "GradualPruner", "PruningPlan", "SensitivityResult", "SparsityReport", "WeightMask",
    "add_mask", "agp_sparsity", "get_mask", "magnitude_mask", "prunable_parameters",
    "remove_parametrization", "sensitivity_analysis", "sparsity_report",
    "thresholds_for_target",
]


# --------------------------------------------------------------------------- helpers

def _check_sparsity(value: float, what: str = "target sparsity") -> float:
    if not isinstance(value, (int, float)) or math.isnan(value) or not 0.0 <= value < 1.0:
        raise DynaseqError(f"{what} must be in [0, 1), got {value!r}")
    return float(value)


def prunable_parameters(model: nn.Module, include_embeddings: bool = False) -> list[str]:
    """Qualified names of the weight matrices pruning acts on by default.

    Every ``nn.Linear`` weight (and ``nn.Embedding`` tables when ``include_embeddings``).
    Linear weights tied to an embedding table count as embeddings; tied weights are listed
    once. A weight already under a mask is listed by its plain name.
    """
    kinds: tuple[type, ...] = (nn.Linear,)
    if include_embeddings:
        kinds += (nn.Embedding,)
    names = []
    seen: set[int] = set()
    if not include_embeddings:  # a Linear tied to an embedding table is an embedding
        seen = {id(_source_param(m, "weight")) for m in model.modules()
                if isinstance(m, nn.Embedding)}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, kinds):
            w = _source_param(mod, "weight")
            if id(w) in seen:  # tied weights: prune once
                continue
            seen.add(id(w))
            names.append(f"{mod_name}.weight" if mod_name else "weight")
    return names


def _resolve(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod_name, _, attr = name.rpartition(".")
    try:
        mod = model.get_submodule(mod_name) if mod_name else model
    except AttributeError as err:
        raise DynaseqError(f"no module {mod_name!r} in the model (from parameter {name!r})"
                           ) from err
    if not (parametrize.is_parametrized(mod, attr)
            or isinstance(mod._parameters.get(attr), torch.Tensor)):
        raise DynaseqError(f"no weight {name!r} in the model")
    return mod, attr


class WeightMask(nn.Module):
    """Parametrization w ↦ w · mask, ``mask`` a 0/1 buffer of the weight's shape."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.mask


def get_mask(mod: nn.Module, attr: str = "weight") -> WeightMask | None:
    """The :class:`WeightMask` parametrization on ``mod.<attr>``, if any."""
    if not parametrize.is_parametrized(mod, attr):
        return None
    return next((p for p in mod.parametrizations[attr] if isinstance(p, WeightMask)), None)


def _source_param(mod: nn.Module, attr: str) -> torch.Tensor:
    """The trainable Parameter behind ``mod.<attr>`` (the original under a parametrization)."""
    if parametrize.is_parametrized(mod, attr):
        return mod.parametrizations[attr].original
    return getattr(mod, attr)


def _effective(mod: nn.Module, attr: str) -> torch.Tensor:
    """The pruned weight before any quantization: original · mask."""
    mask = get_mask(mod, attr)
    src = _source_param(mod, attr)
    return src if mask is None else src * mask.mask


@torch.no_grad()
def add_mask(mod: nn.Module, attr: str, mask: torch.Tensor) -> WeightMask:
    """Set (in place) or register a :class:`WeightMask` on ``mod.<attr>``."""
    current = get_mask(mod, attr)
    if current is not None:
        current.mask.copy_(mask)
        return current
    wm = WeightMask(mask.to(_source_param(mod, attr)))
    parametrize.register_parametrization(mod, attr, wm)
    return wm


def remove_parametrization(mod: nn.Module, attr: str, leave_parametrized: bool = True) -> None:
    """``parametrize.remove_parametrizations`` that leaves ``copy.deepcopy`` twins alone.

    A deep copy of a parametrized module shares its generated class, and the torch function
    edits that class; this gives the module a private copy of the class first.
    """
    cls = type(mod)
    ns = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    mod.__class__ = type(cls.__name__, cls.__bases__, ns)
    parametrize.remove_parametrizations(mod, attr, leave_parametrized=leave_parametrized)


def magnitude_mask(weight: torch.Tensor, sparsity: float,
                   already_pruned: torch.Tensor | None = None) -> torch.Tensor:
    """0/1 mask (same shape) zeroing the round(sparsity·n) smallest-|w| entries.

    Entries where ``already_pruned`` is True are pruned first (so a growing sparsity never
    revives a pruned weight, whatever the value stored under the mask).
    """
    n = weight.numel()
    n_prune = int(round(sparsity * n))
    mask = torch.ones_like(weight, dtype=weight.dtype)
    if n_prune == 0:
        return mask
    score = weight.detach().abs().float().flatten().clone()
    if already_pruned is not None:
        score[already_pruned.flatten()] = -1.0
    idx = torch.topk(score, n_prune, largest=False).indices
    mask.view(-1)[idx] = 0
    return mask


# --------------------------------------------------------------------------- 1. sensitivity

@dataclass
class SensitivityResult:
    """Per-matrix sensitivity curves: ``curves[name] = [(sparsity, perplexity), ...]``."""

    baseline: float  # perplexity of the unpruned model
    curves: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # |φ|, elements per matrix


@torch.no_grad()
def sensitivity_analysis(model: nn.Module, evaluate: Callable[[], float],
                         sparsities: Sequence[float], params: Iterable[str] | None = None,
                         ) -> SensitivityResult:
    """Prune each matrix alone to each sparsity, evaluate, restore (Li et al. 2016).

    Args:
        model: the trained model (changed only temporarily; restored exactly).
        evaluate: ``() -> perplexity`` on the validation data, with the model as it is now
            (called 1 + len(params)·len(sparsities) times).
        sparsities: grid of sparsities in [0, 1), e.g. ``[0.1, 0.2, …, 0.9]``.
        params: matrix names (default :func:`prunable_parameters`).

    Returns:
        :class:`SensitivityResult` with one curve per matrix, each starting with
        ``(0.0, baseline)``.
    """
    grid = sorted({_check_sparsity(s, "sensitivity sparsity") for s in sparsities})
    names = list(params) if params is not None else prunable_parameters(model)
    if not names:
        raise DynaseqError("no prunable weight matrices in the model")
    baseline = float(evaluate())
    result = SensitivityResult(baseline=baseline)
    for name in names:
        mod, attr = _resolve(model, name)
        src = _source_param(mod, attr)
        saved = src.detach().clone()
        eff = _effective(mod, attr).detach().clone()
        old = get_mask(mod, attr)
        pruned_now = old.mask == 0 if old is not None else None
        curve = [(0.0, baseline)]
        try:
            for s in grid:
                if s == 0.0:
                    continue
                mask = magnitude_mask(eff, s, pruned_now)
                src.copy_(saved * mask)
                curve.append((s, float(evaluate())))
        finally:
            src.copy_(saved)
        result.curves[name] = curve
        result.sizes[name] = src.numel()
    return result


# --------------------------------------------------------------------------- 2. threshold

INTERPOLATE_TOL = 1e-6
"""How far above its target a plan may land before :func:`thresholds_for_target` reads the
curves as piecewise linear to meet it."""

@dataclass
class PruningPlan:
    """Per-matrix target sparsities found by :func:`thresholds_for_target`."""

    threshold: float  # ξ*, the perplexity threshold
    sparsities: dict[str, float]  # ρ_φ = f_φ⁻¹(ξ*)
    achieved: float  # Σ|φ|ρ_φ / Σ|φ|
    target: float


def _inverse(curve: Sequence[tuple[float, float]], threshold: float) -> float:
    """f⁻¹(ξ): the largest sparsity on the curve whose perplexity is ≤ ξ (0 if none)."""
    ok = [s for s, ppl in curve if ppl <= threshold]
    return max(ok) if ok else 0.0


def _linear_inverse(curve: Sequence[tuple[float, float]], threshold: float) -> float:
    """f⁻¹(ξ) of the curve read as piecewise linear between its points (sorted by
    sparsity): the largest sparsity on it whose perplexity is ≤ ξ (0 if none)."""
    best = _inverse(curve, threshold)
    points = sorted(curve)
    for (s0, p0), (s1, p1) in zip(points, points[1:], strict=False):
        if p0 <= threshold < p1:  # the segment rises through ξ
            best = max(best, s0 + (threshold - p0) / (p1 - p0) * (s1 - s0))
    return best


def _overall(curves: Mapping[str, Sequence[tuple[float, float]]], sizes: Mapping[str, int],
             threshold: float, inverse: Callable[[Sequence[tuple[float, float]], float], float]
             = _inverse) -> tuple[float, dict[str, float]]:
    per = {n: inverse(c, threshold) for n, c in curves.items()}
    total = sum(sizes[n] for n in curves)
    return sum(sizes[n] * per[n] for n in curves) / total, per


def thresholds_for_target(curves: Mapping[str, Sequence[tuple[float, float]]],
                          sizes: Mapping[str, int], target_sparsity: float) -> PruningPlan:
    """Binary search for the perplexity threshold ξ* reaching a target overall sparsity.

    ρ(ξ) = Σ_φ |φ|·f_φ⁻¹(ξ) / Σ_φ |φ| is a non-decreasing step function of ξ that only
    changes at the perplexities on the curves, so the search runs over those sorted values
    for the smallest ξ* with ρ(ξ*) ≥ ρ_target. Where that steps past the target (a coarse
    grid, or several matrices whose curves reach ξ* together: on a barely trained model a
    0.4 target gave 0.58), ξ* is searched again by bisection on its value with each curve
    read as piecewise linear between its points (:func:`_linear_inverse`), so every matrix
    is pruned by the same perplexity rule and the plan meets the target (up to the float
    bisection, each matrix's count of zeroed entries rounded up; a curve that falls again,
    as noisy ones do, makes ρ jump, and the plan nearer the target of the two is kept): a
    matrix whose curve rises through ξ* gets a sparsity between its points.

    Args:
        curves: ``{name: [(sparsity, perplexity), ...]}`` (:class:`SensitivityResult`).
        sizes: ``{name: number of elements}``.
        target_sparsity: ρ in [0, 1).

    Raises:
        DynaseqError: bad target, or a target above what the grid allows (the largest
        grid sparsities of every matrix together).
    """
    target = _check_sparsity(target_sparsity)
    if not curves:
        raise DynaseqError("no sensitivity curves given")
    missing = [n for n in curves if n not in sizes]
    if missing:
        raise DynaseqError(f"no size given for {missing}")
    if target == 0.0:
        return PruningPlan(threshold=-math.inf, sparsities=dict.fromkeys(curves, 0.0),
                           achieved=0.0, target=0.0)
    # NaN perplexities (a diverged evaluation) meet no threshold: not candidates either
    candidates = sorted({ppl for c in curves.values() for _, ppl in c if not math.isnan(ppl)})
    tol = 1e-9  # Σ|φ|ρ/Σ|φ| rounds: every matrix at exactly ρ must reach ρ
    max_rho, _ = _overall(curves, sizes, math.inf)
    if max_rho < target - tol:
        raise DynaseqError(f"target sparsity {target} is above the {max_rho:.4f} reachable by "
                           "pruning every matrix to its largest analysed sparsity; analyse "
                           "higher sparsities")
    # rho is monotone in the candidate index: find the first index reaching the target.
    lo = bisect.bisect_left(
        range(len(candidates)), True,
        key=lambda i: _overall(curves, sizes, candidates[i])[0] >= target - tol)
    lo = min(lo, len(candidates) - 1)  # (the largest reaches max_rho: never past it)
    threshold = candidates[lo]
    achieved, per = _overall(curves, sizes, threshold)
    if achieved > target + INTERPOLATE_TOL:  # stepped past it: read the curves as lines
        lo_xi, hi_xi = candidates[0] - 1.0, threshold  # ρ 0 below every perplexity
        while lo_xi < (mid := (lo_xi + hi_xi) / 2) < hi_xi:  # ρ non-decreasing in ξ
            if _overall(curves, sizes, mid, _linear_inverse)[0] >= target:
                hi_xi = mid
            else:
                lo_xi = mid
        _, lin = _overall(curves, sizes, hi_xi, _linear_inverse)
        # whole counts, rounded up: the pruner zeroes round(ρ·n) entries, which then sum to
        # at least the target
        lin = {n: rho if not sizes[n] else min(math.ceil(rho * sizes[n] - 1e-9) / sizes[n],
                                               max(s for s, _ in curves[n]))
               for n, rho in lin.items()}  # (no further than the curve was analysed)
        reached = sum(sizes[n] * lin[n] for n in curves) / sum(sizes[n] for n in curves)
        if target - tol <= reached < achieved:  # a noisy curve's jump can overshoot more
            threshold, achieved, per = hi_xi, reached, lin
    return PruningPlan(threshold=threshold, sparsities=per, achieved=achieved, target=target)


# --------------------------------------------------------------------------- 3. AGP

def agp_sparsity(step: int, initial: float, final: float, start_step: int, end_step: int
                 ) -> float:
    """Zhu & Gupta (2017): s_t = s_f + (s_i − s_f)(1 − (t − t_0)/(nΔt))³, clamped to [t_0, t_end].

    ``nΔt = end_step − start_step``; before ``start_step`` the result is 0 (nothing pruned
    yet), from ``start_step`` on it rises from s_i to s_f, and after ``end_step`` it stays s_f.
    """
    if step < start_step:
        return 0.0
    if end_step <= start_step:
        return final
    frac = min(1.0, (step - start_step) / (end_step - start_step))
    return final + (initial - final) * (1.0 - frac) ** 3


class GradualPruner:
    """Automated gradual pruning of several matrices towards per-matrix targets.

    Args:
        model: the model being trained.
        targets: ``{param name: final sparsity s_f ∈ [0, 1)}`` (e.g.
            ``PruningPlan.sparsities``), or one float for every :func:`prunable_parameters`.
        start_step: t_0, the first step that prunes (to s_i).
        end_step: t_0 + nΔt, the step at which s_f is reached.
        frequency: Δt, prune every ``frequency`` steps between start and end.
        initial_sparsity: s_i, the sparsity applied at ``start_step`` (the paper: 0.16); a
            float means ``min(initial, s_f)`` for each matrix, or give a per-matrix dict.
            Default 0.

    Call :meth:`step` with the global step before each forward pass (it prunes only at
    schedule points; between calls every read of ``module.weight`` gives original · mask).
    Optimizer references stay valid: the parametrization keeps the same Parameter object
    as ``module.parametrizations.weight.original``.
    """

    def __init__(self, model: nn.Module, targets: Mapping[str, float] | float, start_step: int,
                 end_step: int, frequency: int,
                 initial_sparsity: float | Mapping[str, float] = 0.0) -> None:
        if isinstance(targets, (int, float)):
            targets = dict.fromkeys(prunable_parameters(model), float(targets))
        if not targets:
            raise DynaseqError("no matrices to prune")
        if frequency < 1:
            raise DynaseqError(f"pruning frequency must be >= 1 step, got {frequency}")
        if start_step < 0 or end_step < start_step:
            raise DynaseqError(f"need 0 <= start_step <= end_step, got {start_step}, {end_step}")
        self.model = model
        self.targets = {n: _check_sparsity(s, f"target sparsity of {n}") for n, s in targets.items()}
        if isinstance(initial_sparsity, Mapping):
            init = {n: _check_sparsity(initial_sparsity.get(n, 0.0), f"initial sparsity of {n}")
                    for n in self.targets}
        else:
            s0 = _check_sparsity(initial_sparsity, "initial sparsity")
            init = {n: min(s0, s) for n, s in self.targets.items()}
        self.initial = init
        self.start_step, self.end_step, self.frequency = start_step, end_step, frequency
        self._modules = {n: _resolve(model, n) for n in self.targets}
        self.current: dict[str, float] = dict.fromkeys(self.targets, 0.0)
        self.finalized = False

    def sparsity_at(self, step: int) -> dict[str, float]:
        """The scheduled sparsity of every matrix at ``step``."""
        return {n: agp_sparsity(step, self.initial[n], s_f, self.start_step, self.end_step)
                for n, s_f in self.targets.items()}

    def is_pruning_step(self, step: int) -> bool:
        if step < self.start_step:
            return False
        if step >= self.end_step:
            return any(self.current[n] != self.targets[n] for n in self.targets)
        return (step - self.start_step) % self.frequency == 0

    @torch.no_grad()
    def step(self, step: int) -> dict[str, float] | None:
        """Prune to the schedule at ``step`` if it is a pruning step; returns the applied
        sparsities (or None when nothing changed)."""
        if self.finalized:
            raise DynaseqError("the pruner was finalized; masks are permanent now")
        if not self.is_pruning_step(step):
            return None
        sched = self.sparsity_at(step)
        for name, s in sched.items():
            s = max(s, self.current[name])  # sparsity never decreases
            self._apply(name, s)
            self.current[name] = s
        return dict(self.current)

    def _apply(self, name: str, sparsity: float) -> None:
        mod, attr = self._modules[name]
        old = get_mask(mod, attr)
        eff = _effective(mod, attr)
        add_mask(mod, attr, magnitude_mask(eff, sparsity,
                                           already_pruned=None if old is None else old.mask == 0))

    def ensure_masks(self) -> None:
        """Give every target an (all-ones) prune mask now, so that a checkpoint saved
        mid-pruning (``parametrizations.weight.*`` keys) loads into a freshly built model::

            pruner = GradualPruner(fresh_model, targets, ...); pruner.ensure_masks()
            fresh_model.load_state_dict(ckpt["model"]); pruner.load_state_dict(ckpt["pruner"])
        """
        for mod, attr in self._modules.values():
            if get_mask(mod, attr) is None:
                add_mask(mod, attr, torch.ones_like(_source_param(mod, attr)))

    def state_dict(self) -> dict[str, object]:
        """The schedule position (the masks themselves live in the model's state dict)."""
        return {"current": dict(self.current), "finalized": self.finalized}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        current = state["current"]
        unknown = set(current) - set(self.targets)
        if unknown:
            raise DynaseqError(f"pruner state has unknown matrices {sorted(unknown)}")
        self.current.update({n: float(v) for n, v in current.items()})
        self.finalized = bool(state.get("finalized", False))

    def finalize(self) -> nn.Module:
        """Make the masks permanent: plain weights with exact zeros, no
        ``parametrizations.*`` entries in the state dict. Returns the model.

        Layers under quantization-aware training are left to ``convert_qat_``, which bakes
        the mask and the quantization in together."""
        with torch.no_grad():
            for mod, attr in self._modules.values():
                if getattr(mod, "_dynaseq_qat", None) is not None:
                    continue
                if get_mask(mod, attr) is not None:
                    remove_parametrization(mod, attr, leave_parametrized=True)
        self.finalized = True
        return self.model


# --------------------------------------------------------------------------- report

@dataclass
class SparsityReport:
    """Zero counts per matrix and overall (parameter-count weighted)."""

    per_param: dict[str, tuple[int, int]]  # name -> (zeros, elements)
    zeros: int
    total: int

    @property
    def overall(self) -> float:
        return self.zeros / self.total if self.total else 0.0

    def sparsity(self, name: str) -> float:
        z, n = self.per_param[name]
        return z / n


@torch.no_grad()
def sparsity_report(model: nn.Module, params: Iterable[str] | None = None) -> SparsityReport:
    """Count exact zeros in the (effective) weights of ``params`` (default: prunable ones)."""
    names = list(params) if params is not None else prunable_parameters(model)
    per = {}
    for name in names:
        mod, attr = _resolve(model, name)
        w = getattr(mod, attr)  # as the model uses it (masked; quantized under QAT)
        per[name] = (int((w == 0).sum()), w.numel())
    return SparsityReport(per_param=per, zeros=sum(z for z, _ in per.values()),
                          total=sum(n for _, n in per.values()))
