"""Fine-tuning an encoder on a labelled table (GLUE) as a
:class:`~dynaseq.tasks.protocol.Task`.

Data: ``data.train`` / ``data.valid`` in the layout of ``data.glue_task`` or
``data.columns`` (:mod:`~dynaseq.tasks.classify.glue`; rows with an empty sentence are
counted and skipped), encoded as ``[CLS] a [SEP] (b [SEP])`` with segments 0/1, shuffled per
epoch from the seed, ``data.batch_size`` sentences per micro-batch.

Model: from scratch (a SentencePiece model trained on the training sentences), or from a
pre-trained ``mlm`` run (``train.init_from``): its ``spm.model`` is copied into the run and
its encoder weights (embeddings, layers, control symbols) are loaded under a new
classification head. The pre-trained run's model section must have the same dimensions
(:meth:`~dynaseq.tasks.encoder.config.EncoderModelConfig.architecture`), else the run is
refused before anything is written.

Loss: cross-entropy (or squared error for a regression) summed over the sentences, plus each
technique's term (CCT-BERT: budgets drawn per sentence, λ·L_c with the run's λ, scaled to
the task loss; adaptive depth: λ_d times the expected depth). A multi-exit model
(``model.exits``) is trained on the weighted sum of its internal classifiers' losses
(``exits.weighting``). Validation: the task's official metrics at the largest trained budget
(adaptive depth: early exit at the run's ``depth.gamma``, multi-exit: at its ``exits.rule``,
with ``avg_layers``);
``best/`` keeps the first metric (CoLA: MCC, MRPC/QQP: F1, STS-B: Pearson, else accuracy).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dynaseq.core import checkpoint as ckpt
from dynaseq.core.config import from_dict
from dynaseq.core.distributed import DistEnv, barrier
from dynaseq.core.errors import CheckpointError, ConfigError, DynaseqError
from dynaseq.core.files import user_path
from dynaseq.core.rundir import read_run_config
from dynaseq.core.runlog import RunLog
from dynaseq.tasks.classify.config import ClassifyRunConfig
from dynaseq.tasks.classify.data import collate_rows, encode_examples, target_tensor
from dynaseq.tasks.classify.glue import read_table
from dynaseq.tasks.classify.predictor import (
    RealizedCompute,
    decide,
    predict_logits,
    task_metrics,
)
from dynaseq.tasks.encoder.budget import exit_for, layer_exit_for
from dynaseq.tasks.encoder.config import EncoderModelConfig
from dynaseq.tasks.encoder.model import build_encoder_model
from dynaseq.tasks.encoder.task import EncoderTask, EpochBatches
from dynaseq.tasks.encoder.training import (
    add_technique_losses,
    largest_control,
    techniques_for,
)
from dynaseq.tasks.encoder.vocab import SPM_FILE, EncoderVocab
from dynaseq.tasks.protocol import LossTerms
from dynaseq.techniques.depth.multi_exit import EXIT_LOGITS, weighted_exit_loss

#: The weights a pre-trained run gives a fine-tuned model (its MLM head is left behind).
PRETRAINED_PREFIXES = ("encoder.", "control_embed.")
PREDICTOR_PREFIX = "encoder.predictor."
"""The structure predictor's weights (not loaded when ``depth.predictor_from_init`` is off)."""


@dataclass
class ClassifyMicro:
    """One micro-batch: this rank's rows, their targets and control ids (CCT) or None;
    ``layers``: the plan positions it runs (LayerDrop) or None (all)."""

    tokens: Tensor
    segments: Tensor
    targets: Tensor
    control: Tensor | None
    layers: tuple[int, ...] | None = None


