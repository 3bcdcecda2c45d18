"""serve_load: a budget-aware server under open-loop load (issue 30's benchmark).

Starts ``dynaseq serve`` on a translation run, or a classification run with ``--data
DEV.tsv`` (its ``latency_table.json``, measured here by ``dynaseq profile --latency-table``
on a copy of the run if it has none) and drives it with real HTTP clients over loopback
(aiohttp + asyncio, one process, on cores of its own):

1. saturation: closed-loop throughput (``--clients`` requests always in flight, default
   three batches' worth) at the full budget, at the smallest, and with the two mixed half
   and half (mixed vs. the same requests run as single-budget batches: the time-weighted rate
   ``2 / (1/R_full + 1/R_small)``), and the issue's "at the same mean budget": the two
   mixed in the proportion whose mean is a middle budget's (:func:`mix_at`) against every
   client at that budget;
2. the deadline: ``--deadline-factor`` x the median latency of one request at a time at
   the full budget (or ``--deadline-ms``);
3. open loop: Poisson arrivals at each ``--rates`` multiple of the full-budget saturation
   rate for ``--seconds`` each, one test sentence per request (seeded), for three policies
   side by side: always the full budget, always the smallest, deadline-aware
   (``deadline_ms``), each cell on a freshly started server (``--cell-rounds N``: each
   rate's cells N times, in turn and back, a row over all its rounds). Per cell: p50/p95/p99
   latency of the answered requests, SLO attainment (answered within the deadline /
   sent), goodput (answered within the deadline per second), mean budget served, the
   share served at the full budget, 503s, and the quality of what was answered: the BLEU
   of the returned translations against their references, or the accuracy of the returned
   labels against the gold ones (a classifier's "full budget" is its largest trained one,
   0.8 for a CCT-BERT). With ``--access-logs DIR`` each cell's server also writes its
   access log (one JSON line per request: budget, planned completion, margin, queue; the
   4 warm-up requests first) to ``DIR/RATEx_POLICY.jsonl``, to see where a cell's budgets
   fell or its answers came late.

Example (a few minutes on 2 CPU cores; take the shared lock)::

    flock /tmp/dynaseq-heavy.lock python benchmarks/serve_load.py --run runs/demo/run \
        --src runs/demo/data/test.src --ref runs/demo/data/test.tgt
    python benchmarks/serve_load.py --run runs/bench/cct_bert/cct_sst2 \
        --data ../shared/data/glue/SST-2/dev.tsv --table-src sst2_train_sentences.txt
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import sacrebleu

from _lib import add_results_arg, command, machine, md_head, md_table, provenance, write_results

POLICIES = ("full", "smallest", "deadline")


@dataclass(frozen=True)
class Task:
    """What the load differs in between run kinds: the endpoint, the answer's field, how a
    served answer is scored against its reference, and the profile options of the kind."""

    endpoint: str
    answer: str
    quality: str
    profile_args: tuple[str, ...]
    serve_args: tuple[str, ...]

    def score(self, hyps: list[str], refs: list[str]) -> float:
        if not hyps:
            return float("nan")
        if self.quality == "BLEU":
            return sacrebleu.corpus_bleu(hyps, [refs]).score
        from sklearn.metrics import accuracy_score

        return 100.0 * accuracy_score(refs, hyps)


TASKS = {"translate": Task("/v1/translate", "translation", "BLEU", ("--beam", "1"),
                           ("--beam", "1")),
         "classify": Task("/v1/classify", "label", "accuracy", (), ())}


def budget_json(budget: list[float]) -> float | list[float]:
    """A budget as a request gives it: a pair as a list, one fraction as a number."""
    return budget[0] if len(budget) == 1 else budget


def classify_pairs(run: Path, data: Path) -> list[tuple[str, str]]:
    """(line, gold label) of each row of the GLUE-layout ``data`` in the run's layout; a
    pair task's two sentences tab-separated, as ``/v1/classify`` takes them."""
    from dynaseq.tasks.classify.glue import read_table
    from dynaseq.tasks.registry import load

    ex = read_table(data, load(run).layout)
    lines = ex.text_a if ex.text_b is None else [f"{a}\t{b}" for a, b in
                                                 zip(ex.text_a, ex.text_b, strict=True)]
    return list(zip(lines, [str(x) for x in ex.targets()], strict=True))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_run(run: Path, work: Path, batches: str, lengths: str, table_src: Path,
                threads: int, cores: set[int] | None, task: Task) -> Path:
    """``run`` if it has a latency table, else a copy of it (config, tokenizer, checkpoint
    folders) in ``work`` with one measured there (free decoding of ``table_src``), with the
    server's torch ``threads`` on the server's ``cores`` (None: not pinned)."""
    if (run / "latency_table.json").is_file():
        return run
    dst = work / "run"
    if not (dst / "latency_table.json").is_file():
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(run, dst, ignore=shutil.ignore_patterns("log.jsonl", "*.lock"))
        subprocess.run([sys.executable, "-m", "dynaseq", "profile", str(dst), "--latency-table",
                        *task.profile_args, "--repeats", "3", "--table-batches", batches,
                        "--table-lengths", lengths, "--table-src", str(table_src)],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                       preexec_fn=pin_to(cores))
    return dst


