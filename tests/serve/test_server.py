"""A real ``dynaseq serve`` process on 127.0.0.1: answers equal the offline ones, mixed
budgets batch together, bad input is refused with one-line 4xx JSON and the server goes
on, /metrics counts what was sent, deadlines choose budgets, SIGTERM drains."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers import run_cli
from serve_helpers import BUDGETS, Server


def test_translate_equals_offline_translate_at_each_budget(server, offline, lines):
    for budget in BUDGETS:
        want = offline.translate(lines, beam=1, budget=budget)
        r = server.post("/v1/translate", json={"texts": lines, "budget": list(budget)})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["translations"] == want
        assert body["budget"] == list(budget)
        assert body["degraded"] is False and body["latency_ms"] > 0
        assert len(body["compute"]) == len(lines)
        for c in body["compute"]:
            assert set(c["fraction"]) == {"encoder", "decoder", "total"}
            assert 0 < c["fraction"]["total"] <= 1.0 + 1e-9
        r1 = server.post("/v1/translate", json={"text": lines[0], "budget": list(budget)})
        assert r1.json()["translation"] == want[0]
    for c in body["compute"]:  # realized MACs per token, encoder + decoder
        per = c["macs_per_token"]
        assert per["total"] == pytest.approx(per["encoder"] + per["decoder"])
    # no budget: the largest trained one
    r = server.post("/v1/translate", json={"text": lines[1]})
    assert r.json()["budget"] == [1.0, 1.0]
    assert r.json()["translation"] == offline.translate([lines[1]], beam=1)[0]
    # an empty line translates to an empty line, as offline
    r = server.post("/v1/translate", json={"texts": ["", lines[2]], "budget": 0.5})
    assert r.json()["translations"] == offline.translate(["", lines[2]], beam=1, budget=0.5)
    assert r.json()["compute"][0] is None


def test_translate_equals_the_cli(server, serve_run, lines):
    cli = run_cli("translate", str(serve_run), "--budget", "1,0.33", "--beam", "1",
                  stdin="\n".join(lines[:3]).encode() + b"\n")
    assert cli.returncode == 0, cli.stderr.decode()
    r = server.post("/v1/translate", json={"texts": lines[:3], "budget": [1, 0.33]})
    assert r.json()["translations"] == cli.stdout.decode().splitlines()


def test_concurrent_requests_at_mixed_budgets_each_get_their_own_answer(server, offline,
                                                                         lines):
    want = {b: offline.translate(lines, beam=1, budget=b) for b in BUDGETS}
    jobs = [(i, BUDGETS[i % len(BUDGETS)]) for i in range(18)]
    batches_before = server.metric("dynaseq_batch_distinct_budgets_count",
                                   endpoint="translate")
    mixed_before = batches_before - server.metric(
        "dynaseq_batch_distinct_budgets_bucket", endpoint="translate", le="1.0")

    def ask(job):
        i, budget = job
        line = lines[i % len(lines)]
        r = httpx.post(server.url + "/v1/translate", json={"text": line, "budget": list(budget)},
                       timeout=60)
        return i, budget, r

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(ask, jobs))
    for i, budget, r in results:
        assert r.status_code == 200, r.text
        assert r.json()["translation"] == want[budget][i % len(lines)]
        assert r.json()["budget"] == list(budget)
    batches = server.metric("dynaseq_batch_distinct_budgets_count", endpoint="translate")
    mixed = batches - server.metric("dynaseq_batch_distinct_budgets_bucket",
                                    endpoint="translate", le="1.0")
    assert batches - batches_before < len(jobs)  # requests were batched together
    assert mixed > mixed_before  # and at least one batch held several budgets
    assert max(r.json()["batch_lines"] for _, _, r in results) > 1


BAD = [
    # (what, kwargs of client.post, status, words of the error)
    ("malformed JSON", {"content": b'{"text": "a",', "headers": {"content-type":
                                                                 "application/json"}},
     400, "malformed JSON"),
    ("empty body", {"content": b"", "headers": {"content-type": "application/json"}}, 400,
     "empty body"),
    ("not an object", {"json": ["a"]}, 400, "JSON object"),
    ("a form, not JSON", {"content": b'{"text": "a"}', "headers": {
        "content-type": "application/x-www-form-urlencoded"}}, 415,
     "unsupported Content-Type 'application/x-www-form-urlencoded'"),
    ("plain text", {"content": b"a", "headers": {"content-type": "text/plain"}}, 415,
     "application/json"),
    ("no content type", {"content": b'{"text": "a"}'}, 415,
     "no Content-Type: send the JSON object as application/json"),
    ("wrong type", {"json": {"text": 5}}, 422, "text"),
    ("wrong type in list", {"json": {"texts": ["a", 5]}}, 422, "texts.1"),
    ("budget as string", {"json": {"text": "a", "budget": "0.5"}}, 422, "budget"),
    ("budget triple", {"json": {"text": "a", "budget": [1, 1, 1]}}, 422, "budget"),
    ("unknown field", {"json": {"text": "a", "beam_size": 4}}, 422, "beam_size"),
    ("text and texts", {"json": {"text": "a", "texts": ["b"]}}, 422, "not both"),
    ("no text", {"json": {"budget": 1}}, 422, "text"),
    ("empty texts", {"json": {"texts": []}}, 422, "texts"),
    ("untrained budget", {"json": {"text": "a", "budget": 0.4}}, 422,
     "trained (encoder, decoder) budgets: (1, 1), (0.5, 0.5), (1, 0.33)"),
    ("budget over 1", {"json": {"text": "a", "budget": 1.5}}, 422, "(0, 1]"),
    ("deadline 0", {"json": {"text": "a", "deadline_ms": 0}}, 422, "deadline_ms"),
    ("negative deadline", {"json": {"text": "a", "deadline_ms": -5}}, 422, "deadline_ms"),
    ("infinite deadline", {"content": b'{"text": "a", "deadline_ms": Infinity}',
                           "headers": {"content-type": "application/json"}}, 422,
     "deadline_ms"),
    ("chunked body too large", {"content": [b'{"texts": ["' + b"a" * 3000, b'"]}'] * 2,
                                "headers": {"content-type": "application/json"}}, 413,
     "body of more than"),
    ("budget and deadline", {"json": {"text": "a", "budget": 1, "deadline_ms": 100}}, 422,
     "not both"),
    ("too many lines", {"json": {"texts": ["a"] * 9}}, 413, "limit is 8"),
    ("line too long", {"json": {"text": "a " * 200}}, 413, "characters"),
    ("too many tokens", {"json": {"texts": ["sum 1 2 3 4 5 6 7 8 9 end " * 5] * 8}}, 413,
     "tokens"),
    ("body too large", {"json": {"texts": ["a" * 290] * 15}}, 413, "bytes"),
    ("line break in a line", {"json": {"text": "a\nb"}}, 422, "line break"),
]


@pytest.mark.parametrize("what,kwargs,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_one_line_4xx_and_the_server_answers_the_next(server, lines, what,
                                                                       kwargs, status,
                                                                       words):
    r = server.post("/v1/translate", **kwargs)
    assert r.status_code == status, (what, r.text)
    body = r.json()
    assert set(body) == {"error"} and "\n" not in body["error"]
    assert words in body["error"], body
    ok = server.post("/v1/translate", json={"text": lines[0]})
    assert ok.status_code == 200


def test_text_without_a_utf8_form_is_a_422_and_the_server_goes_on(server, lines):
    body = b'{"texts": ["a dog", "a \\udfff cat"]}'  # JSON's escape of a lone surrogate
    r = server.client.post("/v1/translate", content=body,
                           headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json() == {"error": "line 2 is not valid text: surrogates not allowed (\\udfff)"}
    assert server.post("/v1/translate", json={"text": lines[0]}).is_success


def test_unknown_paths_and_methods_are_json_errors(server):
    assert server.client.get("/v1/nothing").json() == {"error": "Not Found"}
    r = server.client.get("/v1/translate")
    assert r.status_code == 405 and "error" in r.json()
    assert server.post("/v1/generate", json={"text": "a"}).status_code == 404


def test_health_readiness_and_openapi(server):
    assert server.client.get("/healthz").json() == {"status": "ok"}
    ready = server.client.get("/readyz").json()
    assert ready["ready"] is True and ready["endpoints"] == ["/v1/translate"]
    assert ready["budgets"] == [list(b) for b in BUDGETS] and ready["deadline_policy"]
    schema = server.client.get("/openapi.json").json()
    assert "/v1/translate" in schema["paths"]
    props = schema["components"]["schemas"]["TranslateRequest"]["properties"]
    assert {"text", "texts", "budget", "deadline_ms"} <= set(props)


def test_metrics_count_what_was_sent(serve_run, lines, tmp_path):
    s = Server(serve_run, "--beam", "1", "--batch-window-ms", "0")
    try:
        for _ in range(3):
            assert s.post("/v1/translate", json={"text": lines[0], "budget": 0.5}).is_success
        assert s.post("/v1/translate", json={"texts": lines[:4], "budget": [1, 0.33]}
                      ).is_success
        assert s.post("/v1/translate", json={"text": 1}).status_code == 422
        assert s.post("/v1/translate", json={"text": "a", "budget": 0.7}).status_code == 422
        assert s.metric("dynaseq_requests_total", endpoint="translate", status="200") == 4
        assert s.metric("dynaseq_requests_total", endpoint="translate", status="422") == 2
        for path in ("/v1/a", "/v1/b"):  # paths not served share one label value
            assert s.post(path, json={"text": "a"}).status_code == 404
        assert s.metric("dynaseq_requests_total", endpoint="other", status="404") == 2
        assert "/v1/a" not in s.client.get("/metrics").text
        assert s.metric("dynaseq_lines_total", endpoint="translate", budget="0.5,0.5") == 3
        assert s.metric("dynaseq_lines_total", endpoint="translate", budget="1,0.33") == 4
        assert s.metric("dynaseq_request_latency_seconds_count", endpoint="translate",
                        budget="0.5,0.5") == 3
        assert s.metric("dynaseq_realized_compute_fraction_count", endpoint="translate",
                        budget="1,0.33") == 4
        assert s.metric("dynaseq_batch_lines_sum", endpoint="translate") == 7
        assert s.metric("dynaseq_queue_depth_lines") == 0
    finally:
        s.stop()


def test_deadlines_choose_budgets_from_the_latency_table(server, serve_run, lines):
    table = json.loads((serve_run / "latency_table.json").read_text())
    slowest = max(v for rows in table["service_ms"].values() for r in rows for v in r)
    # a loose deadline on an idle server: the full budget
    r = server.post("/v1/translate", json={"text": lines[0], "deadline_ms": 100 * slowest})
    assert r.status_code == 200 and r.json()["budget"] == [1.0, 1.0]
    assert r.json()["degraded"] is False
    # one no budget can meet: 503 with Retry-After, counted as rejected
    before = server.metric("dynaseq_rejected_total", endpoint="translate", reason="deadline")
    r = server.post("/v1/translate", json={"text": lines[0], "deadline_ms": 0.001})
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert "no budget" in r.json()["error"] and r.json()["reason"] == "deadline"
    assert server.metric("dynaseq_rejected_total", endpoint="translate",
                         reason="deadline") == before + 1
    assert server.post("/v1/translate", json={"text": lines[0]}).status_code == 200


def test_concurrent_deadline_requests_get_the_budget_they_report(server, serve_run, offline,
                                                                  lines):
    """Deadline requests batched together are planned again when their batch is taken;
    whatever budget each ends at, its translation is the offline one at that budget and a
    batch's deadline lines share one budget."""
    want = {b: offline.translate(lines, beam=1, budget=b) for b in BUDGETS}
    before = server.metric("dynaseq_batch_distinct_budgets_bucket", endpoint="translate",
                           le="1.0")
    batches_before = server.metric("dynaseq_batch_distinct_budgets_count",
                                   endpoint="translate")

    table = json.loads((serve_run / "latency_table.json").read_text())
    # loose enough that a slow moment refuses or sheds few of them (a 503 is allowed)
    deadline = 4 * max(v for rows in table["service_ms"].values() for r in rows for v in r)

    def ask(i):
        r = httpx.post(server.url + "/v1/translate",
                       json={"text": lines[i % len(lines)], "deadline_ms": deadline},
                       timeout=60)
        return i, r

    with ThreadPoolExecutor(12) as pool:
        results = [(i, r) for i, r in pool.map(ask, range(12)) if r.status_code != 503]
    assert results
    for i, r in results:
        assert r.status_code == 200, r.text
        budget = tuple(r.json()["budget"])
        assert r.json()["translation"] == want[budget][i % len(lines)]
    batches = server.metric("dynaseq_batch_distinct_budgets_count", endpoint="translate")
    single = server.metric("dynaseq_batch_distinct_budgets_bucket", endpoint="translate",
                           le="1.0")
    assert single - before == batches - batches_before  # one budget in every batch


