"""``dynaseq serve RUN``: load the run, build the app, run uvicorn until SIGTERM/SIGINT.

uvicorn's graceful shutdown stops accepting connections and waits for the requests in
flight; the app's shutdown then drains the batcher (every queued batch still runs), so a
SIGTERM answers everything already received before the process exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dynaseq.core.errors import DynaseqError
from dynaseq.serve.config import ServeConfig


def serve(run_dir: str | Path, config: ServeConfig, checkpoint: str = "auto",
          device: str = "auto", latency_table: str | Path | None = None,
          threads: int | None = None) -> int:
    """Serve ``run_dir`` until stopped; returns the exit status (0 after a clean drain)."""
    import torch
    import uvicorn

    from dynaseq.serve.app import _warn_checkpoint, build_app, build_state, load_table
    from dynaseq.tasks.registry import load, run_kind

    if threads is not None:
        if threads < 1:
            raise DynaseqError("--threads must be >= 1")
        torch.set_num_threads(threads)
    kind = run_kind(run_dir)
    predictor = load(run_dir, checkpoint=checkpoint, device=device)
    table = load_table(run_dir, latency_table) if kind == "seq2seq" else None
    if latency_table is not None and kind != "seq2seq":
        raise DynaseqError("--latency-table is for translation runs")
    _warn_checkpoint(table, predictor)
    state = build_state(predictor, kind, config, table, run_dir=str(run_dir))
    app = build_app(state)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level="warning", access_log=False,
        lifespan="on", timeout_graceful_shutdown=None))
    try:
        server.run()
    except SystemExit as e:  # uvicorn exits 1 when it cannot bind
        raise DynaseqError(f"cannot serve on {config.host}:{config.port}") from e
    if not server.started:
        print(f"dynaseq: error: cannot serve on {config.host}:{config.port}", file=sys.stderr)
        return 2
    return 0
