"""``POST /v1/classify`` on real ``dynaseq serve`` processes: answers equal
``Classifier.classify`` (batched and one line at a time), requests at different budgets share
a batch and each gets its own budget's answer, bad input is refused with one-line 4xx JSON
and the server goes on, a dense classifier refuses a budget, /metrics counts what was
sent."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

import dynaseq
from dynaseq.metrics.encoder_profile import encoder_macs
from dynaseq.serve.app import build_state
from dynaseq.serve.config import ServeConfig
from dynaseq.serve.endpoints import CLASSIFY

from helpers import run_cli
from serve_helpers import InProcess, Server

BUDGETS = [0.8, 0.5, 0.33, 0.2, 0.4]  # trained, and 0.4 calibrated
PAIRS = ["the cat sat 3\ta cat sat 3", "the cat sat 8\ta cat sat 8",
         "a dog ran far away\tthe dog ran", "the cat sat 11\ta dog sat 11",
         "x y z\tz y x", "the cat\tthe cat sat 5 and then it ran off again"]


@pytest.fixture(scope="module")
def offline(cct_clf_run):
    return dynaseq.load(cct_clf_run)


@pytest.fixture(scope="module")
def clf_server(cct_clf_run):
    s = Server(cct_clf_run, "--batch-window-ms", "30", "--max-lines", "8",
               "--max-tokens", "200", "--max-line-chars", "300")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def dense_server(dense_clf_run):
    s = Server(dense_clf_run, "--batch-window-ms", "0")
    yield s
    s.stop()


def test_classify_equals_offline_classify_at_each_budget(clf_server, offline):
    for budget in BUDGETS:
        want = offline.classify(PAIRS, budget=budget)
        assert want == [offline.classify([p], budget=budget)[0] for p in PAIRS]
        r = clf_server.post("/v1/classify", json={"texts": PAIRS, "budget": budget})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["labels"] == want and body["budget"] == budget
        assert body["degraded"] is False and body["batch_lines"] >= len(PAIRS)
        assert len(body["compute"]) == len(PAIRS)
        for c in body["compute"]:
            assert set(c["fraction"]) == {"encoder", "total"}
            assert 0 < c["fraction"]["total"] <= 1.0 + 1e-9
            assert c["macs_per_token"]["total"] > 0
        one = clf_server.post("/v1/classify", json={"text": PAIRS[0], "budget": budget})
        assert one.json()["label"] == want[0]
    # no budget: the largest trained one; empty lines (or pairs) get null, as offline
    r = clf_server.post("/v1/classify", json={"texts": ["", PAIRS[1], "\t"]})
    assert r.json()["budget"] == 0.8
    assert r.json()["labels"] == offline.classify(["", PAIRS[1], "\t"]) == [
        None, offline.classify([PAIRS[1]])[0], None]
    assert r.json()["compute"][0] is None and r.json()["compute"][1] is not None
    r = clf_server.post("/v1/classify", json={"text": ""})
    assert r.status_code == 200 and r.json()["label"] is None


def test_classify_equals_the_cli(clf_server, cct_clf_run):
    cli = run_cli("classify", str(cct_clf_run), "--budget", "0.33",
                  stdin="\n".join(PAIRS).encode() + b"\n")
    assert cli.returncode == 0, cli.stderr.decode()
    r = clf_server.post("/v1/classify", json={"texts": PAIRS, "budget": 0.33})
    assert r.json()["labels"] == cli.stdout.decode().splitlines()


def test_mixed_budgets_in_one_batch_equal_each_budget_alone(cct_clf_run, offline):
    """One batch of five jobs at five budgets (trained and calibrated) gives each job what
    its budget gives alone, realized compute included when the rows are padded alike."""
    state = build_state(offline, "classify", ServeConfig(), log_stream=None)
    schema = CLASSIFY.request
    jobs = [CLASSIFY.plan(state, schema(texts=PAIRS, budget=b)) for b in BUDGETS]
    mixed = state.run_classify(jobs)
    for job, budget, (labels, compute, _) in zip(jobs, BUDGETS, mixed, strict=True):
        alone_labels, alone_compute, _ = state.run_classify([job])[0]
        assert labels == alone_labels == offline.classify(PAIRS, budget=budget)
        assert compute == alone_compute  # the same rows, padded to the same length
    fractions = [m[1][0]["fraction"]["total"] for m in mixed]
    assert len(set(fractions)) > 1  # the rows really ran at different budgets


def test_concurrent_requests_at_mixed_budgets_share_batches(clf_server, offline):
    want = {b: offline.classify(PAIRS, budget=b) for b in BUDGETS}
    jobs = [(i, BUDGETS[i % len(BUDGETS)]) for i in range(15)]
    count = "dynaseq_batch_distinct_budgets_count"
    batches_before = clf_server.metric(count, endpoint="classify")
    mixed_before = batches_before - clf_server.metric(
        "dynaseq_batch_distinct_budgets_bucket", endpoint="classify", le="1.0")

    def ask(job):
        i, budget = job
        r = httpx.post(clf_server.url + "/v1/classify",
                       json={"text": PAIRS[i % len(PAIRS)], "budget": budget}, timeout=60)
        return i, budget, r

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(ask, jobs))
    for i, budget, r in results:
        assert r.status_code == 200, r.text
        assert r.json()["label"] == want[budget][i % len(PAIRS)]
        assert r.json()["budget"] == budget
    batches = clf_server.metric(count, endpoint="classify")
    mixed = batches - clf_server.metric("dynaseq_batch_distinct_budgets_bucket",
                                        endpoint="classify", le="1.0")
    assert batches - batches_before < len(jobs)  # requests were batched together
    assert mixed > mixed_before  # and at least one batch held several budgets


BAD = [
    # (what, body, status, words of the error)
    ("empty texts", {"texts": []}, 422, "texts"),
    ("no text", {"budget": 0.5}, 422, "text"),
    ("one sentence for a pair task", {"text": "the cat sat"}, 422, "sentence-pair task"),
    ("three fields", {"texts": [PAIRS[0], "a\tb\tc"]}, 422, "line 2: rte is a sentence-pair"),
    ("budget over 1", {"text": PAIRS[0], "budget": 1.5}, 422, "(0, 1]"),
    ("budget 0", {"text": PAIRS[0], "budget": 0}, 422, "(0, 1]"),
    ("untrained budget", {"text": PAIRS[0], "budget": 0.6}, 422,
     "budget 0.6 was not trained; trained budgets: 0.8, 0.5, 0.33, 0.2; calibrated: 0.4"),
    ("budget pair", {"text": PAIRS[0], "budget": [1, 0.5]}, 422, "budget"),
    ("budget as string", {"text": PAIRS[0], "budget": "0.5"}, 422, "budget"),
    ("deadline without a latency table", {"text": PAIRS[0], "deadline_ms": 100}, 422,
     "deadline_ms needs the run's latency table"),
    ("budget and deadline", {"text": PAIRS[0], "budget": 0.5, "deadline_ms": 100}, 422,
     'give "budget" or "deadline_ms", not both'),
    ("unknown field", {"text": PAIRS[0], "beam": 2}, 422, "beam"),
    ("too many lines", {"texts": PAIRS[:1] * 9}, 413, "limit is 8"),
    ("line too long", {"text": "a " * 200}, 413, "characters"),
    ("too many tokens", {"texts": ["the cat sat " * 10 + "\tx"] * 8}, 413, "tokens"),
    ("line break in a line", {"text": "a\nb\tc"}, 422, "line break"),
    ("gamma on a model without adaptive depth", {"text": PAIRS[0], "gamma": 0.5}, 422,
     "no structure predictor"),
]


@pytest.mark.parametrize("what,body,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_one_line_4xx_and_the_server_answers_the_next(clf_server, what,
                                                                       body, status, words):
    r = clf_server.post("/v1/classify", json=body)
    assert r.status_code == status, (what, r.text)
    assert set(r.json()) == {"error"} and "\n" not in r.json()["error"]
    assert words in r.json()["error"], r.json()
    ok = clf_server.post("/v1/classify", json={"text": PAIRS[0], "budget": 0.5})
    assert ok.status_code == 200 and ok.json()["budget"] == 0.5


def test_a_dense_classifier_serves_without_a_budget(dense_server, dense_clf_run):
    c = dynaseq.load(dense_clf_run)
    lines = ["a charming , moving film", "", "dull and lifeless"]
    r = dense_server.post("/v1/classify", json={"texts": lines})
    assert r.status_code == 200, r.text
    assert r.json()["labels"] == c.classify(lines) == [c.classify([x])[0] if x else None
                                                      for x in lines]
    assert r.json()["budget"] is None
    compute = r.json()["compute"][0]
    assert compute["fraction"]["total"] == 1.0 and compute["macs_per_token"]["total"] > 0
    for body, words in [({"text": "a film", "budget": 0.5}, "dense encoder"),
                        ({"text": "a film", "budget": 1}, "dense encoder"),
                        ({"text": "a\tfilm"}, "takes one sentence per line")]:
        bad = dense_server.post("/v1/classify", json=body)
        assert bad.status_code == 422 and words in bad.json()["error"], bad.text
        assert dense_server.post("/v1/classify", json={"text": "a film"}).status_code == 200
    ready = dense_server.client.get("/readyz").json()
    assert ready["endpoints"] == ["/v1/classify"] and ready["budgets"] == []
    assert dense_server.post("/v1/translate", json={"text": "a"}).status_code == 404


def test_readiness_and_openapi_of_a_cct_classifier(clf_server):
    ready = clf_server.client.get("/readyz").json()
    assert ready["ready"] is True and ready["budgets"] == BUDGETS
    assert ready["deadline_policy"] is False
    schema = clf_server.client.get("/openapi.json").json()
    assert "/v1/classify" in schema["paths"]
    props = schema["components"]["schemas"]["ClassifyRequest"]["properties"]
    assert {"text", "texts", "budget"} <= set(props)


def test_metrics_count_what_was_sent(cct_clf_run):
    s = Server(cct_clf_run, "--batch-window-ms", "0", "--default-budget", "0.5")
    try:
        for _ in range(3):
            r = s.post("/v1/classify", json={"text": PAIRS[0]})
            assert r.is_success and r.json()["budget"] == 0.5  # --default-budget
        assert s.post("/v1/classify", json={"texts": PAIRS[:4], "budget": 0.4}).is_success
        assert s.post("/v1/classify", json={"text": 1}).status_code == 422
        assert s.post("/v1/classify", json={"text": "a", "budget": 0.7}).status_code == 422
        assert s.metric("dynaseq_requests_total", endpoint="classify", status="200") == 4
        assert s.metric("dynaseq_requests_total", endpoint="classify", status="422") == 2
        assert s.metric("dynaseq_lines_total", endpoint="classify", budget="0.5") == 3
        assert s.metric("dynaseq_lines_total", endpoint="classify", budget="0.4") == 4
        assert s.metric("dynaseq_request_latency_seconds_count", endpoint="classify",
                        budget="0.5") == 3
        assert s.metric("dynaseq_realized_compute_fraction_count", endpoint="classify",
                        budget="0.4") == 4
        assert s.metric("dynaseq_batch_lines_sum", endpoint="classify") == 7
        assert s.metric("dynaseq_queue_depth_lines") == 0
        assert s.metric("dynaseq_in_flight_requests") == 0  # every request answered
        assert s.metric("dynaseq_in_flight_limit") == float("inf")  # no --max-in-flight
    finally:
        s.stop()


def test_serve_refusals_of_classification_runs(cct_clf_run, dense_clf_run):
    for args, words in [
        ((str(cct_clf_run), "--default-budget", "0.6"), "was not trained"),
        ((str(dense_clf_run), "--default-budget", "0.5"), "dense encoder"),
        ((str(cct_clf_run), "--latency-table", "no_such_table.json"), "no_such_table.json"),
    ]:
        r = run_cli("serve", *args, "--port", "1")
        err = r.stderr.decode()
        assert r.returncode == 2 and words in err, (args, err)
        assert err.count("\n") == 1 and err.startswith("dynaseq: error:")


GAMMAS = [0.1, 0.5, 0.9, 0.3]
SENTENCES = ["a charming , moving film", "dull", "an uneven but often funny comedy", "bad",
             "", "it is a film about nothing at all , and it knows it"]


def test_adaptive_depth_requests_at_mixed_gammas_share_a_batch(depth_clf_run):
    """One batch of four jobs at four γ gives each what its γ gives alone and offline, with
    the layers each line ran; a bad γ is a 422 and the server goes on."""
    offline = dynaseq.load(depth_clf_run)
    with torch.no_grad():  # a predictor that spreads the depths over the inputs
        offline.model.encoder.predictor.out.weight.normal_(0, 3.0)
    state = build_state(offline, "classify", ServeConfig(), log_stream=None)
    jobs = [CLASSIFY.plan(state, CLASSIFY.request(texts=SENTENCES, gamma=g)) for g in GAMMAS]
    mixed = state.run_classify(jobs)
    depths = set()
    rows = offline.encode(SENTENCES)[0]
    for job, gamma, (labels, compute, layers) in zip(jobs, GAMMAS, mixed, strict=True):
        assert (labels, layers) == state.run_classify([job])[0][::2]
        # the compute reported is that of the layers the line ran, not of the whole model
        ran = [n for n in layers if n is not None]
        for (ids, _), n, c in zip(rows, ran, [c for c in compute if c], strict=True):
            full = sum(encoder_macs(offline.model, len(ids)).values())
            part = sum(encoder_macs(offline.model, len(ids), range(n)).values())
            assert c["fraction"]["total"] == pytest.approx(part / full)
            assert (c["fraction"]["total"] < 1) == (n < 4)
        assert labels == offline.classify(SENTENCES, gamma=gamma)
        assert layers[4] is None and all(1 <= n <= 4 for n in layers if n is not None)
        depths.update(n for n in layers if n is not None)
        body = CLASSIFY.answer(state, CLASSIFY.request(texts=SENTENCES, gamma=gamma), job,
                               (labels, None, layers))
        assert body["gamma"] == gamma and body["layers"] == layers
    assert len(depths) > 1  # the rows really exited at different depths
    s = Server(depth_clf_run, "--batch-window-ms", "0")
    try:
        r = s.post("/v1/classify", json={"text": SENTENCES[0]})
        assert r.status_code == 200 and r.json()["gamma"] == 0.5  # the run's default
        assert 1 <= r.json()["layers"] <= 4
        for bad in (1.5, 0, -0.1):
            r = s.post("/v1/classify", json={"text": SENTENCES[0], "gamma": bad})
            assert r.status_code == 422 and "in (0, 1)" in r.json()["error"], r.text
        assert s.post("/v1/classify", json={"text": SENTENCES[0],
                                            "gamma": 0.9}).status_code == 200
    finally:
        s.stop()


@pytest.fixture(scope="module")
def table_run(cct_clf_run, tmp_path_factory):
    """A copy of :func:`cct_clf_run` with its latency table (``dynaseq profile RUN
    --latency-table``: the run's validation sentences at each trained and calibrated
    budget)."""
    import shutil

    run = tmp_path_factory.mktemp("clf_table") / "run"
    shutil.copytree(cct_clf_run, run)
    r = run_cli("profile", str(run), "--latency-table", "--repeats", "1", "--table-batches",
                "1,4", "--table-lengths", "4,12", "--quiet")
    assert r.returncode == 0, r.stderr.decode()
    return run


def test_profile_writes_a_classification_latency_table(table_run):
    import json

    from dynaseq.metrics.latency_table import LatencyTable

    t = LatencyTable.load(table_run / "latency_table.json")
    assert [tuple(b) for b in t.budgets] == [(b,) for b in BUDGETS]  # trained + calibrated
    assert set(t.service_ms) == {f"{b:g}" for b in BUDGETS}
    assert (t.batch_sizes, t.lengths, t.beam) == ([1, 4], [4, 12], 1)
    assert all(v > 0 for rows in t.service_ms.values() for r in rows for v in r)
    assert "realized compute" in json.loads((table_run / "latency_table.json").read_text()
                                            )["extra"]["timed"]
    r = run_cli("profile", str(table_run), "--latency-table", "--beam", "2")
    assert r.returncode == 2 and b"--beam is for translation runs" in r.stderr


def test_classify_deadlines_choose_budgets_from_the_latency_table(table_run):
    """A loose deadline on an idle server runs the largest budget; one no budget can meet
    is a 503 with Retry-After; concurrent deadline requests, planned again when their batch
    is taken, each get the labels of the budget they report, one budget per batch."""
    offline = dynaseq.load(table_run)
    want = {b: offline.classify(PAIRS, budget=b) for b in BUDGETS}
    s = Server(table_run, "--batch-window-ms", "20")
    try:
        r = s.post("/v1/classify", json={"texts": PAIRS, "deadline_ms": 60_000})
        assert r.status_code == 200, r.text
        assert r.json()["budget"] == 0.8 and r.json()["degraded"] is False
        assert r.json()["labels"] == want[0.8]
        r = s.post("/v1/classify", json={"text": PAIRS[0], "deadline_ms": 0.001})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert "no budget" in r.json()["error"] and r.json()["reason"] == "deadline"
        assert s.metric("dynaseq_rejected_total", endpoint="classify", reason="deadline") == 1

        def ask(i):
            return i, httpx.post(s.url + "/v1/classify", timeout=60,
                                 json={"text": PAIRS[i % len(PAIRS)], "deadline_ms": 5_000})

        with ThreadPoolExecutor(8) as pool:
            results = [(i, r) for i, r in pool.map(ask, range(16)) if r.status_code != 503]
        assert results
        for i, r in results:
            assert r.status_code == 200, r.text
            assert r.json()["label"] == want[r.json()["budget"]][i % len(PAIRS)]
        batches = s.metric("dynaseq_batch_distinct_budgets_count", endpoint="classify")
        single = s.metric("dynaseq_batch_distinct_budgets_bucket", endpoint="classify",
                          le="1.0")
        assert single == batches  # every batch ran its deadline lines at one budget
    finally:
        s.stop()


def test_a_dense_classifier_plans_deadlines_on_its_one_row(dense_clf_run, tmp_path):
    """A dense encoder's table has one row, ``(1,)``: a deadline request runs without a
    budget, is predicted from that row, and one no batch can meet is refused."""
    import shutil

    from dynaseq.metrics.latency_table import LatencyTable
    from dynaseq.serve.endpoints import Overloaded

    run = tmp_path / "dense"
    shutil.copytree(dense_clf_run, run)
    r = run_cli("profile", str(run), "--latency-table", "--repeats", "1", "--table-batches",
                "1,2", "--table-lengths", "4,8", "--quiet")
    assert r.returncode == 0, r.stderr.decode()
    table = LatencyTable.load(run / "latency_table.json")
    assert table.budgets == [(1.0,)]
    c = dynaseq.load(run)
    state = build_state(c, "classify", ServeConfig(), table=table, log_stream=None)
    job = CLASSIFY.plan(state, CLASSIFY.request(text="a charming film", deadline_ms=60_000))
    assert job.budget is None and job.payload.ran is None and not job.payload.degraded
    assert job.predicted_ms is not None and job.predicted_ms > 0
    with pytest.raises(Overloaded, match="no budget can answer within 0.001 ms"):
        CLASSIFY.plan(state, CLASSIFY.request(text="a charming film", deadline_ms=0.001))


def test_a_classification_server_warms_each_budget_before_it_is_ready(cct_clf_run,
                                                                       dense_clf_run):
    """Before it reports ready, the server classifies one line of the task's shape (a pair
    for the CCT's pair task, a sentence for the dense one's) at each budget it runs, or
    once without a budget for a dense classifier; none of it is counted as served."""
    for run, cct in ((cct_clf_run, True), (dense_clf_run, False)):
        c = dynaseq.load(run)
        state = build_state(c, "classify", ServeConfig(), log_stream=None)
        calls, real = [], c.classify

        def recording(lines, real=real, calls=calls, **kw):
            calls.append((lines, kw["budget"]))
            return real(lines, **kw)

        c.classify = recording
        srv = InProcess(state)  # returns once the app has started: warmed, then ready
        try:
            want = [b[0] for b in state.budgets] if cct else [None]
            assert len(want) == (len(BUDGETS) if cct else 1)
            line = ("a", "a") if cct else "a"
            assert c.layout.is_pair == cct
            assert calls == [([line], b) for b in want]
            assert httpx.get(srv.url + "/readyz", timeout=30).status_code == 200
            assert sum(x.value for m in state.metrics.lines.collect() for x in m.samples) == 0
        finally:
            srv.stop()
