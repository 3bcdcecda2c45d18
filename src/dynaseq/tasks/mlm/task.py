"""Masked-language-model pre-training (BERT) as a :class:`~dynaseq.tasks.protocol.Task`.

Data: ``data.train`` text files -> a SentencePiece model with [CLS]/[SEP]/[MASK]
(``RUN_DIR/spm.model``) -> fixed-length blocks (:func:`~dynaseq.tasks.mlm.data.pack_blocks`),
shuffled per epoch from the seed, ``data.batch_size`` blocks per micro-batch and
``train.update_freq`` micro-batches per update. Each micro-batch is masked afresh from
(seed, step, micro-batch) (dynamic masking), so a resumed run draws the same masks and
every DDP rank masks the same full batch before taking its rows.

Loss: cross-entropy summed over the masked positions (the loop divides by the update's
masked tokens over all ranks), plus each technique's term (:data:`~dynaseq.tasks.encoder.
training.TECHNIQUE_TRAINING`: CCT-BERT's ``L^mlm + λ L^c`` with budgets drawn per sequence).
Validation: masked-token loss, perplexity and accuracy on ``data.valid`` with fixed masks, at
the largest trained budget; ``best/`` keeps the lowest loss.

Run directory: ``config.yaml``, ``spm.model``, ``log.jsonl``, ``checkpoints/``, ``best/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dynaseq.core.distributed import DistEnv, barrier
from dynaseq.core.errors import ConfigError
from dynaseq.core.runlog import RunLog
from dynaseq.data.text import read_lines
from dynaseq.tasks.encoder.model import MLM, build_encoder_model
from dynaseq.tasks.encoder.training import (
    draw_controls,
    draw_layers,
    largest_control,
    techniques_for,
)
from dynaseq.tasks.encoder.vocab import SPM_FILE, EncoderVocab
from dynaseq.tasks.mlm.config import MLMRunConfig
from dynaseq.tasks.mlm.data import MaskedBatch, mask_tokens, pack_blocks
from dynaseq.tasks.mlm.predictor import mask_spec, mlm_metrics
from dynaseq.tasks.protocol import LossTerms, Update


@dataclass
class MLMMicro:
    """One micro-batch: this rank's masked rows and their control ids (CCT) or None;
    ``layers``: the plan positions it runs (LayerDrop) or None (all)."""

    batch: MaskedBatch
    control: Tensor | None
    layers: tuple[int, ...] | None = None


def mask_generator(seed: int, step: int, micro: int) -> torch.Generator:
    """The masks of micro-batch ``micro`` of update ``step`` come from this generator."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1009 + micro + 7)