def check_pretrained(init_from: str, model: EncoderModelConfig) -> tuple[Path, Path]:
    """The pre-trained run's vocabulary and checkpoint, after checking that its encoder has
    this config's dimensions (one-line ConfigError naming the first difference; the structure
    predictor's only where fine-tuning loads it, ``depth.predictor_from_init``)."""
    run = user_path(init_from)
    if not str(init_from).strip():
        raise ConfigError("train.init_from must name a run, got ''")
    try:
        raw = read_run_config(run)  # a run or an exported model directory
    except CheckpointError:
        raise ConfigError(f"train.init_from {run} is not a run directory (no config.yaml) "
                          "nor an exported model (config.json)") from None
    if raw.get("task") not in ("mlm", "classify"):
        raise ConfigError(f"train.init_from {run} is a {raw.get('task', 'seq2seq')} run; "
                          "fine-tuning starts from an mlm (or classify) run")
    predictor = model.depth is None or model.depth.predictor_from_init
    theirs = from_dict(EncoderModelConfig, raw.get("model", {}), "model.").architecture(predictor)
    ours = model.architecture(predictor)
    for key, value in ours.items():
        if theirs.get(key) != value:
            raise ConfigError(f"train.init_from {run} has model.{key}={theirs.get(key)}, this "
                              f"config {value}: the encoder's dimensions must match")
    spm = run / SPM_FILE
    if not spm.is_file():
        raise ConfigError(f"train.init_from {run} has no {SPM_FILE}")
    return spm, ckpt.resolve_checkpoint(run, "auto")


