"""Compression as functions over an ``nn.Module``: each takes a model and returns it changed
(int8 quantization for CPU inference, quantization-aware training, pruning, distillation
targets). Nothing here reads or writes a run directory: that is :mod:`dynaseq.workflows`.

Import from the submodules (``dynaseq.compress.int8``, ``.qat``, ``.prune``, ``.distill``,
``.lm_distill``).
"""
