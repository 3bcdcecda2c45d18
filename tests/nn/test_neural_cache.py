"""Neural cache (Grave et al. 2017 / MicroNet): math, causality, windows, training, search."""

from __future__ import annotations

import math

import pytest
import torch

from dynaseq.core.errors import DynaseqError
from dynaseq.nn.neural_cache import CacheMemory, NeuralCache, local_search


def _data(B=2, T=12, d=3, V=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, d, generator=g, dtype=dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    full = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=dtype), dim=-1)
    model_logp = full.gather(-1, targets[..., None]).squeeze(-1)
    return hidden, targets, full, model_logp


def _reference(model_logp, hidden, targets, n_cache, theta, lam, memory_len=0):
    """Position-by-position loop straight from the formula, in Python floats."""
    B, T, _ = hidden.shape
    out = torch.empty(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            lo = max(0, t - n_cache)
            keys = range(lo, t)
            if not keys:
                out[b, t] = float(model_logp[b, t])
                continue
            w = [math.exp(theta * float(hidden[b, t] @ hidden[b, j])) for j in keys]
            hit = sum(wj for wj, j in zip(w, keys, strict=True) if targets[b, j] == targets[b, t])
            p = (1 - lam) * math.exp(float(model_logp[b, t])) + lam * hit / sum(w)
            out[b, t] = math.log(p)
    return out


def test_hand_computed_tiny_example():
    # T = 4, d = 2, n_cache = 2: position 3 reads positions 1, 2 only.
    h = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, -1.0]]], dtype=torch.float64)
    y = torch.tensor([[5, 7, 5, 7]])
    pm = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    theta, lam = 0.5, 0.25
    cache = NeuralCache(2, theta=theta, lam=lam).double()
    logp, memory = cache.target_log_prob(pm.log(), h, y, None)

    # t=0: empty cache -> P_model. t=1 reads {0: y=5}: target 7 absent -> P_cache = 0.
    # t=2 reads {0: 5, 1: 7}, target 5: scores θ·h2·h0 = 0.5, θ·h2·h1 = 0.5.
    pc2 = math.exp(0.5) / (math.exp(0.5) + math.exp(0.5))
    # t=3 reads {1: 7, 2: 5} (not 0), target 7: θ·h3·h1 = -0.5, θ·h3·h2 = 0.5.
    pc3 = math.exp(-0.5) / (math.exp(-0.5) + math.exp(0.5))
    expected = [0.1, 0.75 * 0.2, 0.75 * 0.3 + 0.25 * pc2, 0.75 * 0.4 + 0.25 * pc3]
    torch.testing.assert_close(logp.exp()[0], torch.tensor(expected, dtype=torch.float64))
    assert memory.size == 2 and memory.targets.tolist() == [[5, 7]]
    torch.testing.assert_close(memory.hidden, h[:, 2:])


@pytest.mark.parametrize("n_cache", [1, 3, 5, 50])
def test_matches_position_loop(n_cache):
    hidden, targets, _, model_logp = _data()
    cache = NeuralCache(n_cache, theta=0.7, lam=0.3).double()
    logp, _ = cache.target_log_prob(model_logp, hidden, targets, None)
    torch.testing.assert_close(logp, _reference(model_logp, hidden, targets, n_cache, 0.7, 0.3))


def test_lambda_zero_gives_model_log_probs_exactly():
    hidden, targets, _, model_logp = _data(dtype=torch.float32)
    cache = NeuralCache(4)
    with torch.no_grad():
        cache.lam_raw.fill_(-math.inf)  # λ = sigmoid(-inf) = 0
    logp, _ = cache.target_log_prob(model_logp, hidden, targets, None)
    assert torch.equal(logp, model_logp)


def test_empty_cache_is_model():
    hidden, targets, full, model_logp = _data()
    cache = NeuralCache(3, theta=1.0, lam=0.5).double()
    logp, _ = cache.target_log_prob(model_logp, hidden, targets, None)
    assert torch.equal(logp[:, 0], model_logp[:, 0])
    assert torch.equal(cache.mix_distribution(full[:, 0], hidden[:, 0], None), full[:, 0])