def test_a_deadline_request_that_can_no_longer_answer_in_time_is_shed(run_copy, lines):
    """Admitted on a prediction that turns out wrong (a latency table 1000 times too fast),
    a deadline request whose batch starts after its deadline is dropped then with a 503
    and ``Retry-After``, counted as rejected for lateness, while the request without a
    deadline in the same batch is answered."""
    path = run_copy / "latency_table.json"
    table = json.loads(path.read_text())
    table["service_ms"] = {k: [[v / 1000 for v in row] for row in rows]
                           for k, rows in table["service_ms"].items()}
    path.write_text(json.dumps(table))
    s = Server(run_copy, "--beam", "1", "--batch-window-ms", "1000")
    try:
        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(httpx.post, s.url + "/v1/translate",
                                json={"text": lines[0]}, timeout=60)
            deadline = time.monotonic() + 30
            while s.metric("dynaseq_queue_depth_lines") < 1:  # it waits out the window
                assert time.monotonic() < deadline
                time.sleep(0.005)
            late = s.post("/v1/translate", json={"text": lines[1], "deadline_ms": 200})
            assert plain.result().status_code == 200
        assert late.status_code == 503 and int(late.headers["retry-after"]) >= 1
        assert "can no longer be met" in late.json()["error"]
        assert late.json()["reason"] == "late"
        assert s.metric("dynaseq_rejected_total", endpoint="translate", reason="late") == 1
    finally:
        s.stop()


