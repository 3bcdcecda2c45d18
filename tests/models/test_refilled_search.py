"""Continuous batching: sentences join a running greedy decode (models/search.py
``refilled_greedy_search``, models/lean.py ``LeanState.join``) and each gets the tokens and
logits it gets alone."""

from __future__ import annotations

import math

import pytest
import torch

from dynaseq.models.lean import LeanDecoder
from dynaseq.models.search import Sentences, greedy_search, refilled_greedy_search
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.tasks.translation.predictor import decode_corpus
from dynaseq.techniques.branching.config import DMBConfig
from dynaseq.techniques.cct.config import CCTConfig
from dynaseq.techniques.cct.gating import BudgetControl

EOS = 3
KINDS = {"dense": {}, "cct": {"cct": CCTConfig(ffn_pieces=2, control_hidden=8)},
         "dmb": {"dmb": DMBConfig(n_branches=3)}}
OFFSETS = [0.0, 1.5, -1.5, math.inf, -math.inf, 0.5]  # gates open, closed and mixed per row


def model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, ffn_dim=64, n_heads=4, encoder_layers=1, decoder_layers=2,
                      dropout=0.0, **KINDS[kind])
    m = build_seq2seq(cfg, vocab_size=30).eval()
    with torch.no_grad():  # peaky outputs, and eos likely enough that lengths vary
        m.decoder.output_proj.weight.mul_(4)
        m.decoder.output_proj.weight[EOS] *= 1.5
    return m


def sentences(n: int, seed: int = 1) -> list[list[int]]:
    """Source ids of 2 to 11 tokens, eos last."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 30, (int(torch.randint(1, 11, (1,), generator=g)),),
                          generator=g).tolist() + [EOS] for _ in range(n)]


def padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def control(kind: str, idx: list[int]) -> BudgetControl | None:
    """Per-row gate offsets (and control ids) for a CCT: each sentence its own."""
    if kind != "cct":
        return None
    off = torch.tensor([OFFSETS[i % len(OFFSETS)] for i in idx])
    return BudgetControl(torch.zeros(len(idx), dtype=torch.long), {"encoder": off, "decoder": -off})


def refilled(lean, srcs: list[list[int]], kind: str, chunk: int, **kw) -> dict[int, list[int]]:
    """Every sentence through a refilled decode, ``chunk`` at a time as rows free up."""
    queue, got = list(range(len(srcs))), {}

    def refill(free: int) -> Sentences | None:
        take, queue[:min(free, chunk)] = queue[:min(free, chunk)], []
        return Sentences(take, padded([srcs[i] for i in take]), control(kind, take)) \
            if take else None

    refilled_greedy_search(lean, refill, got.__setitem__, **kw)
    assert sorted(got) == list(range(len(srcs))), "every sentence answered once"
    return got


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_sentence_gets_its_own_greedy_tokens_while_others_join_and_leave(kind):
    m = model(kind)
    lean = LeanDecoder.prepare(m)
    srcs = sentences(23)
    kw = {"max_len_a": 1.5, "max_len_b": 6}
    alone = [greedy_search(lean, padded([s]), control=control(kind, [i]), **kw)[0]
             for i, s in enumerate(srcs)]
    assert len({len(a) for a in alone}) > 3, "outputs of many lengths: rows leave apart"
    for rows, chunk, min_free in ((5, 2, 1), (4, 4, 3), (1, 1, 1), (32, 32, 8)):
        got = refilled(lean, srcs, kind, chunk, max_rows=rows, min_free=min_free, **kw)
        assert [got[i] for i in range(len(srcs))] == alone, (rows, chunk)


@pytest.mark.parametrize("kind", ["dense", "cct"])
def test_rows_that_join_late_get_their_solo_logits_at_every_step_across_compaction(kind):
    """A and C start together in a state whose caches hold 2 slots at first. After 5
    steps B takes over A's row (``put``: A finished) and D joins after C (``join``); then C
    leaves. The caches grow, then drop the slots only A's and C's steps used (compaction)
    instead of doubling. Every row's logits equal its sentence decoded alone."""
    m = model(kind, seed=2)
    lean = LeanDecoder.prepare(m)
    a, b, c, d = sentences(4, seed=3)
    ctl = [control(kind, [i]) for i in range(4)]

    def solo(src, ctl, steps):
        enc, state = lean.encode(padded([src]), ctl), lean.init_state(capacity=2)
        tok, out = torch.tensor([[m.bos_id]]), []
        for _ in range(steps):
            logits = lean.decode_step(tok, enc, state)
            out.append(logits[0])
            tok = logits.argmax(-1, keepdim=True)
        return out

    want = {"a": solo(a, ctl[0], 5), "b": solo(b, ctl[1], 14), "c": solo(c, ctl[2], 9),
            "d": solo(d, ctl[3], 4)}
    both = control(kind, [0, 2])
    state, enc = lean.begin(lean.encode(padded([a, c]), both))
    state.caches = [type(x)(2) for x in state.caches]  # small: growth and compaction
    bos = torch.tensor([[m.bos_id]])

    def step(names, tok, at):
        logits = lean.decode_step(tok, enc, state)
        for row, name in enumerate(names):
            torch.testing.assert_close(logits[row], want[name][at[row]], rtol=1e-5,
                                       atol=1e-5)
        return logits.argmax(-1, keepdim=True)

    tok = torch.cat([bos, bos])
    for i in range(5):
        tok = step("ac", tok, [i, i])
    fresh, new = lean.begin(lean.encode(padded([b]), ctl[1]))
    enc = lean.put(state, enc, torch.tensor([0]), fresh, new)  # B in A's row
    fresh, new = lean.begin(lean.encode(padded([d]), ctl[3]))
    enc = lean.join(state, enc, fresh, new)
    tok = torch.cat([bos, tok[1:], bos])
    for i in range(4):
        tok = step("bcd", tok, [i, 5 + i, i])
    assert state.starts.tolist() == [5, 0, 5]
    keep = torch.tensor([0])  # C and D leave: B alone, its slots from 5 on
    state.reorder(keep)
    enc, tok = enc.index_select(keep), tok[:1]
    for i in range(4, 14):  # slot 16 is past the capacity: compacted, not doubled
        tok = step("b", tok, [i])
    assert state.starts is None, "compacted to the front: every row from slot 0"
    assert state.length == 14 and all(x.k.size(2) == 16 for x in state.caches)