@pytest.mark.parametrize("n_cache,window", [(5, 4), (5, 1), (3, 5), (40, 3)])
def test_windows_with_memory_equal_one_long_window(n_cache, window):
    hidden, targets, _, model_logp = _data(T=12)
    cache = NeuralCache(n_cache, theta=0.8, lam=0.2).double()
    whole, _ = cache.target_log_prob(model_logp, hidden, targets, None)
    parts, memory = [], None
    for s in range(0, 12, window):
        lp, memory = cache.target_log_prob(model_logp[:, s:s + window],
                                           hidden[:, s:s + window], targets[:, s:s + window],
                                           memory)
        assert memory.size == min(n_cache, s + lp.size(1))
        parts.append(lp)
    torch.testing.assert_close(torch.cat(parts, dim=1), whole)


def test_causality():
    hidden, targets, _, model_logp = _data(T=10, V=3)
    cache = NeuralCache(6, theta=0.9, lam=0.4).double()
    base, _ = cache.target_log_prob(model_logp, hidden, targets, None)
    n = 5
    t2, h2 = targets.clone(), hidden.clone()
    t2[:, n] = (t2[:, n] + 1) % 3
    h2[:, n + 1:] = torch.randn_like(h2[:, n + 1:])
    changed, _ = cache.target_log_prob(model_logp, h2, t2, None)
    assert torch.equal(changed[:, :n], base[:, :n])
    # position n does not read its own pair: a target that occurs nowhere before it gets
    # exactly (1 - λ)·P_model even though its own entry would match
    y = torch.tensor([[0, 1, 2, 3]])
    h = torch.ones(1, 4, 2, dtype=torch.float64)
    pm = torch.full((1, 4), math.log(0.25), dtype=torch.float64)
    lp, _ = cache.target_log_prob(pm, h, y, None)
    torch.testing.assert_close(lp[0, 1:], (0.6 * 0.25 * torch.ones(3, dtype=torch.float64)).log())


def test_mix_distribution_sums_to_one_and_matches_target_log_prob():
    hidden, targets, full, model_logp = _data(T=9, V=5)
    cache = NeuralCache(4, theta=0.6, lam=0.35).double()
    whole, _ = cache.target_log_prob(model_logp, hidden, targets, None)
    memory = None
    for t in range(9):
        dist = cache.mix_distribution(full[:, t], hidden[:, t], memory)
        torch.testing.assert_close(dist.logsumexp(-1), torch.zeros(2, dtype=torch.float64))
        torch.testing.assert_close(dist.gather(1, targets[:, t:t + 1]).squeeze(1), whole[:, t])
        memory = cache.append(memory, hidden[:, t], targets[:, t])
    assert memory.size == 4


def test_float32_long_memory_is_stable_and_rows_normalised():
    torch.manual_seed(0)
    cache = NeuralCache(500, theta=5.0, lam=0.5)  # large θ·hᵀh: needs log space
    h = torch.randn(2, 600, 16) * 10
    y = torch.randint(0, 50, (2, 600))
    pm = torch.full((2, 600), -math.log(50.0))
    lp, memory = cache.target_log_prob(pm, h, y, None)
    assert torch.isfinite(lp).all() and (lp <= 1e-6).all()
    full = torch.log_softmax(torch.randn(2, 50), -1)
    dist = cache.mix_distribution(full, torch.randn(2, 16) * 10, memory)
    torch.testing.assert_close(dist.exp().sum(-1), torch.ones(2))


def test_padding_targets_are_not_cached():
    hidden, targets, _, model_logp = _data(T=6)
    cache = NeuralCache(10, theta=0.5, lam=0.5).double()
    padded = targets.clone()
    padded[:, 2] = -100
    lp, memory = cache.target_log_prob(model_logp, hidden, padded, None)
    # equivalent: the same stream with position 2 removed from the keys
    keep = [0, 1, 3, 4, 5]
    ref = _reference(model_logp[:, keep], hidden[:, keep], targets[:, keep], 10, 0.5, 0.5)
    torch.testing.assert_close(lp[:, keep], ref)
    assert not memory.valid[:, 2].any()