def test_a_deadline_without_a_latency_table_is_refused(run_copy, lines):
    (run_copy / "latency_table.json").unlink()
    s = Server(run_copy, "--beam", "1")
    try:
        r = s.post("/v1/translate", json={"text": lines[0], "deadline_ms": 1000})
        assert r.status_code == 422 and "latency-table" in r.json()["error"]
        assert s.client.get("/readyz").json()["deadline_policy"] is False
        assert s.post("/v1/translate", json={"text": lines[0]}).status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])  # HUP: a closed terminal
def test_sigterm_answers_the_requests_in_flight_then_exits(serve_run, lines, tmp_path, sig):
    """SIGTERM drains; so does SIGHUP (its default ended the process at once, dropping the
    requests in flight), as a SIGTERM."""
    log = tmp_path / "server.log"
    s = Server(serve_run, "--beam", "1", "--batch-window-ms", "600", log=log)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(httpx.post, s.url + "/v1/translate",
                               json={"text": lines[i], "budget": list(BUDGETS[i % 3])},
                               timeout=60) for i in range(6)]
        deadline = time.monotonic() + 30
        while s.metric("dynaseq_queue_depth_lines") < 6:  # all six are queued
            assert time.monotonic() < deadline
            time.sleep(0.01)
        s.proc.send_signal(sig)
        answers = [f.result() for f in futures]
    assert [a.status_code for a in answers] == [200] * 6
    # uvicorn re-raises the signal once drained: the exit status of a SIGTERM (143)
    assert s.proc.wait(60) == -signal.SIGTERM
    with pytest.raises(httpx.TransportError):
        httpx.get(s.url + "/healthz", timeout=2)
    records = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    served = [r for r in records if r.get("path") == "/v1/translate"]
    assert len(served) == 6 and all(r["status"] == 200 for r in served)
    assert records[-1]["event"] == "stopped"
    s.stop()


