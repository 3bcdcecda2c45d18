"""Compression as functions over an ``nn.Module``: each takes a model and returns it changed
(int8 quantization for CPU inference, quantization-aware training, pruning, distillation).

Import from the submodules (``dynaseq.compress.int8``, ``.qat``, ``.prune``, ``.distill``;
``.seqkd``: sequence-level knowledge distillation data).
"""
