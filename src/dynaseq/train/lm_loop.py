"""Language-model training: ``setup`` -> ``fit`` (with ``validate``), plain functions.

Each update is one window of ``data.batch_size`` parallel streams x ``model.extended_context``
tokens (MicroNet's C_e); consecutive updates read consecutive windows, and the per-layer
state (keys/values of the last C-1 positions) is carried across them without gradient, so
window starts see real context. Checkpoints, the run log, resume, SIGINT/SIGTERM handling and
``max_minutes`` work as in the seq2seq loop (:mod:`dynaseq.train.loop`), whose pieces this
reuses; resume is exact (weights, optimizer, schedule, RNG, data position, carried state).
Single process (no DDP).

Extension points (:class:`LMHooks`): ``loss`` computes the loss of a window (where token
distillation and a trained neural cache plug in), ``after_step`` runs after every optimizer
step (where a Hebbian softmax update plugs in), ``before_step`` before each forward pass
(where gradual pruning plugs in). :func:`setup` builds the hooks the config asks for
(:func:`dynaseq.train.lm_hooks.config_hooks`: ``model.cache`` with ``train: true``,
``model.hebbian``, ``train.distill``), checking them before the run directory is written.

Run directory: ``config.yaml``, ``vocab.txt``, ``log.jsonl``, ``checkpoints/step_*``,
``best/`` (lowest validation loss), optionally ``averaged/``.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from dynaseq.config import LMRunConfig, save_config, to_dict
from dynaseq.data.lm_corpus import VOCAB_FILE, StreamBatches, Vocab, read_lm_lines
from dynaseq.errors import ConfigError
from dynaseq.infer.lm import evaluate_stream
from dynaseq.models.lm import LMOutput, LMState, TransformerLM, build_lm
from dynaseq.nn.relative_attention import RelativeCache
from dynaseq.train import checkpoint as ckpt
from dynaseq.train.common import (
    RunLog,
    StopFlag,
    TrainResult,
    TrainState,
    eta,
    rng_state,
    set_rng_state,
)
from dynaseq.train.distributed import pick_device
from dynaseq.train.run_lock import RunDirLock
from dynaseq.train.schedule import cosine_schedule, inverse_sqrt_schedule


@dataclass
class LossTerms:
    """One window's loss: ``loss`` (scalar, per-token mean, what is backpropagated),
    ``nll_sum`` (plain NLL in nats, for perplexity), ``n_tokens`` and extra ``logs``."""

    loss: Tensor
    nll_sum: float
    n_tokens: int
    logs: dict[str, float] = field(default_factory=dict)


def lm_loss(model: TransformerLM, out: LMOutput, targets: Tensor, step: int) -> LossTerms:
    """The plain LM loss: mean -log p(target) under the adaptive softmax.

    Extension point: token-level distillation ((1-λ_t)·L_hard + λ_t·L_soft, MicroNet
    sec. 4.1) and a jointly trained neural cache (sec. 3.5) replace this function through
    :attr:`LMHooks.loss`; ``out.hidden`` (B, T, d) and ``targets`` (B, T) are what they need.
    """
    h = out.hidden
    logp = model.softmax(h.reshape(-1, h.size(-1)), targets.reshape(-1))
    nll = -logp.sum()
    n = targets.numel()
    return LossTerms(nll / n, float(nll.detach()), n)


#: ``after_step(model, out, targets)``: called after each optimizer step (Hebbian softmax).
AfterStep = Callable[[TransformerLM, LMOutput, Tensor], None]
#: ``before_step(model, step)``: called before the forward pass of each step (pruning).
BeforeStep = Callable[[TransformerLM, int], None]


@dataclass
class LMHooks:
    """Where distillation, the neural cache, the Hebbian softmax and pruning plug into
    training. ``loss(model, out, targets, step)``: ``step`` is the global update index; the
    window index in the epoch is ``step % len(train)`` (both advance together)."""

    loss: Callable[[TransformerLM, LMOutput, Tensor, int], LossTerms] = lm_loss
    after_step: list[AfterStep] = field(default_factory=list)
    before_step: list[BeforeStep] = field(default_factory=list)


@dataclass
class LMSetup:
    cfg: LMRunConfig
    run_dir: Path
    device: torch.device
    vocab: Vocab
    train: StreamBatches
    valid_ids: Tensor | None
    model: TransformerLM
    log: RunLog
    hooks: LMHooks = field(default_factory=LMHooks)
    lock: RunDirLock | None = None  # held until fit() ends


def setup(cfg: LMRunConfig) -> LMSetup:
    """Read and check everything first, then create the run directory (config, vocab)."""
    if cfg.data.train is None:
        raise ConfigError("data.train is required for training")
    device = pick_device(cfg.train.device)
    run_dir = Path(cfg.run_dir)
    train_lines = read_lm_lines(cfg.data.train, min_lines=2)
    vocab_path = run_dir / VOCAB_FILE
    vocab = Vocab.load(vocab_path) if vocab_path.is_file() else Vocab.build(train_lines)
    train = StreamBatches(vocab.encode_lines(train_lines), cfg.data.batch_size,
                          cfg.model.extended_context)
    valid_ids = None
    if cfg.data.valid is not None:
        valid_ids = vocab.encode_lines(read_lm_lines(cfg.data.valid, min_lines=1))
    torch.manual_seed(cfg.train.seed)
    model = build_lm(cfg.model, len(vocab))  # bad cutoffs raise here, before any writing
    from dynaseq.train.lm_hooks import config_hooks

    hooks = config_hooks(cfg, train, vocab)  # a bad teacher top-k dir too
    lock = RunDirLock(run_dir).acquire()  # creates run_dir; refused if another run holds it
    try:
        save_config(cfg, run_dir / "config.yaml")
        if not vocab_path.is_file():
            vocab.save(vocab_path)
        log = RunLog(run_dir / "log.jsonl", True)
        log.write("data", split="train", tokens=train.n_tokens + cfg.data.batch_size,
                  vocab=len(vocab), windows=len(train))
    except BaseException:
        lock.release()
        raise
    return LMSetup(cfg, run_dir, device, vocab, train, valid_ids, model.to(device), log, hooks,
                   lock)


def validate(s: LMSetup, model: TransformerLM) -> dict[str, float]:
    """Validation loss and perplexity (``data.valid_max_tokens`` tokens at most)."""
    if s.valid_ids is None:
        return {}
    r = evaluate_stream(model, s.valid_ids, s.cfg.data.eval_batch_size,
                        s.cfg.model.extended_context, s.device, s.cfg.data.valid_max_tokens)
    return {"loss": r["loss"], "ppl": r["ppl"]}


def _scheduler(optimizer: torch.optim.Optimizer, tc):
    if tc.schedule == "cosine":
        return cosine_schedule(optimizer, tc.warmup_steps, tc.max_steps, tc.min_lr_ratio)
    return inverse_sqrt_schedule(optimizer, tc.warmup_steps)


def _state_tensors(state: LMState | None) -> list[Tensor]:
    if state is None:
        return []
    return [t.cpu() for c in state.caches for t in (c.k, c.v)]


def _state_from(tensors: list[Tensor], device: torch.device) -> LMState | None:
    if not tensors:
        return None
    caches = [RelativeCache(tensors[i].to(device), tensors[i + 1].to(device))
              for i in range(0, len(tensors), 2)]
    return LMState(caches)


def _save(s: LMSetup, optimizer, scheduler, state: TrainState, memory: LMState | None,
          metrics: dict[str, float]) -> None:
    meta = {"step": state.step, "epoch": state.epoch, "metrics": metrics,
            "config": to_dict(s.cfg)}
    trainer = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
               "rng": rng_state(), "state": asdict(state), "memory": _state_tensors(memory)}
    path = ckpt.write_checkpoint(ckpt.step_dir(s.run_dir, state.step), s.model, meta, trainer)
    ckpt.prune_checkpoints(s.run_dir, s.cfg.train.keep_last)
    s.log.write("checkpoint", step=state.step, path=str(path))


def _resume(s: LMSetup, optimizer, scheduler) -> tuple[TrainState, LMState | None]:
    found = ckpt.list_checkpoints(s.run_dir)
    if not found:
        return TrainState(), None
    latest = found[-1]
    ckpt.load_weights(s.model, latest)
    trainer = ckpt.load_trainer_state(latest)
    optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    set_rng_state(trainer["rng"])
    state = TrainState(**trainer["state"])
    s.log.write("resume", step=state.step, path=str(latest))
    return state, _state_from(trainer.get("memory", []), s.device)


def _validate_and_keep_best(s: LMSetup, state: TrainState) -> dict[str, float]:
    metrics = validate(s, s.model)
    s.model.train()
    if not metrics:
        return metrics
    s.log.write("valid", step=state.step, **metrics)
    score = -metrics["loss"]
    if state.best_score is None or score > state.best_score:
        state.best_score = score
        ckpt.write_checkpoint(s.run_dir / "best", s.model,
                              {"step": state.step, "metrics": metrics})
        s.log.write("best", step=state.step, score=score)
    return metrics


def fit(s: LMSetup, progress: bool = True, hooks: LMHooks | None = None) -> TrainResult:
    """Train until max_steps / max_epochs / max_minutes or a signal; return the final state.

    ``hooks`` default to the config's (``s.hooks``). Releases the run directory's lock
    (``s.lock``) when it returns or raises."""
    try:
        return _fit(s, progress, hooks)
    finally:
        if s.lock is not None:
            s.lock.release()


def _fit(s: LMSetup, progress: bool, hooks: LMHooks | None) -> TrainResult:
    hooks = hooks or s.hooks
    tc, model = s.cfg.train, s.model
    optimizer = torch.optim.Adam(model.parameters(), lr=tc.lr, betas=tc.betas, eps=tc.adam_eps,
                                 weight_decay=tc.weight_decay)
    scheduler = _scheduler(optimizer, tc)
    state, memory = _resume(s, optimizer, scheduler)
    show_bar = progress and sys.stderr.isatty()
    bar = tqdm(total=tc.max_steps, initial=state.step, disable=not show_bar, unit="upd",
               dynamic_ncols=True)
    t_start = time.monotonic() - state.elapsed
    window_tokens, window_t0 = 0, time.monotonic()
    t_first = (time.monotonic(), state.step)
    stop_reason = None
    metrics: dict[str, float] = {}
    sums: list[float] = [0.0, 0.0]
    model.train()
    with StopFlag() as stop:
        while stop_reason is None:
            if state.step >= tc.max_steps:
                stop_reason = "max_steps"
                break
            if state.epoch >= tc.max_epochs:
                stop_reason = "max_epochs"
                break
            while state.epoch_pos < len(s.train):
                if state.epoch_pos == 0:
                    memory = None  # a new pass over the streams
                x, y = (t.to(s.device) for t in s.train[state.epoch_pos])
                for before in hooks.before_step:
                    before(model, state.step)
                out = model(x, memory)
                terms = hooks.loss(model, out, y, state.step)
                terms.loss.backward()
                if tc.clip_norm > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                for after in hooks.after_step:
                    after(model, out, y)
                memory = out.state.detach()
                state.step += 1
                state.epoch_pos += 1
                state.tokens += terms.n_tokens
                window_tokens += terms.n_tokens
                sums[0] += terms.nll_sum
                sums[1] += terms.n_tokens
                state.elapsed = time.monotonic() - t_start
                over_time = tc.max_minutes is not None and state.elapsed >= tc.max_minutes * 60
                flag = stop.signum is not None or over_time
                lr = scheduler.get_last_lr()[0]
                bar.update(1)
                if state.step % tc.log_every == 0 or state.step == 1:
                    now = time.monotonic()
                    tps = window_tokens / max(now - window_t0, 1e-9)
                    window_tokens, window_t0 = 0, now
                    nll = sums[0] / max(sums[1], 1)
                    sums = [0.0, 0.0]
                    rec = {"step": state.step, "epoch": state.epoch,
                           "loss": float(terms.loss.detach()), "nll": nll, "ppl": math.exp(min(nll, 50.0)), "lr": lr,
                           "tokens_per_s": tps, "elapsed_s": state.elapsed, **terms.logs}
                    s.log.write("train", **rec)
                    bar.set_postfix(nll=f"{nll:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
                    if progress and not show_bar:
                        print(f"step {state.step} epoch {state.epoch} nll {nll:.3f} "
                              f"ppl {rec['ppl']:.1f} lr {lr:.2e} tok/s {tps:.0f} "
                              f"eta {eta(state, tc, t_first)}", file=sys.stderr, flush=True)
                last = state.step >= tc.max_steps
                if state.step % tc.valid_every == 0 or last or flag:
                    metrics = _validate_and_keep_best(s, state)
                    if progress and metrics:
                        print(f"step {state.step} valid ppl {metrics['ppl']:.2f}",
                              file=sys.stderr, flush=True)
                if state.step % tc.save_every == 0 or last or flag:
                    _save(s, optimizer, scheduler, state, memory, metrics)
                if flag:
                    stop_reason = "signal" if stop.signum is not None else "max_minutes"
                    break
                if last:
                    stop_reason = "max_steps"
                    break
            else:
                state.epoch += 1
                state.epoch_pos = 0
        bar.close()
        if stop_reason == "max_epochs":
            metrics = _validate_and_keep_best(s, state)
            _save(s, optimizer, scheduler, state, memory, metrics)
        if tc.average_last_k and stop_reason != "signal":
            recent = ckpt.list_checkpoints(s.run_dir)[-tc.average_last_k:]
            ckpt.average_checkpoints(recent, s.run_dir / "averaged")
            s.log.write("average", checkpoints=[p.name for p in recent])
        s.log.write("stop", reason=stop_reason, step=state.step, elapsed_s=state.elapsed)
        signum = stop.signum
    return TrainResult(state, s.run_dir, signum, s.log.history)


def train(cfg: LMRunConfig, progress: bool = True, hooks: LMHooks | None = None
          ) -> TrainResult:
    """Set up and train one LM run (resuming if the run directory has checkpoints)."""
    return fit(setup(cfg), progress=progress, hooks=hooks)