def test_access_log_is_json_lines(server):
    server.post("/v1/translate", json={"text": "a", "budget": 0.5})
    server.post("/v1/translate", json={"text": "a", "budget": 0.9})
    server.post("/v1/nowhere", json={"text": "a"})  # the router's own 404: a reason too
    server.post("/v1/translate", content=b"a", headers={"content-type": "text/plain"})
    deadline = time.monotonic() + 10  # a request's line is written once its answer is sent
    while True:
        records = [json.loads(x) for x in server.log_text().splitlines()]
        ok = [r for r in records if r.get("status") == 200 and r.get("budget") == [0.5, 0.5]]
        bad = [r for r in records if r.get("status") == 422 and "0.9" in r.get("error", "")]
        lost = [r for r in records if r.get("status") == 404 and r.get("error") == "Not Found"]
        plain = [r for r in records if r.get("status") == 415 and "text/plain" in r["error"]]
        if (ok and bad and lost and plain) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert ok and bad and lost and plain
    assert {"ts", "method", "path", "latency_ms", "lines", "batch_lines"} <= set(ok[-1])


def test_serve_refusals_are_one_line_exit_2(serve_run, lm_run, tmp_path):
    for args, words in [
        ((str(tmp_path / "none"),), "none"),
        ((str(serve_run), "--slack", "2"), "--slack must be in (0, 1]"),
        ((str(serve_run), "--batch-nice", "-1"), "--batch-nice must be in [0, 19]"),
        ((str(serve_run), "--max-in-flight", "0"), "--max-in-flight must be >= 1"),
        ((str(serve_run), "--max-utilization", "0"), "--max-utilization must be > 0"),
        ((str(serve_run), "--scale-by-size", "--continuous"), "give one of them"),
        ((str(serve_run), "--batch-margin", "none"), "invalid choice: 'none'"),
        ((str(serve_run), "--max-lines", "64"), "must not exceed --max-batch-lines"),
        ((str(serve_run), "--default-budget", "0.4"), "was not trained"),
        ((str(serve_run), "--beam", "2"), "measured at beam 1"),
        ((str(serve_run), "--beam", "100000"), "is wider than the target vocabulary"),
        ((str(serve_run), "--max-queue-lines", "16"), "must not exceed --max-queue-lines"),
        ((str(lm_run), "--latency-table", "t.json"), "for translation and classification runs"),
    ]:
        r = run_cli("serve", *args, "--port", "1")
        err = r.stderr.decode()
        assert r.returncode == 2 and words in err, (args, err)
        assert err.count("\n") == 1 and err.startswith("dynaseq: error:")


