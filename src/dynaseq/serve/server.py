"""``dynaseq serve RUN``: bind the address, load the run, build the app, run uvicorn until
SIGTERM/SIGINT.

The socket is bound first (:func:`bind`: an address in use is one error line before the
model loads) and listens only once the model is loaded and warm; the ``ready`` record of
the access log names the address (with ``--port 0``, the port the system chose).
uvicorn's graceful shutdown stops accepting connections and waits for the requests in
flight; the app's shutdown then drains the batcher (every queued batch still runs), so a
SIGTERM answers everything already received; uvicorn then re-raises the signal, so one
server process exits by it (status 143 for SIGTERM).

``--workers N`` (N > 1): the parent binds the port, checks the run and the options once
(loading the model, then freeing it), creates a ``PROMETHEUS_MULTIPROC_DIR`` and starts N
uvicorn worker processes (:class:`uvicorn.supervisors.Multiprocess`, spawned) on the one
socket; each builds its own app from :func:`worker_app`, reading what to serve from the
environment variable :data:`WORKER_ENV`. uvicorn's supervisor restarts a worker that dies.
On SIGTERM or SIGINT the parent closes its copy of the socket (new connections are
refused), passes SIGTERM to every worker, each drains as above, and once all have exited
the parent removes the metrics directory and exits 0.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import user_path
from dynaseq.serve.config import ServeConfig

WORKER_ENV = "DYNASEQ_SERVE_WORKER"
"""The environment variable that tells a worker process what to serve (JSON: the run,
checkpoint, device, latency table, torch threads and the :class:`ServeConfig` fields)."""

WORKER_HEALTHCHECK_S = 30
"""How long uvicorn's supervisor waits for a worker to answer its liveness ping before it
kills and replaces it (uvicorn's default, 5 s, is short for a CPU busy decoding)."""


def default_threads(workers: int) -> int:
    """Torch threads per worker when ``--threads`` is not given and ``workers`` > 1: the
    cores this process may run on, shared out (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // workers)


def _build_state(run_dir: str | Path, config: ServeConfig, checkpoint: str, device: str,
                 latency_table: str | Path | None, warn: bool = True) -> Any:
    """Load the run and build the server state (every check of the run and the options)."""
    from dynaseq.serve.app import _warn_stale_table, build_state, load_table
    from dynaseq.tasks.registry import load, run_kind

    run_dir = user_path(run_dir)  # the latency table is looked for where the run is
    kind = run_kind(run_dir)
    predictor = load(run_dir, checkpoint=checkpoint, device=device, precision=config.precision)
    table = load_table(run_dir, latency_table) if kind in ("seq2seq", "classify") else None
    if latency_table is not None and table is None:
        raise DynaseqError("--latency-table is for translation and classification runs")
    if warn:
        _warn_stale_table(table, predictor, config.precision, run_dir)
    return build_state(predictor, kind, config, table, run_dir=str(run_dir))


def serve(run_dir: str | Path, config: ServeConfig, checkpoint: str = "auto",
          device: str = "auto", latency_table: str | Path | None = None,
          threads: int | None = None) -> int:
    """Serve ``run_dir`` until stopped; returns the exit status (one process: it exits by
    the signal once drained; ``config.workers`` > 1: 0 once every worker has drained)."""
    import torch
    import uvicorn

    from dynaseq.serve.app import build_app

    if threads is not None:
        if threads < 1:
            raise DynaseqError("--threads must be >= 1")
        torch.set_num_threads(threads)
    if config.workers > 1:
        return _serve_workers(run_dir, config, checkpoint, device, latency_table,
                              threads or default_threads(config.workers))
    sock = bind(config)  # before the model loads: a port in use costs no start-up
    try:
        config = dataclasses.replace(config, port=sock.getsockname()[1])  # --port 0: chosen
        state = _build_state(run_dir, config, checkpoint, device, latency_table)
        app = build_app(state)
        freeze_heap()
        server = uvicorn.Server(uvicorn.Config(
            app, host=config.host, port=config.port, log_level="warning", access_log=False,
            lifespan="on", timeout_graceful_shutdown=None))
        # SIGHUP (a closed terminal, a "reload") drains as SIGTERM does while it serves; its
        # default ended the process at once, dropping the requests in flight (with
        # --workers, uvicorn restarts the workers one by one on it)
        main = threading.current_thread() is threading.main_thread()  # (signals: main only)
        hup = (signal.signal(signal.SIGHUP, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
               if main else None)
        try:
            server.run(sockets=[sock])
        except SystemExit as e:  # uvicorn exits 3 when the app fails to start, 1 to listen
            raise DynaseqError(f"the server on {config.host}:{config.port} failed to start "
                               f"(status {e.code}; the reason is above)") from None
        finally:
            if main:
                signal.signal(signal.SIGHUP, hup)
    finally:
        sock.close()
    if not server.started:
        print(f"dynaseq: error: cannot serve on {config.host}:{config.port}", file=sys.stderr)
        return 2
    return 0


def bind(config: ServeConfig) -> socket.socket:
    """A socket bound to ``config.host``/``config.port`` (not yet listening: connections are
    refused until the server is warm and serves); a DynaseqError naming the address and the
    reason when it cannot be bound (in use, not this machine's, no permission). Bound with
    ``SO_REUSEADDR``, as uvicorn binds (a restart need not wait out the old connections),
    two servers started at once on one port can both bind; the second then fails when it
    starts listening, after loading, with one error line."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family=family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except (OSError, OverflowError) as e:
        sock.close()
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise DynaseqError(f"cannot serve on {config.host}:{config.port}: {reason}") from None
    sock.set_inheritable(True)  # --workers: the spawned workers serve on it
    return sock


def _serve_workers(run_dir: str | Path, config: ServeConfig, checkpoint: str, device: str,
                   latency_table: str | Path | None, threads: int) -> int:
    """``--workers N``: bind, check once here, then N uvicorn worker processes on the one
    socket."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    sock = bind(config)
    metrics_dir = None
    saved = {k: os.environ.get(k) for k in (WORKER_ENV, "PROMETHEUS_MULTIPROC_DIR")}
    try:
        config = dataclasses.replace(config, port=sock.getsockname()[1])  # --port 0: chosen
        # every refusal of one server, here, before a worker starts (one line, exit 2)
        _build_state(run_dir, dataclasses.replace(config, workers=1), checkpoint, device,
                     latency_table)
        gc.collect()  # the checked model is not kept: each worker loads its own
        spec = {"run_dir": str(run_dir), "checkpoint": checkpoint, "device": device,
                "latency_table": None if latency_table is None else str(latency_table),
                "threads": threads, "config": dataclasses.asdict(config)}
        uv = uvicorn.Config(
            "dynaseq.serve.server:worker_app", factory=True, host=config.host,
            port=config.port, workers=config.workers, log_level="warning", access_log=False,
            lifespan="on", timeout_graceful_shutdown=None,
            timeout_worker_healthcheck=WORKER_HEALTHCHECK_S)
        metrics_dir = tempfile.mkdtemp(prefix=f"dynaseq-metrics-{os.getpid()}-")
        os.environ[WORKER_ENV] = json.dumps(spec)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by the spawned workers
        supervisor = _supervisor(uv, [sock])
        supervisor.run()
    finally:
        sock.close()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if any(p.exitcode == STARTUP_FAILURE for p in supervisor.processes):
        raise DynaseqError("a worker process failed to start (its error is above)")
    return 0


def _supervisor(config: Any, sockets: list[socket.socket]) -> Any:
    """uvicorn's :class:`~uvicorn.supervisors.Multiprocess`, with three changes.

    * On SIGTERM or SIGINT it closes the parent's copy of the listening socket. Each worker
      closes its own when it starts draining; the parent's kept the socket listening, so
      connections made after the signal were queued by the kernel, never accepted, and reset
      when the parent exited. Now they are refused at once, as by one server process.
    * A worker that is gone (killed, crashed) leaves ``/metrics``' live sums
      (``mark_process_dead``): its queue depth, requests in flight and in-flight limit were
      summed for the rest of the server's life (a limit of 8 read 20 after three kills).
    * A worker that dies while it is being pinged is seen within half a second: the
      parent holds both ends of the ping's pipe, so no end-of-file came, and it waited out
      the whole :data:`WORKER_HEALTHCHECK_S` (30 s) with no worker replaced and signals
      unhandled."""
    from prometheus_client.multiprocess import mark_process_dead
    from uvicorn.supervisors import Multiprocess

    class Supervisor(Multiprocess):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.known: set[int] = set()  # the workers' pids at the last look

        def keep_subprocess_alive(self) -> None:
            for p in self.processes:
                if hasattr(p, "_healthcheck") and hasattr(p, "parent_conn"):  # uvicorn's
                    p._healthcheck = functools.partial(_ping_while_alive, p)
            super().keep_subprocess_alive()
            # gone since: replaced here, or by a restart on SIGHUP, or dropped on SIGTTOU
            now = {p.pid for p in self.processes if p.pid is not None}
            for pid in self.known - now:
                mark_process_dead(pid)
            self.known = now

        def handle_term(self) -> None:
            _close_all(self.sockets)
            super().handle_term()

        def handle_int(self) -> None:
            _close_all(self.sockets)
            super().handle_int()

    return Supervisor(config, sockets=sockets)


def _ping_while_alive(process: Any, timeout: float) -> bool | None:
    """uvicorn's worker health check (ping, then the worker's answer: its start-up flag;
    None when none comes within ``timeout`` seconds), waiting in half-second slices and
    giving up as soon as the worker process is gone."""
    conn = process.parent_conn
    try:
        conn.send(b"ping")
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if conn.poll(min(left, 0.5)):
                return conn.recv()
            if not process.process.is_alive():
                return None
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    return None


def _close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def worker_app() -> Any:
    """The app of one worker process (uvicorn's factory, called in the worker): loads the
    run named by :data:`WORKER_ENV`. A failure is one line on stderr and uvicorn's
    start-up failure status, which stops the parent (it would fail again on a restart)."""
    import torch
    from tqdm import tqdm
    from uvicorn.config import STARTUP_FAILURE

    from dynaseq.serve.app import build_app

    # a spawned worker's default multiprocessing context is spawn, where tqdm's default
    # lock is a named semaphore that a worker ending by SIGTERM leaves to the resource
    # tracker ("leaked semaphore objects"); the decoder's (hidden) bars need a thread lock
    tqdm.set_lock(threading.RLock())
    try:
        spec = json.loads(os.environ[WORKER_ENV])
        fields = spec["config"]
        if isinstance(fields.get("default_budget"), list):  # JSON has no tuples
            fields["default_budget"] = tuple(fields["default_budget"])
        torch.set_num_threads(spec["threads"])
        state = _build_state(spec["run_dir"], ServeConfig(**fields), spec["checkpoint"],
                             spec["device"], spec["latency_table"], warn=False)
    except Exception as e:  # noqa: BLE001 -- any failure: one line, then stop the parent
        print(f"dynaseq: error: worker {os.getpid()}: {' '.join(str(e).split())}",
              file=sys.stderr, flush=True)
        sys.exit(STARTUP_FAILURE)
    app = build_app(state)
    freeze_heap()
    return app


def freeze_heap() -> None:
    """Move every object the server process holds once loaded (the model, torch, the app)
    out of the cyclic garbage collector's reach (``gc.freeze``), so that a full collection
    scans only what requests create. Called once per server process, after loading and
    before serving. Measured under 370 classify requests a second on one core: without it,
    full collections paused the process for 100-113 ms, twice in 6 s, and each pause made a
    whole batch of deadline requests late."""
    gc.collect()
    gc.freeze()
