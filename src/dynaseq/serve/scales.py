"""How much longer than the latency table the server's batches run: the factor its
predictions are multiplied by, overall and per batch size.

The latency table (:mod:`dynaseq.metrics.latency_table`) is measured on the bare model; a
server adds around each batch what the table does not see (request parsing, tokenizing and
answering on the same cores, the event loop). :class:`Ratios` follows the ratio of each
batch's real time to its prediction as a moving average (and the median of the last ones).
:class:`BatchScales` keeps one for every batch and, with ``by_size``, one per size class
(the power of two at or below the batch's lines: 1, 2-3, 4-7, 8-15, 16-31, 32-63, ...):
what the server adds is about the same for a batch of 2 lines as for one of 32, so it is
a larger share of a small batch's time than of a large one's. On the Multi30k CCT at full
load (2 cores, session 54) one factor for every batch left predictions made as a batch
formed late by a median of 2.6 ms at 1-7 lines and early by 5.4 / 18.9 / 33.9 ms at 8-15 /
16-23 / 24+ lines: the large batches that a loaded server runs were predicted too long and
their lines shed for nothing. A class falls back to the overall factor until it has seen
:attr:`BatchScales.CLASS_MIN` batches. Measured (session 55, ``docs/results.md``): 1x
SLO +0.015 / +0.017 in two runs, within their noise, and the answers of batches of 16+
lines still came 17-35 ms before their predictions: with early answers a line's answer is
predicted at its batch's table time at the line's own length (until the longest of n such
outputs ends), which a factor per batch does not correct. Off by default
(``ServeConfig.scale_by_size``).

Why by hand: a moving average with a clamp and a median over a window, no library's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

Scale = float | Callable[[int], float]
"""A factor for the table's times: one for every batch (a float), or one per batch size
(``rows -> factor``, e.g. :meth:`BatchScales.at`)."""


def scale_at(scale: Scale, rows: int) -> float:
    """The factor of ``scale`` for a batch of ``rows`` lines."""
    return scale if isinstance(scale, float | int) else scale(rows)


class Ratios:
    """A moving average of real ÷ predicted times (the k-th weighs ``max(weight, 1 / k)``:
    the first set it at once, later ones move it by ``weight``), clamped to ``bounds``,
    and the median of the last ``window`` (:attr:`typical`; the average until
    ``typical_min`` have come)."""

    def __init__(self, bounds: tuple[float, float], window: int, typical_min: int) -> None:
        self.bounds = bounds
        self.typical_min = typical_min
        self.value = 1.0
        self.count = 0
        self._recent: deque[float] = deque(maxlen=window)

    def update(self, ratio: float, weight: float) -> None:
        self._recent.append(ratio)
        self.count += 1
        w = max(weight, 1.0 / self.count)
        lo, hi = self.bounds
        self.value = min(hi, max(lo, (1 - w) * self.value + w * ratio))

    @property
    def typical(self) -> float:
        """The median of the recent ratios (:attr:`value` until ``typical_min`` came)."""
        if len(self._recent) < self.typical_min:
            return self.value
        ratios = sorted(self._recent)
        return ratios[len(ratios) // 2]


class BatchScales:
    """The server's factors (see the module doc): :attr:`overall`, and per size class with
    ``by_size`` (:meth:`at`, :meth:`typical_at`). Not thread-safe: the batcher holds its
    lock around every call."""

    WEIGHT = 0.2
    BOUNDS = (0.5, 4.0)
    WINDOW = 50
    TYPICAL_MIN = 10
    CLASS_MIN = 5

    def __init__(self, by_size: bool = False) -> None:
        self.by_size = by_size
        self.overall = self._ratios()
        self._classes: dict[int, Ratios] = {}

    def _ratios(self) -> Ratios:
        return Ratios(self.BOUNDS, self.WINDOW, self.TYPICAL_MIN)

    @staticmethod
    def size_class(rows: int) -> int:
        """The class of a batch of ``rows`` lines: 1, 2-3, 4-7, ... are 1, 2, 3, ..."""
        if rows < 1:
            raise ValueError(f"a batch has at least one line, got {rows}")
        return rows.bit_length()

    def update(self, ratio: float, rows: int | None = None, weight: float = WEIGHT) -> None:
        """One more batch of ``rows`` lines (None: of no size class, as a continuous
        decode's line) ran ``ratio`` times its prediction."""
        self.overall.update(ratio, weight)
        if self.by_size and rows is not None:
            key = self.size_class(rows)
            if key not in self._classes:
                self._classes[key] = self._ratios()
            self._classes[key].update(ratio, weight)

    def _class(self, rows: int) -> Ratios:
        own = self._classes.get(self.size_class(rows)) if self.by_size else None
        return own if own is not None and own.count >= self.CLASS_MIN else self.overall

    def at(self, rows: int) -> float:
        """The factor for a batch of ``rows`` lines: its class's, or the overall one."""
        return self._class(rows).value

    def typical_at(self, rows: int) -> float:
        """The median recent ratio for a batch of ``rows`` lines, as :meth:`at` chooses."""
        return self._class(rows).typical

    def sized(self) -> FrozenScales | None:
        """:meth:`frozen` with ``by_size``; None without (plans read the one factor)."""
        return self.frozen() if self.by_size else None

    def frozen(self) -> FrozenScales:
        """:meth:`at` as it is now, for a plan that reads it while the batches go on."""
        return FrozenScales(self.overall.value, tuple(
            (key, r.value) for key, r in sorted(self._classes.items())
            if r.count >= self.CLASS_MIN))


@dataclass(frozen=True)
class FrozenScales:
    """:meth:`BatchScales.at` at one moment: ``overall``, and ``(size class, factor)`` for
    each class that has its own. Called with a batch's lines, it gives that batch's
    factor (a :data:`Scale`)."""

    overall: float
    classes: tuple[tuple[int, float], ...] = ()

    def __call__(self, rows: int) -> float:
        key = BatchScales.size_class(rows)
        return next((v for k, v in self.classes if k == key), self.overall)
