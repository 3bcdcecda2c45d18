"""A model in eval mode for one block of work, walking its module tree only when it must.

``nn.Module.eval()`` and ``train()`` walk the whole module tree and set an attribute on every
module. On a loaded Multi30k CCT translator (about 380 modules) the pair was the largest
Python-side cost of ``translate([line])`` in cProfile (2.6 ms a call there); without them,
translating one sentence takes 0.90x the time at budget 0.5 (interleaved, no profiler). A
predictor's model is loaded in eval mode, so :func:`evaluating` finds nothing to do there and
writes nothing: concurrent callers of one loaded model then also leave its module state alone.

Example::

    with evaluating(model):
        logits = model(tokens)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the block, in training mode again after it if it was.

    Reads the root module's flag: ``train()`` and ``eval()`` set the whole tree alike, so a
    root in eval mode means a tree in eval mode, and nothing is walked or written."""
    if not model.training:
        yield model
        return
    model.eval()
    try:
        yield model
    finally:
        model.train()
