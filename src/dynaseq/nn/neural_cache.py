"""Differentiable neural cache (Grave et al. 2017, trained end to end as in MicroNet).

The cache stores the last ``n_cache`` (hidden state, next word) pairs of a document stream
and turns them into a second, non-parametric distribution over the next word:

    P(x_{n+1} = w | x_{1:n}) = (1 - λ)·P_model(w) + λ·P_cache(w)
    P_cache(w) ∝ Σ_{i=1..n_cache} exp(θ·h_{n-i}ᵀ h_n) · 1[x_{n-i+1} = w]

Indexing convention (the one of :class:`TransformerLM`): ``hidden[:, t]`` is the state
that predicts ``targets[:, t]``, so a cache entry is the pair ``(hidden[t], targets[t])``
and position t reads the entries ``t - n_cache .. t - 1`` — never its own pair (strictly
causal) — reaching back into the memory of earlier windows of the same stream.

MicroNet (Yan et al. 2020, §3.5) trains θ (the "flatness" of the cache attention) and λ
(the mixing weight) by gradient descent together with the model, from θ₀ = 0.016 and
λ₀ = 0.07 with ``n_cache = 2000``, then re-tunes them on validation with a local search
(:func:`local_search`), possibly with a larger cache (their best: 3000). θ is stored as
``softplus⁻¹(θ)`` and λ as ``logit(λ)``, so both stay in range under any update.

Everything is computed in log space (logsumexp, log-sigmoid) in at least float32; an empty
cache (the start of a document) gives exactly P_model. Gradients flow into θ, λ and the
hidden states of the current window (the cache shapes the activations, which MicroNet
found to matter); the memory of earlier windows is detached (truncated BPTT).

Example::

    cache = NeuralCache(n_cache=2000)                       # θ₀ = 0.016, λ₀ = 0.07
    memory = None
    for tokens, targets in windows:                         # consecutive windows
        out = model(tokens)                                 # hidden (B, T, d)
        lp = model.softmax(out.hidden.flatten(0, 1), targets.flatten()).view_as(targets)
        lp, memory = cache.target_log_prob(lp, out.hidden, targets, memory)
        loss = -lp.mean()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynaseq.core.errors import DynaseqError

# Finite "minus infinity" for masked scores: keeps logsumexp and its gradient finite
# (an all-masked row gives a finite junk value that is then discarded by ``torch.where``).
_NEG = -1e30


def _check_theta(theta: float) -> float:
    theta = float(theta)
    if not math.isfinite(theta) or theta <= 0:
        raise DynaseqError(f"cache theta must be a finite number > 0, got {theta}")
    return theta


def _check_lam(lam: float) -> float:
    lam = float(lam)
    if not 0.0 < lam < 1.0:
        raise DynaseqError(f"cache lambda must lie strictly between 0 and 1, got {lam}")
    return lam


def _check_n_cache(n_cache: int) -> int:
    if isinstance(n_cache, bool) or int(n_cache) != n_cache or n_cache < 1:
        raise DynaseqError(f"n_cache must be an integer >= 1, got {n_cache!r}")
    return int(n_cache)


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (half precisions are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


@dataclass
class CacheMemory:
    """The (hidden state, next word) pairs carried from one window to the next.

    Attributes:
        hidden: (B, M, d) detached hidden states, oldest first, ``M <= n_cache``.
        targets: (B, M) long, ``targets[b, j]`` is the word that followed ``hidden[b, j]``.
        valid: (B, M) bool; False marks entries that must not be read (padding targets,
            or rows reset for a new document by :meth:`NeuralCache.reset`).
    """

    hidden: Tensor
    targets: Tensor
    valid: Tensor = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.hidden.dim() != 3 or self.targets.shape != self.hidden.shape[:2]:
            raise DynaseqError(
                f"CacheMemory needs hidden (B, M, d) and targets (B, M), got "
                f"{tuple(self.hidden.shape)} and {tuple(self.targets.shape)}")
        if self.valid is None:
            self.valid = self.targets >= 0
        elif self.valid.shape != self.targets.shape:
            raise DynaseqError(f"CacheMemory.valid must be {tuple(self.targets.shape)}, "
                               f"got {tuple(self.valid.shape)}")

    @property
    def size(self) -> int:
        """M, the number of stored pairs per row."""
        return self.hidden.size(1)

    def last(self, n: int) -> CacheMemory:
        """The newest ``n`` pairs (all of them if there are fewer)."""
        if self.size <= n:
            return self
        return CacheMemory(self.hidden[:, -n:], self.targets[:, -n:], self.valid[:, -n:])


@dataclass(frozen=True)
class CacheOps:
    """Arithmetic per token of the cache (see :meth:`NeuralCache.ops_per_token`)."""

    mults: int
    adds: int
    exps: int
    divs: int

    @property
    def total(self) -> int:
        """All operations counted as one each (mults + adds + exps + divs)."""
        return self.mults + self.adds + self.exps + self.divs


class NeuralCache(nn.Module):
    """Continuous cache with trainable θ (softplus) and λ (sigmoid).

    Args:
        n_cache: number of past (hidden, next word) pairs read per position (>= 1).
        theta: initial θ > 0 in natural units (MicroNet: 0.016).
        lam: initial λ in (0, 1) in natural units (MicroNet: 0.07).

    Parameters: ``theta_raw`` (softplus⁻¹ θ) and ``lam_raw`` (logit λ), 0-dim; read the
    natural values with :attr:`theta` / :attr:`lam`, overwrite them with :meth:`set_params`.
    """

    def __init__(self, n_cache: int, theta: float = 0.016, lam: float = 0.07) -> None:
        super().__init__()
        self.n_cache = _check_n_cache(n_cache)
        self.theta_raw = nn.Parameter(torch.zeros((), dtype=torch.float32))
        self.lam_raw = nn.Parameter(torch.zeros((), dtype=torch.float32))
        self.set_params(theta, lam)

    def extra_repr(self) -> str:
        return f"n_cache={self.n_cache}, theta={self.theta.item():.4g}, lam={self.lam.item():.4g}"

    # ------------------------------------------------------------------ parameters
    @property
    def theta(self) -> Tensor:
        """θ = softplus(theta_raw), 0-dim, differentiable."""
        return F.softplus(self.theta_raw)

    @property
    def lam(self) -> Tensor:
        """λ = sigmoid(lam_raw), 0-dim, differentiable."""
        return torch.sigmoid(self.lam_raw)

    @torch.no_grad()
    def set_params(self, theta: float | None = None, lam: float | None = None,
                   n_cache: int | None = None) -> None:
        """Overwrite θ, λ (natural units) and/or ``n_cache`` in place (e.g. after search)."""
        if theta is not None:
            t = torch.tensor(_check_theta(theta), dtype=torch.float64)
            # softplus⁻¹(θ) = θ + log(1 - e^{-θ}), stable for small and large θ
            self.theta_raw.fill_(float(t + torch.log(-torch.expm1(-t))))
        if lam is not None:
            lam = _check_lam(lam)
            self.lam_raw.fill_(math.log(lam) - math.log1p(-lam))
        if n_cache is not None:
            self.n_cache = _check_n_cache(n_cache)

    def _log_lams(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(log λ, log(1 - λ)) via log-sigmoid: exact at λ → 0 and λ → 1."""
        raw = self.lam_raw.to(dtype)
        return F.logsigmoid(raw), F.logsigmoid(-raw)

    # ------------------------------------------------------------------ memory
    @staticmethod
    def reset(memory: CacheMemory | None, rows: Tensor | None = None) -> CacheMemory | None:
        """Forget the cache at a document boundary.

        ``rows=None`` forgets everything (returns None, the empty memory); otherwise ``rows``
        (a (B,) bool mask or a tensor of row indices) marks the streams that start a new
        document: their stored entries become invalid, the other rows keep theirs.
        """
        if memory is None or rows is None:
            return None
        valid = memory.valid.clone()
        valid[rows] = False
        return CacheMemory(memory.hidden, memory.targets, valid)

    def update_memory(self, memory: CacheMemory | None, hidden: Tensor,
                      targets: Tensor) -> CacheMemory:
        """Append pairs (B, T, d) / (B, T) to ``memory`` and keep the newest ``n_cache``.

        The stored states are detached (no gradient crosses windows). Targets < 0
        (padding / ignore index) are stored as invalid entries.
        """
        if hidden.dim() != 3 or targets.shape != hidden.shape[:2]:
            raise DynaseqError(f"update_memory needs hidden (B, T, d) and targets (B, T), got "
                               f"{tuple(hidden.shape)} and {tuple(targets.shape)}")
        hidden, targets = hidden.detach(), targets.detach().long()
        valid = targets >= 0
        if memory is not None:
            self._check_memory(memory, hidden.size(0), hidden.size(2))
            hidden = torch.cat([memory.hidden.to(hidden), hidden], dim=1)
            targets = torch.cat([memory.targets, targets], dim=1)
            valid = torch.cat([memory.valid, valid], dim=1)
        n = self.n_cache
        return CacheMemory(hidden[:, -n:], targets[:, -n:], valid[:, -n:])

    def append(self, memory: CacheMemory | None, hidden_last: Tensor,
               token: Tensor) -> CacheMemory:
        """Generation: store the step's pair (hidden_last (B, d), chosen token (B,))."""
        if hidden_last.dim() != 2 or token.shape != hidden_last.shape[:1]:
            raise DynaseqError(f"append needs hidden_last (B, d) and token (B,), got "
                               f"{tuple(hidden_last.shape)} and {tuple(token.shape)}")
        return self.update_memory(memory, hidden_last[:, None], token[:, None])

    @staticmethod
    def _check_memory(memory: CacheMemory, batch: int, d: int) -> None:
        if memory.hidden.size(0) != batch or memory.hidden.size(2) != d:
            raise DynaseqError(
                f"cache memory holds (B={memory.hidden.size(0)}, d={memory.hidden.size(2)}) "
                f"but the input has (B={batch}, d={d}); reset the memory for a new stream")

    # ------------------------------------------------------------------ scoring
    def target_log_prob(self, model_logp: Tensor, hidden: Tensor, targets: Tensor,
                        memory: CacheMemory | None = None
                        ) -> tuple[Tensor, CacheMemory]:
        """Log-probability of each target under the cache mixture, for one window.

        Args:
            model_logp: (B, T) log P_model(targets[b, t]).
            hidden: (B, T, d) the states that predicted ``targets`` (hidden[:, t] -> targets[:, t]).
            targets: (B, T) long; values < 0 (padding) are never stored as cache entries
                (their own output is meaningless and should be masked by the caller).
            memory: pairs from the previous windows of the same streams, or None (empty).

        Returns:
            ``(logp, memory)``: logp (B, T) in float32 (float64 for float64 inputs) with
            ``logp = log((1-λ)·P_model + λ·P_cache)``, where position t reads the newest
            ``n_cache`` pairs strictly before it (memory, then the window's earlier
            positions); a position with nothing to read gets ``model_logp`` unchanged.
            The new memory (detached) ends with this window's pairs.

        One banded (T, M + T) score matrix per row, no loop over positions:
        ``log P_cache(y_t) = logsumexp_{j ∈ band(t), y_j = y_t} θ·h_t·h_j
        - logsumexp_{j ∈ band(t)} θ·h_t·h_j``.
        """
        if hidden.dim() != 3:
            raise DynaseqError(f"hidden must be (B, T, d), got {tuple(hidden.shape)}")
        B, T, d = hidden.shape
        if model_logp.shape != (B, T) or targets.shape != (B, T):
            raise DynaseqError(
                f"model_logp and targets must be (B, T) = {(B, T)}, got "
                f"{tuple(model_logp.shape)} and {tuple(targets.shape)}")
        if targets.dtype.is_floating_point:
            raise DynaseqError("targets must be an integer tensor of word ids")
        targets = targets.long()
        dtype = _compute_dtype(model_logp, hidden)
        n = self.n_cache
        if memory is not None:
            self._check_memory(memory, B, d)
            memory = memory.last(n)
            keys = torch.cat([memory.hidden.to(hidden.dtype), hidden], dim=1)  # (B, M+T, d)
            key_t = torch.cat([memory.targets, targets], dim=1)  # (B, M+T)
            key_ok = torch.cat([memory.valid, targets >= 0], dim=1)  # (B, M+T)
            M = memory.size
        else:
            keys, key_t, key_ok, M = hidden, targets, targets >= 0, 0

        q = hidden.to(dtype)
        scores = self.theta.to(dtype) * torch.einsum("btd,bkd->btk", q, keys.to(dtype))
        qpos = torch.arange(T, device=hidden.device)[:, None] + M  # (T, 1)
        kpos = torch.arange(M + T, device=hidden.device)[None, :]  # (1, M+T)
        band = (kpos < qpos) & (kpos >= qpos - n)  # (T, M+T): the n newest strictly earlier
        allowed = band[None] & key_ok[:, None, :]  # (B, T, M+T)
        match = allowed & (key_t[:, None, :] == targets[:, :, None])  # (B, T, M+T)

        masked = scores.masked_fill(~allowed, _NEG)
        log_norm = torch.logsumexp(masked, dim=-1)  # (B, T)
        log_match = torch.logsumexp(masked.masked_fill(~match, _NEG), dim=-1)  # (B, T)
        log_cache = log_match - log_norm  # log P_cache(target), junk where no match

        log_lam, log_1m = self._log_lams(dtype)
        model = model_logp.to(dtype)
        no_cache_hit = log_1m + model  # P_cache(target) = 0
        mixed = torch.logaddexp(no_cache_hit, log_lam + log_cache)
        logp = torch.where(match.any(-1), mixed, no_cache_hit)
        logp = torch.where(allowed.any(-1), logp, model)  # empty cache: P = P_model
        return logp, self.update_memory(memory, hidden, targets)

    def mix_distribution(self, model_logp_full: Tensor, hidden_last: Tensor,
                         memory: CacheMemory | None) -> Tensor:
        """Full next-word log-distribution for generation.

        Args:
            model_logp_full: (B, V) log P_model over the vocabulary.
            hidden_last: (B, d) the state predicting the next word.
            memory: the pairs before this step (:meth:`append` the chosen word after
                sampling), or None.

        Returns:
            (B, V) log-probabilities, rows logsumexp to 0 (if the model's do): the same
            value at the target as :meth:`target_log_prob` for the same history.
        """
        if model_logp_full.dim() != 2 or hidden_last.dim() != 2 or \
                hidden_last.size(0) != model_logp_full.size(0):
            raise DynaseqError(
                f"mix_distribution needs model_logp_full (B, V) and hidden_last (B, d), got "
                f"{tuple(model_logp_full.shape)} and {tuple(hidden_last.shape)}")
        dtype = _compute_dtype(model_logp_full, hidden_last)
        model = model_logp_full.to(dtype)
        if memory is None or memory.size == 0:
            return model
        B, V = model.shape
        self._check_memory(memory, B, hidden_last.size(1))
        memory = memory.last(self.n_cache)
        if int(memory.targets.max()) >= V:
            raise DynaseqError(f"cache memory holds word ids >= V={V}")
        scores = self.theta.to(dtype) * torch.einsum(
            "bd,bmd->bm", hidden_last.to(dtype), memory.hidden.to(dtype))  # (B, M)
        weights = torch.softmax(scores.masked_fill(~memory.valid, _NEG), dim=-1)
        weights = weights * memory.valid
        p_cache = model.new_zeros(B, V).scatter_add(
            1, memory.targets.clamp(min=0), weights)  # (B, V), binned cache attention
        log_lam, log_1m = self._log_lams(dtype)
        mixed = torch.logaddexp(log_1m + model, log_lam + torch.log(p_cache))
        return torch.where(memory.valid.any(-1, keepdim=True), mixed, model)

    # ------------------------------------------------------------------ ops
    def ops_per_token(self, d_model: int, n_cache: int | None = None, *,
                      vocab_size: int | None = None) -> CacheOps:
        """Arithmetic the cache adds per predicted token (for the MicroNet ops count).

        Counted for a full cache of ``n = n_cache`` entries (default ``self.n_cache``),
        in probability space as an inference implementation would run it:

        - query scaling θ·h_n: d mults (once, instead of n mults on the scores);
        - scores h_jᵀ(θh_n): n·d mults, n·(d-1) adds;
        - exp of the scores: n exps; normaliser Σ_j: n-1 adds;
        - binned sum over entries whose word matches (worst case all): n-1 adds;
        - P_cache = matched / normaliser: 1 div;
        - mixing (1-λ)·P_model + λ·P_cache: 2 mults, 1 add (1-λ is a constant).

        With ``vocab_size=V`` it counts the full distribution (generation) instead: the
        n-1 match adds become n-1 scatter adds into bins, P_cache needs ≤ n divs (only
        non-empty bins), and mixing costs V + n mults and n adds.
        Memory writes (storing h_n and its word) are copies, not arithmetic.
        """
        n = self.n_cache if n_cache is None else _check_n_cache(n_cache)
        if d_model < 1:
            raise DynaseqError(f"d_model must be >= 1, got {d_model}")
        mults = d_model + n * d_model
        adds = n * (d_model - 1) + (n - 1) + (n - 1)
        exps = n
        if vocab_size is None:
            return CacheOps(mults=mults + 2, adds=adds + 1, exps=exps, divs=1)
        return CacheOps(mults=mults + vocab_size + n, adds=adds + n, exps=exps, divs=n)


