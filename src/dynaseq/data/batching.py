"""Token-budget batching (fairseq style) and collation into padded tensors.

:func:`token_batches` groups examples of similar length so that every batch, once padded,
holds at most ``max_tokens`` positions on its longer side. :func:`collate` turns a batch of
indices into a :class:`Batch` of right-padded ``long`` tensors::

    src     = tokens + [eos]          (B, S)   encoder input
    tgt_in  = [bos] + tokens          (B, T)   decoder input (teacher forcing)
    tgt_out = tokens + [eos]          (B, T)   decoder labels

Example::

    batches = token_batches(corpus.src_lengths(), corpus.tgt_lengths(), max_tokens=4096,
                            seed=1, epoch=epoch)
    for idx in batches:
        batch = collate(corpus, idx, tok.pad_id, tok.bos_id, tok.eos_id).to(device)

Randomness comes only from ``random.Random(seed * 1000003 + epoch)``; the global RNGs of
``random`` and ``torch`` are never used.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dynaseq.core.errors import DynaseqError
from dynaseq.data.dataset import ParallelCorpus


def epoch_rng(seed: int, epoch: int) -> random.Random:
    """The private RNG that :func:`token_batches` uses for ``(seed, epoch)``."""
    return random.Random(seed * 1000003 + epoch)


def token_batches(
    src_lengths: Sequence[int],
    tgt_lengths: Sequence[int],
    max_tokens: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
) -> list[list[int]]:
    """Split example indices into length-bucketed batches under a padded-token budget.

    Lengths are the per-example lengths as batched (with eos/bos; see
    :meth:`ParallelCorpus.src_lengths`). The size of example ``i`` is
    ``max(src_lengths[i], tgt_lengths[i])``. Indices are sorted by (size, source length,
    target length); with ``shuffle`` the ties are broken by a random permutation drawn
    from ``(seed, epoch)``, otherwise by index. The sorted list is cut greedily so that
    every batch satisfies ``len(batch) * max(size in batch) <= max_tokens``. With
    ``shuffle`` the order of the batches is then shuffled with the same RNG, so each epoch
    gets different batches in a different order, reproducibly; without it the batches come
    shortest first (for validation and inference).

    Every index ``0 .. n-1`` appears in exactly one batch; no batch is empty.

    Example::

        >>> token_batches([3, 3, 5, 2], [4, 2, 5, 2], max_tokens=8, seed=0, epoch=0,
        ...               shuffle=False)
        [[3, 1], [0], [2]]

    Raises:
        DynaseqError: ``max_tokens < 1``, or ``"example N has L tokens > max_tokens=M"``
            for an example that cannot fit any batch.
    """
    n = len(src_lengths)
    if len(tgt_lengths) != n:
        raise DynaseqError(f"{n} source lengths but {len(tgt_lengths)} target lengths")
    if max_tokens < 1:
        raise DynaseqError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = [max(s, t) for s, t in zip(src_lengths, tgt_lengths, strict=True)]
    for i, size in enumerate(sizes):
        assert min(src_lengths[i], tgt_lengths[i]) >= 1, f"example {i} has a zero length"
        if size > max_tokens:
            raise DynaseqError(f"example {i} has {size} tokens > max_tokens={max_tokens}")

    order = list(range(n))
    rng = epoch_rng(seed, epoch)
    if shuffle:
        rng.shuffle(order)
    order.sort(key=lambda i: (sizes[i], src_lengths[i], tgt_lengths[i]))  # stable

    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, sizes[i])
        if current and (len(current) + 1) * new_longest > max_tokens:
            batches.append(current)
            current, new_longest = [], sizes[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)

    if shuffle:
        rng.shuffle(batches)
    return batches


@dataclass
class Batch:
    """One padded batch of sentence pairs (all tensors ``long``, padded on the right).

    Attributes:
        src: ``(B, S)`` source tokens + eos.
        tgt_in: ``(B, T)`` bos + target tokens (decoder input).
        tgt_out: ``(B, T)`` target tokens + eos (decoder labels); for every row,
            ``tgt_in[r, 1:]`` equals ``tgt_out[r, :-1]`` at the non-pad positions.
        indices: corpus index of each row.
        pad_id: the id used for padding.
    """

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    indices: list[int]
    pad_id: int = 0

    def __post_init__(self) -> None:
        assert self.src.dim() == 2 and self.tgt_in.dim() == 2, (self.src.shape, self.tgt_in.shape)
        assert self.tgt_in.shape == self.tgt_out.shape, (self.tgt_in.shape, self.tgt_out.shape)
        assert self.src.size(0) == self.tgt_in.size(0) == len(self.indices)

    def __len__(self) -> int:
        """Number of rows (sentence pairs)."""
        return len(self.indices)

    @property
    def n_src_tokens(self) -> int:
        """Non-pad source positions (eos included)."""
        return int(self.src.ne(self.pad_id).sum().item())

    @property
    def n_tgt_tokens(self) -> int:
        """Non-pad positions of ``tgt_out`` (eos included): the number of predictions."""
        return int(self.tgt_out.ne(self.pad_id).sum().item())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy with the tensors on ``device``."""
        return Batch(
            src=self.src.to(device, non_blocking=non_blocking),
            tgt_in=self.tgt_in.to(device, non_blocking=non_blocking),
            tgt_out=self.tgt_out.to(device, non_blocking=non_blocking),
            indices=list(self.indices),
            pad_id=self.pad_id,
        )

    def shard(self, rank: int, world: int) -> Batch:
        """Rows ``rank, rank + world, ...`` of this batch, for data-parallel training.

        The shards of ranks ``0 .. world-1`` together hold every row exactly once. The
        width (``S``, ``T``) is kept, so a shard may end with all-pad columns. When the batch
        has fewer rows than ``world``, the last ranks get an empty batch with 0 rows
        (shapes ``(0, S)`` and ``(0, T)``); the caller must still take part in gradient
        synchronisation for such a rank (e.g. with a zero loss).
        """
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
        return Batch(
            src=self.src[rank::world],
            tgt_in=self.tgt_in[rank::world],
            tgt_out=self.tgt_out[rank::world],
            indices=self.indices[rank::world],
            pad_id=self.pad_id,
        )


