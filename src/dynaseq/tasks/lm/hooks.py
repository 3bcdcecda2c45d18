"""Training hooks an LM config asks for: a jointly trained neural cache, token-level
distillation and the Hebbian softmax (MicroNet §3.5, §4.1, A.1).

- ``model.cache`` with ``train: true``: the loss is the NLL of the cache mixture
  (1−λ)·P_model + λ·P_cache, so θ and λ (``model.cache``'s parameters, saved in the
  checkpoints) and the hidden states get gradients. The :class:`CacheMemory` is carried from
  one window to the next (detached), reset when the streams restart (window 0 of an epoch)
  and saved with each checkpoint (:meth:`ConfigLoss.trainer_state`), so a resumed run reads
  the same cache as the run that was never stopped.
- ``train.distill``: (1−λ_t)·L_hard + λ_t·L_soft with the teacher's top-k rows of the
  window (see :mod:`dynaseq.compress.lm_distill` for the order contract), λ_t annealed
  over ``train.max_steps``; the student's log-probabilities are computed only at the target
  and the k teacher ids (:meth:`AdaptiveSoftmax.log_prob_at`). With a trained cache too, the
  hard term is the cache mixture's.
- ``model.hebbian``: after every optimizer step, the Hebbian update of the adaptive softmax
  (:func:`~dynaseq.nn.hebbian.adaptive_hebbian_update_`, counts in ``model.hebbian``).

The reported ``nll`` stays the plain model's (comparable across runs); the cache NLL and λ_t
go to the log as ``nll_cache``, ``distill_lambda``, ``soft``, ``cache_theta``, ``cache_lam``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dynaseq.compress.distill import AnnealedLambda, TeacherTopK, distill_loss
from dynaseq.data.lm_corpus import StreamBatches, Vocab
from dynaseq.models.lm import LMOutput, TransformerLM
from dynaseq.nn.hebbian import adaptive_hebbian_update_
from dynaseq.nn.neural_cache import CacheMemory
from dynaseq.tasks.lm.config import LMRunConfig
from dynaseq.tasks.lm.task import LMHooks, lm_loss
from dynaseq.tasks.protocol import LossTerms


class ConfigLoss:
    """``LMHooks.loss`` with a trained cache and/or distillation (see the module doc).

    Args:
        n_windows: windows per epoch (``len(train)``): window index = step % n_windows.
        window_len: W, tokens per window (``train.window``): window i starts at row B·i·W.
        train_cache: mix ``model.cache`` into the loss.
        teacher: the student-layout top-k (:func:`~dynaseq.compress.lm_distill.open_teacher_topk`).
        lam: λ_t schedule (with ``teacher``).
    """

    def __init__(self, n_windows: int, window_len: int, train_cache: bool = False,
                 teacher: TeacherTopK | None = None, lam: AnnealedLambda | None = None) -> None:
        self.n_windows, self.window_len, self.train_cache = n_windows, window_len, train_cache
        self.teacher, self.lam = teacher, lam
        self.memory: CacheMemory | None = None

    def trainer_state(self) -> dict[str, Any]:
        """The carried cache memory, saved with each checkpoint (exact resume): its hidden
        states (B, M, d), next words (B, M) and validity mask (B, M), on the CPU."""
        m = self.memory
        return {} if m is None else {"cache_memory": [m.hidden.cpu(), m.targets.cpu(),
                                                       m.valid.cpu()]}

    def load_trainer_state(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore what :meth:`trainer_state` saved (no memory when it saved none)."""
        saved = state.get("cache_memory")
        self.memory = CacheMemory(*(t.to(device) for t in saved)) if saved else None

    def _mix(self, model: TransformerLM, logp: Tensor, out: LMOutput, targets: Tensor) -> Tensor:
        """(N,) target log-probs -> the cache mixture's (N,), carrying the memory."""
        if not self.train_cache:
            return logp
        mixed, self.memory = model.cache.target_log_prob(logp.view(targets.shape), out.hidden,
                                                         targets, self.memory)
        return mixed.reshape(-1)

    def __call__(self, model: TransformerLM, out: LMOutput, targets: Tensor,
                 step: int) -> LossTerms:
        window = step % self.n_windows
        if window == 0:
            self.memory = None  # the streams restart
        h = out.hidden.reshape(-1, out.hidden.size(-1))  # (N, d)
        y = targets.reshape(-1)
        n = y.numel()
        logs: dict[str, float] = {}
        if self.teacher is None:
            plain = model.softmax(h, y)
            mixed = self._mix(model, plain, out, targets)
            loss = -mixed.sum()
        else:
            start = targets.size(0) * window * self.window_len  # the order contract
            idx, prob = self.teacher[slice(start, start + n)]
            held: dict[str, Tensor] = {}

            def student(ids: Tensor) -> Tensor:
                picked = model.softmax.log_prob_at(h, ids)  # (N, k+1), target first
                held["plain"] = picked[:, 0]
                return torch.cat([self._mix(model, picked[:, 0], out, targets)[:, None],
                                  picked[:, 1:]], dim=1)

            lam = self.lam(step)
            d = distill_loss(student, y, idx.to(y.device), prob.to(y.device), lam)
            loss, plain, mixed = d.loss * n, held["plain"], None  # (a mean)
            logs.update(distill_lambda=lam, soft=float(d.soft.detach()))
            if self.train_cache:
                logs["nll_cache"] = float(d.hard.detach())
        if self.train_cache:
            if mixed is not None:
                logs["nll_cache"] = float(-mixed.detach().mean())
            logs.update(cache_theta=float(model.cache.theta.detach()),
                        cache_lam=float(model.cache.lam.detach()))
        # LossTerms holds sums: the loop divides by the window's tokens
        return LossTerms(loss, float(-plain.detach().sum()), n, {k: v * n for k, v in logs.items()})


def hebbian_after_step(model: TransformerLM, out: LMOutput, targets: Tensor) -> None:
    """``LMHooks.after_step``: the Hebbian softmax update with this window's states."""
    h = out.hidden.detach()
    adaptive_hebbian_update_(model.softmax, h.reshape(-1, h.size(-1)), targets.reshape(-1),
                             model.hebbian)


def config_hooks(cfg: LMRunConfig, train: StreamBatches, vocab: Vocab) -> LMHooks:
    """The hooks ``cfg`` asks for (plain :func:`lm_loss` when none). Raises DynaseqError for
    a teacher top-k directory that does not match ``train``/``vocab``."""
    from dynaseq.compress.lm_distill import open_teacher_topk

    train_cache = cfg.model.cache is not None and cfg.model.cache.train
    teacher = lam = None
    if cfg.train.distill is not None:
        dc = cfg.train.distill
        teacher = open_teacher_topk(dc.topk_dir, train, vocab)
        lam = AnnealedLambda(dc.lam_max, dc.lam_min, cfg.train.max_steps)
    hooks = LMHooks()
    if train_cache or teacher is not None:
        hooks.loss = ConfigLoss(len(train), train.window, train_cache, teacher, lam)
    else:
        hooks.loss = lm_loss
    if cfg.model.hebbian is not None:
        hooks.after_step.append(hebbian_after_step)
    return hooks
