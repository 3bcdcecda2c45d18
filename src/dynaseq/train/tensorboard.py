"""An optional TensorBoard sink for the run log (``train.tensorboard: true``).

Every ``train`` and ``valid`` record of ``log.jsonl`` also goes to TensorBoard as scalars
``train/<field>`` and ``valid/<field>`` at the record's ``step`` (numeric fields only; the
wall-clock ``time`` and the counters are left out), in ``run_dir/tensorboard``. Written by
``torch.utils.tensorboard``, which needs the ``tensorboard`` package (the ``[tensorboard]``
extra); asking for the sink without it is a one-line error before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynaseq.core.errors import ConfigError

#: record fields that are not metrics
NOT_SCALARS = {"event", "time", "step", "epoch"}
#: the events whose fields become scalars
EVENTS = ("train", "valid")


def check_tensorboard() -> None:
    """Raise ConfigError when the ``tensorboard`` package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError("train.tensorboard needs the tensorboard package: pip install "
                          "'dynaseq[tensorboard]' (or tensorboard)") from None


class TensorBoardSink:
    """Hands run-log records to a ``SummaryWriter`` in ``log_dir`` (see the module doc)."""

    def __init__(self, log_dir: str | Path) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def __call__(self, record: dict[str, Any]) -> None:
        event, step = record.get("event"), record.get("step")
        if event not in EVENTS or not isinstance(step, int):
            return
        for key, value in record.items():
            if key not in NOT_SCALARS and isinstance(value, (int, float)) \
                    and not isinstance(value, bool):
                self.writer.add_scalar(f"{event}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
