"""Prometheus metrics of one server instance (``/metrics``).

Every collector lives in the :class:`ServerMetrics` object's own ``CollectorRegistry``:
nothing is registered in ``prometheus_client``'s global registry, so two apps in one process
(tests) count separately.

With ``dynaseq serve --workers N`` (N > 1) every worker process counts into
``prometheus_client``'s multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, a directory the
parent creates before the workers import ``prometheus_client`` and removes when they have
exited), and ``/metrics`` -- whichever worker answers it -- renders their sum: counters and
histograms summed over every worker that ran, the queue-depth gauge summed over the live
ones.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0,
                   5.0, 10.0)
COMPUTE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    """The server's counters, gauges and histograms, in one registry per instance.

    multiprocess: render the sum over every process counting into
        ``PROMETHEUS_MULTIPROC_DIR`` (which must be set before ``prometheus_client`` is
        imported, so that the values live in its files) instead of this instance alone.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, multiprocess: bool = False) -> None:
        self.multiprocess = multiprocess
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("dynaseq_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.lines = Counter("dynaseq_lines", "input lines served, by the budget they ran at",
                             ["endpoint", "budget"], registry=r)
        self.latency = Histogram("dynaseq_request_latency_seconds",
                                 "server-side latency of answered requests, per budget",
                                 ["endpoint", "budget"], buckets=LATENCY_BUCKETS, registry=r)
        self.compute = Histogram("dynaseq_realized_compute_fraction",
                                 "realized compute of each served line (fraction of every "
                                 "gate on)", ["endpoint", "budget"], buckets=COMPUTE_BUCKETS,
                                 registry=r)
        self.queue_rows = Gauge("dynaseq_queue_depth_lines", "lines waiting for a batch",
                                registry=r, multiprocess_mode="livesum")
        self.in_flight = Gauge("dynaseq_in_flight_requests", "requests to the task's "
                               "endpoints being handled", registry=r,
                               multiprocess_mode="livesum")
        self.in_flight_limit = Gauge("dynaseq_in_flight_limit", "the --max-in-flight cap, "
                                     "summed over the live workers (+Inf: none)", registry=r,
                                     multiprocess_mode="livesum")
        self.batch_rows = Histogram("dynaseq_batch_lines", "lines per batch run",
                                    ["endpoint"], buckets=BATCH_BUCKETS, registry=r)
        self.batch_budgets = Histogram("dynaseq_batch_distinct_budgets",
                                       "distinct budgets per batch run", ["endpoint"],
                                       buckets=(1, 2, 3, 4, 6, 8), registry=r)
        self.batch_failures = Counter("dynaseq_batch_failures", "batches that raised",
                                      ["endpoint"], registry=r)
        self.degraded = Counter("dynaseq_degraded", "deadline requests run below the largest "
                                "budget", ["endpoint"], registry=r)
        self.rejected = Counter("dynaseq_rejected", "requests refused for load (503)",
                                ["endpoint", "reason"], registry=r)
        self.cancelled = Counter("dynaseq_cancelled", "requests dropped before running "
                                 "because the client disconnected", ["endpoint"], registry=r)
        self._summed: CollectorRegistry | None = None
        if multiprocess:
            self._summed = CollectorRegistry()
            MultiProcessCollector(self._summed)

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector (summed over the worker
        processes in multiprocess mode)."""
        return generate_latest(self._summed if self._summed is not None else self.registry)

    def process_exited(self) -> None:
        """Multiprocess mode: drop this process's live gauges (its queue depth) from the
        sum; its counters and histograms stay counted."""
        if self.multiprocess:
            mark_process_dead(os.getpid())