def test_reset_rows():
    hidden, targets, _, model_logp = _data(T=8)
    cache = NeuralCache(8, theta=0.5, lam=0.5).double()
    _, memory = cache.target_log_prob(model_logp[:, :4], hidden[:, :4], targets[:, :4], None)
    assert cache.reset(memory) is None
    memory = cache.reset(memory, torch.tensor([True, False]))
    lp, _ = cache.target_log_prob(model_logp[:, 4:], hidden[:, 4:], targets[:, 4:], memory)
    fresh, _ = cache.target_log_prob(model_logp[:1, 4:], hidden[:1, 4:], targets[:1, 4:], None)
    torch.testing.assert_close(lp[:1], fresh)  # row 0 starts a new document
    whole, _ = cache.target_log_prob(model_logp, hidden, targets, None)
    torch.testing.assert_close(lp[1:], whole[1:, 4:])  # row 1 continues


def test_gradients_finite_and_memory_detached():
    hidden, targets, _, model_logp = _data(T=6, dtype=torch.float32)
    cache = NeuralCache(3)
    h1 = hidden[:, :3].clone().requires_grad_(True)
    _, memory = cache.target_log_prob(model_logp[:, :3], h1, targets[:, :3], None)
    assert not memory.hidden.requires_grad
    h2 = hidden[:, 3:].clone().requires_grad_(True)
    lp, _ = cache.target_log_prob(model_logp[:, 3:], h2, targets[:, 3:], memory)
    lp.sum().backward()
    assert h1.grad is None
    for g in (cache.theta_raw.grad, cache.lam_raw.grad, h2.grad):
        assert g is not None and torch.isfinite(g).all()
    assert cache.lam_raw.grad != 0


def test_training_theta_lambda_lowers_loss():
    torch.manual_seed(0)
    V, d, B, T = 20, 8, 4, 32
    emb = torch.randn(V, d) * 2
    cache = NeuralCache(16, theta=0.016, lam=0.07)
    opt = torch.optim.Adam(cache.parameters(), lr=0.1)

    def batch():
        # a stream that repeats a few words: the state that predicts word w looks like emb[w]
        pool = torch.randint(0, V, (B, 4))
        targets = pool.gather(1, torch.randint(0, 4, (B, T)))
        hidden = emb[targets] + 0.3 * torch.randn(B, T, d)
        return torch.full((B, T), -math.log(V)), hidden, targets

    torch.manual_seed(1)
    fixed = batch()
    first = -cache.target_log_prob(*fixed, None)[0].mean().item()
    for _ in range(30):
        opt.zero_grad()
        loss = -cache.target_log_prob(*batch(), None)[0].mean()
        loss.backward()
        opt.step()
    last = -cache.target_log_prob(*fixed, None)[0].mean().item()
    assert last < first - 0.5
    assert cache.lam.item() > 0.07 and cache.theta.item() > 0.016


def test_parameters_natural_units_and_validation():
    cache = NeuralCache(2000)
    assert cache.theta.item() == pytest.approx(0.016, rel=1e-5)
    assert cache.lam.item() == pytest.approx(0.07, rel=1e-5)
    cache.set_params(theta=0.0266, lam=0.145, n_cache=3000)
    assert cache.theta.item() == pytest.approx(0.0266, rel=1e-5)
    assert cache.lam.item() == pytest.approx(0.145, rel=1e-5)
    assert cache.n_cache == 3000
    for bad in (dict(n_cache=0), dict(n_cache=2, lam=0.0), dict(n_cache=2, lam=1.0),
                dict(n_cache=2, theta=-1.0), dict(n_cache=1.5)):
        with pytest.raises(DynaseqError):
            NeuralCache(**bad)
    assert issubclass(DynaseqError, Exception)
    hidden, targets, full, model_logp = _data(dtype=torch.float32)
    with pytest.raises(DynaseqError):
        cache.target_log_prob(model_logp[:, :-1], hidden, targets, None)
    with pytest.raises(DynaseqError):
        cache.target_log_prob(model_logp, hidden, targets.float(), None)
    _, memory = cache.target_log_prob(model_logp, hidden, targets, None)
    with pytest.raises(DynaseqError):  # memory from a stream with another batch size
        cache.target_log_prob(model_logp[:1], hidden[:1], targets[:1], memory)
    with pytest.raises(DynaseqError):
        cache.mix_distribution(full[:, 0], hidden[:, 0, :2], memory)
    with pytest.raises(DynaseqError):
        CacheMemory(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))


