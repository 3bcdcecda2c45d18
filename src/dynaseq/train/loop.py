"""The one training loop: ``setup`` -> ``fit``, for any :class:`~dynaseq.tasks.protocol.Task`.

The loop owns what every task shares: the run directory's lock (written once, before
anything else), the optimizer and learning-rate schedule, exact resume from the latest
checkpoint (weights, optimizer, schedule, RNG, data position, the task's carried state),
DDP (one process or many under ``torchrun``), the per-update loss normalisation, logging,
validation with best-keeping (``best/``), periodic checkpoints, checkpoint averaging and
SIGINT/SIGTERM handling (finish the current update, write a checkpoint, stop). It knows
nothing about models, batches or techniques: the task gives the micro-batches of each
update and the loss of each (``loss = task.loss(out, micro)``, technique losses included).

Example::

    from dynaseq.tasks.registry import load_config
    from dynaseq.train.loop import train
    result = train(load_config("configs/tiny.yaml"))   # any task's config
"""

from __future__ import annotations

import contextlib
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from dynaseq.core import checkpoint as ckpt
from dynaseq.core.config import read_yaml, save_config, to_dict
from dynaseq.core.distributed import (
    DistEnv,
    all_reduce_sum,
    barrier,
    cleanup,
    init_distributed,
    pick_device,
)
from dynaseq.core.errors import CheckpointError, ConfigError
from dynaseq.core.files import user_path
from dynaseq.core.run_lock import RunDirLock
from dynaseq.core.runlog import RunLog
from dynaseq.tasks.protocol import Task
from dynaseq.tasks.registry import task_for
from dynaseq.train.common import (
    StopFlag,
    TrainResult,
    TrainState,
    eta,
    rng_state,
    set_rng_state,
)
from dynaseq.train.schedule import make_schedule
from dynaseq.train.tensorboard import TensorBoardSink, check_tensorboard


@dataclass
class Run:
    """A task set up for training: its locked run directory, log, device and process group."""

    task: Task
    run_dir: Path
    env: DistEnv
    device: torch.device
    log: RunLog
    lock: RunDirLock | None = None  # held by the main rank until fit() ends
    #: the latest checkpoint and the model setup() loaded its weights into (None: a new run)
    resumed: tuple[Path, nn.Module] | None = None

    @property
    def model(self) -> nn.Module:
        return self.task.model


def setup(cfg: Any, hooks: Any = None) -> Run:
    """Check ``cfg`` and build its task (nothing written if that raises), lock the run
    directory, then let the task write its files and build its data and model.

    ``cfg``: a run config (its task from :data:`dynaseq.tasks.registry.TASKS`) or a
    :class:`~dynaseq.tasks.protocol.Task` built by the caller. ``hooks``: task-specific
    extension points (e.g. :class:`~dynaseq.tasks.lm.task.LMHooks`) replacing those the config
    asks for."""
    if not str(getattr(cfg, "cfg", cfg).run_dir).strip():  # "" is the working directory
        raise ConfigError("run_dir must name a directory, got ''")
    task = cfg if isinstance(cfg, Task) else task_for(cfg, hooks)
    cfg = task.cfg
    device = pick_device(cfg.train.device, what="train.device")
    env = init_distributed(device)
    run_dir = user_path(cfg.run_dir)
    if cfg.train.tensorboard:
        check_tensorboard()  # before anything is written
    created = not run_dir.exists()  # a refused new run leaves no directory behind
    lock = None
    try:
        if not created:  # refused before the lock file is written (and again under the lock)
            _check_fits(run_dir, cfg)
        lock = RunDirLock(run_dir).acquire() if env.is_main else None  # before any write
        latest = _check_fits(run_dir, cfg)
        log = RunLog(run_dir / "log.jsonl", False)  # held until the run is accepted
        task.prepare(env, device, log)
        resumed = None
        if latest:  # a resumed run: its checkpoint must fit this config's model
            ckpt.load_weights(task.model, latest[0])
            resumed = (latest[0], task.model)
        if env.is_main:  # only now: a refused run keeps its config and log
            save_config(cfg, run_dir / "config.yaml")
            log.start_writing()
            if cfg.train.tensorboard:
                log.add_sink(TensorBoardSink(run_dir / "tensorboard"))
    except BaseException:
        if lock is not None:
            if created:  # still locked: nobody else writes here
                shutil.rmtree(run_dir, ignore_errors=True)
            lock.release(discard=True)
        cleanup(env)
        raise
    return Run(task, run_dir, env, device, log, lock, resumed)


