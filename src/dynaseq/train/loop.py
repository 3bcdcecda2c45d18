"""The training loop: ``setup`` -> ``fit`` (with ``validate``), plain functions.

One process or many under ``torchrun`` (DDP). Every rank builds the same token-budget batches
from the same seed and trains on its rows; the loss is normalised by the global number of
target tokens, so N processes follow the same trajectory as one process with the whole batch.
Training resumes exactly from the latest checkpoint (weights, optimizer, schedule, RNG, data
position). SIGINT/SIGTERM finish the current update, write a checkpoint and stop.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from dynaseq.adaptive.cct import seq2seq_budget_loss, set_gate_step
from dynaseq.branching import seq2seq_routing_loss
from dynaseq.config import RunConfig, save_config, to_dict
from dynaseq.data import (
    ParallelCorpus,
    Tokenizer,
    collate,
    make_corpus,
    read_parallel,
    token_batches,
)
from dynaseq.errors import ConfigError
from dynaseq.infer.translator import bleu, control_for_budget, decode_corpus, score_corpus
from dynaseq.models import build_seq2seq
from dynaseq.train import checkpoint as ckpt
from dynaseq.train.common import (  # shared with the LM loop (train/lm_loop.py)
    RunLog,
    TrainResult,
    TrainState,
)
from dynaseq.train.common import StopFlag as _StopFlag
from dynaseq.train.common import eta as _eta
from dynaseq.train.common import rng_state as _rng_state
from dynaseq.train.common import set_rng_state as _set_rng_state
from dynaseq.train.distributed import (
    DistEnv,
    all_reduce_sum,
    barrier,
    cleanup,
    init_distributed,
    pick_device,
)
from dynaseq.train.loss import label_smoothed_loss
from dynaseq.train.run_lock import RunDirLock
from dynaseq.train.schedule import inverse_sqrt_schedule
from dynaseq.train.self_distill import inplace_distill_term


@dataclass
class Setup:
    cfg: RunConfig
    run_dir: Path
    env: DistEnv
    device: torch.device
    tokenizer: Tokenizer
    train: ParallelCorpus
    valid: ParallelCorpus | None
    valid_src_ids: list[list[int]]
    valid_refs: list[str]
    model: nn.Module
    log: RunLog
    lock: RunDirLock | None = None  # held by the main rank until fit() ends


def _require(cfg: RunConfig, *names: str) -> None:
    for name in names:
        if getattr(cfg.data, name) is None:
            raise ConfigError(f"data.{name} is required for training")


def setup(cfg: RunConfig) -> Setup:
    """Device, process group, run directory, tokenizer, encoded corpora and the model."""
    _require(cfg, "train_src", "train_tgt")
    device = pick_device(cfg.train.device)
    env = init_distributed(device)
    run_dir = Path(cfg.run_dir)
    lock = RunDirLock(run_dir).acquire() if env.is_main else None  # before writing anything
    try:
        return _load(cfg, env, device, run_dir, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _load(cfg: RunConfig, env: DistEnv, device: torch.device, run_dir: Path,
          lock: RunDirLock | None) -> Setup:
    """The rest of :func:`setup`, with the run directory locked (main rank)."""
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    log = RunLog(run_dir / "log.jsonl", env.is_main)
    src_lines, tgt_lines = read_parallel(cfg.data.train_src, cfg.data.train_tgt)
    valid_lines = None
    if cfg.data.valid_src is not None and cfg.data.valid_tgt is not None:
        valid_lines = read_parallel(cfg.data.valid_src, cfg.data.valid_tgt)
    spm_path = run_dir / "spm.model"
    if env.is_main and not spm_path.is_file():
        Tokenizer.train(src_lines + tgt_lines, spm_path, cfg.data.vocab_size,
                        cfg.data.spm_model_type, cfg.data.character_coverage)
    barrier(env)
    tok = Tokenizer.load(spm_path)
    train, stats = make_corpus(tok.encode(src_lines), tok.encode(tgt_lines), cfg.data.max_len,
                               cfg.data.long_lines)
    if len(train) == 0:
        raise ConfigError("no training pairs left after dropping empty and over-long lines")
    log.write("data", split="train", lines=len(src_lines), **stats.as_dict())
    valid, valid_src_ids, valid_refs = None, [], []
    if valid_lines is not None:
        v_src, v_tgt = tok.encode(valid_lines[0]), tok.encode(valid_lines[1])
        valid, vstats = make_corpus(v_src, v_tgt, cfg.data.max_len, "truncate")
        log.write("data", split="valid", lines=len(v_src), **vstats.as_dict())
        n = cfg.train.valid_bleu_lines
        valid_src_ids, valid_refs = v_src[:n], valid_lines[1][:n]
    torch.manual_seed(cfg.train.seed)
    model = build_seq2seq(cfg.model, tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id)
    return Setup(cfg, run_dir, env, device, tok, train, valid, valid_src_ids, valid_refs,
                 model.to(device), log, lock)


def validate(s: Setup, model: nn.Module) -> dict[str, float]:
    """Validation loss (teacher forced) and greedy/beam BLEU on the first lines."""
    result: dict[str, float] = {}
    if s.valid is None:
        return result
    control = control_for_budget(s.cfg.model)  # the largest trained budget
    scores = score_corpus(model, s.valid.src, s.valid.tgt, s.cfg.data.max_len,
                          s.cfg.data.max_tokens, s.device, control)
    result.update(loss=scores["loss"], ppl=scores["ppl"])
    if s.valid_src_ids:
        d = s.cfg.decode
        hyps = decode_corpus(model, s.valid_src_ids, beam=s.cfg.train.valid_beam,
                             length_penalty=d.length_penalty, max_len_a=d.max_len_a,
                             max_len_b=d.max_len_b, batch_size=d.batch_size, device=s.device,
                             control=control)
        result["bleu"], _ = bleu(s.tokenizer.decode(hyps), s.valid_refs)
    return result


def _score_of(metrics: dict[str, float]) -> float | None:
    if "bleu" in metrics:
        return metrics["bleu"]
    if "loss" in metrics:
        return -metrics["loss"]
    return None


def _save(s: Setup, model: nn.Module, optimizer, scheduler, state: TrainState,
          metrics: dict[str, float] | None = None) -> None:
    if not s.env.is_main:
        return
    meta = {"step": state.step, "epoch": state.epoch, "metrics": metrics or {},
            "config": to_dict(s.cfg)}
    trainer = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
               "rng": _rng_state(), "state": asdict(state)}
    path = ckpt.write_checkpoint(ckpt.step_dir(s.run_dir, state.step), model, meta, trainer)
    ckpt.prune_checkpoints(s.run_dir, s.cfg.train.keep_last)
    s.log.write("checkpoint", step=state.step, path=str(path))


def _resume(s: Setup, optimizer, scheduler) -> TrainState:
    found = ckpt.list_checkpoints(s.run_dir)
    if not found:
        return TrainState()
    latest = found[-1]
    ckpt.load_weights(s.model, latest)
    trainer = ckpt.load_trainer_state(latest)
    optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    _set_rng_state(trainer["rng"])
    state = TrainState(**trainer["state"])
    s.log.write("resume", step=state.step, path=str(latest))
    return state


def fit(s: Setup, progress: bool = True) -> TrainResult:
    """Train until max_steps / max_epochs / max_minutes or a signal; return the final state.

    Releases the run directory's lock (``s.lock``) when it returns or raises."""
    try:
        return _fit(s, progress)
    finally:
        if s.lock is not None:
            s.lock.release()


