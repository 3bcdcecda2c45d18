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
from typing import Any

import torch
from torch import Tensor, nn

from dynaseq.core.distributed import DistEnv, barrier
from dynaseq.core.errors import ConfigError
from dynaseq.core.files import user_path
from dynaseq.core.runlog import RunLog
from dynaseq.data.text import read_lines
from dynaseq.tasks.encoder.model import MLM, build_encoder_model
from dynaseq.tasks.encoder.task import EncoderTask, EpochBatches
from dynaseq.tasks.encoder.training import (
    add_technique_losses,
    largest_control,
    techniques_for,
)
from dynaseq.tasks.encoder.vocab import SPM_FILE, EncoderVocab
from dynaseq.tasks.mlm.config import MLMRunConfig
from dynaseq.tasks.mlm.data import MaskedBatch, mask_tokens, pack_blocks
from dynaseq.tasks.mlm.predictor import mask_spec, mlm_metrics
from dynaseq.tasks.protocol import LossTerms


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


class MLMTask(EncoderTask):
    """See the module doc. ``cfg``: an :class:`MLMRunConfig`; ``hooks`` must be None."""

    def __init__(self, cfg: MLMRunConfig, hooks: None = None) -> None:
        if hooks is not None:
            raise ConfigError("MLM training takes no hooks")
        if not cfg.data.train:
            raise ConfigError("data.train (one or more text files) is required for training")
        self.cfg = cfg
        self.run_dir = user_path(cfg.run_dir)
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
        self.batches = EpochBatches(int(self.blocks.size(0)), d.batch_size,
                                    cfg.train.update_freq, cfg.train.seed)
        torch.manual_seed(cfg.train.seed)
        self.model = build_encoder_model(cfg.model, self.vocab.size, MLM,
                                         self.vocab.pad_id).to(device)

    def micro_batch(self, idx: Tensor, step: int, micro: int, env: DistEnv,
                    control: Tensor | None, layers: tuple[int, ...] | None
                    ) -> tuple[MLMMicro, int]:
        full = mask_tokens(self.blocks[idx], self.vocab, self.spec,
                           mask_generator(self.cfg.train.seed, step, micro))
        return (MLMMicro(full.shard(env.rank, env.world_size).to(self.device), control, layers),
                full.targets.numel())

    def forward(self, model: nn.Module, micro: MLMMicro) -> Any:
        b = micro.batch
        return model(b.inputs, None, micro.control, select=b.select, layers=micro.layers)

    def loss(self, out: Any, micro: MLMMicro, step: int) -> LossTerms:
        b = micro.batch
        nll = nn.functional.cross_entropy(out.logits, b.targets, reduction="sum")
        n = b.targets.numel()
        loss, logs = add_technique_losses(nll, self.techniques, out.aux,
                                          b.inputs.ne(self.vocab.pad_id), micro.control, n,
                                          step)
        return LossTerms(loss, float(nll.detach()), n, logs)

    def validate(self, model: nn.Module) -> dict[str, float]:
        if self.valid_blocks is None or self.valid_blocks.numel() == 0:
            return {}
        r = mlm_metrics(model, self.valid_blocks, self.vocab, self.spec,
                        self.cfg.data.batch_size, self.device, largest_control(self.cfg.model))
        return {"loss": r["loss"], "ppl": r["ppl"], "accuracy": r["accuracy"]}

    def score(self, metrics: dict[str, float]) -> float | None:
        return -metrics["loss"] if "loss" in metrics and self.keeps_best() else None