class ClassifyTask(EncoderTask):
    """See the module doc. ``cfg``: a :class:`ClassifyRunConfig`; ``hooks`` must be None.

    Construction reads and checks the tables and the pre-trained run (nothing written)."""

    def __init__(self, cfg: ClassifyRunConfig, hooks: None = None) -> None:
        if hooks is not None:
            raise ConfigError("fine-tuning takes no hooks")
        if cfg.data.train is None:
            raise ConfigError("data.train is required for training")
        self.cfg = cfg
        self.run_dir = user_path(cfg.run_dir)
        layout = cfg.data.layout()
        self.train_ex = read_table(cfg.data.train, layout)
        if not len(self.train_ex):
            raise ConfigError(f"{cfg.data.train}: every row has an empty sentence")
        if layout.labels is None and not layout.regression:  # a column spec: learn the set
            cfg.data.columns.labels = sorted(set(self.train_ex.labels))
            if len(cfg.data.columns.labels) < 2:
                raise ConfigError(f"{cfg.data.train} holds one label only: nothing to learn")
            layout = cfg.data.layout()
        self.layout = layout
        if cfg.model.exits is not None and layout.regression:
            raise ConfigError("model.exits (internal classifiers with probability-based exit "
                              f"rules) is for classification, and {layout.name} is a regression")
        self.valid_ex = None if cfg.data.valid is None else read_table(cfg.data.valid, layout)
        self.pretrained = (None if cfg.train.init_from is None
                           else check_pretrained(cfg.train.init_from, cfg.model))
        spm_path = self.run_dir / SPM_FILE
        if self.pretrained is not None and spm_path.is_file() and (
                spm_path.read_bytes() != self.pretrained[0].read_bytes()):
            raise ConfigError(f"{spm_path} is not the vocabulary of train.init_from "
                              f"{cfg.train.init_from} (use a new run_dir)")
        self.techniques = techniques_for(cfg.model, cfg.train)
        self.model: nn.Module | None = None

    def prepare(self, env: DistEnv, device: torch.device, log: RunLog) -> None:
        cfg = self.cfg
        spm_path = self.run_dir / SPM_FILE
        if env.is_main and not spm_path.is_file():
            if self.pretrained is not None:
                shutil.copyfile(self.pretrained[0], spm_path.with_suffix(".tmp"))
                spm_path.with_suffix(".tmp").replace(spm_path)
            else:
                ex = self.train_ex
                EncoderVocab.train(ex.text_a + (ex.text_b or []), spm_path,
                                   cfg.data.vocab_size, cfg.data.spm_model_type,
                                   cfg.data.character_coverage)
        barrier(env)
        self.vocab = EncoderVocab.load(spm_path)
        self.rows = encode_examples(self.vocab, self.train_ex, cfg.data.max_len)
        self.targets = target_tensor(self.train_ex, self.layout)
        log.write("data", split="train", examples=len(self.rows), skipped=self.train_ex.skipped,
                  vocab=self.vocab.size)
        if self.valid_ex is not None:
            self.valid_rows = encode_examples(self.vocab, self.valid_ex, cfg.data.max_len)
            log.write("data", split="valid", examples=len(self.valid_rows),
                      skipped=self.valid_ex.skipped)
        self.device = device
        self.batches = EpochBatches(len(self.rows), cfg.data.batch_size,
                                    cfg.train.update_freq, cfg.train.seed)
        torch.manual_seed(cfg.train.seed)
        model = build_encoder_model(cfg.model, self.vocab.size, self.layout.n_outputs,
                                    self.vocab.pad_id)
        if self.pretrained is not None:
            try:
                fresh = cfg.model.depth is not None and not cfg.model.depth.predictor_from_init
                loaded = ckpt.load_weights_prefixed(model, self.pretrained[1],
                                                    PRETRAINED_PREFIXES,
                                                    (PREDICTOR_PREFIX,) if fresh else ())
            except DynaseqError as e:
                raise ConfigError(f"train.init_from: {e}") from None
            log.write("init_from", run=cfg.train.init_from, checkpoint=str(self.pretrained[1]),
                      tensors=len(loaded))
        self.model = model.to(device)

    def micro_batch(self, idx: Tensor, step: int, micro: int, env: DistEnv,
                    control: Tensor | None, layers: tuple[int, ...] | None
                    ) -> tuple[ClassifyMicro, int]:
        mine = idx[env.rank::env.world_size].tolist()
        tokens, segments = collate_rows([self.rows[j] for j in mine], self.vocab.pad_id)
        return (ClassifyMicro(tokens.to(self.device), segments.to(self.device),
                              self.targets[mine].to(self.device), control, layers),
                idx.numel())

    def forward(self, model: nn.Module, micro: ClassifyMicro) -> Any:
        return model(micro.tokens, micro.segments, micro.control, layers=micro.layers)

    def _nll(self, logits: Tensor, micro: ClassifyMicro) -> Tensor:
        if self.layout.regression:
            return nn.functional.mse_loss(logits[:, 0], micro.targets, reduction="sum")
        return nn.functional.cross_entropy(logits, micro.targets, reduction="sum",
                                           label_smoothing=self.cfg.train.label_smoothing)

    def loss(self, out: Any, micro: ClassifyMicro, step: int) -> LossTerms:
        nll = self._nll(out.logits, micro)  # the final classifier's (reported)
        n = micro.targets.numel()
        loss = nll
        exit_logits = out.aux.traces.get(EXIT_LOGITS)
        if exit_logits:  # model.exits: every internal classifier's loss, weighted
            weights = self.cfg.model.exits.loss_weights(len(exit_logits))
            loss = weighted_exit_loss(exit_logits, weights, lambda z: self._nll(z, micro))
        loss, logs = add_technique_losses(loss, self.techniques, out.aux,
                                          micro.tokens.ne(self.vocab.pad_id), micro.control,
                                          n, step)
        return LossTerms(loss, float(nll.detach()), n, logs)

    def validate(self, model: nn.Module) -> dict[str, float]:
        if self.valid_ex is None or not len(self.valid_ex):
            return {}
        # adaptive depth: early exit at the run's γ; multi-exit: at the run's rule
        exit = exit_for(self.cfg.model) or layer_exit_for(self.cfg.model)
        compute = RealizedCompute()
        logits = predict_logits(model, self.valid_rows, 64, self.device,
                                largest_control(self.cfg.model), compute, exit=exit)
        metrics = task_metrics(self.layout, self.valid_ex.targets(), decide(logits, self.layout))
        if exit is not None:
            metrics["avg_layers"] = compute.avg_layers
        return metrics

    def score(self, metrics: dict[str, float]) -> float | None:
        main = self.layout.metrics[0]
        return metrics.get(main) if self.keeps_best() else None
