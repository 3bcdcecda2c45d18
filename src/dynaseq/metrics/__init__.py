"""Compute accounting (analytic MACs, flop-counter cross-check), BLEU, latency."""

from dynaseq.metrics.macs import MacReport, count_macs, flop_counter_macs, pair_macs, ptr

__all__ = ["MacReport", "count_macs", "flop_counter_macs", "pair_macs", "ptr"]
