import math
import sys

import pytest
import torch

import dynaseq.models.search as search_module
from dynaseq.models.search import beam_search, greedy_search, max_lengths, stay_in_place
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq

EOS = 3


def model(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, ffn_dim=64, n_heads=2, encoder_layers=1, decoder_layers=2,
                      dropout=0.0)
    m = build_seq2seq(cfg, vocab_size=30).eval()
    with torch.no_grad():  # make eos likely enough that lengths vary
        m.decoder.output_proj.weight[EOS] *= 3
    return m


def sources(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 30, (n, 7), generator=g)
    for i in range(n):
        src[i, 7 - (i % 4):] = 0
        src[i, 6 - (i % 4)] = EOS
    return src


def naive_greedy(m, src_row, limit):
    """No cache: rerun the full decoder on the whole prefix each step."""
    out = [m.bos_id]
    for _ in range(limit):
        logits = m(src_row, torch.tensor([out])).logits[0, -1]
        if len(out) == limit:
            return out[1:]
        nxt = int(logits.argmax())
        if nxt == EOS:
            return out[1:]
        out.append(nxt)
    return out[1:]


def test_greedy_matches_uncached_rerun():
    m = model()
    src = sources()
    hyps = greedy_search(m, src, max_len_a=0.0, max_len_b=12)
    for i in range(src.size(0)):
        row = src[i: i + 1, : int(src[i].ne(0).sum())]
        assert hyps[i] == naive_greedy(m, row, 12)


def test_batched_equals_one_by_one():
    m = model()
    src = sources()
    batched = beam_search(m, src, beam=3, max_len_a=1.0, max_len_b=5)
    for i in range(src.size(0)):
        row = src[i: i + 1, : int(src[i].ne(0).sum())]
        assert beam_search(m, row, beam=3, max_len_a=1.0, max_len_b=5)[0] == batched[i]


def test_beam_one_equals_greedy():
    m = model()
    src = sources()
    assert beam_search(m, src, beam=1) == greedy_search(m, src)


@torch.no_grad()
def sequence_logprob(m, src_row, hyp):
    tgt_in = torch.tensor([[m.bos_id, *hyp]])
    logp = m(src_row, tgt_in).logits.log_softmax(-1)[0]
    return float(sum(logp[i, t] for i, t in enumerate([*hyp, EOS])))


def test_beam_finds_at_least_the_greedy_score():
    m = model(seed=4)
    src = sources(seed=5)
    greedy = greedy_search(m, src, max_len_a=0.0, max_len_b=10)
    beam = beam_search(m, src, beam=5, length_penalty=0.0, max_len_a=0.0, max_len_b=10)
    for i in range(src.size(0)):
        row = src[i: i + 1, : int(src[i].ne(0).sum())]
        assert sequence_logprob(m, row, beam[i]) >= sequence_logprob(m, row, greedy[i]) - 1e-4


def test_length_limits_and_min_len():
    m = model()
    src = sources()
    for hyp in greedy_search(m, src, max_len_a=0.0, max_len_b=4):
        assert len(hyp) <= 3  # 4 tokens including eos
    fixed = beam_search(m, src, beam=2, max_len_a=0.0, max_len_b=9, min_len=8)
    assert all(len(h) == 8 for h in fixed)
    assert all(EOS not in h for h in fixed)


def test_beam_first_step_runs_once_per_sentence():
    m = model()
    src = sources()  # 6 sentences, padded to 7 tokens
    rows = []
    m.decoder.layers[0].cross_attn.k_proj.register_forward_hook(
        lambda mod, args, out: rows.append(args[0].shape[:2]))
    steps = []
    decode_step = m.decode_step
    m.decode_step = lambda tokens, enc, state: (steps.append(tokens.size(0)),
                                                decode_step(tokens, enc, state))[1]
    beam_search(m, src, beam=3, max_len_a=0.0, max_len_b=4, min_len=3)
    # the cross-attention keys/values are projected once, for one row per sentence
    assert rows == [torch.Size([6, 7])]
    assert steps == [6, 18, 18, 18]  # then 3 beams each


