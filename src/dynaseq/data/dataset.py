"""A parallel corpus of subword ids, and the length filter that builds it.

Ids are stored WITHOUT bos/eos. Each side gets exactly one extra token when batched (the
source and the decoder output get eos, the decoder input gets bos), so a side of ``n``
tokens occupies ``n + 1`` positions; :meth:`ParallelCorpus.src_lengths` and
:meth:`ParallelCorpus.tgt_lengths` report that length.

Example::

    corpus, stats = make_corpus(tok.encode(src), tok.encode(tgt), max_len=256)
    stats.as_dict()   # {'empty': 3, 'too_long': 1, 'truncated': 0, 'kept': 28996}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from dynaseq.core.errors import DynaseqError

#: What :func:`make_corpus` does with a side longer than ``max_len - 1`` tokens.
LONG_LINE_POLICIES = ("skip", "truncate")


@dataclass
class FilterStats:
    """Pair counts from :func:`make_corpus`.

    Every input pair is counted once in ``empty``, ``too_long`` or ``kept``;
    ``truncated`` counts the kept pairs that had a side cut (so ``truncated <= kept``).
    """

    empty: int = 0
    too_long: int = 0
    truncated: int = 0
    kept: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class ParallelCorpus:
    """Sentence pairs as subword ids without bos/eos; ``src[i]`` translates to ``tgt[i]``."""

    src: list[list[int]] = field(default_factory=list)
    tgt: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.src) == len(self.tgt), (len(self.src), len(self.tgt))

    def __len__(self) -> int:
        return len(self.src)

    def src_lengths(self) -> list[int]:
        """Source lengths including the eos each source gets: ``len(src[i]) + 1``."""
        return [len(s) + 1 for s in self.src]

    def tgt_lengths(self) -> list[int]:
        """Target lengths including the bos (decoder input) or eos (decoder output)."""
        return [len(t) + 1 for t in self.tgt]


def make_corpus(
    src_ids: Sequence[Sequence[int]],
    tgt_ids: Sequence[Sequence[int]],
    max_len: int,
    long_lines: str = "skip",
) -> tuple[ParallelCorpus, FilterStats]:
    """Filter encoded pairs into a :class:`ParallelCorpus`.

    A pair with an empty side is dropped (``empty``). A side with more than
    ``max_len - 1`` tokens (so that it would not fit ``max_len`` once eos/bos is added) is,
    with ``long_lines="skip"``, a reason to drop the pair (``too_long``), or with
    ``long_lines="truncate"``, cut to its first ``max_len - 1`` tokens (the pair counts as
    ``truncated`` and ``kept``). Pairs keep their input order.

    Example::

        >>> c, s = make_corpus([[5], [], [5, 6, 7]], [[8], [9], [8]], max_len=3)
        >>> c.src, s.as_dict()
        ([[5]], {'empty': 1, 'too_long': 1, 'truncated': 0, 'kept': 1})

    Raises:
        DynaseqError: an unknown ``long_lines`` policy, ``max_len < 2``, or sides of
            different lengths.
    """
    if long_lines not in LONG_LINE_POLICIES:
        raise DynaseqError(f"long_lines must be 'skip' or 'truncate', got {long_lines!r}")
    if max_len < 2:
        raise DynaseqError(f"max_len must be >= 2 (one token plus eos), got {max_len}")
    if len(src_ids) != len(tgt_ids):
        raise DynaseqError(f"{len(src_ids)} source sentences but {len(tgt_ids)} targets")
    limit = max_len - 1
    stats = FilterStats()
    corpus = ParallelCorpus()
    for s, t in zip(src_ids, tgt_ids, strict=True):
        if len(s) == 0 or len(t) == 0:
            stats.empty += 1
            continue
        if len(s) > limit or len(t) > limit:
            if long_lines == "skip":
                stats.too_long += 1
                continue
            stats.truncated += 1
        corpus.src.append([int(i) for i in s[:limit]])
        corpus.tgt.append([int(i) for i in t[:limit]])
        stats.kept += 1
    assert stats.empty + stats.too_long + stats.kept == len(src_ids)
    return corpus, stats
