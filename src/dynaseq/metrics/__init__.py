"""Compute accounting (analytic MACs, flop-counter cross-check), BLEU, latency."""

from dynaseq.metrics.macs import MacReport, count_macs, flop_counter_macs

__all__ = ["MacReport", "count_macs", "flop_counter_macs"]