def _check_fits(run_dir: Path, cfg: Any) -> list[Path]:
    """Refuse ``cfg`` for a run directory of another task, or one that holds a trained model
    but no checkpoint; the latest checkpoint to resume from (none: ``[]``)."""
    if (run_dir / "config.yaml").is_file():  # read once for both checks
        saved, given = read_yaml(run_dir / "config.yaml"), to_dict(cfg)
        _check_same_task(run_dir, saved, given)
        _check_same_tokenizer(saved, given)
    latest = ckpt.list_checkpoints(run_dir)[-1:]
    if not latest:
        _check_no_model(run_dir)
    elif (step := ckpt.read_meta(latest[0]).get("step", 0)) > cfg.train.max_steps:
        raise ConfigError(f"{run_dir} is at update {step}, past train.max_steps="
                          f"{cfg.train.max_steps}: nothing to train (its config would record "
                          "the smaller value; raise max_steps to go on)")
    return latest


def _check_same_task(run_dir: Path, saved: dict, given: dict) -> None:
    """Refuse a config (``given``, as a mapping) of another task than the run directory's
    saved one (before anything is written into it)."""
    saved_task, given_task = saved.get("task", "seq2seq"), given.get("task", "seq2seq")
    if saved_task != given_task:
        raise ConfigError(f"{run_dir} holds a {saved_task} run; this config is a {given_task} "
                          "run (use a new run_dir)")


TOKENIZER_KEYS = ("vocab_size", "spm_model_type", "character_coverage")
"""The ``data`` settings that made a run's tokenizer, trained once when the run starts."""


def _check_same_tokenizer(saved: dict, given: dict) -> None:
    """Refuse a config (``given``) whose tokenizer settings (:data:`TOKENIZER_KEYS`) differ
    from the run's saved one: its tokenizer is trained and kept, so the new values would be
    recorded but not used. Fine-tuning (``train.init_from``) takes the pre-trained run's."""
    if (given.get("train") or {}).get("init_from") is not None:
        return
    saved_data, given_data = saved.get("data") or {}, given.get("data") or {}
    for key in TOKENIZER_KEYS:
        if key in saved_data and key in given_data and saved_data[key] != given_data[key]:
            raise ConfigError(f"data.{key}={given_data[key]} differs from the run's "
                              f"{saved_data[key]}, with which its tokenizer was trained (use "
                              "a new run_dir)")


def _check_no_model(run_dir: Path) -> None:
    """Refuse to start a new run in a directory that holds a trained model but no checkpoint
    to resume: the new run would replace its config and log and leave weights that no
    longer fit them."""
    held = [f"{name}/" for name in ckpt.MODEL_DIRS if (run_dir / name).is_dir()]
    if (run_dir / ckpt.WEIGHTS).is_file():  # an exported model directory
        held.append(ckpt.WEIGHTS)
    if held:
        raise ConfigError(f"{run_dir} holds a trained model ({held[0]}) but no checkpoint to "
                          "resume from: train into a new run_dir")


def fit(run: Run, progress: bool = True) -> TrainResult:
    """Train until max_steps / max_epochs / max_minutes or a signal; return the final state.

    Releases the run directory's lock (``run.lock``) when it returns or raises."""
    try:
        return _Trainer(run, progress).fit()
    finally:
        if run.lock is not None:
            run.lock.release()


def train(cfg: Any, progress: bool = True, hooks: Any = None) -> TrainResult:
    """Set up and train one run of any task (resuming if the run directory has checkpoints);
    ``cfg`` and ``hooks`` as in :func:`setup`."""
    run = setup(cfg, hooks)
    try:
        return fit(run, progress=progress)
    finally:
        cleanup(run.env)


