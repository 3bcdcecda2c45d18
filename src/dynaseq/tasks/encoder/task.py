"""The half of training that both encoder tasks (``mlm``, ``classify``) share:
:class:`EpochBatches`, the order of the training examples, and :class:`EncoderTask`, the
base of both Tasks (updates of micro-batches with the techniques' controls and LayerDrop's
layers; no task state to save). Each task adds its data, its micro-batch and its loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dynaseq.core.distributed import DistEnv
from dynaseq.tasks.encoder.training import draw_controls, draw_layers
from dynaseq.tasks.protocol import Update


class EpochBatches:
    """The training order of ``n`` examples: a permutation per epoch (seeded by ``seed`` and
    the epoch, so the same on every rank and on resume), cut into updates of
    ``update_freq`` micro-batches of ``batch_size`` examples (the last update of an epoch
    may have fewer)."""

    def __init__(self, n: int, batch_size: int, update_freq: int, seed: int) -> None:
        self.n, self.batch_size, self.update_freq, self.seed = n, batch_size, update_freq, seed
        self._order: tuple[int, Tensor] | None = None  # (epoch, its permutation)

    def n_updates(self) -> int:
        """Updates per epoch."""
        return -(-self.n // (self.batch_size * self.update_freq))

    def _epoch_order(self, epoch: int) -> Tensor:
        if self._order is None or self._order[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._order = (epoch, torch.randperm(self.n, generator=gen))
        return self._order[1]

    def update(self, epoch: int, pos: int) -> list[Tensor]:
        """The example indices of each micro-batch of update ``pos`` of ``epoch``."""
        order, bs, f = self._epoch_order(epoch), self.batch_size, self.update_freq
        micro = [order[(pos * f + i) * bs:(pos * f + i + 1) * bs] for i in range(f)]
        return [idx for idx in micro if idx.numel()]


class EncoderTask:
    """The part of :class:`~dynaseq.tasks.protocol.Task` both encoder tasks share. A subclass
    sets ``cfg`` (its run config), ``techniques`` and, in ``prepare``, ``model``, ``device``
    and ``batches`` (an :class:`EpochBatches`), and makes each micro-batch in
    :meth:`micro_batch`."""

    cfg: Any
    techniques: list[Any]
    model: Any
    device: torch.device
    batches: EpochBatches

    def n_updates(self, epoch: int) -> int:
        return self.batches.n_updates()

    def micro_batch(self, idx: Tensor, step: int, micro: int, env: DistEnv,
                    control: Tensor | None, layers: tuple[int, ...] | None) -> tuple[Any, int]:
        """Micro-batch ``micro`` of update ``step`` from the examples ``idx`` (every rank's),
        this rank's share on the device, with its ``control`` ids and LayerDrop ``layers``;
        and the loss units it holds over all ranks (tokens, sentences)."""
        raise NotImplementedError

    last_step = 0  # the last update's step (set by update), for keeps_best

    def keeps_best(self) -> bool:
        """Whether the model after the last update may become ``best/`` (a task's ``score``
        is None otherwise): every technique agrees (the CCT: only once every sequence draws
        its budget)."""
        return all(t.keeps_best(self.last_step) for t in self.techniques)

    def update(self, epoch: int, pos: int, step: int, env: DistEnv) -> Update:
        for t in self.techniques:
            t.before_update(self.model, step)
        self.last_step = step
        micro, n_units = [], 0
        for i, idx in enumerate(self.batches.update(epoch, pos)):
            control = draw_controls(self.techniques, idx.numel(), step, i, env, self.device)
            layers = draw_layers(self.cfg.model, self.cfg.train.seed, step, i)
            batch, n = self.micro_batch(idx, step, i, env, control, layers)
            micro.append(batch)
            n_units += n
        return Update(micro, n_units)

    def after_update(self, out: Any, micro: Any) -> None:
        pass

    def trainer_state(self) -> dict[str, Any]:
        return {}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        pass
