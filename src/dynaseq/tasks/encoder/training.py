"""What techniques add to encoder training (both encoder tasks): :data:`TECHNIQUE_TRAINING`
maps a model section to its training plug-in (the CCT's: control sampling, noise ramp,
budget loss; adaptive depth's: the compute term on the expected depth), drawn and added by
:func:`draw_controls` and :func:`add_technique_losses`; :func:`draw_layers`, LayerDrop's
layers per micro-batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from dynaseq.core.config import TrainConfig
from dynaseq.core.distributed import DistEnv
from dynaseq.tasks.encoder.config import EncoderModelConfig
from dynaseq.techniques.cct.training import EncoderCCTTraining
from dynaseq.techniques.depth.layerdrop import sample_layers
from dynaseq.techniques.depth.training import DepthTraining


class EncoderTechnique(Protocol):
    """A technique's part in encoder training (see :class:`EncoderCCTTraining`)."""

    def before_update(self, model: nn.Module, step: int) -> None: ...

    def keeps_best(self, step: int) -> bool: ...

    def controls(self, n_rows: int, step: int, micro: int) -> Tensor | None: ...

    def loss(self, aux: Any, valid: Tensor, control: Tensor | None, n_units: int,
             step: int) -> tuple[Tensor, dict[str, float]]: ...


#: ``model.<section>`` -> the technique's training plug-in, built when the section is set.
TECHNIQUE_TRAINING: dict[str, Callable[[Any, TrainConfig], EncoderTechnique]] = {
    "cct": EncoderCCTTraining.from_config,
    "depth": DepthTraining.from_config,
}


def techniques_for(model: EncoderModelConfig, train: TrainConfig) -> list[EncoderTechnique]:
    return [make(getattr(model, name), train) for name, make in TECHNIQUE_TRAINING.items()
            if getattr(model, name) is not None]


def draw_controls(techniques: list[EncoderTechnique], n_rows: int, step: int, micro: int,
                  env: DistEnv, device: torch.device) -> Tensor | None:
    """The control ids the techniques draw for the ``n_rows`` rows of a micro-batch (the
    same on every rank), this rank's share of them on ``device``; None: no technique
    draws one."""
    control = None
    for t in techniques:
        drawn = t.controls(n_rows, step, micro)
        control = drawn if drawn is not None else control
    return None if control is None else control[env.rank::env.world_size].to(device)


def add_technique_losses(loss: Tensor, techniques: list[EncoderTechnique], aux: Any,
                         valid: Tensor, control: Tensor | None, n_units: int,
                         step: int) -> tuple[Tensor, dict[str, float]]:
    """``loss`` plus the model's auxiliary losses (``aux.losses``) and each technique's loss
    term (``valid``: the non-padding tokens; ``n_units``: what the task's loss is summed
    over), and the techniques' logged values."""
    for aux_loss in aux.losses.values():
        loss = loss + aux_loss
    logs: dict[str, float] = {}
    for t in techniques:
        extra, extra_logs = t.loss(aux, valid, control, n_units, step)
        loss = loss + extra
        logs.update(extra_logs)
    return loss, logs


def draw_layers(model: EncoderModelConfig, seed: int, step: int,
                micro: int) -> tuple[int, ...] | None:
    """LayerDrop (``model.layerdrop`` p > 0): the plan positions micro-batch ``micro`` of update
    ``step`` runs (:func:`~dynaseq.techniques.depth.layerdrop.sample_layers`, the same on every
    rank and on resume); None without LayerDrop (every layer runs)."""
    if not model.layerdrop:
        return None
    return sample_layers(model.layers, model.layerdrop, seed, step, micro)


def largest_control(model: EncoderModelConfig) -> int | None:
    """The control id of the largest trained budget (validation runs at it); None without
    a CCT."""
    return None if model.cct is None else model.cct.largest_control