def test_a_long_refilled_decode_keeps_its_caches_small():
    """Slots of finished sentences are dropped, so the caches hold about the longest
    running span of steps, not every step the decode ran."""
    m = model("dense", seed=4)
    lean = LeanDecoder.prepare(m)
    srcs = sentences(200, seed=5)
    seen = []
    step = lean.decode_step

    def watched(tokens, enc, state):
        seen.append((state.length, max(c.k.size(2) if c.k is not None else 0
                                       for c in state.caches)))
        return step(tokens, enc, state)

    lean.decode_step = watched
    refilled(lean, srcs, "dense", 2, max_rows=4, min_free=1, max_len_b=20)
    steps = len(seen)
    assert steps > 200, "a long decode"
    assert max(cap for _, cap in seen) <= 64 and max(n for n, _ in seen) <= 64


@pytest.mark.parametrize("kind", ["dense", "cct"])
def test_decode_corpus_continuous_gives_the_batched_decodes_tokens(kind):
    m = model(kind, seed=6)
    lean = LeanDecoder.prepare(m)
    srcs = [s[:-1] for s in sentences(40, seed=7)]  # decode_corpus adds the eos
    ctl = control(kind, list(range(len(srcs))))
    static = decode_corpus(m, srcs, batch_size=8, control=ctl, lean=lean, max_len_b=12)
    cont = decode_corpus(m, srcs, batch_size=8, control=ctl, lean=lean, max_len_b=12,
                         continuous=True)
    assert cont == static