def test_a_job_past_its_expiry_leaves_its_batch_with_a_503_and_the_others_are_answered(
        offline, lines):
    """The server's batch (in process): a job whose answer would be late (its ``expires``
    already passed) is dropped after the first decoding step and marked shed, with the
    configured ``Retry-After``; the jobs beside it get the offline translations at their
    own budgets."""
    from dynaseq.serve.batcher import Job, Shed
    from dynaseq.serve.endpoints import TranslateWork, run_translate

    want = {b: offline.translate(lines, beam=1, budget=b) for b in BUDGETS[:2]}
    # lines whose translation is not empty run past the first step: two of them expire
    late = [i for i in range(len(lines)) if want[BUDGETS[i % 2]][i]][:2]
    assert len(late) == 2
    jobs = []
    for i, line in enumerate(lines):
        budget = BUDGETS[i % 2]
        work = TranslateWork([line], offline.tokenizer.encode([line]), budget, budget, False)
        jobs.append(Job(group=("translate", 1), run=None, payload=work, rows=1,
                        deadline_ms=50.0, expires=0.0 if i in late else None))
    out = run_translate(offline, 1, True, jobs, retry_after_s=7)
    for i, (job, (texts, _)) in enumerate(zip(jobs, out, strict=True)):
        if i in late:
            assert isinstance(job.shed, Shed) and job.shed.retry_after_s == 7
            assert "passed while the batch was decoding" in str(job.shed)
        else:
            assert job.shed is None
            assert texts == [want[BUDGETS[i % 2]][i]]


