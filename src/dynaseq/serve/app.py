"""The FastAPI application of ``dynaseq serve``: one loaded predictor, its task's endpoints
(:data:`~dynaseq.serve.endpoints.TASK_ENDPOINTS`), ``/healthz``, ``/readyz``, ``/metrics``.

Every refusal is ``{"error": "one line"}``: 400 malformed JSON or an empty body, 408 a body
that stalls (``--body-timeout-s``), 413 a body (measured as it arrives, chunked or not),
line count, line or token count over its limit, 422 a wrong type, an unknown field, an
untrained budget (naming the trained ones), a budget for a model without one, a deadline
<= 0 or one this run cannot plan, a line the task cannot read, 503 with ``Retry-After``
when the queue is full, too many requests are in flight or no budget meets a deadline,
500 when the request's batch raised (the next batch runs). The server keeps no state
between requests: worker processes on one port (``dynaseq serve --workers N``) or replicas
behind any load balancer serve alike.

Example::

    state = build_state(dynaseq.load("runs/demo/run"), "seq2seq", ServeConfig())
    app = build_app(state)      # uvicorn.run(app) -- or: dynaseq serve runs/demo/run
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dynaseq.core.errors import DynaseqError
from dynaseq.metrics.latency_table import LatencyTable
from dynaseq.serve import endpoints as ep
from dynaseq.serve.batcher import Batcher, BudgetParts, Job, QueueFull, Shed
from dynaseq.serve.config import ServeConfig
from dynaseq.serve.metrics import ServerMetrics
from dynaseq.serve.policy import DeadlinePolicy
from dynaseq.serve.row_policy import RowPolicy
from dynaseq.serve.schemas import ErrorResponse, one_line
from dynaseq.tasks.translation.predictor import check_decode


class AccessLog:
    """One JSON object per line (request id, time, method, path, status, latency, lines,
    budget, degraded, error) on ``stream``; thread-safe. ``extra`` is added to every line
    (a worker's ``pid`` when several serve one port)."""

    def __init__(self, stream: TextIO | None, extra: dict[str, Any] | None = None) -> None:
        self.stream = stream
        self.extra = extra or {}
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        if self.stream is None:
            return
        line = json.dumps({**record, **self.extra}, separators=(",", ":"), default=str)
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()


@dataclass
class ServeState:
    """Everything one app instance holds: the predictor and its kind, settings, metrics,
    the batcher and the deadline policy (None without a latency table). Nothing here
    changes between requests except the queue, the counters and ``in_flight`` (the
    requests being handled, changed only on the event loop's thread)."""

    predictor: Any
    kind: str
    config: ServeConfig
    metrics: ServerMetrics
    batcher: Batcher
    policy: DeadlinePolicy | None
    beam: int
    default_budget: Any
    budgets: list[BudgetParts]
    log: AccessLog
    run_dir: str = ""
    draining: bool = False
    lm_compute: dict[str, Any] | None = None
    in_flight: int = 0
    run_translate: Callable[[list[Job]], list[Any]] | None = None
    run_generate: Callable[[list[Job]], list[Any]] | None = None
    run_score: Callable[[list[Job]], list[Any]] | None = None
    run_classify: Callable[[list[Job]], list[Any]] | None = None
    _requests: int = field(default=0, repr=False)

    def budget_ran(self, budget: Any) -> BudgetParts | None:
        """The budget a request's ``budget`` runs at (:data:`~dynaseq.serve.endpoints.
        BUDGET_RAN`); DynaseqError for one the run has not trained or calibrated."""
        return ep.BUDGET_RAN[self.kind](self.predictor, budget)


def _trained_budgets(predictor: Any) -> list[BudgetParts]:
    """The trained and calibrated budgets (a translation's pairs, an encoder's ``(b,)``)."""
    cct = getattr(getattr(predictor.config, "model", None), "cct", None)
    if cct is None:
        return []
    budgets = [*cct.controls, *(c.budget for c in getattr(predictor, "calibrations", []))]
    return list(dict.fromkeys(tuple(float(x) for x in (b if isinstance(b, tuple) else (b,)))
                              for b in budgets))


def build_state(predictor: Any, kind: str, config: ServeConfig,
                table: LatencyTable | None = None, run_dir: str = "",
                log_stream: TextIO | None = sys.stderr) -> ServeState:
    """The state of one server: checks the settings against the run (default budget
    trained, latency table at the server's beam) and builds the batcher and the policy."""
    if kind not in ep.TASK_ENDPOINTS:
        raise DynaseqError(f"no endpoints serve a {kind} run (served: "
                           f"{', '.join(ep.TASK_ENDPOINTS)})")
    metrics = ServerMetrics(multiprocess=config.workers > 1)
    budgets = _trained_budgets(predictor) if kind in ep.BUDGET_RAN else []
    beam = config.beam or (predictor.config.decode.beam if kind == "seq2seq" else 1)
    if kind == "seq2seq":  # refused here, in one line, not by the warm-up inside uvicorn
        check_decode(predictor.model, beam, predictor.config.decode.length_penalty)
    default_budget = config_default_budget(predictor, kind, config)
    if config.continuous:
        if kind != "seq2seq":
            raise DynaseqError("--continuous is for translation runs")
        if beam != 1:
            raise DynaseqError(f"--continuous decodes greedily: serve with --beam 1 (this "
                               f"run decodes at beam {beam})")
        if predictor.lean_decoder() is None:
            raise DynaseqError("--continuous needs a model with a lean decoding step (MoE, "
                               "int8 CCT and relative-position models have none)")
        if not config.early_answers:
            raise DynaseqError("--answer-at-batch-end: a continuous batch never ends; each "
                               "request is answered as its own lines end")
    policy = None
    if table is not None and kind in ("seq2seq", "classify"):
        if kind == "seq2seq" and table.beam != beam:
            raise DynaseqError(f"the latency table was measured at beam {table.beam}, the "
                               f"server decodes at beam {beam}: serve with --beam "
                               f"{table.beam} or run dynaseq profile RUN --latency-table "
                               f"--beam {beam}")
        dense = (1.0, 1.0) if kind == "seq2seq" else (1.0,)
        usable = [b for b in (budgets or [dense]) if table.has(b)]
        if not usable:
            raise DynaseqError("the latency table holds none of the run's budgets: run "
                               "dynaseq profile RUN --latency-table again")
        # answered as its own lines end, unless beam search's gates decide (run_translate)
        # (a classify batch answers every line at once)
        early = kind == "seq2seq" and config.early_answers and (
            beam == 1 or predictor.model.n_controls == 0)
        # a continuous decode's lines take rows as they free up (serve/row_policy.py)
        kind_of_policy = RowPolicy if config.continuous else DeadlinePolicy
        policy = kind_of_policy(table, usable, config.max_batch_rows, config.batch_window_ms,
                                config.slack, config.overload, config.retry_after_min_s,
                                early_answers=early)

    def estimate(jobs: list[Job]) -> float:
        if policy is None:
            return 0.0
        works = [j.work(policy.largest) for j in jobs]
        return policy.batch_ms([w for w in works if policy.table.has(w.budget)])

    batcher = Batcher(metrics, config.batch_window_ms, config.max_batch_rows,
                      config.max_queue_rows, estimate, nice=config.batch_nice,
                      by_budget=config.batch_by_budget, scale_by_size=config.scale_by_size)
    log = AccessLog(log_stream if config.access_log else None,
                    {"pid": os.getpid()} if config.workers > 1 else None)
    state = ServeState(predictor, kind, config, metrics, batcher, policy, beam, default_budget,
                       budgets, log, run_dir=run_dir)
    if kind == "seq2seq" and config.continuous:
        line_ms = None
        if isinstance(policy, RowPolicy):
            def line_ms(budget: BudgetParts | None, length: int) -> float:
                return policy.held_ms(budget, length, batcher.running_rows + 1)
        state.run_translate = partial(ep.run_translate_continuous, predictor,
                                      config.report_compute, max_rows=config.max_batch_rows,
                                      all_on={}, clock=batcher, line_ms=line_ms,
                                      retry_after_s=config.retry_after_min_s)
    elif kind == "seq2seq":
        state.run_translate = partial(ep.run_translate, predictor, beam, config.report_compute,
                                      retry_after_s=config.retry_after_min_s,
                                      early=config.early_answers, all_on={})
    elif kind == "classify":
        state.run_classify = partial(ep.run_classify, predictor, config.report_compute)
    else:
        state.run_generate = partial(ep.run_generate, predictor)
        state.run_score = partial(ep.run_score, predictor)
        state.lm_compute = ep.lm_compute(predictor)
    return state


def config_default_budget(predictor: Any, kind: str, config: Any) -> Any:
    """The budget a request without ``budget`` or ``deadline_ms`` runs at (checked)."""
    budget = getattr(config, "default_budget", None)
    if budget is not None:
        if kind not in ep.BUDGET_RAN:
            raise DynaseqError("--default-budget is for translation and classification runs")
        ep.BUDGET_RAN[kind](predictor, budget)
    return budget


def _error(status: int, message: str, headers: dict[str, str] | None = None,
           reason: str | None = None) -> JSONResponse:
    body = {"error": " ".join(str(message).split())}
    if reason is not None:
        body["reason"] = reason
    return JSONResponse(body, status_code=status, headers=headers)


class _BodyRefused(Exception):
    """Raised into the app by :class:`BodyLimit`'s ``receive``: the body is refused."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413, one whose next bytes
    do not arrive within ``timeout_s`` seconds 408. A ``Content-Length`` over the limit is
    refused before the body is read; a chunked body (or one longer than it said) is counted
    as it arrives and refused at the first chunk past the limit, so no more of it is read
    or parsed. A client that leaves before its body is in is logged 499, as one that leaves
    while its request runs (before: 400, the app's answer to a body that ended short). The
    refusal replaces whatever the app answers (it sees the body end in an error and answers
    400 or 500, which is dropped)."""

    def __init__(self, app: Any, limit: int, timeout_s: float) -> None:
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    n = -1
                if n > self.limit or n < 0:
                    await self._refuse(scope, receive, send, _BodyRefused(
                        413 if n >= 0 else 400,
                        f"body of {n} bytes; the limit is {self.limit}" if n >= 0
                        else "bad Content-Length"))
                    return
        seen = {"bytes": 0, "done": False, "refused": None}

        async def body_receive() -> dict:
            if seen["done"]:  # the body is in: waiting for a disconnect, unbounded
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:  # TimeoutError from 3.11 on; not on 3.10
                seen["refused"] = _BodyRefused(408, f"the request body stalled: no bytes for "
                                                    f"{self.timeout_s:g} s")
                raise seen["refused"] from None
            if message["type"] == "http.disconnect":  # gone before its body was in
                seen["refused"] = _BodyRefused(499, "the client closed the connection "
                                                    "before its body was in")
                raise seen["refused"]
            if message["type"] == "http.request":
                seen["bytes"] += len(message.get("body", b""))
                seen["done"] = not message.get("more_body", False)
                if seen["bytes"] > self.limit:
                    seen["refused"] = _BodyRefused(413, f"body of more than {self.limit} "
                                                        f"bytes; the limit is {self.limit}")
                    raise seen["refused"]
            return message

        async def app_send(message: dict) -> None:
            if seen["refused"] is None:  # after a refusal the app's own answer is dropped
                await send(message)

        try:
            await self.app(scope, body_receive, app_send)
        except Exception:
            if seen["refused"] is None:
                raise
        # the app may have answered the error itself (FastAPI: 400, dropped) or raised it
        if seen["refused"] is not None:
            await self._refuse(scope, receive, send, seen["refused"])

    @staticmethod
    async def _refuse(scope: dict, receive: Any, send: Any, e: _BodyRefused) -> None:
        scope.setdefault("state", {})["log"] = {"error": str(e)}
        await _error(e.status, str(e))(scope, receive, send)


class InFlightLimit:
    """ASGI middleware: counts the requests to the task's endpoints being handled (read,
    queued, run, answered: ``state.in_flight``) and, with a ``limit`` (``--max-in-flight``;
    None: none), admits at most that many at once; one more gets 503 with ``Retry-After``
    at once, before its body is read, parsed or validated, and counts in
    ``dynaseq_rejected`` (reason ``busy``). Health, readiness and metrics are never refused.

    Under overload a refusal here costs the event loop a header scan instead of a parse,
    a validation and a plan, and the requests it admits wait behind fewer others. The count
    (``state.in_flight``) changes only on the event loop's thread. A request whose client
    went away leaves the count when it is answered 499, though its batch may still be
    running: the cap counts requests, not the model's work."""

    def __init__(self, app: Any, state: ServeState, limit: int | None) -> None:
        self.app, self.state, self.limit = app, state, limit
        self.endpoints = {e.path: e for e in ep.TASK_ENDPOINTS[state.kind]}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        endpoint = (self.endpoints.get(scope.get("path", "")) if scope["type"] == "http"
                    and scope.get("method") == "POST" else None)
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        state, limit = self.state, self.limit
        if limit is not None and state.in_flight >= limit:
            log = scope.setdefault("state", {})["log"] = {}
            resp = _refuse(state, endpoint, log, 503,
                           f"{state.in_flight} requests are in flight (limit {limit})",
                           retry=state.config.retry_after_min_s, reason="busy")
            await resp(scope, receive, send)
            return
        state.in_flight += 1
        state.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            state.in_flight -= 1
            state.metrics.in_flight.dec()


class AccessLogMiddleware:
    """ASGI middleware: times every request, counts it in ``dynaseq_requests`` under its
    endpoint's name, as every metric names it (``translate``; a ``/v1/`` path this server
    does not serve as ``other``: a client cannot add label values) and writes its
    access-log line (with what the endpoint put in ``request.state.log``)."""

    def __init__(self, app: Any, state: ServeState) -> None:
        self.app, self.state = app, state
        self.served = {e.path: e.name for e in ep.TASK_ENDPOINTS[state.kind]}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        scope.setdefault("state", {})["t0"] = t0
        status = {"code": 500}

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            info = scope["state"].get("log", {})
            if path.startswith("/v1/"):
                self.state.metrics.requests.labels(self.served.get(path, "other"),
                                                   str(status["code"])).inc()
            if path not in ("/metrics", "/healthz", "/readyz") or status["code"] >= 400:
                client = scope.get("client")
                self.state.log.write({
                    "ts": round(time.time(), 3), "method": scope.get("method"), "path": path,
                    "status": status["code"],
                    "latency_ms": round(1000 * (time.perf_counter() - t0), 3),
                    "client": client[0] if client else None, **info})


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel ``job`` if the client goes away before it is answered."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


def _route(state: ServeState, endpoint: ep.Endpoint) -> Callable:
    async def handle(request, body):
        t0 = request.state.t0 if hasattr(request.state, "t0") else time.perf_counter()
        log = {"lines": len(body.lines)}
        request.state.log = log
        if state.draining:
            return _refuse(state, endpoint, log, 503, "the server is shutting down",
                           retry=state.config.retry_after_min_s, reason="draining")
        try:
            job = endpoint.plan(state, body)
            if job.deadline_ms is not None:
                job.due = t0 + state.config.slack * job.deadline_ms / 1000.0
                if state.config.overload == "reject":  # no late answers: drop them
                    job.expires = (t0 + (job.deadline_ms - state.batcher.loop_lag_ms)
                                   / 1000.0)
            fut = state.batcher.submit(job)
        except ep.Overloaded as e:
            return _refuse(state, endpoint, log, 503, str(e), retry=e.retry_after_s,
                           reason="deadline")
        except QueueFull as e:
            return _refuse(state, endpoint, log, 503, str(e),
                           retry=state.config.retry_after_min_s, reason="queue")
        except ep.TooLarge as e:
            return _refuse(state, endpoint, log, 413, str(e))
        except DynaseqError as e:
            return _refuse(state, endpoint, log, 422, str(e))
        if job.budget is not None:
            log["budget"] = ep.budget_json(job.budget)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            await asyncio.wait({fut, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not fut.done():  # the client went away: its job is dropped unless running
                job.cancel()
                return _refuse(state, endpoint, log, 499, "the client closed the connection")
            result = fut.result()
        except Shed as e:  # dropped from its batch: it could no longer answer in time
            return _refuse(state, endpoint, log, 503, str(e), retry=e.retry_after_s,
                           reason="late")
        except Exception as e:  # the batch raised: this batch's requests fail, not the server
            msg = f"the batch failed: {type(e).__name__}: {e}"
            return _refuse(state, endpoint, log, 500, msg)
        finally:
            watcher.cancel()
            if not fut.done():
                job.cancel()
        out = endpoint.answer(state, body, job, result)
        done = time.perf_counter()
        latency = done - t0
        label = ep.budget_label(job.budget)
        m = state.metrics
        if job.predicted_ms is not None:
            state.batcher.observe(job.predicted_ms, 1000 * latency)
        if job.formed_due is not None:
            log["formed_late_ms"] = round(1000 * (done - job.formed_due), 1)
            state.batcher.observe_formed(log["formed_late_ms"])
        m.latency.labels(endpoint.name, label).observe(latency)
        m.lines.labels(endpoint.name, label).inc(job.rows)
        if out.get("degraded"):
            m.degraded.labels(endpoint.name).inc()
        computes = out.get("compute")
        for c in (computes if isinstance(computes, list) else [computes]):
            if c and endpoint.realized:
                m.compute.labels(endpoint.name, label).observe(c["fraction"]["total"])
        out.update(latency_ms=round(1000 * latency, 3),
                   queue_ms=round(1000 * ((job.started or done) - job.enqueued), 3),
                   batch_lines=job.batch_rows)
        log.update(degraded=bool(out.get("degraded")), batch_lines=job.batch_rows,
                   queue_ms=out["queue_ms"])
        if job.budget is not None:  # the budget that ran (a deadline's batch may re-plan it)
            log["budget"] = ep.budget_json(job.budget)
        if job.predicted_ms is not None:
            log["predicted_ms"] = round(job.predicted_ms, 1)
        if job.plan is not None:
            log.update(job.plan)
        data = endpoint.response(**out).model_dump(exclude_none=True)
        data.setdefault("budget", None)  # None: the model has no budget knob
        return JSONResponse(data)

    handle.__name__ = endpoint.name
    # real types (this module's annotations are strings): FastAPI reads the body model here
    handle.__annotations__ = {"request": Request, "body": endpoint.request, "return": Any}
    return handle


def _refuse(state: ServeState, endpoint: ep.Endpoint, log: dict, status: int, msg: str,
            retry: int | None = None, reason: str | None = None) -> JSONResponse:
    log["error"] = msg
    if reason is not None:
        state.metrics.rejected.labels(endpoint.name, reason).inc()
    headers = {"Retry-After": str(retry)} if retry is not None else None
    return _error(status, msg, headers, reason)


def build_app(state: ServeState) -> Any:
    """The ASGI app: the task's routes, health, readiness and metrics, wrapped in the body
    limit, the in-flight count and limit (``max_in_flight``) and the access log. Starting
    it starts the batcher; stopping it drains it."""

    async def watch_loop(period: float = 0.01, weight: float = 0.2) -> None:
        """How late the event loop runs a timer: requests waiting for the loop (not yet
        parsed) wait about as long; the deadline policy adds it to its predictions."""
        while True:
            t = time.perf_counter()
            await asyncio.sleep(period)
            lag = max(0.0, 1000 * (time.perf_counter() - t - period))
            b = state.batcher
            b.loop_lag_ms = (1 - weight) * b.loop_lag_ms + weight * lag

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        for endpoint in ep.TASK_ENDPOINTS[state.kind]:  # before ready: not on a request
            if endpoint.warm is not None:
                await asyncio.to_thread(endpoint.warm, state)
        if state.batcher._thread is None:
            state.batcher.start()
        monitor = asyncio.create_task(watch_loop()) if state.policy is not None else None
        state.log.write({"ts": round(time.time(), 3), "event": "ready", "run": state.run_dir,
                         "host": state.config.host, "port": state.config.port,
                         "kind": state.kind,
                         "budgets": [ep.budget_json(b) for b in state.budgets],
                         "deadline_policy": state.policy is not None})
        try:
            yield
        finally:
            state.draining = True
            if monitor is not None:
                monitor.cancel()
            await asyncio.to_thread(state.batcher.stop)
            state.metrics.process_exited()
            state.log.write({"ts": round(time.time(), 3), "event": "stopped"})

    app = FastAPI(title="dynaseq serve", lifespan=lifespan,
                  description="A budget-aware inference server: each request carries its "
                              "compute budget or its deadline.")
    errors = {status: {"model": ErrorResponse} for status in (400, 408, 413, 415, 422, 500, 503)}
    for endpoint in ep.TASK_ENDPOINTS[state.kind]:
        app.post(endpoint.path, response_model=endpoint.response, summary=endpoint.summary,
                 responses=errors, response_model_exclude_none=True)(_route(state, endpoint))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = list(exc.errors())
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media and not _is_json(media):  # a body read as another type: not a JSON one
            msg, status = (f"unsupported Content-Type {media!r}: send a JSON object as "
                           "application/json"), 415
        elif any(e.get("type") == "json_invalid" for e in errs):
            msg, status = "malformed JSON: " + one_line(errs), 400
        elif any(e.get("type") == "missing" and tuple(e.get("loc", ())) == ("body",)
                 for e in errs):
            msg, status = "empty body: send a JSON object", 400
        elif any(e.get("type") in ("model_attributes_type", "model_type", "dict_type")
                 and tuple(e.get("loc", ())) == ("body",) for e in errs):
            # no Content-Type: the body was not read as JSON, whatever it holds
            msg, status = (("no Content-Type: send the JSON object as application/json",
                            415) if not media else
                           ("the body must be a JSON object (Content-Type: "
                            "application/json)", 400))
        else:
            msg, status = one_line(errs), 422
        request.state.log = {"error": msg}
        return _error(status, msg)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        request.state.log = {"error": str(exc.detail)}  # the access log says why, too
        return _error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.get("/healthz", summary="The process is up")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="The model is loaded and requests are accepted")
    async def readyz() -> Response:
        ready = state.batcher.alive and not state.draining
        body = {"ready": ready, "kind": state.kind, "run": state.run_dir,
                "endpoints": [e.path for e in ep.TASK_ENDPOINTS[state.kind]],
                "budgets": [ep.budget_json(b) for b in state.budgets],
                "deadline_policy": state.policy is not None}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        state.metrics.queue_rows.set(state.batcher.queued_rows())
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    cap = state.config.max_in_flight
    state.metrics.in_flight_limit.set(math.inf if cap is None else cap)
    inner = InFlightLimit(BodyLimit(app, state.config.max_body_bytes,
                                    state.config.body_timeout_s), state, cap)
    return AccessLogMiddleware(inner, state)


def _is_json(media: str) -> bool:
    """Whether a Content-Type's media type (lower case, no parameters) names JSON:
    ``application/json`` or a structured ``application/*+json`` (RFC 6839)."""
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


def load_table(run_dir: str | Path, path: str | Path | None) -> LatencyTable | None:
    """The latency table at ``path``, else the run's ``latency_table.json`` if it has one."""
    from dynaseq.metrics.latency_table import LATENCY_TABLE_FILE

    if path is not None:
        return LatencyTable.load(path)
    default = Path(run_dir) / LATENCY_TABLE_FILE
    if default.is_file():
        return LatencyTable.load(default)
    return None


def _same_checkpoint(recorded: str, loaded: Path, run_dir: Path) -> bool:
    """Whether ``recorded``, the checkpoint path a latency table names (as its ``profile``
    was given it: relative to that command's folder, or absolute), is ``loaded``, a
    checkpoint of ``run_dir``: the same folder, or the same path below its run (the run
    named from another folder, or moved)."""
    if Path(recorded).resolve() == loaded.resolve():
        return True
    try:
        below = loaded.resolve().relative_to(run_dir.resolve()).parts
    except ValueError:  # a checkpoint outside its run: only the same folder is it
        return False
    if not below:  # the run is its own checkpoint (an exported model): its name
        return Path(recorded).name == loaded.resolve().name
    return Path(recorded).parts[-len(below):] == below


def _warn_stale_table(table: LatencyTable | None, predictor: Any, precision: str,
                      run_dir: Path) -> None:
    """Warn when the latency table was measured on another checkpoint or precision than
    the server runs: its predicted service times are another model's."""
    if table is None:
        return
    if table.checkpoint and not _same_checkpoint(table.checkpoint,
                                                 Path(predictor.checkpoint), run_dir):
        warnings.warn(f"the latency table was measured on {table.checkpoint}, the server "
                      f"loaded {predictor.checkpoint}", stacklevel=2)
    if table.precision != precision:
        warnings.warn(f"the latency table was measured at precision {table.precision}, the "
                      f"server runs {precision}", stacklevel=2)
