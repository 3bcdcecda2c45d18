"""Gate statistics and plots of trained CCT models (Bapna et al. 2020, section 7).

* :mod:`~dynaseq.analysis.gates` — per-token compute and gate values from gate traces, and
  their reductions for fig. 9-13;
* ``dynaseq analyze`` (:mod:`dynaseq.workflows.analyze`): a run at its budgets -> JSON;
* :mod:`~dynaseq.analysis.plots` — the fig. 9-13 PNGs from that JSON (matplotlib, Agg).
"""

from dynaseq.analysis.gates import (
    GateStats,
    StepUsage,
    SubwordCompute,
    TokenCompute,
    activation_rates,
    collect_gate_stats,
    compute_by_rank,
    compute_by_subword,
    compute_histogram,
    token_compute,
    usage_by_step,
)

__all__ = [
    "GateStats",
    "StepUsage",
    "SubwordCompute",
    "TokenCompute",
    "activation_rates",
    "collect_gate_stats",
    "compute_by_rank",
    "compute_by_subword",
    "compute_histogram",
    "token_compute",
    "usage_by_step",
]
