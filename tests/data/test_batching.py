from __future__ import annotations

import random

import pytest
import torch

from dynaseq.core.errors import DynaseqError
from dynaseq.data.batching import Batch, collate, collate_source, token_batches
from dynaseq.data.dataset import ParallelCorpus

PAD, BOS, EOS = 0, 2, 3


def _lengths(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    src = [rng.randint(1, 60) for _ in range(n)]
    tgt = [max(1, s + rng.randint(-5, 5)) for s in src]
    return src, tgt


def _padded_size(batch: list[int], src: list[int], tgt: list[int]) -> int:
    return len(batch) * max(max(src[i], tgt[i]) for i in batch)


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_index_once_and_budget(shuffle: bool) -> None:
    src, tgt = _lengths(2000)
    batches = token_batches(src, tgt, max_tokens=500, seed=3, epoch=1, shuffle=shuffle)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(2000))
    assert all(b for b in batches)
    assert all(_padded_size(b, src, tgt) <= 500 for b in batches)
    # greedy: adding the next batch's first example would have broken the budget
    if not shuffle:
        for a, b in zip(batches, batches[1:], strict=False):
            assert _padded_size(a + b[:1], src, tgt) > 500


def test_batches_are_length_bucketed() -> None:
    src, tgt = _lengths(2000)
    batches = token_batches(src, tgt, max_tokens=500, seed=3, epoch=1, shuffle=False)
    sizes = [[max(src[i], tgt[i]) for i in b] for b in batches]
    assert all(s == sorted(s) for s in sizes)
    assert all(a[-1] <= b[0] for a, b in zip(sizes, sizes[1:], strict=False))
    # shuffled batches hold examples of similar length too: little padding
    shuffled = token_batches(src, tgt, max_tokens=500, seed=3, epoch=1)
    padded = sum(_padded_size(b, src, tgt) for b in shuffled)
    assert padded <= 1.1 * sum(max(s, t) for s, t in zip(src, tgt, strict=True))


def test_deterministic_per_seed_and_epoch() -> None:
    src, tgt = _lengths(1000)
    a = token_batches(src, tgt, 300, seed=7, epoch=2)
    assert a == token_batches(src, tgt, 300, seed=7, epoch=2)
    assert a != token_batches(src, tgt, 300, seed=7, epoch=3)
    assert a != token_batches(src, tgt, 300, seed=8, epoch=2)
    plain = token_batches(src, tgt, 300, seed=7, epoch=2, shuffle=False)
    assert plain == token_batches(src, tgt, 300, seed=1, epoch=9, shuffle=False)


def test_does_not_use_global_rng() -> None:
    src, tgt = _lengths(500)
    random.seed(0)
    torch.manual_seed(0)
    before = (random.random(), torch.rand(1).item())
    random.seed(0)
    torch.manual_seed(0)
    token_batches(src, tgt, 300, seed=1, epoch=0)
    assert (random.random(), torch.rand(1).item()) == before


def test_small_example() -> None:
    assert token_batches([3, 3, 5, 2], [4, 2, 5, 2], max_tokens=8, seed=0, epoch=0,
                         shuffle=False) == [[3, 1], [0], [2]]
    assert token_batches([], [], max_tokens=8, seed=0, epoch=0) == []


def test_oversize_example() -> None:
    with pytest.raises(DynaseqError) as err:
        token_batches([3, 3, 9], [2, 11, 4], max_tokens=10, seed=0, epoch=0)
    assert str(err.value) == "example 1 has 11 tokens > max_tokens=10"


def _corpus() -> ParallelCorpus:
    return ParallelCorpus(
        src=[[10, 11, 12], [13], [14, 15]],
        tgt=[[20], [21, 22, 23, 24], [25, 26]],
    )