def _padded(rows: list[list[int]], pad_id: int) -> Tensor:
    """``(len(rows), longest)`` long tensor of ``rows`` right-padded with ``pad_id``."""
    width = max((len(r) for r in rows), default=0)
    data = [r + [pad_id] * (width - len(r)) for r in rows]
    return torch.tensor(data, dtype=torch.long).reshape(len(rows), width)


def collate(
    corpus: ParallelCorpus, indices: Sequence[int], pad_id: int, bos_id: int, eos_id: int
) -> Batch:
    """Padded tensors for the pairs ``corpus[indices]`` (see the module docstring).

    Example::

        >>> c = ParallelCorpus(src=[[7, 8]], tgt=[[9]])
        >>> b = collate(c, [0], pad_id=0, bos_id=2, eos_id=3)
        >>> b.src.tolist(), b.tgt_in.tolist(), b.tgt_out.tolist()
        ([[7, 8, 3]], [[2, 9]], [[9, 3]])
    """
    idx = [int(i) for i in indices]
    src = _padded([list(corpus.src[i]) + [eos_id] for i in idx], pad_id)
    tgt_in = _padded([[bos_id] + list(corpus.tgt[i]) for i in idx], pad_id)
    tgt_out = _padded([list(corpus.tgt[i]) + [eos_id] for i in idx], pad_id)
    return Batch(src=src, tgt_in=tgt_in, tgt_out=tgt_out, indices=idx, pad_id=pad_id)


def collate_source(ids: Sequence[Sequence[int]], pad_id: int, eos_id: int) -> Tensor:
    """``(B, S)`` long tensor of ``tokens + [eos]`` per sentence, right-padded (inference).

    Example::

        >>> collate_source([[5, 6], [7]], pad_id=0, eos_id=3).tolist()
        [[5, 6, 3], [7, 3, 0]]
    """
    return _padded([list(s) + [eos_id] for s in ids], pad_id)
