"""The one training loop runs any Task: a toy regression task it has never seen trains,
keeps its best, and resumes exactly (3 + 3 updates = 6 straight)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from dynaseq.core import checkpoint as ckpt
from dynaseq.core.config import TrainConfig
from dynaseq.tasks.protocol import LossTerms, Task, Update
from dynaseq.train.loop import train


@dataclass
class ToyConfig:
    run_dir: str
    train: TrainConfig = field(default_factory=TrainConfig)


class ToyTask:
    """y = x·w on 64 fixed rows, 4 updates an epoch of 2 micro-batches of 8 rows each."""

    def __init__(self, cfg: ToyConfig) -> None:
        self.cfg = cfg
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 4, generator=gen)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        self.model = nn.Linear(4, 1)
        self.after = 0

    def prepare(self, env, device, log) -> None:
        torch.manual_seed(1)
        self.model = nn.Linear(4, 1)

    def n_updates(self, epoch: int) -> int:
        return 4

    def update(self, epoch: int, pos: int, step: int, env) -> Update:
        order = torch.randperm(64, generator=torch.Generator().manual_seed(epoch))
        rows = order[pos * 16:(pos + 1) * 16]
        return Update([(self.x[rows[:8]], self.y[rows[:8]]), (self.x[rows[8:]], self.y[rows[8:]])],
                      16)

    def forward(self, model, micro):
        return model(micro[0])

    def loss(self, out, micro, step: int) -> LossTerms:
        se = ((out - micro[1]) ** 2).sum()
        return LossTerms(se, float(se.detach()), 8, {"extra": 2.0 * 8})

    def after_update(self, out, micro) -> None:
        self.after += 1

    def validate(self, model) -> dict[str, float]:
        with torch.no_grad():
            return {"loss": float(((model(self.x) - self.y) ** 2).mean())}

    def score(self, metrics):
        return -metrics["loss"]

    def trainer_state(self):
        return {"after": self.after}

    def load_trainer_state(self, state) -> None:
        self.after = state["after"]


def _cfg(run_dir, steps: int) -> ToyConfig:
    return ToyConfig(str(run_dir), TrainConfig(lr=0.05, warmup_steps=0, max_steps=steps,
                                               log_every=1, valid_every=3, save_every=3,
                                               label_smoothing=0.0, clip_norm=0.0))


def test_the_loop_trains_and_resumes_a_task_it_has_never_seen(tmp_path):
    task = ToyTask(_cfg(tmp_path / "a", 6))
    assert isinstance(task, Task)
    straight = train(task, progress=False)
    assert straight.state.step == 6 and task.after == 6
    logs = [e for e in straight.history if e["event"] == "train"]
    assert [e["step"] for e in logs] == [1, 2, 3, 4, 5, 6]
    assert all(e["extra"] == pytest.approx(2.0) for e in logs)  # per-token sums averaged
    valid = [e["loss"] for e in straight.history if e["event"] == "valid"]
    assert len(valid) == 2 and valid[1] < valid[0]
    assert ckpt.read_meta(tmp_path / "a" / "best")["step"] == 6

    first = ToyTask(_cfg(tmp_path / "b", 3))
    train(first, progress=False)
    second = ToyTask(_cfg(tmp_path / "b", 6))
    resumed = train(second, progress=False)
    assert any(e["event"] == "resume" and e["step"] == 3 for e in resumed.history)
    assert second.after == 6  # the task's own state came back from the checkpoint
    for p, q in zip(task.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(p, q)
