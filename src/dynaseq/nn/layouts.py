"""The fastest of a product's equivalent layouts on this machine, measured on its own calls.

A decoding step's products are matrix-vector or few-row products, which read a weight once
and are bound by how fast the BLAS reads it; oneDNN/MKL read one weight at rates up to 2x
apart depending on which side of the product it stands, how it is stored and how many rows
the other side has, and **which layout wins differs between CPUs**. Measured at 1 thread,
weights out of L2 as in a decode:

* AMD EPYC AVX-512 (sessions before 50): one row of a wide projection reads an ``(in, out)``
  copy at twice ``F.linear``'s rate (768 x 256: 66 against 113 us); 2 to 8 rows read the
  weight fastest on the left, ``W xᵀ`` (4 rows, 1024 x 256: 112 against 233 us; the output
  layer 8000 x 512: 1563 against 2660); the CCT's four 256 x 256 feed-forward pieces at one
  row, weight on the left 63 against 159 us as a batched ``h · W2ᵀ`` stack.
* Intel Xeon AVX-512 (session 50): the ``(in, out)`` copy is fastest at every row count and
  the weight on the left is the slowest (4 rows, 1024 x 256: 48 us copy, 56 ``F.linear``,
  101 left; 8000 x 256: 325, 597, 659); the CCT pieces at one row, 41 us as the stack
  against 82 on the left.

A fixed rule tuned on one of them runs the other slower: on the Intel machine, the layouts
timed here took 0.83x the AMD rule's time for the dense ``small`` model at beam 4, batch 1,
0.79x for ``base``, 0.83x for the CCT with every gate open, 0.87-0.90x at batch 8 and
0.92-1.02x at batch 32 (``benchmarks/layouts.py``, ``layouts.md``). So a product offers its
layouts, and :class:`Layouts` times the first calls of each size class, each layout
:attr:`Layouts.TRIALS` times in turn, then runs the one with the least median time. The
trials are the product's real calls, inside a real decode (the same cache state and
threads), so they cost nothing but the slower layouts' few calls.

Known limit: a fresh ``(in, out)`` copy reads slowly for its first several calls (8000 x 256
at 4 rows, 2 threads: 1097, 449, 349, 241, 221 ... 178 us, against 312 for ``F.linear`` on
the old weight), so the trials under-rate it: every projection pinned to the copy decoded
the dense ``small`` model at beam 4 in 47 ms against 51 for the timed choice (which
preferred ``F.linear`` at 4 rows, for the output layer mostly: 8000 x 256 took ~300 us a
call through ``F.linear`` in a decode and ~234 through the copy read every step, but ~390
through the copy in trials taking turns with ``F.linear``, which evicts it). Tried, not
kept (session 50): discarding the first 1 or 3 runs of each layout, two untimed reads of a
new copy, and each layout's trials back to back (49.5 against 47.4 ms with the output
layer's copy forced; with 7 trials instead of 3, two of three decoders reached 47 ms).
Back to back, the copy still warmed over its first five calls (614, 521, 403, 324, 289 us,
against ``F.linear``'s 559, 356, 323, 320, 321), so a copy needs more reads before it is
timed than a layout's trials should cost. Both together (two untimed reads, then back to
back) still timed every layout above its steady state (``F.linear`` 450-560 us in the
trials against ~300 later): every product of the decoder is in its trials in the same
first steps, reading its weight and its copy, so the trials run amid more memory traffic
than any later step. Next: trials that do not coincide, or a second look once settled.

Why by hand: no library picks among equivalent layouts of one CPU product at run time
(``torch.backends.cudnn.benchmark`` does it for CUDA convolutions; ``torch.compile``'s
max-autotune generates kernels, at seconds of compilation per shape, measured not to pay
here: ``dynaseq.models.lean``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

T = TypeVar("T")


def rows_class(rows: int) -> int:
    """The size class of a call of ``rows`` rows: 1, 2, then the next power of two (a
    decode whose batch shrinks row by row tries each class once, not each count)."""
    assert rows >= 1, "a product of no rows is never timed"
    return 1 << (rows - 1).bit_length()


def call_key(rows: int) -> tuple[int, int]:
    """A call's key: its rows' size class and the intra-op threads, which change the
    fastest layout too."""
    return rows_class(rows), torch.get_num_threads()


class Layouts:
    """The choice among ``n`` equivalent layouts of one product, per call key.

    ``trial(key, run, *args)`` runs ``run(i, *args)`` with the layout ``i`` that has been
    timed least at ``key`` (ties: the lowest index) and times it; once every layout has
    :attr:`TRIALS` times at ``key``, :attr:`chosen` ``[key]`` is the one with the least
    median and the caller runs it without timing. ``clock``: seconds, monotonic (a test's
    fake clock). Concurrent callers may add a time or two more; the choice stays one of the
    layouts, each of which computes the same map.
    """

    TRIALS = 3

    def __init__(self, n: int, clock: Callable[[], float] = time.perf_counter) -> None:
        if n < 1:
            raise ValueError(f"a product has at least one layout, got {n}")
        self.n, self.clock = n, clock
        self.chosen: dict[Hashable, int] = {}
        self._times: dict[Hashable, list[list[float]]] = {}

    def trial(self, key: Hashable, run: Callable[..., T], *args: object) -> T:
        """``run(i, *args)`` for the next layout ``i`` to time at ``key`` (one layout: no
        timing, it is chosen at once)."""
        if self.n == 1:
            self.chosen[key] = 0
            return run(0, *args)
        times = self._times.setdefault(key, [[] for _ in range(self.n)])
        i = min(range(self.n), key=lambda j: len(times[j]))
        start = self.clock()
        out = run(i, *args)
        times[i].append(self.clock() - start)
        if all(len(t) >= self.TRIALS for t in times):
            medians = [statistics.median(t) for t in times]
            self.chosen[key] = medians.index(min(medians))
            self._times.pop(key, None)
        return out

    def run(self, key: Hashable, run: Callable[..., T], *args: object) -> T:
        """``run(i, *args)`` with ``key``'s chosen layout, or as the next :meth:`trial`."""
        i = self.chosen.get(key)
        return self.trial(key, run, *args) if i is None else run(i, *args)

    @property
    def settled(self) -> bool:
        """No key is in trials."""
        return not self._times