def _fit(s: Setup, progress: bool) -> TrainResult:
    cfg, tc, env = s.cfg, s.cfg.train, s.env
    model = s.model
    optimizer = torch.optim.Adam(model.parameters(), lr=tc.lr, betas=tc.betas, eps=tc.adam_eps,
                                 weight_decay=tc.weight_decay)
    scheduler = inverse_sqrt_schedule(optimizer, tc.warmup_steps)
    state = _resume(s, optimizer, scheduler)
    wrapped: nn.Module = model
    if env.enabled:
        wrapped = DistributedDataParallel(
            model, device_ids=[s.device.index] if s.device.type == "cuda" else None)
    src_len, tgt_len = s.train.src_lengths(), s.train.tgt_lengths()
    budgets = sampling_ids = None
    distill, teacher_control = 0.0, 0
    if cfg.model.cct is not None:
        budgets = torch.tensor(cfg.model.cct.controls, dtype=torch.float32, device=s.device)
        sampling_ids = torch.tensor(cfg.model.cct.sampling_ids, dtype=torch.long)
        distill = cfg.model.cct.distill_weight
        teacher_control = control_for_budget(cfg.model)  # the largest trained budget
    routing = cfg.model.dmb or cfg.model.moe  # DMB / MoE: the gates' auxiliary losses
    dmb = cfg.model.dmb
    show_bar = progress and env.is_main and sys.stderr.isatty()
    bar = tqdm(total=tc.max_steps, initial=state.step, disable=not show_bar, unit="upd",
               dynamic_ncols=True)
    t_start = time.monotonic() - state.elapsed
    window_tokens, window_t0 = 0, time.monotonic()
    t_first = (time.monotonic(), state.step)
    stop_reason = None
    metrics: dict[str, float] = {}
    model.train()
    with _StopFlag() as stop:
        while stop_reason is None:
            if state.step >= tc.max_steps:
                stop_reason = "max_steps"
                break
            if state.epoch >= tc.max_epochs:
                stop_reason = "max_epochs"
                break
            batches = token_batches(src_len, tgt_len, cfg.data.max_tokens, tc.seed, state.epoch)
            n_updates = math.ceil(len(batches) / tc.update_freq)
            while state.epoch_pos < n_updates:
                group = batches[state.epoch_pos * tc.update_freq:
                                (state.epoch_pos + 1) * tc.update_freq]
                full = [collate(s.train, idx, model.pad_id, model.bos_id, model.eos_id)
                        for idx in group]
                total_tokens = sum(b.n_tgt_tokens for b in full)
                sums = [0.0, 0.0, 0.0, 0.0]
                share = 1.0
                if budgets is not None:
                    set_gate_step(model, state.step)
                    share = cfg.model.cct.sampled_share(state.step)
                for i, b in enumerate(full):
                    control = _sample_controls(sampling_ids, len(b), tc.seed, state.step, i,
                                               share)
                    if control is not None:
                        control = control[env.rank::env.world_size].to(s.device)
                    b = b.shard(env.rank, env.world_size).to(s.device)
                    sync = i == len(full) - 1 or not env.enabled
                    ctx = contextlib.nullcontext() if sync else wrapped.no_sync()
                    with ctx:
                        out = wrapped(b.src, b.tgt_in, control)
                        loss, nll, n_tok = label_smoothed_loss(out.logits, b.tgt_out,
                                                               tc.label_smoothing, model.pad_id)
                        if distill:  # the teacher pass runs on the bare model, outside DDP
                            loss = loss + inplace_distill_term(
                                model, b.src, b.tgt_in, b.tgt_out, control, out.logits,
                                teacher_control, distill, tc.label_smoothing, model.pad_id)
                        for aux_loss in out.aux.losses.values():
                            loss = loss + aux_loss
                        if budgets is not None:
                            # a per-batch mean: weighted by tokens so the sum over micro-batches
                            # and ranks divided by all tokens averages it; logged without λ
                            blo = seq2seq_budget_loss(out.aux, b.src, b.tgt_in, model.pad_id,
                                                      control, budgets, 1.0)
                            loss = loss + cfg.model.cct.budget_weight * blo * n_tok
                            sums[2] += float(blo.detach()) * n_tok
                        if routing is not None:
                            # eq. 31 without α, padding excluded: weighted by tokens like the
                            # budget loss, so α weighs it against the per-token CE
                            rlo = seq2seq_routing_loss(
                                out.aux, b.src, b.tgt_in, model.pad_id,
                                diversity=(1.0 if dmb is None else
                                           dmb.diversity_weight if dmb.diversity else 0.0),
                                entropy=dmb is None or dmb.entropy)
                            loss = loss + routing.aux_weight * rlo * n_tok
                            sums[3] += float(rlo.detach()) * n_tok
                        (loss * env.world_size / total_tokens).backward()
                    sums[0] += float(loss.detach())
                    sums[1] += float(nll)
                if tc.clip_norm > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state.step += 1
                state.epoch_pos += 1
                state.tokens += total_tokens
                window_tokens += total_tokens
                state.elapsed = time.monotonic() - t_start
                over_time = tc.max_minutes is not None and state.elapsed >= tc.max_minutes * 60
                loss_sum, nll_sum, budget_sum, routing_sum, flag = all_reduce_sum(
                    [*sums, float(stop.signum is not None or over_time)], env, s.device)
                lr = scheduler.get_last_lr()[0]
                bar.update(1)
                if state.step % tc.log_every == 0 or state.step == 1:
                    now = time.monotonic()
                    tps = window_tokens / max(now - window_t0, 1e-9)
                    window_tokens, window_t0 = 0, now
                    rec = {"step": state.step, "epoch": state.epoch,
                           "loss": loss_sum / total_tokens, "nll": nll_sum / total_tokens,
                           "lr": lr, "tokens_per_s": tps, "elapsed_s": state.elapsed}
                    if budgets is not None:
                        rec["budget_loss"] = budget_sum / total_tokens
                    if routing is not None:
                        rec["routing_loss"] = routing_sum / total_tokens
                    s.log.write("train", **rec)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{lr:.2e}",
                                    tok_s=f"{tps:.0f}")
                    if progress and env.is_main and not show_bar:
                        print(f"step {state.step} epoch {state.epoch} loss {rec['loss']:.3f} "
                              f"lr {lr:.2e} tok/s {tps:.0f} eta {_eta(state, tc, t_first)}",
                              file=sys.stderr, flush=True)
                last = state.step >= tc.max_steps
                if state.step % tc.valid_every == 0 or last or flag:
                    metrics = _validate_and_keep_best(s, model, state)
                if state.step % tc.save_every == 0 or last or flag:
                    _save(s, model, optimizer, scheduler, state, metrics)
                    barrier(env)
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
        if stop_reason in ("max_epochs",):
            metrics = _validate_and_keep_best(s, model, state)
            _save(s, model, optimizer, scheduler, state, metrics)
        if tc.average_last_k and env.is_main and stop_reason != "signal":
            recent = ckpt.list_checkpoints(s.run_dir)[-tc.average_last_k:]
            ckpt.average_checkpoints(recent, s.run_dir / "averaged")
            s.log.write("average", checkpoints=[p.name for p in recent])
        s.log.write("stop", reason=stop_reason, step=state.step, elapsed_s=state.elapsed)
        signum = stop.signum
    barrier(env)
    return TrainResult(state, s.run_dir, signum, s.log.history)


