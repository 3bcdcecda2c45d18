"""Server settings: one typed dataclass, filled from ``dynaseq serve`` options."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dynaseq.core.config import PRECISIONS
from dynaseq.core.errors import DynaseqError

BATCH_MARGINS = ("admission", "formation", "risk")
"""The margin a batch's own deadline lines keep when their budget is chosen again as the
batch is formed: ``admission``, the errors of the predictions made on arrival; or
``formation``, those of the predictions made as batches were formed (see
:class:`~dynaseq.serve.batcher.Batcher`); or ``risk``, no margin, but a budget whose
expected share of late lines, each line's chance read from the formation errors at its
slack, is above :data:`LATE_TOLERANCE` is passed over
(:meth:`~dynaseq.serve.policy.DeadlinePolicy.batch_budget`). The lines queued behind keep
the admission margin in every mode."""

LATE_TOLERANCE = 0.01
"""``batch_margin="risk"``: the expected share of a batch's deadline lines answered late
that a budget may carry (the 1% that a 99%-in-time target leaves)."""

OVERLOAD_ACTIONS = ("reject", "smallest")
"""What a deadline request that no budget can meet gets: ``reject`` (503 with
``Retry-After``) or ``smallest`` (run at the fastest budget, normally the smallest,
late)."""


@dataclass(frozen=True)
class ServeConfig:
    """How ``dynaseq serve`` batches, limits and schedules requests.

    host, port: where uvicorn listens.
    batch_window_ms: a batch waits at most this long after its first request for more
        requests to join it (0: run what is queued at once).
    max_batch_rows: lines per batch at most (a request's lines are never split).
    max_queue_rows: lines waiting at most; beyond, requests get 503 + ``Retry-After``.
    max_in_flight: requests to the task's endpoints handled at once at most (None: no
        limit); one more gets 503 + ``Retry-After`` before its body is read or parsed.
    max_body_bytes, max_lines, max_line_chars, max_tokens: per-request limits (413/422);
        a body is measured as it arrives, chunked or not.
    body_timeout_s: a request body's next bytes must arrive within this many seconds, else
        408 (a client that sends half a body holds no slot of ``max_in_flight`` forever).
    beam: beam size for translation (None: the run's ``decode.beam``).
    overload: ``reject`` or ``smallest`` (see :data:`OVERLOAD_ACTIONS`).
    slack: a deadline request's predicted completion must be within ``slack × deadline``.
    batch_margin: ``admission``, ``formation`` or ``risk`` (see :data:`BATCH_MARGINS`).
    max_utilization: a batch's deadline lines (a continuous decode's: each request's, as
        the decode takes it) run at a budget other than the smallest only
        if the recent arrival rate x that budget's time per line in a full batch, at the
        recent lines' mean source length, is at most this (None: no such limit;
        :meth:`~dynaseq.serve.policy.DeadlinePolicy.utilization`): near saturation, time
        spent on larger budgets is time the queue does not get back.
    retry_after_min_s: the smallest ``Retry-After`` sent.
    report_compute: measure each translated line's realized compute (one teacher-forced
        pass over the batch's outputs; off: responses carry no ``compute``).
    access_log: write one JSON line per request to stderr.
    max_generate_tokens: largest ``tokens`` a generate request may ask for.
    default_budget: what a request with neither ``budget`` nor ``deadline_ms`` runs at
        (None: the largest trained budget).
    early_answers: answer each translation request as soon as its own lines are done, while
        its batch decodes the others (False: when the batch ends).
    batch_by_budget: when more lines of one kind are queued than a batch holds, a batch
        takes the oldest request's budget's requests (at least half a batch of them), not
        every budget in arrival order (``Batcher.by_budget``).
    scale_by_size: predictions run at the measured real ÷ predicted time of batches of
        their own size class (powers of two of the lines), not at one factor for every
        batch (:class:`~dynaseq.serve.scales.BatchScales`).
    batch_nice: how much lower the batch thread's scheduling priority is than the event
        loop's (Linux: its nice value, raised by this much; 0: the same), so that where they
        share a core requests are read and answered while a batch decodes.
    workers: server processes answering on the one port (uvicorn's workers, each with its
        own copy of the model and its own batcher); above 1, ``/metrics`` sums them and
        each access-log line carries the ``pid`` of the worker that answered.
    precision: the model's, ``fp32`` or ``bf16`` (``dynaseq.load``'s ``precision``); a
        deadline server warns when its latency table was measured at another.
    continuous: translation decodes greedily with continuous batching: a finished line's
        row is taken over by a queued line at the next step, so a batch never runs out to
        its longest output (:func:`~dynaseq.serve.endpoints.run_translate_continuous`).
        Deadlines are planned for its rows (:class:`~dynaseq.serve.row_policy.RowPolicy`).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    batch_window_ms: float = 5.0
    max_batch_rows: int = 32
    max_queue_rows: int = 4096
    max_in_flight: int | None = None
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 10.0
    max_lines: int = 32
    max_line_chars: int = 2000
    max_tokens: int = 4096
    beam: int | None = None
    overload: str = "reject"
    slack: float = 0.9
    batch_margin: str = "formation"
    max_utilization: float | None = None
    retry_after_min_s: int = 1
    report_compute: bool = True
    access_log: bool = True
    max_generate_tokens: int = 512
    default_budget: float | tuple[float, float] | None = None
    workers: int = 1
    early_answers: bool = True
    batch_nice: int = 10
    batch_by_budget: bool = True
    scale_by_size: bool = False
    precision: str = "fp32"
    continuous: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise DynaseqError(f"--port must be in [0, 65535], got {self.port}")
        if not self.host.strip():
            raise DynaseqError("--host must name an address (0.0.0.0 for every interface)")
        if self.batch_window_ms < 0:
            raise DynaseqError("--batch-window-ms must be >= 0")
        if not 0 < self.body_timeout_s < math.inf:
            raise DynaseqError(f"--body-timeout-s must be a positive number of seconds, got "
                               f"{self.body_timeout_s}")
        for name in ("max_batch_rows", "max_queue_rows", "max_body_bytes", "max_lines",
                     "max_line_chars", "max_tokens", "retry_after_min_s",
                     "max_generate_tokens", "workers"):
            if getattr(self, name) < 1:  # named as the command line names it
                flag = name.replace("_rows", "_lines").replace("_", "-")
                raise DynaseqError(f"--{flag} must be >= 1")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise DynaseqError("--max-in-flight must be >= 1")
        if self.precision not in PRECISIONS:
            raise DynaseqError(f"--precision must be fp32 or bf16, got {self.precision!r}")
        if not 0 <= self.batch_nice <= 19:
            raise DynaseqError(f"--batch-nice must be in [0, 19], got {self.batch_nice}")
        if self.beam is not None and self.beam < 1:
            raise DynaseqError("--beam must be >= 1")
        if self.overload not in OVERLOAD_ACTIONS:
            raise DynaseqError(f"--overload must be one of {', '.join(OVERLOAD_ACTIONS)}")
        if self.batch_margin not in BATCH_MARGINS:
            raise DynaseqError(f"--batch-margin must be one of {', '.join(BATCH_MARGINS)}")
        if self.max_utilization is not None and self.max_utilization <= 0:
            raise DynaseqError("--max-utilization must be > 0")
        if not 0 < self.slack <= 1:
            raise DynaseqError("--slack must be in (0, 1]")
        if self.max_lines > self.max_queue_rows:  # such a request could never be queued
            raise DynaseqError(f"--max-lines ({self.max_lines}) must not exceed "
                               f"--max-queue-lines ({self.max_queue_rows})")
        if self.scale_by_size and self.continuous:
            raise DynaseqError("--scale-by-size plans batches by their size; a continuous "
                               "decode (--continuous) plans rows: give one of them")
        if self.max_lines > self.max_batch_rows:
            raise DynaseqError(f"--max-lines ({self.max_lines}) must not exceed "
                               f"--max-batch-lines ({self.max_batch_rows})")