def test_each_job_of_a_batch_is_answered_when_its_own_lines_are_done(offline, lines,
                                                                     monkeypatch):
    """The server's batch (in process): every job is settled once, before the batch ends
    for all but the last to finish, with the offline translations at its budget and the
    compute the batch reports for it; a job of empty lines is settled before decoding."""
    from dynaseq.serve.batcher import Job
    from dynaseq.serve.endpoints import TranslateWork, run_translate

    settled = []
    monkeypatch.setattr(Job, "settle", lambda self, result: settled.append((self, result)))
    jobs = []
    for k, group in enumerate([lines[:2], [""], lines[2:3], lines[3:6]]):
        budget = BUDGETS[k % 2]
        work = TranslateWork(group, offline.tokenizer.encode(group), budget, budget, False)
        jobs.append(Job(group=("translate", 1), run=None, payload=work, rows=len(group)))
    out = run_translate(offline, 1, True, jobs)
    assert sorted(id(j) for j, _ in settled) == sorted(id(j) for j in jobs)  # once each
    assert run_translate(offline, 1, True, jobs, early=False) == out  # --answer-at-batch-end
    assert len(settled) == len(jobs)  # which settles none
    assert settled[0][0] is jobs[1] and settled[0][1] == ([""], [None])
    for job, result in settled:
        assert result == out[jobs.index(job)]
        texts, compute = result
        assert texts == offline.translate(job.payload.lines, beam=1, budget=job.payload.budget)
        assert all((c is None) == (not line) for c, line in zip(compute, job.payload.lines,
                                                                strict=True))


def test_serve_load_keeps_a_cells_access_log_when_asked(serve_run, lines, tmp_path):
    """``serve_load --access-logs``: the benchmark's server writes its access log (JSON
    lines, with the planned completion and margin) to the cell's file, closed when the
    server stops."""
    from helpers import load_benchmark

    pytest.importorskip("aiohttp", reason="serve_load's load generator (the bench extra)")
    sl = load_benchmark("serve_load")
    log = tmp_path / "0.5x_deadline.jsonl"
    server = sl.ServerProc(serve_run, 1, 5.0, 8, access_log=log)
    try:
        r = httpx.post(server.url + "/v1/translate", json={"text": lines[0],
                                                           "deadline_ms": 10_000})
        assert r.status_code == 200
    finally:
        server.stop()
    records = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    asked = [x for x in records if x.get("path") == "/v1/translate"]
    assert len(asked) == 1 and asked[0]["status"] == 200
    assert asked[0]["predicted_ms"] > 0 and asked[0]["margin_ms"] >= 0
    # replanned as its batch was formed: the margin kept then, and how late against it
    assert asked[0]["batch_margin_ms"] >= 0 and isinstance(asked[0]["formed_late_ms"], float)
    assert server.log.closed


def test_a_batch_at_the_full_budget_reports_its_compute_without_counting(offline, lines,
                                                                         monkeypatch):
    """The server's batch (in process): a batch whose lines all ask for the full budget
    runs as that budget's call and is decoded without counting gates (every gate runs);
    each line reports every gate, and translates as offline; a batch of a gated budget
    counts as it decodes."""
    from dynaseq.serve.batcher import Job
    from dynaseq.serve.endpoints import TranslateWork, run_translate
    from dynaseq.tasks.translation import predictor

    searched, search = [], predictor.counted_greedy_search

    def counting(model, src, **kw):  # the counting decode, which reports as lines finish
        searched.append(src.size(0))
        return search(model, src, **kw)

    monkeypatch.setattr(predictor, "counted_greedy_search", counting)
    for budget in ((1.0, 1.0), (0.5, 0.5)):
        searched.clear()
        jobs = [Job(group=("translate", 1), run=None, rows=1, payload=TranslateWork(
            [line], offline.tokenizer.encode([line]), budget, budget, False)) for line in lines]
        out = run_translate(offline, 1, True, jobs)
        assert [t for texts, _ in out for t in texts] == offline.translate(lines, beam=1,
                                                                            budget=budget)
        fractions = [c["fraction"]["total"] for _, compute in out for c in compute if c]
        if budget == (1.0, 1.0):
            assert searched == [] and fractions == pytest.approx([1.0] * len(fractions))
        else:
            assert searched == [len(lines)] and max(fractions) < 1.0