def pin_to(cores: set[int] | None):
    """A child process's ``preexec_fn`` that pins it (and the threads it starts) to
    ``cores``; None (no pinning) for None."""
    return None if cores is None else (lambda: os.sched_setaffinity(0, cores))


def split_cores(server_cores: int) -> tuple[set[int], set[int]] | None:
    """(the server's cores, the load generator's) out of this process's, the server taking
    the first ``server_cores``; None when there are too few to give each side its own."""
    cores = sorted(os.sched_getaffinity(0))
    if server_cores <= 0 or len(cores) <= server_cores:
        return None
    return set(cores[:server_cores]), set(cores[server_cores:])


class ServerProc:
    """``dynaseq serve`` in a child process, pinned to ``cores`` (None: not pinned); its
    threads (event loop, batcher, torch's) inherit the pinning."""

    def __init__(self, run: Path, threads: int, window_ms: float, max_batch: int,
                 cores: set[int] | None = None, extra: list[str] | None = None,
                 task: Task = TASKS["translate"], access_log: Path | None = None,
                 src: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if src is not None:  # dynaseq imported from another checkout's src (before ours)
            env["PYTHONPATH"] = os.pathsep.join([str(src.resolve()), env.get("PYTHONPATH", "")])
        # the access log is the server's stderr: its JSON lines, and any warning it prints
        self.log = None if access_log is None else access_log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynaseq", "serve", str(run), "--port", str(self.port),
             *task.serve_args, "--threads", str(threads), "--batch-window-ms", str(window_ms),
             "--max-batch-lines", str(max_batch), "--max-lines", str(max_batch),
             *(["--no-access-log"] if access_log is None else []), *(extra or [])],
            env=env, preexec_fn=pin_to(cores), stderr=self.log)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("dynaseq serve did not start")
                time.sleep(0.2)
            self.info = httpx.get(self.url + "/readyz").json()
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            self._close_log()
            raise

    def stop(self) -> None:
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
        finally:
            self._close_log()

    def _close_log(self) -> None:
        if self.log is not None:
            self.log.close()

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the server process has used."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def queue_depth(self) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith("dynaseq_queue_depth_lines "):
                return float(line.split()[1])
        return 0.0


def body_for(policy: str, line: str, full: list[float], smallest: list[float],
             deadline_ms: float) -> dict:
    if policy == "full":
        return {"text": line, "budget": budget_json(full)}
    if policy == "smallest":
        return {"text": line, "budget": budget_json(smallest)}
    return {"text": line, "deadline_ms": deadline_ms}