def _sample_controls(sampling_ids: torch.Tensor | None, batch: int, seed: int, step: int,
                     micro: int, share: float = 1.0) -> torch.Tensor | None:
    """One control symbol per sequence: a uniformly drawn entry of the configured budget
    list (CCT sec. 2.2), mapped to its symbol (``sampling_ids``, see ``CCTConfig``); with
    probability ``1 - share`` the full budget (symbol 0) instead (``budget_ramp_steps``).

    Drawn from (seed, step, micro-batch) alone, so every rank and every resume draws the
    same ids for the same batch. ``sampling_ids`` None (a dense model) gives None.
    """
    if sampling_ids is None:
        return None
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 131 + micro)
    ids = sampling_ids[torch.randint(sampling_ids.numel(), (batch,), generator=gen)]
    if share < 1.0:
        ids = torch.where(torch.rand(batch, generator=gen) < share, ids, torch.zeros_like(ids))
    return ids


def _validate_and_keep_best(s: Setup, model: nn.Module, state: TrainState) -> dict[str, float]:
    if not s.env.is_main:
        return {}
    metrics = validate(s, model)
    model.train()
    if not metrics:
        return metrics
    s.log.write("valid", step=state.step, **metrics)
    score = _score_of(metrics)
    if score is not None and (state.best_score is None or score > state.best_score):
        state.best_score = score
        ckpt.write_checkpoint(s.run_dir / "best", model,
                              {"step": state.step, "metrics": metrics})
        s.log.write("best", step=state.step, score=score)
    return metrics


def train(cfg: RunConfig, progress: bool = True) -> TrainResult:
    """Set up and train one run (resuming if the run directory has checkpoints)."""
    s = setup(cfg)
    try:
        return fit(s, progress=progress)
    finally:
        cleanup(s.env)
