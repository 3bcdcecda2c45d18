"""``dynaseq serve RUN --workers 2`` on 127.0.0.1: two worker processes on one port answer
as the offline Predictor does, requests spread over both, ``/metrics`` sums the workers,
SIGTERM to the parent drains every worker and exits 0, a bad ``--workers`` is refused."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from helpers import free_port, run_cli
from serve_helpers import BUDGETS, Server


def records(server: Server) -> list[dict]:
    return [json.loads(x) for x in server.log_text().splitlines() if x.startswith("{")]


def start(run: Path, log: Path, *args: str) -> Server:
    """A two-worker server, returned once both workers are ready (their ``ready`` lines)."""
    s = Server(run, "--workers", "2", "--beam", "1", *args, log=log)
    deadline = time.monotonic() + 120
    while len({r["pid"] for r in records(s) if r.get("event") == "ready"}) < 2:
        assert time.monotonic() < deadline, s.log_text()
        time.sleep(0.1)
    return s


def metrics_dirs(server: Server) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"dynaseq-metrics-{server.proc.pid}-*"))


def test_two_workers_answer_as_offline_spread_and_sum_their_metrics(serve_run, offline, lines,
                                                                    tmp_path):
    s = start(serve_run, tmp_path / "server.log", "--batch-window-ms", "0",
              "--max-in-flight", "8")
    try:
        assert s.client.get("/healthz").json() == {"status": "ok"}
        assert s.client.get("/readyz").json()["ready"] is True
        assert len(metrics_dirs(s)) == 1
        sent = 0
        for budget in BUDGETS:
            want = offline.translate(lines, beam=1, budget=budget)
            r = s.post("/v1/translate", json={"texts": lines, "budget": list(budget)})
            assert r.status_code == 200 and r.json()["translations"] == want, r.text
            sent += 1
        # one request per connection until both workers have answered some
        want = offline.translate(lines[:1], beam=1, budget=0.5)
        while True:
            r = httpx.post(s.url + "/v1/translate", json={"text": lines[0], "budget": 0.5},
                           timeout=60)
            assert r.status_code == 200 and r.json()["translation"] == want[0]
            sent += 1
            pids = {x["pid"] for x in records(s) if x.get("path") == "/v1/translate"}
            if len(pids) > 1:
                break
            assert sent < 600, "every request went to one worker"
        assert s.post("/v1/translate", json={"text": 1}).status_code == 422
        # /metrics, whichever worker answers it, counts both workers' requests
        deadline = time.monotonic() + 10
        while s.metric("dynaseq_requests_total", endpoint="translate", status="200") < sent:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for _ in range(4):  # the same sums from either worker
            assert s.metric("dynaseq_requests_total", endpoint="translate",
                            status="200") == sent
            assert s.metric("dynaseq_requests_total", endpoint="translate",
                            status="422") == 1
            assert s.metric("dynaseq_lines_total", endpoint="translate",
                            budget="0.5,0.5") == len(lines) + sent - 3
            assert s.metric("dynaseq_queue_depth_lines") == 0
        assert s.metric("dynaseq_in_flight_limit") == 16
        # a worker killed is replaced, and its live gauges leave the sums (they stayed)
        ready = [r["pid"] for r in records(s) if r.get("event") == "ready"]
        os.kill(ready[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while len({r["pid"] for r in records(s) if r.get("event") == "ready"}) < 3:
            assert time.monotonic() < deadline, s.log_text()
            time.sleep(0.1)
        assert s.metric("dynaseq_in_flight_limit") == 16
        assert s.metric("dynaseq_in_flight_requests") == 0
        assert s.post("/v1/translate", json={"text": lines[0]}).status_code == 200
        s.proc.send_signal(signal.SIGHUP)  # uvicorn restarts both: the old pids leave too
        deadline = time.monotonic() + 120
        while (len({r["pid"] for r in records(s) if r.get("event") == "ready"}) < 5
               or s.metric("dynaseq_in_flight_limit") != 16):
            assert time.monotonic() < deadline, (s.metric("dynaseq_in_flight_limit"),
                                                 s.log_text())
            time.sleep(0.2)
    finally:
        assert s.stop() == 0
    assert not metrics_dirs(s)


def clients_per_worker(server: Server, k: int) -> dict[int, list[httpx.Client]]:
    """``k`` keep-alive clients connected to each of the two workers: a refused request on
    each new connection shows, in the access log, which worker accepted it."""
    by_pid: dict[int, list[httpx.Client]] = {}
    # the kernel hands a new connection to whichever worker wakes first; on a loaded machine
    # one worker may take nearly all of them for a while, hence the many tries
    for _ in range(600):
        client = httpx.Client(base_url=server.url, timeout=60)
        refused = len([r for r in records(server) if r.get("status") == 422])
        assert client.post("/v1/translate", json={"text": 1}).status_code == 422
        deadline = time.monotonic() + 10
        while len(log := [r for r in records(server) if r.get("status") == 422]) == refused:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        mine = by_pid.setdefault(log[-1]["pid"], [])
        if len(mine) < k:
            mine.append(client)
        else:
            client.close()
        if len(by_pid) == 2 and all(len(v) == k for v in by_pid.values()):
            return by_pid
    raise AssertionError(f"connections did not reach both workers: {by_pid}")


def test_sigterm_drains_every_worker_then_exits_0(serve_run, lines, tmp_path):
    s = start(serve_run, tmp_path / "server.log", "--batch-window-ms", "3000")
    by_pid = clients_per_worker(s, 3)
    jobs = [(c, i) for i, c in enumerate(c for cs in by_pid.values() for c in cs)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(c.post, "/v1/translate",
                               json={"text": lines[i], "budget": list(BUDGETS[i % 3])})
                   for c, i in jobs]
        deadline = time.monotonic() + 30
        while s.metric("dynaseq_queue_depth_lines") < len(jobs):  # summed over the workers
            assert time.monotonic() < deadline
            time.sleep(0.01)
        s.proc.send_signal(signal.SIGTERM)
        refused_by = time.monotonic() + 5  # a new connection is refused, not queued and reset
        while True:
            try:
                httpx.get(s.url + "/healthz", timeout=1)
            except httpx.ConnectError:
                break
            except httpx.TimeoutException:  # accepted by the kernel, never by a worker
                raise AssertionError("a connection after SIGTERM was queued") from None
            except (httpx.ReadError, httpx.RemoteProtocolError):
                pass  # queued just as a worker closed its socket: reset, not left hanging
            assert time.monotonic() < refused_by, "still accepting connections after SIGTERM"
            time.sleep(0.1)
        answers = [f.result() for f in futures]
    assert [a.status_code for a in answers] == [200] * len(jobs)
    assert s.proc.wait(60) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(s.url + "/healthz", timeout=2)
    log = records(s)
    served = [r["pid"] for r in log if r.get("path") == "/v1/translate" and r["status"] == 200]
    assert sorted(served) == sorted(p for p, cs in by_pid.items() for _ in cs)  # 3 each
    for pid in by_pid:  # each worker drained, then stopped
        events = [r.get("event") or r["status"] for r in log if r["pid"] == pid]
        assert events[0] == "ready" and events[-1] == "stopped", events
    assert not metrics_dirs(s)
    # nothing but the JSON lines: no traceback, no semaphore left to the resource tracker
    assert [x for x in s.log_text().splitlines() if not x.startswith("{")] == []
    for cs in by_pid.values():
        for c in cs:
            c.close()
    s.stop()


def test_bad_workers_values_are_one_line_exit_2(serve_run):
    for args, words in [
        (("--workers", "0"), "--workers must be >= 1"),
        (("--workers", "-2"), "--workers must be >= 1"),
        (("--workers", "two"), "invalid int value: 'two'"),
        (("--workers", "2", "--threads", "0"), "--threads must be >= 1"),
        (("--workers", "2", "--default-budget", "0.4"), "was not trained"),
    ]:
        r = run_cli("serve", str(serve_run), *args, "--port", free_port())
        err = r.stderr.decode()
        assert r.returncode == 2 and words in err, (args, err)
        assert err.count("\n") == 1 and err.startswith("dynaseq: error:")
