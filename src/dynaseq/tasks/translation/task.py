"""Machine translation as a :class:`~dynaseq.tasks.protocol.Task` for the training loop.

Data: a parallel corpus (``data.train_src/train_tgt``), a SentencePiece model trained on it
and written to ``RUN_DIR/spm.model``; token-budget batches (``data.max_tokens``) shuffled per
epoch from the seed, ``train.update_freq`` of them per update. Under DDP every rank collates
the same batches and trains on its rows; the loop divides the summed loss by the update's
target tokens over all ranks, so N processes follow one process's trajectory.

Loss: label-smoothed cross-entropy (summed over target tokens) plus the model's auxiliary
losses (``out.aux.losses``) plus what each technique adds (:data:`TECHNIQUE_TRAINING`: the
CCT's budget loss and control sampling, DMB/MoE routing losses). Validation: loss and
perplexity, and BLEU of greedy/beam decoding of the first ``train.valid_bleu_lines`` lines
(the kept ``best/`` is the highest BLEU, or the lowest loss without BLEU lines).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from dynaseq.core.config import TrainConfig
from dynaseq.core.distributed import DistEnv, barrier
from dynaseq.core.errors import ConfigError
from dynaseq.core.files import user_path
from dynaseq.core.runlog import RunLog
from dynaseq.data import (
    Batch,
    ParallelCorpus,
    Tokenizer,
    collate,
    make_corpus,
    read_parallel,
    token_batches,
)
from dynaseq.nn.losses import label_smoothed_loss
from dynaseq.tasks.protocol import LossTerms, Update
from dynaseq.tasks.translation.config import RunConfig
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.tasks.translation.predictor import (
    bleu,
    control_for_budget,
    decode_corpus,
    score_corpus,
)
from dynaseq.techniques.branching.training import RoutingTraining
from dynaseq.techniques.cct.training import CCTTraining


class TechniqueTraining(Protocol):
    """What a technique adds to seq2seq training (see :class:`CCTTraining`)."""

    def before_update(self, model: nn.Module, step: int) -> None: ...

    def keeps_best(self, step: int) -> bool: ...

    def controls(self, n_rows: int, step: int, micro: int) -> Tensor | None: ...

    def loss(self, model: nn.Module, out: Any, src: Tensor, tgt_in: Tensor, tgt_out: Tensor,
             control: Tensor | None, n_tokens: int, pad_id: int
             ) -> tuple[Tensor, dict[str, float]]: ...


#: ``model.<section>`` -> the technique's training plug-in, built from that section and the
#: training settings when the section is set.
TECHNIQUE_TRAINING: dict[str, Callable[[Any, TrainConfig], TechniqueTraining]] = {
    "cct": CCTTraining.from_config,
    "dmb": RoutingTraining.for_dmb,
    "moe": RoutingTraining.for_moe,
}


@dataclass
class Micro:
    """One micro-batch: this rank's rows and their control ids (CCT) or None."""

    batch: Batch
    control: Tensor | None


