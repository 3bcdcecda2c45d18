"""Pieces of the training loop (:mod:`dynaseq.train.loop`): counters, the signal flag, RNG
state capture and the ETA string."""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class TrainState:
    """Counters saved with every checkpoint; (epoch, epoch_pos) is the data position."""

    step: int = 0
    epoch: int = 0
    epoch_pos: int = 0
    tokens: int = 0
    elapsed: float = 0.0
    best_score: float | None = None


@dataclass
class TrainResult:
    state: TrainState
    run_dir: Path
    stopped_by_signal: int | None = None
    history: list[dict[str, Any]] = field(default_factory=list)


class StopFlag:
    """Records SIGINT/SIGTERM so the loop can checkpoint and stop between updates."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def eta(state: TrainState, tc, t_first: tuple[float, int]) -> str:
    """Time left until max_steps at this session's rate, or until max_minutes if sooner."""
    t0, step0 = t_first
    done = state.step - step0
    if done <= 0:
        return "?"
    left = (tc.max_steps - state.step) * (time.monotonic() - t0) / done
    if tc.max_minutes is not None:
        left = min(left, tc.max_minutes * 60 - state.elapsed)
    left = max(left, 0.0)
    return f"{int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}"
