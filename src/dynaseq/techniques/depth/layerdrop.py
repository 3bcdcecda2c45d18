"""LayerDrop (Fan, Grave & Joulin 2019, "Reducing Transformer Depth on Demand with Structured
Dropout"), a baseline of adaptive depth: train with each layer application skipped with
probability p, then prune the trained model to any depth at inference without fine-tuning.

Both are the ``layers`` argument of an encoder call (the plan positions to run; see
:class:`~dynaseq.models.encoder.TransformerEncoder`), never state written into the model:

* training (:func:`sample_layers`): every position is kept independently with probability
  1 − p, drawn per micro-batch from (seed, step, micro-batch) alone, so every rank and every
  resume draws the same layers for the same batch;
* inference (:func:`every_other`): the paper's "every other" pruning, generalised to any
  kept depth N <= L: positions ``floor(i · L / N)`` for i = 0 .. N−1 (N = L/2 keeps
  0, 2, 4, ..., as fairseq's ``--encoder-layers-to-keep`` example does).

Example::

    sample_layers(6, 0.2, seed=1, step=40, micro=0)     # e.g. (0, 1, 3, 4, 5)
    every_other(6, 3)                                   # (0, 2, 4)
    model(tokens, segments, layers=every_other(6, 3))   # the model pruned to 3 layers
"""

from __future__ import annotations

import torch

#: mixed into the seed of the LayerDrop generator, so its draws differ from those of other
#: per-micro-batch draws from the same (seed, step, micro) (budgets, masks)
_SALT = 0x1A7E4D


def sample_layers(depth: int, p: float, seed: int, step: int, micro: int) -> tuple[int, ...]:
    """The plan positions (increasing) that micro-batch ``micro`` of update ``step`` runs: each
    of the ``depth`` positions kept independently with probability 1 − ``p`` (possibly none,
    as in the paper). Drawn from (seed, step, micro) alone."""
    gen = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 131 + micro) ^ _SALT)
    keep = torch.rand(depth, generator=gen) >= p
    return tuple(int(i) for i in keep.nonzero().flatten())


def every_other(depth: int, keep: int) -> tuple[int, ...]:
    """``keep`` of the ``depth`` plan positions, evenly spaced from the first:
    ``floor(i · depth / keep)``, i = 0 .. keep−1 (``keep = depth // 2``: every other one)."""
    if not 1 <= keep <= depth:
        raise ValueError(f"keep-layers {keep} is not in [1, {depth}] (the model's depth)")
    return tuple(i * depth // keep for i in range(keep))
