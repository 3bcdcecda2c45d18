"""``dynaseq serve``: a budget-aware HTTP inference server.

One module per concept: :mod:`~dynaseq.serve.config` (settings), :mod:`~dynaseq.serve.schemas`
(request/response bodies), :mod:`~dynaseq.serve.endpoints` (what each task kind serves),
:mod:`~dynaseq.serve.compute` (each line's realized compute, as answers report it),
:mod:`~dynaseq.serve.batcher` (dynamic batching with mixed budgets, one worker thread),
:mod:`~dynaseq.serve.policy` (deadline -> budget from the run's latency table),
:mod:`~dynaseq.serve.metrics` (Prometheus), :mod:`~dynaseq.serve.app` (the FastAPI app) and
:mod:`~dynaseq.serve.server` (uvicorn, graceful drain, ``--workers``). See ``docs/serving.md``.
"""

from dynaseq.serve.config import ServeConfig

__all__ = ["ServeConfig"]
