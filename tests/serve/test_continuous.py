"""``dynaseq serve --continuous``: translation through one refilled greedy decode whose
finished lines' rows queued lines take over (serve/endpoints.py
``run_translate_continuous``, serve/batcher.py ``Batcher.take_more``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dynaseq.serve.batcher import Batcher, Job, QueueFull, Shed
from dynaseq.serve.metrics import ServerMetrics

from helpers import run_cli
from serve_helpers import BUDGETS, Server


@pytest.fixture(scope="module")
def continuous(serve_run, tmp_path_factory) -> Iterator[Server]:
    """A continuous server on the micro CCT: 4 rows, so lines wait and take rows over."""
    log = tmp_path_factory.mktemp("serve_log") / "continuous.log"
    s = Server(serve_run, "--beam", "1", "--continuous", "--max-batch-lines", "4",
               "--max-lines", "4", "--batch-window-ms", "20", log=log)
    yield s
    s.stop()


def test_concurrent_requests_at_mixed_budgets_get_the_offline_answers_and_compute(
        continuous, server, offline, lines):
    """Many requests of one or several lines at three budgets, more lines than rows: each
    answer equals the offline translation at its budget, and each line's realized compute
    equals what the batch server reports for it."""
    want = {b: offline.translate(lines, beam=1, budget=b) for b in BUDGETS}
    jobs = [(i, BUDGETS[i % len(BUDGETS)], 1 + i % 3) for i in range(15)]

    def ask(url, job):
        i, budget, n = job
        texts = [lines[(i + k) % len(lines)] for k in range(n)]
        return httpx.post(url + "/v1/translate", json={"texts": texts, "budget": list(budget)},
                          timeout=60)

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: ask(continuous.url, j), jobs))
    for (i, budget, n), r in zip(jobs, got, strict=True):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["translations"] == [want[budget][(i + k) % len(lines)] for k in range(n)]
        assert body["budget"] == list(budget)
        batch = ask(server.url, (i, budget, n)).json()  # the batch server, same request
        assert body["compute"] == batch["compute"]
    assert continuous.metric("dynaseq_batch_failures_total", endpoint="translate") == 0


def test_deadlines_on_a_continuous_decode_get_the_budget_they_report(
        continuous, serve_run, offline, lines):
    """A continuous server with the run's latency table: a loose deadline on an idle
    server runs the full budget; concurrent deadline requests, more lines than rows, each
    get the offline translation at the budget they report (those with a loose deadline are
    all answered, whatever the tight ones beside them get: on a busy machine the decode's
    lines take several times the table's time and the tight ones may all be shed); a
    deadline no budget can meet is a 503 with ``Retry-After``, and the next request is
    answered."""
    table = json.loads((serve_run / "latency_table.json").read_text())
    slowest = max(v for rows in table["service_ms"].values() for r in rows for v in r)
    want = {b: offline.translate(lines, beam=1, budget=b) for b in BUDGETS}
    s = continuous
    r = s.post("/v1/translate", json={"text": lines[0], "deadline_ms": 100 * slowest})
    assert r.status_code == 200, r.text
    assert r.json()["budget"] == [1.0, 1.0] and r.json()["degraded"] is False
    assert r.json()["translation"] == want[(1.0, 1.0)][0]

    def ask(i):
        return i, httpx.post(s.url + "/v1/translate", timeout=60, json={
            "text": lines[i % len(lines)], "deadline_ms": (4 if i % 2 else 100) * slowest})

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(ask, range(12)))
    assert all(r.status_code == 200 for i, r in got if i % 2 == 0), [r.text for _, r in got]
    for i, r in got:
        if r.status_code == 503:
            assert i % 2 and r.json()["reason"] in ("deadline", "late"), r.text
            continue
        assert r.status_code == 200, r.text
        assert r.json()["translation"] == want[tuple(r.json()["budget"])][i % len(lines)]
    r = s.post("/v1/translate", json={"text": lines[0], "deadline_ms": 0.001})
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.json()["reason"] == "deadline"
    assert s.post("/v1/translate", json={"text": lines[1]}).status_code == 200
    assert s.metric("dynaseq_batch_failures_total", endpoint="translate") == 0


def test_continuous_refusals_are_one_line_exit_2(serve_run, lm_run):
    for args, words in [
        ((str(serve_run), "--continuous", "--beam", "2"), "--continuous decodes greedily"),
        ((str(lm_run), "--continuous"), "--continuous is for translation runs"),
        ((str(serve_run), "--continuous", "--beam", "1", "--answer-at-batch-end"),
         "a continuous batch never ends"),
    ]:
        r = run_cli("serve", *args, "--port", "1")
        err = r.stderr.decode()
        assert r.returncode == 2 and words in err, (args, err)
        assert err.count("\n") == 1 and err.startswith("dynaseq: error:")


def _job(group, rows, due=None, payload=None):
    job = Job(group=group, run=lambda jobs: [None] * len(jobs), payload=payload, rows=rows,
              endpoint="t")
    job.due = due
    return job


def test_take_more_takes_the_front_of_the_queue_while_it_is_of_the_group_and_fits():
    async def go():
        b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=8, max_queue_rows=100)
        jobs = [_job("a", 2), _job("a", 1), _job("a", 3), _job("b", 1), _job("a", 1)]
        jobs[1].cancel()  # its client left: dropped, not run
        for j in jobs:
            b.submit(j)
        first = b.take_more("a", 5)  # 2 + 3 fit; the b job stops it
        second = b.take_more("a", 5)
        rest = [j.group for j in b._queue]
        return jobs, first, second, rest

    jobs, first, second, rest = asyncio.run(go())
    assert first == [jobs[0], jobs[2]] and second == [] and rest == ["b", "a"]
    assert jobs[0].started is not None and jobs[0].batch_rows == 2


def test_take_more_stops_at_what_does_not_fit_and_replans_deadline_jobs():
    """The deadline jobs taken are planned again together (with the jobs still queued);
    one the replan sheds gets the Shed and is not handed over."""
    seen = []

    def replan(jobs, scale, behind):
        seen.append((jobs, scale, list(behind)))
        for j in jobs:
            if j.payload == "shed":
                j.shed = Shed("too late", 3)

    async def go():
        b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=8, max_queue_rows=100)
        jobs = [_job("a", 3), _job("a", 1, due=1e18, payload="shed"),
                _job("a", 1, due=1e18), _job("a", 2)]
        for j in jobs[1:3]:
            j.replan = replan
        futs = [b.submit(j) for j in jobs]
        small, fits = b.take_more("a", 2), b.take_more("a", 5)
        await asyncio.sleep(0)
        return jobs, small, fits, futs

    jobs, small, fits, futs = asyncio.run(go())
    assert small == [] and fits == [jobs[0], jobs[2]]  # the shed job is not handed over
    assert isinstance(futs[1].exception(), Shed) and not futs[2].done()
    assert [(j, rest) for j, _, rest in seen] == [(jobs[:3], jobs[3:])]


def test_rows_of_a_continuous_decode_are_what_a_snapshot_sees_and_move_the_scale(
        monkeypatch):
    """:meth:`Batcher.row_wait` / ``row_begin`` / ``row_end``: the snapshot's
    ``rows_waiting`` holds each waiting line's predicted time, scaled, ``rows_left`` each
    running line's less its age; a finished line's real over predicted time (from when it
    took its row) sets the scale (the first at once), a dropped one only once it ran
    longer than the scale predicts."""
    import dynaseq.serve.batcher as batcher_mod

    now = [100.0]
    monkeypatch.setattr(batcher_mod.time, "perf_counter", lambda: now[0])
    b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=4, max_queue_rows=100)
    b.row_wait("a", 100.0)
    b.row_wait("b", 200.0)
    assert b.snapshot().rows_waiting == (100.0, 200.0) and b.snapshot().rows_left == ()
    now[0] += 1.0  # waiting does not count
    b.row_begin("a")
    now[0] += 0.03
    b.row_begin("b")
    assert b.running_rows == 2 and b.snapshot().rows_waiting == ()
    assert sorted(b.snapshot().rows_left) == pytest.approx([70.0, 200.0])
    now[0] += 0.12  # "a" took 150 ms for 100 predicted
    b.row_end("a")
    assert b.scale == pytest.approx(1.5) and b.running_rows == 1
    assert b.snapshot().rows_left == pytest.approx((1.5 * 200 - 120.0,))
    b.row_end("b", finished=False)  # dropped after 120 ms of 300 predicted: no news
    assert b.scale == pytest.approx(1.5) and b.snapshot().rows_left == ()
    b.row_wait("c", 100.0)
    b.row_begin("c")
    now[0] += 0.2
    b.row_end("c", finished=False)  # dropped after running 2x its prediction: it counts
    assert b.scale == pytest.approx(0.5 * 1.5 + 0.5 * 2.0)
    # past the first lines, each moves it by a batch's weight over the rows: 0.2 / 4
    for k in range(30):
        b.row_wait(k, 100.0)
        b.row_begin(k)
        now[0] += 0.1
        b.row_end(k)  # on time: ratio 1
    before = b.scale
    b.row_wait("slow", 100.0)
    b.row_begin("slow")
    now[0] += 0.3
    b.row_end("slow")
    assert b.scale == pytest.approx(0.95 * before + 0.05 * 3.0)


def _feeding(rows, answers, fail=False, leave=False):
    """A job whose run takes the queued jobs (``more``) and answers them, or raises, or
    leaves one it took unanswered."""
    def run(jobs, more):
        taken = more(10)
        if fail:
            raise RuntimeError("boom")
        for job in taken[: len(taken) - int(leave)]:
            job.settle(job.payload)
        answers.append([j.payload for j in jobs + taken])
        return [j.payload for j in jobs]

    return Job(group="a", run=run, payload=f"first-{rows}", rows=rows, endpoint="t",
               feeds=True)


@pytest.mark.parametrize("fail, leave", [(False, False), (True, False), (False, True)])
def test_a_feeding_batch_answers_the_jobs_it_took_and_a_fault_fails_them_all(fail, leave):
    async def go():
        answers = []  # one line a batch: the first job alone, the others queued
        b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=1, max_queue_rows=100)
        first = _feeding(1, answers, fail, leave)
        others = [_job("a", 1, payload=f"later-{i}") for i in range(3)]
        futs = [b.submit(first)] + [b.submit(j) for j in others]
        b.start()
        got = await asyncio.gather(*futs, return_exceptions=True)
        b.stop()
        return got

    got = asyncio.run(go())
    if not fail and not leave:
        assert got == ["first-1", "later-0", "later-1", "later-2"]
    elif fail:
        assert all(isinstance(g, RuntimeError) and str(g) == "boom" for g in got)
    else:  # the last job it took was left unanswered: a fault of the batch, whose jobs
        # not yet answered fail with it
        assert got[1:3] == ["later-0", "later-1"]
        assert all(isinstance(g, RuntimeError) and "unanswered" in str(g)
                   for g in (got[0], got[3]))


def test_in_process_jobs_fed_while_decoding_are_answered_and_a_gone_client_leaves(
        offline, lines, monkeypatch):
    """``run_translate_continuous`` in process, 2 rows: the first batch's jobs, then the
    jobs ``more`` hands over (one of only empty lines), each settled once with the offline
    translations at its budget; a job whose client has gone (its lines would run several
    steps) is settled without decoding them, and nothing else changes."""
    from dynaseq.serve.endpoints import TranslateWork, run_translate_continuous

    settled = {}
    monkeypatch.setattr(Job, "settle", lambda self, result: settled.setdefault(id(self),
                                                                               result))
    want = {b: offline.translate(lines, beam=1, budget=b) for b in BUDGETS}

    def job(k, group):
        budget = BUDGETS[k % len(BUDGETS)]
        work = TranslateWork(group, offline.tokenizer.encode(group), budget, budget, False)
        return Job(group=("translate", 1), run=None, payload=work, rows=len(group))

    first = [job(0, lines[:2])]
    later = [job(1, lines[2:3]), job(2, [""]), job(3, lines[3:5]), job(4, lines[5:6])]
    gone = later[2]
    gone.cancel()
    queue = list(later)

    def more(rows):
        taken = []
        while queue and sum(j.rows for j in taken) + queue[0].rows <= rows:
            taken.append(queue.pop(0))
        return taken

    assert run_translate_continuous(offline, True, first, more, max_rows=2) == [None]
    assert set(settled) == {id(j) for j in first + later}
    for k, j in enumerate(first + later):
        texts, compute = settled[id(j)]
        if j is gone:
            assert texts == ["", ""] and compute == [None, None]
            continue
        group = j.payload.lines
        budget = BUDGETS[k % len(BUDGETS)]
        assert texts == [want[budget][lines.index(x)] if x else "" for x in group]
        assert [c is None for c in compute] == [not x for x in group]


def test_stop_drains_a_feeding_batch_and_the_jobs_queued_behind_it():
    """``Batcher.stop`` (SIGTERM's drain) while a feeding batch runs: it refuses new jobs,
    and the batch still takes the queued ones and answers them before the worker ends."""
    import threading

    async def go():
        gate, answered = threading.Event(), []
        b = Batcher(ServerMetrics(), window_ms=0, max_batch_rows=1, max_queue_rows=100)

        def run(jobs, more):
            gate.wait(5)  # the queue fills and stop() is called meanwhile
            taken = more(10)
            for job in taken:
                job.settle(job.payload)
            answered.extend(j.payload for j in taken)
            return [j.payload for j in jobs]

        first = Job(group="a", run=run, payload="first", rows=1, endpoint="t", feeds=True)
        futs = [b.submit(first)]
        b.start()
        await asyncio.sleep(0.05)  # the worker took the first job
        futs += [b.submit(_job("a", 1, payload=f"later-{i}")) for i in range(3)]
        stopper = threading.Thread(target=b.stop)
        stopper.start()
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull, match="shutting down"):
            b.submit(_job("a", 1))
        gate.set()
        got = await asyncio.gather(*futs)
        stopper.join(5)
        return got, answered, b.alive

    got, answered, alive = asyncio.run(go())
    assert got == ["first", "later-0", "later-1", "later-2"]
    assert answered == ["later-0", "later-1", "later-2"] and not alive


def test_in_process_a_line_past_its_deadline_leaves_and_its_job_gets_a_503(offline, lines,
                                                                            monkeypatch):
    """``run_translate_continuous``: a job whose deadline has passed (``expires`` 0) while
    its lines decode is refused with a :class:`Shed` carrying the ``Retry-After``, not
    answered with empty translations; the job beside it gets its offline translation, and
    the clock saw each line wait, take its row and leave it, the expired one leaving
    unfinished before it took one."""
    from dynaseq.serve.endpoints import TranslateWork, run_translate_continuous

    class Clock:
        def __init__(self):
            self.events = []

        def row_wait(self, key, predicted_ms):
            self.events.append(("wait", key, predicted_ms))

        def row_begin(self, key):
            self.events.append(("begin", key, None))

        def row_end(self, key, finished=True):
            self.events.append(("end", key, finished))

    want = offline.translate(lines, beam=1, budget=BUDGETS[0])
    answers = {}
    settle = Job.settle
    monkeypatch.setattr(Job, "settle", lambda self, result: (
        answers.setdefault(id(self), result), settle(self, result)))
    jobs = []
    for k, line in enumerate(lines[:2]):
        work = TranslateWork([line], offline.tokenizer.encode([line]), BUDGETS[0],
                             BUDGETS[0], False)
        jobs.append(Job(group=("translate", 1), run=None, payload=work, rows=1,
                        deadline_ms=50.0, expires=0.0 if k == 0 else None))
    clock = Clock()
    run_translate_continuous(offline, True, jobs, lambda rows: [], max_rows=4, clock=clock,
                             line_ms=lambda budget, length: 7.0, retry_after_s=5)
    late, ok = jobs
    assert late.settled and isinstance(late.shed, Shed) and late.shed.retry_after_s == 5
    assert "passed while its lines were decoding" in str(late.shed)
    assert ok.settled and ok.shed is None and answers[id(ok)][0] == [want[1]]
    assert id(late) not in answers
    seen = {id(late): [], id(ok): []}
    for what, key, value in clock.events:
        seen[key[0]].append((what, value))
    # the late line left while it waited (its deadline had passed): it never took a row
    assert seen == {id(late): [("wait", 7.0), ("end", False)],
                    id(ok): [("wait", 7.0), ("begin", None), ("end", True)]}