def test_collate_shapes_and_specials() -> None:
    corpus = _corpus()
    b = collate(corpus, [2, 0, 1], pad_id=PAD, bos_id=BOS, eos_id=EOS)
    assert b.indices == [2, 0, 1]
    assert b.src.dtype == b.tgt_in.dtype == b.tgt_out.dtype == torch.long
    assert b.src.tolist() == [[14, 15, EOS, PAD], [10, 11, 12, EOS], [13, EOS, PAD, PAD]]
    assert b.tgt_in.tolist() == [[BOS, 25, 26, PAD, PAD], [BOS, 20, PAD, PAD, PAD],
                                 [BOS, 21, 22, 23, 24]]
    assert b.tgt_out.tolist() == [[25, 26, EOS, PAD, PAD], [20, EOS, PAD, PAD, PAD],
                                  [21, 22, 23, 24, EOS]]
    assert b.n_src_tokens == 3 + 4 + 2
    assert b.n_tgt_tokens == 3 + 2 + 5
    assert len(b) == 3


def test_collate_teacher_forcing_shift() -> None:
    rng = random.Random(1)
    corpus = ParallelCorpus(
        src=[[rng.randint(4, 99) for _ in range(rng.randint(1, 9))] for _ in range(20)],
        tgt=[[rng.randint(4, 99) for _ in range(rng.randint(1, 9))] for _ in range(20)],
    )
    b = collate(corpus, list(range(20)), pad_id=PAD, bos_id=BOS, eos_id=EOS)
    assert (b.tgt_in[:, 0] == BOS).all()
    out_mask = b.tgt_out.ne(PAD)
    in_mask = b.tgt_in.ne(PAD)
    assert torch.equal(in_mask, out_mask)
    both = in_mask[:, 1:] & out_mask[:, :-1]
    assert torch.equal(b.tgt_in[:, 1:][both], b.tgt_out[:, :-1][both])
    lengths = torch.tensor(corpus.tgt_lengths())
    assert torch.equal(out_mask.sum(1), lengths)
    assert (b.tgt_out.gather(1, (lengths - 1)[:, None]) == EOS).all()
    assert (b.src.gather(1, (torch.tensor(corpus.src_lengths()) - 1)[:, None]) == EOS).all()
    assert b.tgt_out.eq(EOS).sum() == 20 and b.src.eq(EOS).sum() == 20
    assert b.tgt_in.eq(BOS).sum() == 20


def test_collate_source() -> None:
    t = collate_source([[5, 6], [7], [8, 9, 10]], pad_id=PAD, eos_id=EOS)
    assert t.dtype == torch.long
    assert t.tolist() == [[5, 6, EOS, PAD], [7, EOS, PAD, PAD], [8, 9, 10, EOS]]
    assert collate_source([], pad_id=PAD, eos_id=EOS).shape == (0, 0)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_shard_covers_rows_once(world: int) -> None:
    corpus = ParallelCorpus(src=[[4 + i] * (1 + i % 3) for i in range(5)],
                            tgt=[[50 + i] * (1 + i % 4) for i in range(5)])
    b = collate(corpus, [4, 1, 0, 3, 2], pad_id=PAD, bos_id=BOS, eos_id=EOS)
    shards = [b.shard(r, world) for r in range(world)]
    assert sorted(i for s in shards for i in s.indices) == [0, 1, 2, 3, 4]
    assert sum(len(s) for s in shards) == len(b)
    for s in shards:
        assert s.src.shape == (len(s), b.src.size(1))
        assert s.tgt_in.shape == s.tgt_out.shape == (len(s), b.tgt_in.size(1))
        for row, idx in enumerate(s.indices):
            full = b.indices.index(idx)
            assert torch.equal(s.src[row], b.src[full])
            assert torch.equal(s.tgt_out[row], b.tgt_out[full])
    assert sum(s.n_tgt_tokens for s in shards) == b.n_tgt_tokens
    if world > 5:
        assert len(shards[-1]) == 0 and shards[-1].n_src_tokens == 0


def test_shard_bad_rank() -> None:
    b = collate(_corpus(), [0], pad_id=PAD, bos_id=BOS, eos_id=EOS)
    with pytest.raises(ValueError):
        b.shard(2, 2)


def test_to_device() -> None:
    b = collate(_corpus(), [0, 1], pad_id=PAD, bos_id=BOS, eos_id=EOS)
    moved = b.to("cpu")
    assert isinstance(moved, Batch) and moved.indices == b.indices
    assert torch.equal(moved.src, b.src) and moved.src.device.type == "cpu"