def session(url: str, timeout_s: float) -> aiohttp.ClientSession:
    """The load generator's HTTP client: aiohttp (a fraction of httpx's CPU per request,
    which matters when one core must send hundreds a second), no connection limit."""
    return aiohttp.ClientSession(base_url=url,
                                 timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 connector=aiohttp.TCPConnector(limit=0))


async def closed_loop(url: str, lines: list[str], budgets: list, clients: int,
                      seconds: float, endpoint: str = "/v1/translate") -> float:
    """Requests per second with ``clients`` always in flight, client ``k`` always at
    ``budgets[k % len(budgets)]``."""
    done = 0
    stop_at = time.perf_counter() + seconds
    async with session(url, 60) as c:
        async def worker(k: int) -> None:
            nonlocal done
            i = k
            budget = budget_json(budgets[k % len(budgets)])
            while time.perf_counter() < stop_at:
                async with c.post(endpoint,
                                  json={"text": lines[i % len(lines)], "budget": budget}
                                  ) as r:
                    r.raise_for_status()
                    await r.read()
                done += 1
                i += clients

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(clients)))
        return done / (time.perf_counter() - t0)


def mix_at(middle: list[float], full: list[float], smallest: list[float],
           clients: int) -> list[list[float]]:
    """Budgets for ``clients`` closed-loop clients, ``full`` and ``smallest`` interleaved in
    the proportion whose mean budget (by total compute) is ``middle``'s: the issue's "mixed
    budgets against single-budget batches at the same mean budget". E.g. (1, 1) and
    (0.2, 0.2) at a mean of (0.5, 0.5): 12 of 32 clients at the full budget."""
    if not sum(smallest) < sum(middle) < sum(full):
        raise ValueError(f"{middle} is not between {smallest} and {full}")
    n_full = round(clients * (sum(middle) - sum(smallest)) / (sum(full) - sum(smallest)))
    if not 0 < n_full < clients:
        raise ValueError(f"{clients} clients cannot mix {full} and {smallest} at {middle}")
    # spread the full-budget clients evenly (Bresenham) so every batch holds both kinds
    return [full if (k + 1) * n_full // clients > k * n_full // clients else smallest
            for k in range(clients)]


def middle_budget(budgets: list[list[float]], full: list[float],
                  smallest: list[float]) -> list[float] | None:
    """The budget with every part equal (a diagonal one) nearest the midpoint of ``full``
    and ``smallest`` by total compute, strictly between them; None when there is none."""
    mid = (sum(full) + sum(smallest)) / 2
    inner = [b for b in budgets if len(set(b)) == 1 and sum(smallest) < sum(b) < sum(full)]
    return min(inner, key=lambda b: abs(sum(b) - mid)) if inner else None


async def one_at_a_time(url: str, lines: list[str], n: int, full: list[float],
                        endpoint: str = "/v1/translate") -> float:
    """Median latency (ms) of ``n`` full-budget requests sent one after another (the
    first two not counted)."""
    times = []
    async with session(url, 60) as c:
        for i in range(n):
            t0 = time.perf_counter()
            async with c.post(endpoint, json={"text": lines[i % len(lines)],
                                              "budget": budget_json(full)}) as r:
                r.raise_for_status()
                await r.read()
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times[2:])