class _Trainer:
    """One call of :func:`fit`: the optimizer, schedule and counters of a run."""

    def __init__(self, run: Run, progress: bool) -> None:
        self.run, self.task, self.tc = run, run.task, run.task.cfg.train
        model, tc = self.task.model, self.tc
        self.optimizer = torch.optim.Adam(model.parameters(), lr=tc.lr, betas=tc.betas,
                                          eps=tc.adam_eps, weight_decay=tc.weight_decay)
        self.scheduler = make_schedule(self.optimizer, tc)
        self.state = self._resume()
        self.progress = progress
        self.main = run.env.is_main

    def _resume(self) -> TrainState:
        if self.run.resumed is None:
            return TrainState()
        latest, loaded_into = self.run.resumed
        if loaded_into is not self.task.model:  # the model was replaced after setup()
            ckpt.load_weights(self.task.model, latest)
        trainer = ckpt.load_trainer_state(latest)
        try:
            self.optimizer.load_state_dict(trainer["optimizer"])
            self.scheduler.load_state_dict(trainer["scheduler"])
            set_rng_state(trainer["rng"])
            self.task.load_trainer_state(trainer)
            state = TrainState(**trainer["state"])
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
            raise CheckpointError(f"{latest / ckpt.TRAINER} is not this run's trainer state "
                                  f"({type(e).__name__}: {e})") from None
        self.run.log.write("resume", step=state.step, path=str(latest))
        return state

    def _save(self, metrics: dict[str, float], scheduled: bool = True) -> None:
        """A step checkpoint; ``scheduled``: one a run never stopped writes too (not a
        signal's or a time limit's: :func:`~dynaseq.core.checkpoint.scheduled_checkpoints`)."""
        if self.main:
            s, run = self.state, self.run
            meta = {"step": s.step, "epoch": s.epoch, "metrics": metrics,
                    "config": to_dict(self.task.cfg), "scheduled": scheduled}
            trainer = {"optimizer": self.optimizer.state_dict(),
                       "scheduler": self.scheduler.state_dict(), "rng": rng_state(),
                       "state": asdict(s), **self.task.trainer_state()}
            path = ckpt.write_checkpoint(ckpt.step_dir(run.run_dir, s.step), self.task.model,
                                         meta, trainer)
            ckpt.prune_checkpoints(run.run_dir, self.tc.keep_last)
            run.log.write("checkpoint", step=s.step, path=str(path))
        barrier(self.run.env)

    def _validate_and_keep_best(self) -> dict[str, float]:
        if not self.main:
            return {}
        model, s, log = self.task.model, self.state, self.run.log
        metrics = self.task.validate(model)
        model.train()
        if not metrics:
            return metrics
        log.write("valid", step=s.step, **metrics)
        if self.progress and "ppl" in metrics:
            print(f"step {s.step} valid ppl {metrics['ppl']:.2f}", file=sys.stderr, flush=True)
        score = self.task.score(metrics)
        if score is not None and (s.best_score is None or score > s.best_score):
            s.best_score = score
            ckpt.write_checkpoint(self.run.run_dir / "best", model,
                                  {"step": s.step, "metrics": metrics})
            log.write("best", step=s.step, score=score)
        return metrics

    def _step(self, wrapped: nn.Module, env: DistEnv) -> tuple[int, dict[str, float]]:
        """One optimizer update: forward + backward of every micro-batch, the step, and the
        task's after-update hook. Returns the update's tokens and this rank's log sums."""
        task, s = self.task, self.state
        upd = task.update(s.epoch, s.epoch_pos, s.step, env)
        sums: dict[str, float] = {"loss": 0.0, "nll": 0.0}
        out = None
        for i, micro in enumerate(upd.micro):
            sync = i == len(upd.micro) - 1 or not env.enabled
            with contextlib.nullcontext() if sync else wrapped.no_sync():
                with torch.autocast(self.run.device.type, torch.bfloat16,
                                    enabled=self.tc.precision == "bf16"):
                    out = task.forward(wrapped, micro)
                    terms = task.loss(out, micro, s.step)
                (terms.loss * env.world_size / upd.n_tokens).backward()
            sums["loss"] += float(terms.loss.detach())
            sums["nll"] += terms.nll_sum
            for k, v in terms.logs.items():
                sums[k] = sums.get(k, 0.0) + v
        if self.tc.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(task.model.parameters(), self.tc.clip_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        task.after_update(out, upd.micro[-1])
        return upd.n_tokens, sums

    def fit(self) -> TrainResult:
        run, task, tc, s, env = self.run, self.task, self.tc, self.state, self.run.env
        model = task.model
        wrapped: nn.Module = model
        if env.enabled:
            wrapped = DistributedDataParallel(
                model, device_ids=[run.device.index] if run.device.type == "cuda" else None)
        show_bar = self.progress and self.main and sys.stderr.isatty()
        bar = tqdm(total=tc.max_steps, initial=s.step, disable=not show_bar, unit="upd",
                   dynamic_ncols=True)
        t_start = time.monotonic() - s.elapsed
        window: dict[str, float] = {}
        window_tokens, window_t0 = 0, time.monotonic()
        t_first = (time.monotonic(), s.step)
        stop_reason = None
        metrics: dict[str, float] = {}
        model.train()
        with StopFlag() as stop:
            while stop_reason is None:
                if s.step >= tc.max_steps:
                    stop_reason = "max_steps"
                    break
                if tc.max_minutes is not None and s.elapsed >= tc.max_minutes * 60:
                    stop_reason = "max_minutes"  # a resumed run that has used its time
                    break
                if s.epoch >= tc.max_epochs:
                    stop_reason = "max_epochs"
                    break
                while s.epoch_pos < task.n_updates(s.epoch):
                    n_tokens, sums = self._step(wrapped, env)
                    s.step += 1
                    s.epoch_pos += 1
                    s.tokens += n_tokens
                    window_tokens += n_tokens
                    s.elapsed = time.monotonic() - t_start
                    over_time = tc.max_minutes is not None and s.elapsed >= tc.max_minutes * 60
                    keys = sorted(sums)  # every rank has the same keys
                    *reduced, flag = all_reduce_sum(
                        [sums[k] for k in keys] + [float(stop.signum is not None or over_time)],
                        env, run.device)
                    for k, v in zip(keys, reduced, strict=True):
                        window[k] = window.get(k, 0.0) + v
                    bar.update(1)
                    if s.step % tc.log_every == 0 or s.step == 1:
                        self._log(window, window_tokens, window_t0, bar, show_bar, t_first)
                        window, window_tokens, window_t0 = {}, 0, time.monotonic()
                    last = s.step >= tc.max_steps
                    if s.step % tc.valid_every == 0 or last or flag:
                        metrics = self._validate_and_keep_best()
                    if s.step % tc.save_every == 0 or last or flag:
                        self._save(metrics, scheduled=s.step % tc.save_every == 0 or last)
                    if flag:
                        stop_reason = "signal" if stop.signum is not None else "max_minutes"
                        break
                    if last:
                        stop_reason = "max_steps"
                        break
                else:
                    s.epoch += 1
                    s.epoch_pos = 0
            bar.close()
            if stop_reason == "max_epochs":
                metrics = self._validate_and_keep_best()
                self._save(metrics)
            if tc.average_last_k and self.main and stop_reason != "signal":
                recent = ckpt.scheduled_checkpoints(run.run_dir)[-tc.average_last_k:]
                ckpt.average_checkpoints(recent, run.run_dir / "averaged")
                run.log.write("average", checkpoints=[p.name for p in recent])
            run.log.write("stop", reason=stop_reason, step=s.step, elapsed_s=s.elapsed)
            signum = stop.signum
        barrier(env)
        return TrainResult(s, run.run_dir, signum, run.log.history)

    def _log(self, window: dict[str, float], tokens: int, t0: float, bar, show_bar: bool,
             t_first: tuple[float, int]) -> None:
        """One ``train`` log record: every sum averaged over the target tokens since the last
        record (``loss``, ``nll``, ``ppl`` and the task's extra terms), lr and throughput."""
        s, tc = self.state, self.tc
        lr = self.scheduler.get_last_lr()[0]
        tps = tokens / max(time.monotonic() - t0, 1e-9)
        per_token = {k: v / max(tokens, 1) for k, v in window.items()}
        nll = per_token.pop("nll")
        rec = {"step": s.step, "epoch": s.epoch, "loss": per_token.pop("loss"), "nll": nll,
               "ppl": math.exp(min(nll, 50.0)), "lr": lr, "tokens_per_s": tps,
               "elapsed_s": s.elapsed, **per_token}
        self.run.log.write("train", **rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
        if self.progress and self.main and not show_bar:
            print(f"step {s.step} epoch {s.epoch} loss {rec['loss']:.3f} ppl {rec['ppl']:.1f} "
                  f"lr {lr:.2e} tok/s {tps:.0f} eta {eta(s, tc, t_first)}",
                  file=sys.stderr, flush=True)