class MLMTask:
    """See the module doc. ``cfg``: an :class:`MLMRunConfig`; ``hooks`` must be None."""

    def __init__(self, cfg: MLMRunConfig, hooks: None = None) -> None:
        if hooks is not None:
            raise ConfigError("MLM training takes no hooks")
        if not cfg.data.train:
            raise ConfigError("data.train (one or more text files) is required for training")
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.techniques = techniques_for(cfg.model, cfg.train)
        self.spec = mask_spec(cfg)
        self.model: nn.Module | None = None

    def prepare(self, env: DistEnv, device: torch.device, log: RunLog) -> None:
        cfg, d = self.cfg, self.cfg.data
        lines = [line for path in d.train for line in read_lines(path)]
        n_empty = sum(1 for line in lines if not line.strip())
        lines = [line for line in lines if line.strip()]
        if not lines:
            raise ConfigError("data.train holds no text (every line is empty)")
        spm_path = self.run_dir / SPM_FILE
        if env.is_main and not spm_path.is_file():
            EncoderVocab.train(lines, spm_path, d.vocab_size, d.spm_model_type,
                               d.character_coverage)
        barrier(env)
        self.vocab = EncoderVocab.load(spm_path)
        self.blocks = pack_blocks(self.vocab.encode(lines), d.block_len, self.vocab)
        log.write("data", split="train", lines=len(lines), empty_lines=n_empty,
                  blocks=int(self.blocks.size(0)), block_len=d.block_len, vocab=self.vocab.size)
        self.valid_blocks = None
        if d.valid is not None:
            valid_lines = read_lines(d.valid)
            self.valid_blocks = pack_blocks(self.vocab.encode(valid_lines), d.block_len,
                                            self.vocab)[:d.valid_max_blocks]
            log.write("data", split="valid", lines=len(valid_lines),
                      blocks=int(self.valid_blocks.size(0)))
        self.device = device
        self._order: tuple[int, Tensor] | None = None
        torch.manual_seed(cfg.train.seed)
        self.model = build_encoder_model(cfg.model, self.vocab.size, MLM,
                                         self.vocab.pad_id).to(device)

    def _epoch_order(self, epoch: int) -> Tensor:
        if self._order is None or self._order[0] != epoch:
            gen = torch.Generator().manual_seed(self.cfg.train.seed * 7919 + epoch)
            self._order = (epoch, torch.randperm(self.blocks.size(0), generator=gen))
        return self._order[1]

    def n_updates(self, epoch: int) -> int:
        per_update = self.cfg.data.batch_size * self.cfg.train.update_freq
        return -(-self.blocks.size(0) // per_update)

    def update(self, epoch: int, pos: int, step: int, env: DistEnv) -> Update:
        bs, f = self.cfg.data.batch_size, self.cfg.train.update_freq
        order = self._epoch_order(epoch)
        for t in self.techniques:
            t.before_update(self.model, step)
        micro, n_tokens = [], 0
        for i in range(f):
            idx = order[(pos * f + i) * bs:(pos * f + i + 1) * bs]
            if idx.numel() == 0:
                break
            full = mask_tokens(self.blocks[idx], self.vocab, self.spec,
                               mask_generator(self.cfg.train.seed, step, i))
            n_tokens += full.targets.numel()
            control = draw_controls(self.techniques, idx.numel(), step, i)
            if control is not None:
                control = control[env.rank::env.world_size].to(self.device)
            layers = draw_layers(self.cfg.model, self.cfg.train.seed, step, i)
            micro.append(MLMMicro(full.shard(env.rank, env.world_size).to(self.device), control,
                                  layers))
        return Update(micro, n_tokens)

    def forward(self, model: nn.Module, micro: MLMMicro) -> Any:
        b = micro.batch
        return model(b.inputs, None, micro.control, select=b.select, layers=micro.layers)

    def loss(self, out: Any, micro: MLMMicro, step: int) -> LossTerms:
        b = micro.batch
        nll = nn.functional.cross_entropy(out.logits, b.targets, reduction="sum")
        n = b.targets.numel()
        loss = nll
        for aux_loss in out.aux.losses.values():
            loss = loss + aux_loss
        logs: dict[str, float] = {}
        for t in self.techniques:
            extra, extra_logs = t.loss(out.aux, b.inputs.ne(self.vocab.pad_id), micro.control,
                                       n, step)
            loss = loss + extra
            logs.update(extra_logs)
        return LossTerms(loss, float(nll.detach()), n, logs)

    def after_update(self, out: Any, micro: MLMMicro) -> None:
        pass

    def validate(self, model: nn.Module) -> dict[str, float]:
        if self.valid_blocks is None or self.valid_blocks.numel() == 0:
            return {}
        r = mlm_metrics(model, self.valid_blocks, self.vocab, self.spec,
                        self.cfg.data.batch_size, self.device, largest_control(self.cfg.model))
        return {"loss": r["loss"], "ppl": r["ppl"], "accuracy": r["accuracy"]}

    def score(self, metrics: dict[str, float]) -> float | None:
        return -metrics["loss"] if "loss" in metrics else None

    def trainer_state(self) -> dict[str, Any]:
        return {}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        pass