def test_ops_per_token():
    cache = NeuralCache(2000)
    ops = cache.ops_per_token(d_model=256)
    assert ops.mults == 256 + 2000 * 256 + 2
    assert ops.adds == 2000 * 255 + 2 * 1999 + 1
    assert (ops.exps, ops.divs) == (2000, 1)
    assert ops.total == ops.mults + ops.adds + ops.exps + ops.divs
    assert cache.ops_per_token(256, n_cache=3000).mults > ops.mults
    gen = cache.ops_per_token(256, vocab_size=100)
    assert gen.mults == 256 + 2000 * 256 + 100 + 2000
    with pytest.raises(DynaseqError):
        cache.ops_per_token(256, n_cache=0)


def _bowl(theta, lam, n_cache, calls=None):
    """Convex in (log θ, logit λ), minimum at θ = 0.03, λ = 0.15; larger caches help."""
    if calls is not None:
        calls.append((theta, lam, n_cache))
    u, v = math.log(theta), math.log(lam / (1 - lam))
    return 30 + (u - math.log(0.03)) ** 2 + 2 * (v - math.log(0.15 / 0.85)) ** 2 \
        - 0.5 * min(n_cache, 4000) / 1000


def test_local_search_finds_minimum_of_convex_function():
    calls = []
    res = local_search(lambda t, lm, n: _bowl(t, lm, n, calls), 0.016, 0.07, 2000,
                       step=0.5, min_step=0.01, max_evals=500)
    assert res.n_cache == 2000
    assert math.log(res.theta) == pytest.approx(math.log(0.03), abs=0.02)
    assert math.log(res.lam / (1 - res.lam)) == pytest.approx(math.log(0.15 / 0.85), abs=0.02)
    assert res.score == pytest.approx(_bowl(res.theta, res.lam, 2000))
    assert len(res.trajectory) == len(calls)  # every evaluation recorded, none repeated
    assert len(set(calls)) == len(calls)
    accepted = [p.score for p in res.trajectory if p.accepted]
    assert accepted == sorted(accepted, reverse=True) and accepted[-1] == res.score
    assert res.trajectory[0].theta == pytest.approx(0.016)


def test_local_search_cache_sizes_and_budget():
    res = local_search(_bowl, 0.016, 0.07, 2000, cache_sizes=[3000, 4000, 6000],
                       min_step=0.02)
    assert res.n_cache == 4000  # 6000 is no better (ties keep the first)
    assert res.theta == pytest.approx(0.03, rel=0.05)
    calls = []
    res = local_search(lambda t, lm, n: _bowl(t, lm, n, calls), 0.016, 0.07, 2000,
                       max_evals=7)
    assert len(calls) == 7 and len(res.trajectory) == 7
    nan = local_search(lambda t, lm, n: float("nan"), 0.016, 0.07, 10, max_evals=5)
    assert nan.score == math.inf and (nan.theta, nan.n_cache) == (pytest.approx(0.016), 10)
    with pytest.raises(DynaseqError):
        local_search(_bowl, 0.016, 1.5, 2000)
    with pytest.raises(DynaseqError):
        local_search(_bowl, 0.016, 0.07, 0)
    with pytest.raises(DynaseqError):
        local_search(_bowl, 0.016, 0.07, 10, shrink=1.0)
