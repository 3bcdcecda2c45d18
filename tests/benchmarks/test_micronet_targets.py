"""benchmarks/micronet.py's targets: one definition per key (perplexities without the cache
unless the key says ``_cache``; relative costs between perplexities without the cache)."""

from __future__ import annotations

from helpers import load_benchmark


def test_prune_quant_target_keeps_with_and_without_cache_apart():
    micronet = load_benchmark("micronet")
    rows = [{"name": "core", "test_ppl": 200.0, "test_ppl_cache": 140.0,
             "ms_per_token": {}, "gen_ratio": 1.0},
            {"name": "prune", "pruned_from": "core", "test_ppl": 210.0, "test_ppl_cache": 150.0},
            {"name": "cache", "test_ppl": 210.0, "test_ppl_cache": 125.0},
            {"name": "quant", "test_ppl": 198.0, "test_ppl_cache": 124.0},
            {"name": "control", "test_ppl": 190.0, "test_ppl_cache": 120.0}]
    t = micronet.targets(rows)["prune_quant"]
    assert (t["ppl_before_prune"], t["ppl_quantized"], t["ppl_control"]) == (200.0, 198.0, 190.0)
    assert (t["ppl_pruned_cache"], t["ppl_quantized_cache"]) == (125.0, 124.0)
    assert t["relative_cost_of_prune_and_qat"] == round(198.0 / 200.0 - 1, 4)
    assert t["relative_cost_vs_control"] == round(198.0 / 190.0 - 1, 4)