async def open_loop(url: str, pairs: list[tuple[str, str]], policy: str, rate: float,
                    seconds: float, deadline_ms: float, full: list[float],
                    smallest: list[float], timeout_s: float, seed: int,
                    task: Task = TASKS["translate"]) -> list[dict]:
    """Poisson arrivals at ``rate``/s for ``seconds``; one record per request (what
    :func:`summarize` reads)."""
    rng = random.Random(seed)
    records: list[dict] = []
    async with session(url, timeout_s) as c:
        async def send(src: str, ref: str) -> None:
            t0 = time.perf_counter()
            rec = {"ref": ref}
            try:
                async with c.post(task.endpoint,
                                  json=body_for(policy, src, full, smallest, deadline_ms)
                                  ) as r:
                    rec["status"] = r.status
                    b = await r.json()
                if rec["status"] == 503:  # refused on arrival, or shed from its batch
                    rec["shed"] = b.get("reason") == "late"
                if rec["status"] == 200:
                    budget = b["budget"]
                    rec.update(hyp=str(b[task.answer]), degraded=b["degraded"],
                               budget=budget if isinstance(budget, list) else [budget],
                               server_ms=b["latency_ms"])
            except TimeoutError:
                rec["status"] = "timeout"
            except aiohttp.ClientError:  # the connection was refused or reset
                rec["status"] = "conn_error"
            rec["ms"] = 1000 * (time.perf_counter() - t0)
            records.append(rec)

        tasks = []
        t_end = time.perf_counter() + seconds
        nxt = time.perf_counter()
        while nxt < t_end:
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
            src, ref = pairs[rng.randrange(len(pairs))]
            tasks.append(asyncio.create_task(send(src, ref)))
            nxt += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return records


def slo_cell(row: dict) -> str:
    """A row's SLO attained for the table, each round's after it when it has several."""
    rounds = row.get("slo_by_round", [])
    return str(row["slo_attainment"]) + (
        f" ({', '.join(str(x) for x in rounds)})" if len(rounds) > 1 else "")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(records: list[dict], seconds: float, deadline_ms: float,
              full: list[float] = (1.0, 1.0), task: Task = TASKS["translate"]) -> dict:
    ok = [r for r in records if r["status"] == 200]
    lat = [r["ms"] for r in ok]
    in_slo = [r for r in ok if r["ms"] <= deadline_ms]
    budgets = [statistics.fmean(r["budget"]) for r in ok]
    quality = task.score([r["hyp"] for r in ok], [r["ref"] for r in ok])
    return {
        "sent": len(records), "answered": len(ok),
        "rejected_503": sum(r["status"] == 503 for r in records),
        "shed_late": sum(bool(r.get("shed")) for r in records),
        "timeouts": sum(r["status"] == "timeout" for r in records),
        "conn_errors": sum(r["status"] == "conn_error" for r in records),
        "other_errors": sum(r["status"] not in (200, 503, "timeout", "conn_error")
                            for r in records),
        "p50_ms": round(pct(lat, 0.50), 1), "p95_ms": round(pct(lat, 0.95), 1),
        "p99_ms": round(pct(lat, 0.99), 1),
        "server_p50_ms": round(pct([r["server_ms"] for r in ok], 0.50), 1),
        "server_p99_ms": round(pct([r["server_ms"] for r in ok], 0.99), 1),
        "accepted_within_deadline": round(len(in_slo) / max(len(ok), 1), 4),
        "slo_attainment": round(len(in_slo) / max(len(records), 1), 4),
        "goodput_rps": round(len(in_slo) / seconds, 2),
        "mean_budget": round(statistics.fmean(budgets), 3) if budgets else float("nan"),
        "full_budget_share": round(sum(list(r["budget"]) == list(full) for r in ok)
                                   / max(len(ok), 1), 4),
        "degraded": sum(bool(r.get("degraded")) for r in ok),
        task.quality.lower(): round(quality, 2),
    }


def deadline_cells(policies: list[str], variants: list[str]
                   ) -> list[tuple[str, str, list[str]]]:
    """(policy, name, more server options) of each cell at a rate, in the order they run:
    the policies as given, the deadline one once per ``NAME=ARGS`` variant (named
    ``deadline NAME``, its server given ARGS besides ``--server-args``), or once, plain,
    without variants."""
    parsed = []
    for v in variants:
        name, eq, more = v.partition("=")
        if not eq or not name.strip():
            raise SystemExit(f"--deadline-variant wants NAME=ARGS, got {v!r}")
        parsed.append((f"deadline {name.strip()}", more.split()))
    cells = []
    for policy in policies:
        for name, more in (parsed if policy == "deadline" and parsed else [(policy, [])]):
            cells.append((policy, name, more))
    return cells


