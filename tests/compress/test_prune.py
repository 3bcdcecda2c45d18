"""Sensitivity analysis, threshold binary search, gradual (AGP) pruning, sparsity report."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dynaseq.compress.prune import (
    GradualPruner,
    agp_sparsity,
    get_mask,
    magnitude_mask,
    prunable_parameters,
    sensitivity_analysis,
    sparsity_report,
    thresholds_for_target,
)
from dynaseq.core.errors import DynaseqError


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 10))


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10, (32,), generator=g), torch.randint(0, 10, (32,), generator=g)


def _ppl(model: nn.Module, x, y) -> float:
    with torch.no_grad():
        return float(torch.exp(nn.functional.cross_entropy(model(x), y)))


def test_prunable_parameters_default_and_embeddings():
    m = _model()
    assert prunable_parameters(m) == ["1.weight", "3.weight"]
    assert prunable_parameters(m, include_embeddings=True) == ["0.weight", "1.weight", "3.weight"]


def test_magnitude_mask_exact_count_and_keeps_pruned():
    w = torch.randn(10, 10)
    m = magnitude_mask(w, 0.37)
    assert int((m == 0).sum()) == 37
    kept = w.abs()[m.bool()].min()
    assert w.abs()[~m.bool()].max() <= kept
    # entries pruned earlier stay pruned even if their stored value is large
    earlier = torch.zeros(10, 10, dtype=torch.bool)
    earlier[0, :5] = True
    w2 = w.clone()
    w2[0, :5] = 100.0
    m2 = magnitude_mask(w2, 0.2, already_pruned=earlier)
    assert not m2[0, :5].any() and int((m2 == 0).sum()) == 20


def test_agp_schedule_values():
    s_i, s_f, t0, t1 = 0.16, 0.6, 100, 1100
    assert agp_sparsity(50, s_i, s_f, t0, t1) == 0.0
    assert agp_sparsity(t0, s_i, s_f, t0, t1) == pytest.approx(s_i)
    assert agp_sparsity(t1, s_i, s_f, t0, t1) == pytest.approx(s_f)
    assert agp_sparsity(5000, s_i, s_f, t0, t1) == pytest.approx(s_f)
    mid = agp_sparsity(600, s_i, s_f, t0, t1)
    assert mid == pytest.approx(s_f + (s_i - s_f) * 0.5 ** 3)
    values = [agp_sparsity(t, s_i, s_f, t0, t1) for t in range(t0, t1 + 1, 50)]
    assert values == sorted(values)


def test_gradual_pruner_masks_survive_optimizer_and_finalize_counts():
    m = _model()
    x, y = _data()
    targets = {"1.weight": 0.5, "3.weight": 0.75}
    pruner = GradualPruner(m, targets, start_step=2, end_step=12, frequency=3,
                           initial_sparsity=0.1)
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    applied_steps = []
    last = dict.fromkeys(targets, 0.0)
    for step in range(16):
        applied = pruner.step(step)
        if applied is not None:
            applied_steps.append(step)
            for n, s in applied.items():
                assert s >= last[n]
                last[n] = s
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        # forward pass sees exact zeros where the mask is 0, whatever Adam did to weight_orig
        for n in targets:
            mod = m.get_submodule(n.split(".")[0])
            mask = get_mask(mod)
            if mask is not None:
                assert torch.all(mod.weight[mask.mask == 0] == 0)
                assert int((mask.mask == 0).sum()) == round(last[n] * mask.mask.numel())
    assert applied_steps == [2, 5, 8, 11, 12]
    assert pruner.current == pytest.approx(targets)
    rep = sparsity_report(m)
    assert rep.per_param["1.weight"] == (64, 128) and rep.per_param["3.weight"] == (120, 160)
    pruner.finalize()
    sd = m.state_dict()
    assert not any("parametrizations" in k for k in sd)
    assert isinstance(m[1].weight, nn.Parameter)
    assert int((sd["1.weight"] == 0).sum()) == round(0.5 * 128)
    assert int((sd["3.weight"] == 0).sum()) == round(0.75 * 160)
    assert sparsity_report(m).overall == pytest.approx((64 + 120) / (128 + 160))
    # parameters optimized before pruning are still the model's parameters
    assert {id(p) for p in m.parameters()} == {id(p) for g in opt.param_groups for p in g["params"]}


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, float("nan")])
def test_bad_target_sparsity(bad):
    m = _model()
    with pytest.raises(DynaseqError, match=r"\[0, 1\)"):
        GradualPruner(m, {"1.weight": bad}, 0, 10, 1)
    with pytest.raises(DynaseqError, match=r"\[0, 1\)"):
        thresholds_for_target({"a": [(0.0, 1.0)]}, {"a": 4}, bad)
    with pytest.raises(DynaseqError, match=r"\[0, 1\)"):
        sensitivity_analysis(m, lambda: 1.0, [bad])


def test_bad_names_and_frequency():
    m = _model()
    with pytest.raises(DynaseqError, match="no weight"):
        GradualPruner(m, {"1.nothing": 0.5}, 0, 10, 1)
    with pytest.raises(DynaseqError, match="frequency"):
        GradualPruner(m, 0.5, 0, 10, 0)


def test_sensitivity_analysis_restores_model():
    m = _model()
    x, y = _data()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    calls = []

    def evaluate() -> float:
        calls.append(1)
        return _ppl(m, x, y)

    res = sensitivity_analysis(m, evaluate, [0.25, 0.5, 0.9])
    assert len(calls) == 1 + 2 * 3
    assert set(res.curves) == {"1.weight", "3.weight"}
    assert res.sizes == {"1.weight": 128, "3.weight": 160}
    for curve in res.curves.values():
        assert [s for s, _ in curve] == [0.0, 0.25, 0.5, 0.9]
        assert curve[0][1] == res.baseline
    assert res.curves["3.weight"][-1][1] != res.baseline
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k])


def test_threshold_binary_search_hits_target():
    grid = [i / 100 for i in range(96)]
    sizes = {"a": 1000, "b": 3000, "c": 500}
    sens = {"a": 40.0, "b": 5.0, "c": 200.0}  # b is robust, c is fragile
    curves = {n: [(s, 30.0 + k * s ** 2) for s in grid] for n, k in sens.items()}
    for target in (0.1, 0.358, 0.6, 0.8):
        plan = thresholds_for_target(curves, sizes, target)
        assert target <= plan.achieved <= target + 0.01
        total = sum(sizes.values())
        assert plan.achieved == pytest.approx(
            sum(sizes[n] * plan.sparsities[n] for n in sizes) / total)
        assert plan.sparsities["b"] >= plan.sparsities["a"] >= plan.sparsities["c"]
        for n, s in plan.sparsities.items():  # every matrix sits at the threshold's inverse
            assert 30.0 + sens[n] * (s - 1 / sizes[n]) ** 2 <= plan.threshold  # (a whole
            assert s * sizes[n] == pytest.approx(round(s * sizes[n]))  # count, rounded up)
    assert thresholds_for_target(curves, sizes, 0.0).achieved == 0.0
    with pytest.raises(DynaseqError, match="above"):
        thresholds_for_target({"a": [(0.0, 30.0), (0.5, 31.0)]}, {"a": 10}, 0.7)
    # matrices whose curves reach the threshold together (a barely trained model): the
    # grid alone steps from 0.2 to 0.4 overall; read as lines, the plan meets the target
    flat = {n: [(0.0, 30.0), (0.2, 30.5), (0.4, 31.0), (0.6, 35.0)] for n in "abc"}
    steep = {**flat, "d": [(0.0, 30.0), (0.2, 30.6), (0.4, 40.0)]}
    flat_sizes, steep_sizes = {"a": 100, "b": 200, "c": 300}, {"a": 100, "b": 200, "c": 300,
                                                                "d": 400}
    for target in (0.1, 0.3, 0.5):
        plan = thresholds_for_target(flat, flat_sizes, target)
        assert target <= plan.achieved <= target + 0.01
        assert plan.sparsities == pytest.approx(dict.fromkeys("abc", target), abs=0.01)
        plan = thresholds_for_target(steep, steep_sizes, target)
        assert target <= plan.achieved <= target + 4 / 400  # a count rounded up per matrix
        for n, curve in steep.items():  # one perplexity rule: each line's inverse at ξ*
            rising = [(a, b) for a, b in zip(curve, curve[1:], strict=False)
                      if a[1] <= plan.threshold <= b[1]]
            if not rising:  # ξ* above the whole curve
                assert plan.sparsities[n] == curve[-1][0] and curve[-1][1] <= plan.threshold
                continue
            (s0, p0), (s1, p1) = rising[-1]
            assert plan.sparsities[n] == pytest.approx(
                s0 + (plan.threshold - p0) / (p1 - p0) * (s1 - s0), abs=1 / steep_sizes[n])
    # every matrix at the grid's one sparsity reaches exactly that target (no rounding miss)
    odd = {n: [(0.0, 30.0), (0.3, 31.0 + i)] for i, n in enumerate("abc")}
    assert thresholds_for_target(odd, {"a": 500, "b": 333, "c": 1024}, 0.3).sparsities == {
        "a": 0.3, "b": 0.3, "c": 0.3}  # Σ|φ|·0.3/Σ|φ| = 0.29999999999999993


def test_plan_drives_pruner_to_overall_target():
    m = _model()
    x, y = _data()
    res = sensitivity_analysis(m, lambda: _ppl(m, x, y), [i / 10 for i in range(1, 10)])
    plan = thresholds_for_target(res.curves, res.sizes, 0.4)
    pruner = GradualPruner(m, plan.sparsities, start_step=0, end_step=4, frequency=2)
    for t in range(6):
        pruner.step(t)
    pruner.finalize()
    rep = sparsity_report(m)
    assert abs(rep.overall - plan.achieved) < 2 / rep.total
    assert rep.overall >= 0.4 - 2 / rep.total  # per-matrix counts are rounded


def test_resume_mid_pruning_from_checkpoint():
    m = _model()
    pruner = GradualPruner(m, {"1.weight": 0.5, "3.weight": 0.5}, 0, 10, 5)
    pruner.step(0)
    pruner.step(5)
    ckpt = {"model": m.state_dict(), "pruner": pruner.state_dict()}
    fresh = _model(seed=1)
    resumed = GradualPruner(fresh, {"1.weight": 0.5, "3.weight": 0.5}, 0, 10, 5)
    resumed.ensure_masks()
    fresh.load_state_dict(ckpt["model"])
    resumed.load_state_dict(ckpt["pruner"])
    assert resumed.current == pruner.current
    x, _ = _data()
    torch.testing.assert_close(fresh(x), m(x))
    resumed.step(10)
    resumed.finalize()
    assert sparsity_report(fresh).per_param["1.weight"] == (64, 128)


def test_tied_linear_counts_as_embedding():
    m = _model()
    tied = nn.Linear(8, 10, bias=False)
    tied.weight = m[0].weight
    m.append(tied)
    assert prunable_parameters(m) == ["1.weight", "3.weight"]
    assert prunable_parameters(m, include_embeddings=True) == ["0.weight", "1.weight", "3.weight"]


class TiedToy(nn.Module):
    """Reads ``head.weight`` directly as an embedding table, like the tied adaptive input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(8, 10, bias=False)
        self.mid = nn.Linear(8, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = nn.functional.embedding(tokens, self.head.weight)  # (N, 8)
        return self.head(torch.tanh(self.mid(e)))


def test_direct_weight_reads_see_the_mask_every_step():
    m = TiedToy()
    x, y = _data()
    pruner = GradualPruner(m, {"head.weight": 0.5, "mid.weight": 0.3}, 0, 4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(6):  # would fail with a forward-hook mask (stale graph)
        pruner.step(step)
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        assert int((m.head.weight == 0).sum()) == round(pruner.current["head.weight"] * 80)
    pruner.finalize()
    assert int((m.head.weight == 0).sum()) == 40


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(30.0, 60.0), min_size=4, max_size=4), min_size=2,
                max_size=5),
       st.lists(st.integers(50, 5000), min_size=5, max_size=5), st.floats(0.05, 0.85))