class TranslationTask:
    """See the module doc. ``cfg``: a :class:`RunConfig`; techniques plug in through
    :data:`TECHNIQUE_TRAINING`, so ``hooks`` must be None."""

    def __init__(self, cfg: RunConfig, hooks: None = None) -> None:
        if hooks is not None:
            raise ConfigError("translation training takes no hooks (techniques plug in "
                              "through TECHNIQUE_TRAINING)")
        for name in ("train_src", "train_tgt"):
            if getattr(cfg.data, name) is None:
                raise ConfigError(f"data.{name} is required for training")
        self.cfg = cfg
        self.run_dir = user_path(cfg.run_dir)
        self.techniques = [make(getattr(cfg.model, name), cfg.train) for name, make in
                           TECHNIQUE_TRAINING.items() if getattr(cfg.model, name) is not None]
        self.last_step = 0  # the last update's step (set by update), for keeps_best
        self.model: nn.Module | None = None
        spm_path = self.run_dir / "spm.model"
        if spm_path.is_file():  # a tokenizer left by another config: refused, nothing written
            pieces = Tokenizer.load(spm_path).vocab_size
            if pieces > cfg.data.vocab_size:
                raise ConfigError(f"{spm_path} holds {pieces} pieces, more than "
                                  f"data.vocab_size={cfg.data.vocab_size} (use a new run_dir)")

    def prepare(self, env: DistEnv, device: torch.device, log: RunLog) -> None:
        cfg = self.cfg
        src_lines, tgt_lines = read_parallel(cfg.data.train_src, cfg.data.train_tgt)
        valid_lines = None
        if cfg.data.valid_src is not None and cfg.data.valid_tgt is not None:
            valid_lines = read_parallel(cfg.data.valid_src, cfg.data.valid_tgt)
        spm_path = self.run_dir / "spm.model"
        if env.is_main and not spm_path.is_file():
            Tokenizer.train(src_lines + tgt_lines, spm_path, cfg.data.vocab_size,
                            cfg.data.spm_model_type, cfg.data.character_coverage)
        barrier(env)
        tok = Tokenizer.load(spm_path)
        train, stats = make_corpus(tok.encode(src_lines), tok.encode(tgt_lines),
                                   cfg.data.max_len, cfg.data.long_lines)
        if len(train) == 0:
            raise ConfigError("no training pairs left after dropping empty and over-long lines")
        log.write("data", split="train", lines=len(src_lines), **stats.as_dict())
        self.valid: ParallelCorpus | None = None
        self.valid_src_ids: list[list[int]] = []
        self.valid_refs: list[str] = []
        if valid_lines is not None:
            v_src, v_tgt = tok.encode(valid_lines[0]), tok.encode(valid_lines[1])
            self.valid, vstats = make_corpus(v_src, v_tgt, cfg.data.max_len, "truncate")
            log.write("data", split="valid", lines=len(v_src), **vstats.as_dict())
            n = cfg.train.valid_bleu_lines
            self.valid_src_ids, self.valid_refs = v_src[:n], valid_lines[1][:n]
        self.tokenizer, self.train, self.device = tok, train, device
        self._lengths = (train.src_lengths(), train.tgt_lengths())
        self._epoch_batches: tuple[int, list[list[int]]] | None = None
        torch.manual_seed(cfg.train.seed)
        model = build_seq2seq(cfg.model, tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id)
        self.model = model.to(device)

    def _batches(self, epoch: int) -> list[list[int]]:
        if self._epoch_batches is None or self._epoch_batches[0] != epoch:
            b = token_batches(*self._lengths, self.cfg.data.max_tokens, self.cfg.train.seed,
                              epoch)
            self._epoch_batches = (epoch, b)
        return self._epoch_batches[1]

    def n_updates(self, epoch: int) -> int:
        return -(-len(self._batches(epoch)) // self.cfg.train.update_freq)

    def update(self, epoch: int, pos: int, step: int, env: DistEnv) -> Update:
        f = self.cfg.train.update_freq
        model = self.model
        full = [collate(self.train, idx, model.pad_id, model.bos_id, model.eos_id)
                for idx in self._batches(epoch)[pos * f:(pos + 1) * f]]
        for t in self.techniques:
            t.before_update(model, step)
        self.last_step = step
        micro = []
        for i, b in enumerate(full):
            control = None
            for t in self.techniques:
                drawn = t.controls(len(b), step, i)
                control = drawn if drawn is not None else control
            if control is not None:
                control = control[env.rank::env.world_size].to(self.device)
            micro.append(Micro(b.shard(env.rank, env.world_size).to(self.device), control))
        return Update(micro, sum(b.n_tgt_tokens for b in full))

    def forward(self, model: nn.Module, micro: Micro) -> Any:
        return model(micro.batch.src, micro.batch.tgt_in, micro.control)

    def loss(self, out: Any, micro: Micro, step: int) -> LossTerms:
        b, pad = micro.batch, self.model.pad_id
        loss, nll, n_tok = label_smoothed_loss(out.logits, b.tgt_out,
                                               self.cfg.train.label_smoothing, pad)
        for aux_loss in out.aux.losses.values():
            loss = loss + aux_loss
        logs: dict[str, float] = {}
        for t in self.techniques:
            extra, extra_logs = t.loss(self.model, out, b.src, b.tgt_in, b.tgt_out,
                                       micro.control, n_tok, pad)
            loss = loss + extra
            logs.update(extra_logs)
        return LossTerms(loss, float(nll), n_tok, logs)

    def after_update(self, out: Any, micro: Micro) -> None:
        pass

    def validate(self, model: nn.Module) -> dict[str, float]:
        """Validation loss (teacher forced) and greedy/beam BLEU on the first lines, at the
        largest trained budget."""
        result: dict[str, float] = {}
        if self.valid is None:
            return result
        cfg = self.cfg
        control = control_for_budget(cfg.model)
        scores = score_corpus(model, self.valid.src, self.valid.tgt, cfg.data.max_len,
                              cfg.data.max_tokens, self.device, control)
        result.update(loss=scores["loss"], ppl=scores["ppl"])
        if self.valid_src_ids:
            d = cfg.decode
            hyps = decode_corpus(model, self.valid_src_ids, beam=cfg.train.valid_beam,
                                 length_penalty=d.length_penalty, max_len_a=d.max_len_a,
                                 max_len_b=d.max_len_b, batch_size=d.batch_size,
                                 device=self.device, control=control)
            result["bleu"], _ = bleu(self.tokenizer.decode(hyps), self.valid_refs)
        return result

    def score(self, metrics: dict[str, float]) -> float | None:
        """Validation BLEU (else minus the loss); None while a technique holds best-keeping
        back at the last update (the CCT before its budgets are all in: ``keeps_best``)."""
        if not all(t.keeps_best(self.last_step) for t in self.techniques):
            return None
        if "bleu" in metrics:
            return metrics["bleu"]
        if "loss" in metrics:
            return -metrics["loss"]
        return None

    def trainer_state(self) -> dict[str, Any]:
        return {}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        pass