class StepClock:
    """A clock that moves one second each time it is read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_a_sentence_past_its_expiry_is_dropped_and_the_others_are_unchanged():
    """Greedy and beam search: a sentence still decoding when its expiry passes gives None;
    every other sentence gives what it gives without expiries (rows leave as finished ones
    do); a sentence that ended before its expiry keeps its result."""
    m = model()
    src = sources()
    never = float("inf")
    for search, kw in ((greedy_search, {}), (beam_search, {"beam": 3})):
        free = search(m, src, max_len_a=0.0, max_len_b=12, **kw)
        steps = max(len(h) for h in free) + 1  # the longest runs this many steps
        expires = [never, 2.5, never, 0.0, never, float(steps + 5)]
        got = search(m, src, max_len_a=0.0, max_len_b=12, expires=expires,
                     clock=StepClock(), **kw)
        assert got[1] is None and got[3] is None  # expired after steps 3 and 1
        assert got[5] == free[5]  # it ended before its time
        assert [got[i] for i in (0, 2, 4)] == [free[i] for i in (0, 2, 4)]


def test_a_sentence_whose_expiry_moves_to_minus_inf_is_dropped_at_that_step():
    """An expiry may be a function read at every step (a server's row whose client went
    away turns ``-inf``): that sentence gives None, the others what they give without it,
    and no clock is read for it."""
    m = model()
    src = sources()
    for search, kw in ((greedy_search, {}), (beam_search, {"beam": 3})):
        free = search(m, src, max_len_a=0.0, max_len_b=12, **kw)
        reads = [0]

        def gone_after_two_steps(reads: list[int] = reads) -> float:
            reads[0] += 1
            return -math.inf if reads[0] > 2 else math.inf

        def no_clock() -> float:
            raise AssertionError("the clock was read")

        expires = [math.inf, gone_after_two_steps, *[math.inf] * (src.size(0) - 2)]
        got = search(m, src, max_len_a=0.0, max_len_b=12, expires=expires, clock=no_clock,
                     **kw)
        assert got[1] is None and reads[0] == 3
        assert [got[i] for i in range(src.size(0)) if i != 1] == [
            free[i] for i in range(src.size(0)) if i != 1]


def test_expiries_must_match_the_sentences():
    m = model()
    with pytest.raises(ValueError, match="one time per sentence: 6 sentences, 2 times"):
        greedy_search(m, sources(), expires=[1.0, 2.0])


def test_each_sentence_is_reported_once_when_it_finishes_with_its_final_tokens():
    """``on_done``: greedy and beam search hand each sentence over once, at the step its
    search ends (greedy: shorter outputs first), with the tokens the search returns; an
    expired sentence is never handed over."""
    m = model()
    src = sources()
    for search, kw in ((greedy_search, {}), (beam_search, {"beam": 3})):
        calls: list[dict] = []

        def record(rows, toks, calls=calls):
            calls.append(dict(zip(rows, toks, strict=True)))

        got = search(m, src, max_len_a=0.0, max_len_b=12, on_done=record, **kw)
        reported = {r: t for c in calls for r, t in c.items()}
        assert sum(len(c) for c in calls) == len(reported) == src.size(0)
        assert [reported[i] for i in range(src.size(0))] == got
        if search is greedy_search:  # a call per step with finishers, in step order
            lengths = [{len(t) for t in c.values()} for c in calls]
            assert all(len(s) == 1 for s in lengths)
            assert [s.pop() for s in lengths] == sorted({len(t) for t in got})
        calls.clear()
        out = search(m, src, max_len_a=0.0, max_len_b=12, expires=[float("inf")] * 5 + [0.0],
                     clock=StepClock(), on_done=record, **kw)
        assert out[5] is None and 5 not in {r for c in calls for r in c}


@pytest.mark.parametrize("parents, want", [
    ([[0, 1, 2, 3]], [[0, 1, 2, 3]]),  # every slot extends itself: nothing moves
    ([[2, 0, 3, 1]], [[1, 3, 0, 2]]),  # a permutation: each continuation to its parent's slot
    ([[0, 0, 0, 0]], [[0, 1, 2, 3]]),  # one parent: it keeps the best, the rest in rank order
    ([[1, 1, 3, 0]], [[3, 0, 1, 2]]),  # slot 2 died: the second child of 1 takes it
    ([[0, 1], [1, 1]], [[0, 1], [1, 0]])])
def test_stay_in_place_keeps_continuations_in_their_parents_slots(parents, want):
    got = stay_in_place(parents)
    assert got == want
    for ranked, order in zip(parents, got, strict=True):
        assert sorted(order) == list(range(len(ranked)))  # each continuation once
        # a parent's slot holds one of its children whenever it has any
        assert all(ranked[order[t]] == t for t in set(ranked))


def test_beam_results_do_not_depend_on_the_slots_beams_sit_in(monkeypatch):
    """Beams in rank order every step (the order before :func:`stay_in_place`) give the
    same hypotheses, general and lean step alike."""
    from dynaseq.models.lean import LeanDecoder

    m = model(seed=3)
    src = sources(n=6, seed=4)
    lean = LeanDecoder.prepare(m)
    kept = {k: [beam_search(d, src, beam=k, max_len_a=1.0, max_len_b=8) for d in (m, lean)]
            for k in (2, 4)}
    monkeypatch.setattr(search_module, "stay_in_place",
                        lambda parents: [list(range(len(p))) for p in parents])
    for k, (general, fast) in kept.items():
        ranked = beam_search(m, src, beam=k, max_len_a=1.0, max_len_b=8)
        assert general == fast == ranked
        assert beam_search(lean, src, beam=k, max_len_a=1.0, max_len_b=8) == ranked


@torch.no_grad()
def naive_beam(m, src_row, k, limit, length_penalty=1.0, min_len=0):
    """The search as its docstring states it, for one sentence, with no cache and no
    shortcuts: each step ranks every (beam, token) continuation of the live beams."""
    live = [(0.0, [])]  # (log p, tokens)
    finished: list[tuple[float, list[int]]] = []
    for step in range(limit):
        cands = []
        for score, toks in live:
            logp = m(src_row, torch.tensor([[m.bos_id, *toks]])).logits[0, -1].log_softmax(-1)
            if step < min_len:
                logp[EOS] = float("-inf")
            if step + 1 >= limit:  # at the limit only eos
                cands.append((score + float(logp[EOS]), toks, EOS))
                continue
            cands += [(score + float(v), toks, t) for t, v in enumerate(logp.tolist())]
        cands.sort(key=lambda c: -c[0])
        top = cands[: 2 * k]
        for rank, (score, toks, t) in enumerate(top):
            if t == EOS and rank < k and len(finished) < k:
                finished.append((score / (len(toks) + 1) ** length_penalty, toks))
        live = [(s, [*toks, t]) for s, toks, t in top if t != EOS][:k]
        if len(finished) >= k or not live:
            break
    return max(finished, key=lambda h: h[0])[1]


@pytest.mark.parametrize("seed", range(6))
def test_beam_search_equals_ranking_every_continuation(seed):
    """Batched beam search (each row's best k + 1 tokens, then the sentence's best 2k of
    those) picks what ranking every (beam, token) continuation picks. Fails when each row
    keeps only its best k: then a row whose eos ranks in its top k loses its (k + 1)-th
    token, which some of these sentences continue with."""
    m = model(seed)
    src = sources(n=6, seed=seed + 1)
    for k, min_len in ((2, 0), (3, 0), (3, 2)):
        got = beam_search(m, src, beam=k, max_len_a=0.0, max_len_b=7, min_len=min_len)
        for i in range(src.size(0)):
            row = src[i: i + 1, : int(src[i].ne(0).sum())]
            assert got[i] == naive_beam(m, row, k, 7, min_len=min_len), (k, i)


def test_length_limits_cap_huge_values_instead_of_wrapping_around():
    """``a · src_len + b`` is capped at the model's positions however large ``a`` or ``b``
    (before, int64 wrapped around: ``max_len_b=sys.maxsize`` gave empty translations)."""
    src = torch.tensor([3, 7])
    assert max_lengths(src, 1.2, 10, 100).tolist() == [13, 18]
    for a, b in ((1.0, sys.maxsize), (1e19, 0), (0.0, 10**30), (1e300, 10**30)):
        assert max_lengths(src, a, b, 100).tolist() == [100, 100], (a, b)
    assert max_lengths(src, 0.0, 0, 100).tolist() == [1, 1]


def test_a_greedy_step_keeps_the_rows_that_go_on_moving_only_those_from_the_end():
    """Finished rows are replaced by rows that go on from the end (swap-remove): the kept
    rows are exactly the unfinished ones, and each row that stays in the first places keeps
    its place, so a lean decoder's caches copy only the moved rows."""
    from dynaseq.models.search import _kept
    from dynaseq.nn.lean_step import moved_rows

    done = torch.tensor([False, True, False, False, True, False])
    keep = _kept(done, 4)
    assert keep.tolist() == [0, 5, 2, 3]
    assert moved_rows(keep, 6).tolist() == [1]
    assert _kept(torch.tensor([True, False, True]), 1).tolist() == [1]
    assert _kept(torch.tensor([False, False, True]), 2).tolist() == [0, 1]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        done = torch.rand(9, generator=g) > 0.5
        keep = _kept(done, int((~done).sum()))
        assert sorted(keep.tolist()) == (~done).nonzero().squeeze(1).tolist()
        assert moved_rows(keep, 9).numel() == int(done[: keep.numel()].sum())
