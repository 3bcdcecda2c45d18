"""Conditional Computation Transformer (Bapna, Arivazhagan, Firat 2020).

Per-token gates on every attention (key/value and query gates) and feed-forward piece,
noisy-sigmoid gates trained in expectation, a two-sided budget loss, control-symbol budgets,
calibrated inference offsets; gated-off work is not executed. Import from the submodules:
``layers`` (the gated encoder/decoder layers and the budget loss), ``gating``, ``budget``,
``conditional_attention``, ``conditional_ffn``, ``calibration``, ``self_distill``.
"""

from dynaseq.techniques.cct import lean_step  # noqa: F401, E402  (registers the lean parts)