def interleaved(cells: list, rounds: int) -> list[tuple[int, object]]:
    """``(round, cell)`` in the order a rate's cells run over ``rounds`` rounds: the cells
    as given, then backwards, and so on (a, b, c, c, b, a, ...), so that a machine that
    drifts in speed through a run weighs on every cell alike."""
    if rounds < 1:
        raise SystemExit(f"--cell-rounds must be >= 1, got {rounds}")
    return [(r, c) for r in range(rounds) for c in (cells if r % 2 == 0 else cells[::-1])]


def variant_sources(specs: list[str], names: list[str]) -> dict[str, Path]:
    """``{"deadline NAME": DIR}`` of ``--variant-src NAME=DIR``, each DIR a folder holding a
    ``dynaseq`` package, each NAME one of the cells' (``names``)."""
    out = {}
    for spec in specs:
        name, eq, folder = spec.partition("=")
        cell = f"deadline {name.strip()}"
        if not eq or cell not in names:
            raise SystemExit(f"--variant-src wants NAME=DIR with NAME a --deadline-variant, "
                             f"got {spec!r}")
        if not (Path(folder) / "dynaseq" / "__init__.py").is_file():
            raise SystemExit(f"--variant-src {spec!r}: {folder} holds no dynaseq package")
        out[cell] = Path(folder)
    return out


