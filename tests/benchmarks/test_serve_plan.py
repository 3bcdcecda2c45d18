"""benchmarks/serve_plan.py: the policy that keeps nothing between requests decides as the
served one does (what it times is the same work, priced again)."""

from __future__ import annotations

import random

from dynaseq.metrics.latency_table import LatencyTable
from dynaseq.serve.batcher import Load
from dynaseq.serve.policy import Work

from helpers import load_benchmark

FULL, HALF = (1.0, 1.0), (0.5, 0.5)


def test_priced_and_every_line_policies_plan_alike_and_only_one_keeps_prices():
    sp = load_benchmark("serve_plan")
    table = LatencyTable([FULL, HALF], [1, 10], [10, 20],
                         {"1,1": [[10.0, 20.0], [50.0, 100.0]],
                          "0.5,0.5": [[6.0, 12.0], [30.0, 60.0]]})
    priced, every = sp.policy(table, 4, True), sp.policy(table, 4, False)
    rng = random.Random(1)
    ahead = []
    for _ in range(30):
        w = Work(rng.choice([FULL, HALF]), 1, rng.randint(5, 25), True)
        load = Load(list(ahead), 20.0, 1.3, 10.0, 10.0, 100.0)
        for deadline in (60.0, 200.0, 2000.0):
            assert priced.plan(load, deadline, 1, w.length) == every.plan(load, deadline, 1,
                                                                          w.length)
        assert priced.predicted(load, FULL, 1, w.length) == every.predicted(load, FULL, 1,
                                                                            w.length)
        ahead.append(w)
    assert priced._priced.cache_info().currsize > 0 and len(priced._line_costs) > 0
    assert len(every._line_costs) == 0
    assert sp.time_requests(every, ahead[:8], ahead[8:12], 200.0) > 0
