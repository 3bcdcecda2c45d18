"""What every task gives the training loop (:class:`Task`) and its users (:class:`Predictor`).

A task (translation, language modelling, ...) owns its data, its model builder, its loss and
its validation metric. The one training loop (:mod:`dynaseq.train.loop`) runs any
:class:`Task`: it knows nothing about models, batches or techniques, only that an update is a
list of micro-batches whose losses it backpropagates, normalised by the update's tokens.

``dynaseq.load(path)`` returns the task's :class:`Predictor` for any run directory; every
predictor is loaded the same way and answers with the task's own methods (``translate``,
``score``, ``generate``, ``evaluate``), each taking the compute knob of the call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from dynaseq.core.distributed import DistEnv
from dynaseq.core.runlog import RunLog


@dataclass
class LossTerms:
    """One micro-batch's loss.

    loss: scalar, *summed* over the micro-batch's tokens, technique losses included; the loop
        backpropagates ``loss * world_size / Update.n_tokens``.
    nll_sum: the plain negative log-likelihood of the targets (nats, summed), for perplexity.
    n_tokens: target tokens of this micro-batch (this rank's share).
    logs: extra per-token *sums* (e.g. ``budget_loss`` · tokens); the loop logs each divided
        by the tokens since the last log line.
    """

    loss: Tensor
    nll_sum: float
    n_tokens: int
    logs: dict[str, float] = field(default_factory=dict)


@dataclass
class Update:
    """The micro-batches of one optimizer update for this rank (already on the device) and
    the target tokens of the whole update over all ranks (the loss normaliser)."""

    micro: list[Any]
    n_tokens: int


@runtime_checkable
class Task(Protocol):
    """A trainable task, built from its run config (``cfg.run_dir``, ``cfg.train``).

    Construction reads and checks everything and writes nothing (a refused run leaves no
    trace); :meth:`prepare` runs with the run directory locked and writes the task's own
    files (tokenizer or vocabulary, when the run has none yet), then builds the data and
    :attr:`model`. The loop writes ``config.yaml`` once the model is built and the run's
    latest checkpoint, if any, has loaded into it.
    """

    cfg: Any
    model: nn.Module

    def prepare(self, env: DistEnv, device: torch.device, log: RunLog) -> None:
        """Write the task's files (main rank), encode the data, build :attr:`model` on
        ``device``."""
        ...

    def n_updates(self, epoch: int) -> int:
        """Optimizer updates in ``epoch`` (the loop's data position is ``(epoch, pos)``)."""
        ...

    def update(self, epoch: int, pos: int, step: int, env: DistEnv) -> Update:
        """The micro-batches of update ``pos`` of ``epoch`` (global update index ``step``);
        technique schedules that follow the step (gate noise, budget curriculum) are set here.
        """
        ...

    def forward(self, model: nn.Module, micro: Any) -> Any:
        """The model's output on one micro-batch (``model`` may be wrapped in DDP)."""
        ...

    def loss(self, out: Any, micro: Any, step: int) -> LossTerms:
        """Task loss plus every technique's auxiliary losses for one micro-batch."""
        ...

    def after_update(self, out: Any, micro: Any) -> None:
        """Called after each optimizer step with the last micro-batch and its output (carried
        state such as an LM's memory, Hebbian updates)."""
        ...

    def validate(self, model: nn.Module) -> dict[str, float]:
        """Validation metrics (empty without validation data)."""
        ...

    def score(self, metrics: dict[str, float]) -> float | None:
        """Higher is better: what ``best/`` keeps (None: nothing to compare)."""
        ...

    def trainer_state(self) -> dict[str, Any]:
        """Task state saved with each checkpoint beside the optimizer's (exact resume)."""
        ...

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`trainer_state` saved."""
        ...


@runtime_checkable
class Predictor(Protocol):
    """A trained model ready for inference: what ``dynaseq.load(path)`` returns.

    Every predictor has the loaded ``model`` (eval mode), its run ``config`` and the
    ``checkpoint`` directory it came from, and is built by ``load(run_dir, checkpoint,
    device)``; the task adds its own methods (``Translator.translate/score/evaluate``,
    ``LanguageModel.evaluate/generate``), each taking the call's compute knob.
    """

    model: nn.Module
    config: Any
    checkpoint: Path

    @classmethod
    def load(cls, run_dir: str | Path, checkpoint: str = "auto",
             device: str | torch.device | None = None,
             precision: str = "fp32") -> Predictor:
        ...