def wait_idle(server: ServerProc, limit_s: float = 60) -> None:
    t_end = time.monotonic() + limit_s
    while server.queue_depth() > 0 and time.monotonic() < t_end:
        time.sleep(0.1)
    time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, default=Path("runs/demo/run"))
    p.add_argument("--src", type=Path, default=Path("runs/demo/data/test.src"))
    p.add_argument("--ref", type=Path, default=Path("runs/demo/data/test.tgt"))
    p.add_argument("--data", type=Path, default=None,
                   help="a classification run's test rows (a GLUE-layout TSV with labels), "
                        "instead of --src/--ref")
    p.add_argument("--work", type=Path, default=Path("runs/bench/serve_load"),
                   help="where a copy of the run gets its latency table, if it has none")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0, 4.0],
                   help="multiples of the full-budget saturation rate")
    p.add_argument("--seconds", type=float, default=6.0, help="open-loop seconds per cell")
    p.add_argument("--saturation-seconds", type=float, default=5.0)
    p.add_argument("--saturation-rounds", type=int, default=3,
                   help="interleaved closed-loop rounds of each mix (medians reported)")
    p.add_argument("--clients", type=int, default=None,
                   help="closed-loop clients (default 3 x --max-batch: a queue deeper than "
                        "a batch, as at saturation, where the server forms single-budget "
                        "batches; at exactly one batch's worth every batch must mix)")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--cell-rounds", type=int, default=1,
                   help="run each rate's cells this many times, in turn and back (a, b, "
                        "c, c, b, a, ...; each round its own arrivals, the same for every "
                        "cell): a row sums its rounds and lists each round's SLO")
    p.add_argument("--base-rps", type=float, default=None,
                   help="the rate the --rates multiply (default: the measured full-budget "
                        "saturation), e.g. to compare two versions at the same arrivals")
    p.add_argument("--deadline-ms", type=float, default=None)
    p.add_argument("--deadline-factor", type=float, default=3.0,
                   help="deadline = this x one full-budget request's median latency")
    p.add_argument("--timeout-s", type=float, default=10.0, help="client timeout")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--server-cores", type=int, default=1,
                   help="pin the server to this many cores and the load generator to the "
                        "rest (0: no pinning; also none when there are no cores left over)")
    p.add_argument("--window-ms", type=float, default=5.0)
    p.add_argument("--server-args", default="",
                   help="more dynaseq serve options, one string (e.g. '--slack 0.8')")
    p.add_argument("--deadline-variant", action="append", default=[], metavar="NAME=ARGS",
                   help="run the deadline policy once per variant at each rate, side by "
                        "side, its server given ARGS (more dynaseq serve options, after "
                        "--server-args; e.g. 'u09=--max-utilization 0.9', 'plain='); "
                        "reported as 'deadline NAME'. Default: one, with --server-args")
    p.add_argument("--variant-src", action="append", default=[], metavar="NAME=DIR",
                   help="the deadline variant NAME's server imports dynaseq from DIR (the "
                        "src folder of another checkout: older code side by side)")
    p.add_argument("--access-logs", type=Path, default=None,
                   help="keep each cell's server access log (one JSON line per request, "
                        "with its planned completion and margin) in this folder, as "
                        "RATEx_POLICY.jsonl")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--table-src", type=Path, default=Path("runs/demo/data/valid.src"),
                   help="sentences the latency table is timed on (not the test set)")
    p.add_argument("--table-batches", default="1,2,4,8,16,32")
    p.add_argument("--table-lengths", default="8,16,32")
    p.add_argument("--seed", type=int, default=0)
    add_results_arg(p)
    args = p.parse_args()
    if args.clients is None:
        args.clients = 3 * args.max_batch
    if args.access_logs is not None:
        args.access_logs.mkdir(parents=True, exist_ok=True)

    task = TASKS["translate" if args.data is None else "classify"]
    if args.data is None:
        src = args.src.read_text().splitlines()
        ref = args.ref.read_text().splitlines()
        pairs = [(s, r) for s, r in zip(src, ref, strict=True) if s.strip()]
    else:
        pairs = classify_pairs(args.run, args.data)
    lines = [s for s, _ in pairs]
    # the cells, their order and their sources are checked before anything is measured
    cells = deadline_cells(args.policies, args.deadline_variant)
    order = interleaved(cells, args.cell_rounds)
    sources = variant_sources(args.variant_src, [name for _, name, _ in cells])
    split = split_cores(args.server_cores)
    run = prepare_run(args.run, args.work, args.table_batches, args.table_lengths,
                      args.table_src, args.threads, None if split is None else split[0], task)
    if split is not None:
        os.sched_setaffinity(0, split[1])
    extra = args.server_args.split() if args.server_args else []
    server = ServerProc(run, args.threads, args.window_ms, args.max_batch,
                        None if split is None else split[0], extra, task)
    started = time.time()
    try:
        # a translation's [encoder, decoder] pairs, a classifier's fractions: as lists
        budgets = [b if isinstance(b, list) else [b] for b in server.info["budgets"]]
        smallest = min(budgets, key=lambda b: (sum(b), b[-1]))
        full = max(budgets, key=lambda b: (sum(b), b[-1]))
        solo_ms = asyncio.run(one_at_a_time(server.url, lines, 22, full, task.endpoint))
        deadline = args.deadline_ms or round(args.deadline_factor * solo_ms, 1)
        middle = middle_budget(budgets, full, smallest)
        phases = [("full", [full]), ("smallest", [smallest]), ("mixed", [full, smallest])]
        if middle is not None:  # mixed against one budget at the same mean
            phases += [("middle", [middle]),
                       ("mixed_at_middle", mix_at(middle, full, smallest, args.clients))]
        rounds: dict[str, list[float]] = {name: [] for name, _ in phases}
        sat_cpu: dict[str, dict[str, float]] = {}
        for _ in range(args.saturation_rounds):  # interleaved: drifts hit all alike
            for name, bs in phases:
                wait_idle(server)
                cpu0, own0 = server.cpu_s(), time.process_time()
                rounds[name].append(round(asyncio.run(closed_loop(
                    server.url, lines, bs, args.clients, args.saturation_seconds,
                    task.endpoint)), 2))
                cpu = sat_cpu.setdefault(name, {"server_cpu_s": 0.0, "client_cpu_s": 0.0})
                cpu["server_cpu_s"] = round(cpu["server_cpu_s"] + server.cpu_s() - cpu0, 2)
                cpu["client_cpu_s"] = round(cpu["client_cpu_s"] + time.process_time() - own0,
                                            2)
                print(f"saturation {name}: {rounds[name][-1]} req/s", file=sys.stderr)
        sat = {name: statistics.median(v) for name, v in rounds.items()}
        segregated = 2 / (1 / sat["full"] + 1 / sat["smallest"])
        rows = []
        for mult in args.rates:
            rate = mult * (args.base_rps or sat["full"])
            got: dict[str, dict] = {}  # cell name -> its records and CPU over the rounds
            for r, (policy, name, more) in order:
                # a fresh server per cell: nothing one cell leaves (a backlog of abandoned
                # requests, the measured scale and margin) reaches the next
                server.stop()
                suffix = "" if r == 0 else f"_round{r}"
                log = (None if args.access_logs is None else args.access_logs
                       / f"{mult:g}x_{name.replace(' ', '_')}{suffix}.jsonl")
                server = ServerProc(run, args.threads, args.window_ms, args.max_batch,
                                    None if split is None else split[0], extra + more, task,
                                    log, sources.get(name))
                asyncio.run(one_at_a_time(server.url, lines, 4, full, task.endpoint))  # warm
                cpu0, own0 = server.cpu_s(), time.process_time()
                records = asyncio.run(open_loop(
                    server.url, pairs, policy, rate, args.seconds, deadline, full, smallest,
                    args.timeout_s, args.seed + int(100 * mult) + 7919 * r, task))
                g = got.setdefault(name, {"records": [], "slo": [], "server_cpu_s": 0.0,
                                          "client_cpu_s": 0.0, "more": more})
                g["records"] += records
                g["slo"].append(summarize(records, args.seconds, deadline, full,
                                          task)["slo_attainment"])
                g["server_cpu_s"] += server.cpu_s() - cpu0
                g["client_cpu_s"] += time.process_time() - own0
                print(f"{mult:g}x {name} round {r}: SLO {g['slo'][-1]}", file=sys.stderr)
            for _, name, _ in cells:
                g = got[name]
                cell = summarize(g["records"], args.seconds * args.cell_rounds, deadline,
                                 full, task)
                row = {"rate_x": mult, "rate_rps": round(rate, 2), "policy": name,
                       "server_options": extra + g["more"],
                       "server_src": str(sources.get(name, "src")), **cell,
                       "rounds": args.cell_rounds, "slo_by_round": g["slo"],
                       "server_cpu_s": round(g["server_cpu_s"], 2),
                       "client_cpu_s": round(g["client_cpu_s"], 2)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    finally:
        server.stop()
    table = json.loads((run / "latency_table.json").read_text())
    data = {
        "command": command(), "made_by": provenance(),
        "machine": machine(processor=True, server_threads=args.threads, cores=os.cpu_count()),
        "pinning": (None if split is None else
                    {"server_cores": sorted(split[0]), "client_cores": sorted(split[1])}),
        "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
        "run": str(args.run), "run_with_table": str(run),
        "test_set": (f"{args.src} / {args.ref}" if args.data is None else str(args.data))
                    + f" ({len(pairs)} {'sentences' if args.data is None else 'rows'}, "
                    "drawn at random)",
        "endpoint": task.endpoint, "quality": task.quality,
        "server": {"beam": 1 if args.data is None else None, "batch_window_ms": args.window_ms,
                   "options": extra, "max_batch_lines": args.max_batch,
                   "threads": args.threads, "budgets": budgets, "full": full,
                   "smallest": smallest},
        "latency_table": {k: table[k] for k in ("batch_sizes", "lengths", "service_ms",
                                                "extra")},
        "solo_full_ms": round(solo_ms, 2), "deadline_ms": deadline,
        "saturation_rps": sat, "saturation_rounds_rps": rounds, "saturation_cpu": sat_cpu,
        "saturation_seconds": args.saturation_seconds,
        "segregated_rps": round(segregated, 2),
        "mixed_over_segregated": round(sat["mixed"] / segregated, 3),
        "middle": middle,
        "mixed_at_middle_full_clients": (None if middle is None else sum(
            b == full for b in mix_at(middle, full, smallest, args.clients))),
        "mixed_at_middle_over_middle": (None if middle is None else
                                        round(sat["mixed_at_middle"] / sat["middle"], 3)),
        "seconds_per_cell": args.seconds, "cell_rounds": args.cell_rounds,
        "client_timeout_s": args.timeout_s,
        "rows": rows,
    }
    md = md_head(
        "serve_load: open-loop Poisson load on dynaseq serve, three budget policies",
        data["command"],
        f"Machine: {data['machine']}  ",
        f"Run: `{args.run}` (latency table in `{run}`); `{task.endpoint}`; test set "
        f"{data['test_set']}; " + ("greedy; " if args.data is None else "")
        + f"batching window {args.window_ms} ms, at most {args.max_batch} lines a "
        f"batch; server torch threads {args.threads}; "
        + (f"server options `{' '.join(extra)}`; " if extra else "")
        + ("client and server share the machine's cores.  " if split is None else
           f"server pinned to cores {sorted(split[0])}, the load generator to "
           f"{sorted(split[1])}.  "),
        f"Saturation (closed loop, {args.clients} clients, medians of "
        f"{args.saturation_rounds} interleaved rounds of {args.saturation_seconds} s): full "
        f"budget {budget_json(full)} {sat['full']} req/s, "
        f"smallest {smallest} {sat['smallest']} req/s, half and half mixed "
        f"{sat['mixed']} req/s = {data['mixed_over_segregated']}x the same requests "
        f"in single-budget batches ({data['segregated_rps']} req/s)"
        + ("." if middle is None else
           f"; at the same mean budget {middle}: {data['mixed_at_middle_full_clients']} of "
           f"{args.clients} clients at the full budget, the rest at the smallest, "
           f"{sat['mixed_at_middle']} req/s = {data['mixed_at_middle_over_middle']}x "
           f"every client at {middle} ({sat['middle']} req/s)") + ".  ",
        f"Deadline {deadline} ms ("
        + ("given: " if args.deadline_ms else "")
        + f"{round(deadline / solo_ms, 1)} x one full-budget request alone, "
        f"{data['solo_full_ms']} ms); rates are multiples of the full-budget saturation "
        f"rate; {args.seconds} s of arrivals per cell"
        + (f" in each of {args.cell_rounds} rounds, run in turn and back (a row sums its "
           "rounds; its SLO is followed by each round's)" if args.cell_rounds > 1 else "")
        + f", client timeout {args.timeout_s} s.")
    md += md_table(
        ["rate", "req/s", "policy", "sent", "503 (shed)", "timeouts + resets", "p50 ms",
         "p95 ms", "p99 ms",
         "server p50/p99 ms", "SLO attained", "accepted in SLO", "goodput/s", "mean budget",
         "full share", task.quality],
        "rrlrrrrrrrrrrrrr",
        [[f"{r['rate_x']}x", r["rate_rps"], r["policy"], r["sent"],
          f"{r['rejected_503']} ({r.get('shed_late', 0)})",
          r["timeouts"] + r["conn_errors"], r["p50_ms"], r["p95_ms"], r["p99_ms"],
          f"{r['server_p50_ms']} / {r['server_p99_ms']}", slo_cell(r),
          r["accepted_within_deadline"], r["goodput_rps"], r["mean_budget"],
          r["full_budget_share"], r[task.quality.lower()]] for r in rows])
    md += ["", "503 (shed): refused, of which (shed) were admitted and then dropped when "
           "their batch was formed, predicted late even at the smallest budget. "
           "SLO attained: answered within the deadline / sent. Accepted in SLO: answered "
           "within the deadline / answered. p-latencies are of the answered requests, "
           "measured by the client (timeouts excluded, counted apart); server p50/p99: the "
           "`latency_ms` the server reported (from the app receiving the request to its "
           "answer)."]
    write_results(args.results, "serve_load", data, md)
    print("\n".join(md))


if __name__ == "__main__":
    main()
