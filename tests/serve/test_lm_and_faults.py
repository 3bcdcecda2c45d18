"""Language-model endpoints against the offline predictor and CLI; a batch that raises fails
only its own requests; a client that goes away before its batch costs nothing."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import dynaseq
from dynaseq.serve.app import build_state
from dynaseq.serve.config import ServeConfig

from helpers import run_cli
from serve_helpers import InProcess, Server


@pytest.fixture(scope="module")
def lm_server(lm_run):
    s = Server(lm_run)
    yield s
    s.stop()


def test_generate_equals_offline_generate_and_the_cli(lm_server, lm_run):
    lm = dynaseq.load(lm_run)
    r = lm_server.post("/v1/generate", json={"text": "w1 w2", "tokens": 6, "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == lm.generate("w1 w2", 6, 1.0, 3, None)
    assert body["budget"] is None and body["compute"]["macs_per_token"]["total"] > 0
    cli = run_cli("generate", str(lm_run), "--prompt", "w1 w2", "--tokens", "6", "--seed", "3")
    assert cli.stdout.decode() == body["text"] + "\n"
    r = lm_server.post("/v1/generate", json={"texts": ["w3", ""], "tokens": 4,
                                             "temperature": 0.0})
    assert r.json()["texts"] == [lm.generate("w3", 4, 0.0), lm.generate(None, 4, 0.0)]


def test_score_equals_offline_evaluate(lm_server, lm_run, tmp_path):
    lm = dynaseq.load(lm_run)
    lines = ["w1 w5 w7 w2", "w3 nonword w4"]
    r = lm_server.post("/v1/score", json={"texts": lines})
    assert r.status_code == 200, r.text
    for line, got in zip(lines, r.json()["scores"], strict=True):
        f = tmp_path / "one.txt"
        f.write_text(f"\n{line}\n")  # a line start, then the line
        want = lm.evaluate(str(f), batch_size=1)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-6)
        assert got["tokens"] == want["tokens"]
    one = lm_server.post("/v1/score", json={"text": lines[0]}).json()
    assert one["score"] == r.json()["scores"][0]


@pytest.mark.parametrize("body,words", [
    ({"text": "w1", "budget": 0.5}, "no compute-budget knob"),
    ({"text": "w1", "deadline_ms": 100}, "no budgets"),
    ({"text": "w1", "tokens": -1}, "tokens"),
    ({"text": "w1", "tokens": 100000}, "limit"),
    ({"text": "w1", "temperature": "hot"}, "temperature"),
    ({"text": "w1", "top_k": 0}, "top_k"),
])
def test_language_model_refusals(lm_server, body, words):
    r = lm_server.post("/v1/generate", json=body)
    assert 400 <= r.status_code < 500 and words in r.json()["error"], r.text
    assert lm_server.post("/v1/score", json={"text": "w1", "budget": 1}).status_code == 422
    assert lm_server.post("/v1/generate", json={"text": "w1", "tokens": 2}).status_code == 200


def test_text_and_numbers_a_batch_cannot_take_are_422_not_500(lm_server):
    raw = {"content-type": "application/json"}
    for path, body in (("/v1/generate", b'{"text": "w1", "temperature": Infinity}'),
                       ("/v1/generate", b'{"text": "w1 \\ud800", "tokens": 2}'),
                       ("/v1/score", b'{"text": "w1 \\ud800"}')):
        r = lm_server.client.post(path, content=body, headers=raw)
        assert r.status_code == 422, (path, body, r.text)
        assert "error" in r.json()
    assert lm_server.metric("dynaseq_requests_total", endpoint="generate",
                            status="500") == 0
    assert lm_server.post("/v1/generate", json={"text": "w1", "tokens": 2}).status_code == 200


def test_language_model_server_serves_no_translation(lm_server):
    assert lm_server.post("/v1/translate", json={"text": "a"}).status_code == 404
    assert lm_server.client.get("/readyz").json()["endpoints"] == ["/v1/generate",
                                                                   "/v1/score"]


def test_an_exception_in_a_batch_fails_that_batch_only(serve_run, synthetic_paths):
    lines = synthetic_paths["test.src"].read_text().splitlines()[:3]
    state = build_state(dynaseq.load(serve_run), "seq2seq",
                        ServeConfig(beam=1, batch_window_ms=300), log_stream=None)
    real = state.run_translate

    def faulty(jobs):
        if any("BOOM" in line for j in jobs for line in j.payload.lines):
            raise RuntimeError("injected fault")
        return real(jobs)

    state.run_translate = faulty
    srv = InProcess(state)
    try:
        with ThreadPoolExecutor(2) as pool:  # both land in one batch (300 ms window)
            a = pool.submit(httpx.post, srv.url + "/v1/translate", json={"text": "BOOM"},
                            timeout=30)
            time.sleep(0.05)
            b = pool.submit(httpx.post, srv.url + "/v1/translate", json={"text": lines[0]},
                            timeout=30)
            ra, rb = a.result(), b.result()
        assert ra.status_code == rb.status_code == 500
        assert ra.json() == {"error": "the batch failed: RuntimeError: injected fault"}
        r = httpx.post(srv.url + "/v1/translate", json={"texts": lines}, timeout=30)
        assert r.status_code == 200
        assert r.json()["translations"] == dynaseq.load(serve_run).translate(lines, beam=1)
        assert state.metrics.batch_failures.labels("translate")._value.get() == 1
        assert state.in_flight == 0  # the 500s left the count
    finally:
        srv.stop()


def test_a_request_beyond_max_in_flight_gets_503_before_its_body_is_read(serve_run,
                                                                          synthetic_paths):
    """With ``max_in_flight=2`` and two requests held in their batch, a third is refused
    with 503, ``Retry-After`` and a one-line JSON error before its body is parsed (a
    malformed body gets the 503, not a 400), counted as ``busy``; health and metrics are
    answered meanwhile; once the two are answered, the next request is served."""
    lines = synthetic_paths["test.src"].read_text().splitlines()[:3]
    state = build_state(dynaseq.load(serve_run), "seq2seq",
                        ServeConfig(beam=1, batch_window_ms=0, max_in_flight=2,
                                    retry_after_min_s=3), log_stream=None)
    real, release, entered = state.run_translate, threading.Event(), threading.Event()

    def held(jobs):
        entered.set()
        assert release.wait(30)
        return real(jobs)

    state.run_translate = held
    srv = InProcess(state)
    try:
        with ThreadPoolExecutor(2) as pool:
            try:
                a = pool.submit(httpx.post, srv.url + "/v1/translate",
                                json={"text": lines[0]}, timeout=30)
                assert entered.wait(30)  # the first is in its batch, the second queued
                b = pool.submit(httpx.post, srv.url + "/v1/translate",
                                json={"text": lines[1]}, timeout=30)
                deadline = time.monotonic() + 10
                while state.batcher.queued_rows() < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                for body in ({"content": b"{not json"}, {"json": {"text": lines[2]}}):
                    r = httpx.post(srv.url + "/v1/translate", timeout=30,
                                   headers={"Content-Type": "application/json"}, **body)
                    assert r.status_code == 503 and r.headers["Retry-After"] == "3"
                    assert r.json() == {"error": "2 requests are in flight (limit 2)",
                                        "reason": "busy"}
                # not an endpoint's method: not counted, not refused (FastAPI's 405)
                assert httpx.get(srv.url + "/v1/translate", timeout=30).status_code == 405
                assert httpx.get(srv.url + "/healthz", timeout=30).status_code == 200
                metrics = httpx.get(srv.url + "/metrics").text
                assert ('dynaseq_rejected_total{endpoint="translate",reason="busy"} 2.0'
                        in metrics)
                assert "dynaseq_in_flight_requests 2.0" in metrics  # the two held
                assert "dynaseq_in_flight_limit 2.0" in metrics
            finally:
                release.set()
            assert a.result().status_code == b.result().status_code == 200
        r = httpx.post(srv.url + "/v1/translate", json={"text": lines[2]}, timeout=30)
        assert r.status_code == 200
        assert state.metrics.rejected.labels("translate", "busy")._value.get() == 2
        assert state.in_flight == 0  # every admitted request left the count
    finally:
        release.set()
        srv.stop()


def test_a_client_that_goes_away_costs_nothing_further(serve_run, synthetic_paths):
    lines = synthetic_paths["test.src"].read_text().splitlines()[:2]
    state = build_state(dynaseq.load(serve_run), "seq2seq",
                        ServeConfig(beam=1, batch_window_ms=400), log_stream=None)
    real, ran = state.run_translate, []

    def counting(jobs):
        ran.extend(line for j in jobs for line in j.payload.lines)
        return real(jobs)

    state.run_translate = counting
    srv = InProcess(state)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/translate", json={"text": lines[0]}, timeout=0.1)
        time.sleep(0.6)  # past the window: the batch would have run
        r = httpx.post(srv.url + "/v1/translate", json={"text": lines[1]}, timeout=30)
        assert r.status_code == 200
        assert ran == [lines[1]]
        assert state.metrics.cancelled.labels("translate")._value.get() == 1
        assert state.in_flight == 0  # the 499 left the count
    finally:
        srv.stop()


def test_a_translation_server_warms_each_budget_before_it_is_ready(serve_run):
    """Before it reports ready, the server translates one line at each budget it runs (the
    lean decoder prepared off the first request's clock); nothing of it is counted."""
    t = dynaseq.load(serve_run)
    state = build_state(t, "seq2seq", ServeConfig(beam=1), log_stream=None)
    calls = []
    real = t.translate

    def recording(lines, **kw):
        calls.append((lines, kw["budget"]))
        return real(lines, **kw)

    t.translate = recording
    srv = InProcess(state)
    try:
        assert len(state.budgets) > 1
        assert [b for _, b in calls] == [[b] for b in state.budgets]
        assert all(len(lines) == 1 for lines, _ in calls)
        assert httpx.get(srv.url + "/readyz", timeout=30).status_code == 200
        assert state.batcher.overhead_ms == 0.0  # no answer observed yet
        counted = [x.value for m in state.metrics.lines.collect() for x in m.samples]
        assert sum(counted) == 0
    finally:
        srv.stop()


def test_a_server_process_freezes_what_it_loaded():
    """``freeze_heap`` (run by ``serve`` and each worker once loaded) leaves the loaded
    objects to the permanent generation: a full collection then scans none of them."""
    import subprocess
    import sys

    code = ("import gc, torch\n"
            "from dynaseq.serve.server import freeze_heap\n"
            "model = torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1,\n"
            "                             num_decoder_layers=1, dim_feedforward=32)\n"
            "before = gc.get_freeze_count()\n"
            "freeze_heap()\n"
            "print(before, gc.get_freeze_count(), gc.get_count()[2])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    before, frozen, gen2 = map(int, out)
    assert before == 0 and frozen > 10_000 and gen2 == 0


def test_a_dense_translation_model_plans_deadlines_on_its_one_row(trained_run, tmp_path):
    """A dense model's table has one row, ``(1, 1)``: a deadline request runs without a
    budget (it used to be refused as a budget the dense model has no knob for)."""
    import shutil

    from dynaseq.metrics.latency_table import LatencyTable
    from dynaseq.serve.endpoints import TRANSLATE

    run = tmp_path / "dense"
    shutil.copytree(trained_run, run)
    r = run_cli("profile", str(run), "--latency-table", "--beam", "1", "--repeats", "1",
                "--table-batches", "1,2", "--table-lengths", "4,8", "--quiet")
    assert r.returncode == 0, r.stderr.decode()
    table = LatencyTable.load(run / "latency_table.json")
    assert table.budgets == [(1.0, 1.0)]
    t = dynaseq.load(run)
    state = build_state(t, "seq2seq", ServeConfig(beam=1), table=table, log_stream=None)
    job = TRANSLATE.plan(state, TRANSLATE.request(text="kalo sum 3 4 end",
                                                  deadline_ms=60_000))
    assert job.budget is None and job.payload.pair is None and not job.payload.degraded
    assert job.predicted_ms is not None and job.predicted_ms > 0


def test_a_generate_request_whose_client_left_stops_at_its_next_word(lm_run):
    """The client leaves after the first prompt's third word: no more words are sampled,
    and the request's other prompts do not run."""
    from dynaseq.serve.batcher import Job
    from dynaseq.serve.endpoints import run_generate
    from dynaseq.serve.schemas import GenerateRequest

    lm = dynaseq.load(lm_run)
    steps = []
    step = lm.model.step

    def counted(*args, **kwargs):
        steps.append(1)
        if len(steps) == 3:
            job.cancel()
        return step(*args, **kwargs)

    job = Job(group="generate", run=run_generate, payload=GenerateRequest(
        texts=["the", "a", "of"], tokens=20), rows=3)
    lm.model.step = counted
    try:
        (texts,) = run_generate(lm, [job])
    finally:
        del lm.model.step
    assert len(steps) == 3 and texts == [lm.generate("the", 3)]  # its first 3 words
    whole = Job(group="generate", run=run_generate, payload=GenerateRequest(
        texts=["the", "a"], tokens=5), rows=2)
    assert run_generate(lm, [whole]) == [[lm.generate("the", 5), lm.generate("a", 5)]]
