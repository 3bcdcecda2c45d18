from __future__ import annotations

import pytest

from dynaseq.core.errors import DynaseqError
from dynaseq.data.dataset import FilterStats, ParallelCorpus, make_corpus

# max_len=4: a side may have at most 3 tokens
SRC = [[5, 6], [], [5, 6, 7, 8], [5], [9, 9, 9], [5, 6, 7, 8, 9], [4]]
TGT = [[7], [8], [7], [], [1, 2, 3, 4], [6], [4, 4, 4]]


def test_skip_policy_counts() -> None:
    corpus, stats = make_corpus(SRC, TGT, max_len=4, long_lines="skip")
    assert stats == FilterStats(empty=2, too_long=3, truncated=0, kept=2)
    assert stats.as_dict() == {"empty": 2, "too_long": 3, "truncated": 0, "kept": 2}
    assert corpus.src == [[5, 6], [4]]
    assert corpus.tgt == [[7], [4, 4, 4]]
    assert len(corpus) == 2


def test_truncate_policy_counts() -> None:
    corpus, stats = make_corpus(SRC, TGT, max_len=4, long_lines="truncate")
    assert stats.as_dict() == {"empty": 2, "too_long": 0, "truncated": 3, "kept": 5}
    assert corpus.src == [[5, 6], [5, 6, 7], [9, 9, 9], [5, 6, 7], [4]]
    assert corpus.tgt == [[7], [7], [1, 2, 3], [6], [4, 4, 4]]
    assert max(corpus.src_lengths() + corpus.tgt_lengths()) == 4


def test_lengths_include_eos() -> None:
    corpus = ParallelCorpus(src=[[5, 6], [7]], tgt=[[8], [9, 9, 9]])
    assert corpus.src_lengths() == [3, 2]
    assert corpus.tgt_lengths() == [2, 4]


def test_inputs_are_not_aliased() -> None:
    src, tgt = [[5, 6, 7]], [[8]]
    corpus, _ = make_corpus(src, tgt, max_len=10)
    corpus.src[0].append(1)
    assert src == [[5, 6, 7]]


def test_bad_arguments() -> None:
    with pytest.raises(DynaseqError, match="long_lines"):
        make_corpus(SRC, TGT, max_len=4, long_lines="drop")
    with pytest.raises(DynaseqError, match="max_len"):
        make_corpus(SRC, TGT, max_len=1)
    with pytest.raises(DynaseqError):
        make_corpus(SRC, TGT[:-1], max_len=4)