def test_a_plan_reaches_its_target_and_never_overshoots_more_than_the_grid(ppls, sizes,
                                                                           target):
    """Noisy curves (perplexity falling again as sparsity grows): the plan is at least the
    target, and no further above it than the grid's own plan (the smallest candidate
    threshold reaching it, read on the grid points alone)."""
    from dynaseq.compress.prune import _overall

    grid = [0.0, 0.3, 0.6, 0.9]
    curves = {f"m{i}": list(zip(grid, p, strict=True)) for i, p in enumerate(ppls)}
    size = {f"m{i}": sizes[i] for i in range(len(ppls))}
    plan = thresholds_for_target(curves, size, target)
    candidates = sorted({v for p in ppls for v in p})
    grid_plan = next(a for a in (_overall(curves, size, c)[0] for c in candidates)
                     if a >= target - 1e-9)
    assert target - 1e-9 <= plan.achieved <= grid_plan + 1e-12


def test_nan_perplexities_and_empty_matrices_do_not_break_a_plan():
    curves = {"a": [(0.0, 30.0), (0.3, math.nan), (0.6, 31.0)],
              "b": [(0.0, 30.0), (0.3, 30.2), (0.6, 33.0)], "c": [(0.0, 30.0), (0.6, 30.1)]}
    plan = thresholds_for_target(curves, {"a": 100, "b": 300, "c": 0}, 0.5)
    assert 0.5 <= plan.achieved <= 0.51 and not math.isnan(plan.threshold)
    assert all(0.0 <= v <= 0.6 for v in plan.sparsities.values())