def test_a_sentence_past_its_expiry_leaves_and_the_others_get_their_tokens():
    """Sentence 2 expires before it gets a row, sentence 5 after 3 steps (its client left),
    sentence 7 at a time on the clock: each is answered None; the others as alone."""
    m = model("dense", seed=8)
    lean = LeanDecoder.prepare(m)
    srcs = [s + [4] * 6 for s in sentences(12, seed=9)]  # long enough to run 3 steps
    kw = {"max_len_a": 1.5, "max_len_b": 6}
    alone = [greedy_search(lean, padded([s]), **kw)[0] for s in srcs]
    steps = [0]
    clock = [0.0]
    left_at = {2: -math.inf, 5: lambda: -math.inf if steps[0] >= 3 else math.inf, 7: 2.5}
    queue, got = list(range(len(srcs))), {}

    def refill(limit: int) -> Sentences | None:
        take, queue[:min(limit, 4)] = queue[:min(limit, 4)], []
        return (Sentences(take, padded([srcs[i] for i in take]),
                          expires=[left_at.get(i, math.inf) for i in take]) if take else None)

    step = lean.decode_step

    def counting(tokens, enc, state):
        steps[0] += 1
        clock[0] += 1.0
        return step(tokens, enc, state)

    lean.decode_step = counting
    refilled_greedy_search(lean, refill, got.__setitem__, max_rows=3, clock=lambda: clock[0],
                           **kw)
    assert [i for i in sorted(got) if got[i] is None] == [2, 5, 7]
    assert all(got[i] == alone[i] for i in got if i not in (2, 5, 7))
    assert all(len(alone[i]) > 3 for i in (5, 7)), "they would have run longer"


def test_a_counted_refilled_decode_gives_each_sentence_its_counts_alone():
    """``on_counted``: each sentence's decoding counts (every gated part's open gates, its
    steps, its cross-attention keys) equal those of a counted greedy search of it alone, and
    its encoder records are those of the sentences encoded with it, at its index."""
    from dynaseq.models.search import counted_greedy_search

    m = model("cct", seed=10)
    lean = LeanDecoder.prepare(m)
    srcs = sentences(14, seed=11)
    kw = {"max_len_a": 1.5, "max_len_b": 6}
    queue, got = list(range(len(srcs))), {}

    def refill(limit: int) -> Sentences | None:
        take, queue[:min(limit, 3)] = queue[:min(limit, 3)], []
        return (Sentences(take, padded([srcs[i] for i in take]), control("cct", take))
                if take else None)

    refilled_greedy_search(lean, refill, print, max_rows=4, on_counted=lambda k, t, c:
                           got.__setitem__(k, (t, c)), **kw)
    assert sorted(got) == list(range(len(srcs)))
    for i, (tokens, count) in got.items():
        hyps, (aux, counts) = counted_greedy_search(lean, padded([srcs[i]]),
                                                    control=control("cct", [i]), **kw)
        assert tokens == hyps[0]
        assert set(count.counts) == set(counts)
        for key, value in counts.items():
            assert torch.equal(count.counts[key], value), (i, key)
        assert count.src[count.row].tolist()[: len(srcs[i])] == srcs[i]
        assert count.aux.traces and set(count.aux.traces) == set(aux.traces)


def test_bad_calls_are_refused():
    m = model("dense")
    lean = LeanDecoder.prepare(m)
    src = padded(sentences(3))
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        refilled_greedy_search(lean, lambda free: None, print, max_rows=0)
    with pytest.raises(ValueError, match=r"refill gave 3 sentences \(3 keys\) for at most 2"):
        refilled_greedy_search(lean, lambda free: Sentences([0, 1, 2], src), print,
                               max_rows=2)
    with pytest.raises(ValueError, match="continuous decoding is greedy"):
        decode_corpus(m, [[5, 6]], beam=2, lean=lean, continuous=True)
    with pytest.raises(ValueError, match="continuous decoding is greedy"):
        decode_corpus(m, [[5, 6]], continuous=True)  # no lean decoder
    nothing: list = []
    refilled_greedy_search(lean, lambda free: None, lambda *a: nothing.append(a))
    assert nothing == []
