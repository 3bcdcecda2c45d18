"""Workflows: a run directory in, a new run directory (or report) out: quantize, prune,
cache-search, distill-data, calibrate, analyze, the demo."""