# ---------------------------------------------------------------------- local search
@dataclass(frozen=True)
class SearchPoint:
    """One evaluation of the local search."""

    theta: float
    lam: float
    n_cache: int
    score: float
    step: float
    accepted: bool  # became the best point so far


@dataclass(frozen=True)
class SearchResult:
    """Best cache parameters found by :func:`local_search` and every evaluation made."""

    theta: float
    lam: float
    n_cache: int
    score: float
    trajectory: list[SearchPoint]


def local_search(evaluate: Callable[[float, float, int], float], theta: float, lam: float,
                 n_cache: int, *, cache_sizes: Sequence[int] = (), step: float = 0.5,
                 min_step: float = 0.05, shrink: float = 0.5,
                 max_evals: int = 100) -> SearchResult:
    """Coordinate local search over θ and λ (and cache sizes) minimising a validation score.

    MicroNet (§3.5, appendix F) observes that validation perplexity is a smooth function of
    θ and λ with a clear minimum, and re-tunes the trained values on validation after
    training, often with a larger search-time cache ``n_cache^s``.

    Search space: ``u = log θ`` and ``v = logit λ``. From the current best point, each
    coordinate is tried at ``± step``; a strictly better score is accepted at once (the next
    try starts from it). A full sweep without improvement multiplies ``step`` by ``shrink``;
    the search at one cache size stops when ``step < min_step``. Then, for each size in
    ``cache_sizes`` (in the given order), the search restarts from the best (θ, λ) so far
    with the initial step. Repeated points are not re-evaluated.

    Args:
        evaluate: ``evaluate(theta, lam, n_cache) -> score`` (e.g. validation perplexity),
            lower is better; NaN counts as +inf.
        theta, lam, n_cache: start point (e.g. the trained values).
        cache_sizes: extra cache sizes to search with, e.g. ``[3000, 4000]``.
        step, min_step, shrink: step schedule in log/logit units.
        max_evals: hard cap on calls of ``evaluate`` (across all sizes).

    Returns:
        :class:`SearchResult` with the best (θ, λ, n_cache, score) and the trajectory.
    """
    theta, lam, n_cache = _check_theta(theta), _check_lam(lam), _check_n_cache(n_cache)
    sizes = [_check_n_cache(s) for s in cache_sizes]
    if not (step > 0 and min_step > 0 and 0 < shrink < 1):
        raise DynaseqError(f"local_search needs step > 0, min_step > 0 and 0 < shrink < 1, "
                           f"got step={step}, min_step={min_step}, shrink={shrink}")
    if max_evals < 1:
        raise DynaseqError(f"max_evals must be >= 1, got {max_evals}")

    seen: dict[tuple[int, float, float], float] = {}
    trajectory: list[SearchPoint] = []
    best: list = [math.inf, math.log(theta), math.log(lam) - math.log1p(-lam), n_cache]

    def score_at(u: float, v: float, n: int, cur_step: float) -> float | None:
        key = (n, round(u, 9), round(v, 9))
        if key in seen:
            return seen[key]
        if len(seen) >= max_evals:
            return None
        t, lm = math.exp(u), 1.0 / (1.0 + math.exp(-v))
        if not (0.0 < lm < 1.0 and t > 0.0):  # saturated float: outside the domain
            seen[key] = math.inf
            return math.inf
        s = float(evaluate(t, lm, n))
        s = math.inf if math.isnan(s) else s
        seen[key] = s
        accepted = s < best[0]
        if accepted:
            best[:] = [s, u, v, n]
        trajectory.append(SearchPoint(t, lm, n, s, cur_step, accepted))
        return s

    for n in [n_cache, *sizes]:
        u, v = best[1], best[2]
        cur = score_at(u, v, n, 0.0)
        if cur is None:
            break
        h = step
        exhausted = False
        while h >= min_step and not exhausted:
            improved = False
            for coord in (0, 1):
                for sign in (1.0, -1.0):
                    cu, cv = (u + sign * h, v) if coord == 0 else (u, v + sign * h)
                    s = score_at(cu, cv, n, h)
                    if s is None:
                        exhausted = True
                        break
                    if s < cur:
                        u, v, cur, improved = cu, cv, s, True
                        break
                if exhausted:
                    break
            if not improved:
                h *= shrink
    score, u, v, n = best
    return SearchResult(theta=math.exp(u), lam=1.0 / (1.0 + math.exp(-v)), n_cache=n,
                        score=score, trajectory=trajectory)
