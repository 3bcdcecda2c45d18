"""The lean decoding step (models/lean.py) decodes exactly as the general step."""

from __future__ import annotations

import pytest
import torch

from dynaseq.compress.int8 import quantize_int8
from dynaseq.models.lean import LeanDecoder, LeanState, is_lean
from dynaseq.models.search import beam_search, greedy_search
from dynaseq.nn.lean_step import StepTally
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.techniques.branching.config import DMBConfig, MoEConfig
from dynaseq.techniques.cct.config import CCTConfig

from helpers import assert_same_searches, padded_sources, step_ops

EOS = 3


def model(seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, ffn_dim=64, n_heads=4, encoder_layers=1, decoder_layers=2,
                      dropout=0.0, **kw)
    m = build_seq2seq(cfg, vocab_size=30).eval()
    with torch.no_grad():  # peaky outputs, and eos likely enough that lengths vary
        m.decoder.output_proj.weight.mul_(4)
        m.decoder.output_proj.weight[EOS] *= 1.5
    return m


def sources(n: int = 7, seed: int = 1) -> torch.Tensor:
    return padded_sources(n, seed, eos=EOS)


def test_greedy_and_beam_give_the_general_steps_tokens_with_rows_finishing_apart():
    m = model()
    lean = LeanDecoder.prepare(m)
    assert_same_searches(m, lean, sources(), beams=(2, 4), max_len_b=40)


def test_batched_equals_one_at_a_time():
    m = model(seed=3)
    lean = LeanDecoder.prepare(m)
    src = sources(seed=4)
    batched = greedy_search(lean, src, max_len_b=30)
    for i in range(src.size(0)):
        row = src[i: i + 1, : int(src[i].ne(0).sum())]
        assert greedy_search(lean, row, max_len_b=30) == [batched[i]]
        assert beam_search(lean, row, beam=3, max_len_b=30) == beam_search(m, row, beam=3,
                                                                           max_len_b=30)


@pytest.mark.parametrize("capacity", [1, 2, 32])
def test_each_steps_logits_equal_the_general_step_across_cache_growth(capacity):
    m = model(seed=5)
    lean = LeanDecoder.prepare(m)
    src = sources(n=3, seed=6)
    enc = m.encode(src)
    general, fast = m.init_state(), lean.init_state(capacity)
    tokens = torch.full((3, 1), m.bos_id)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _ in range(12):  # capacity 1 and 2 double several times
            want = m.decode_step(tokens, enc, general)
            got = lean.decode_step(tokens, enc, fast)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            tokens = torch.randint(4, 30, (3, 1), generator=g)
    assert fast.step == general.step == 12



def test_a_step_concatenates_nothing_and_projects_the_encoder_output_once():
    counts = step_ops(LeanDecoder.prepare(model()), sources(n=2), steps=5)
    assert all("cat.default" not in names for names in counts)
    linears = [sum(n in ("addmm.default", "mm.default") for n in names) for names in counts]
    # per layer: fused qkv, self out, cross q, cross out, fc1, fc2; then the output layer;
    # the first step also projects the encoder output to each layer's keys and values
    assert linears == [2 * 6 + 1 + 2 * 2] + [2 * 6 + 1] * 4


def test_which_models_get_a_lean_step():
    assert is_lean(model())
    assert is_lean(quantize_int8(model()))
    assert is_lean(model(cct=CCTConfig(ffn_pieces=2, control_hidden=8)))
    assert is_lean(model(dmb=DMBConfig(n_branches=2)))  # tests/techniques/branching/
    assert LeanDecoder.prepare(model(moe=MoEConfig(n_experts=2, k=1))) is None


def test_an_int8_model_decodes_as_its_general_step():
    """int8 projections run their own kernel in the lean step; the fused q/k/v stacks the
    int8 rows, which equals the three products exactly (the input is quantized per row)."""
    m = quantize_int8(model(seed=2))
    lean = LeanDecoder.prepare(m)
    src = sources(seed=3)
    enc = m.encode(src)
    general, fast = m.init_state(), lean.init_state(2)
    tokens = torch.full((src.size(0), 1), m.bos_id)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for _ in range(8):
            torch.testing.assert_close(lean.decode_step(tokens, enc, fast),
                                       m.decode_step(tokens, enc, general), rtol=0, atol=2e-5)
            tokens = torch.randint(4, 30, (src.size(0), 1), generator=g)
    assert greedy_search(lean, src, max_len_b=30) == greedy_search(m, src, max_len_b=30)
    assert beam_search(lean, src, beam=3, max_len_b=30) == beam_search(m, src, beam=3,
                                                                       max_len_b=30)


def test_a_changed_weight_or_module_makes_it_stale():
    m = model()
    lean = LeanDecoder.prepare(m)
    assert lean.is_current()
    with torch.no_grad():
        m.decoder.layers[1].self_attn.v_proj.bias.add_(0.5)
    assert not lean.is_current()
    lean = LeanDecoder.prepare(m)
    m.decoder.layers[0].ffn.fc1 = torch.nn.Linear(32, 64)
    assert not lean.is_current()
    lean = LeanDecoder.prepare(m)
    m.decoder.norm = torch.nn.LayerNorm(32)
    assert not lean.is_current()
    src = sources()
    assert greedy_search(LeanDecoder.prepare(m), src) == greedy_search(m, src)


def test_translator_decodes_the_same_with_and_without_the_lean_step(trained_run,
                                                                      synthetic_paths):
    from dynaseq.tasks.translation.predictor import Translator

    t = Translator.load(trained_run)
    lines = synthetic_paths["test.src"].read_text().splitlines()[:20]
    fast = t.translate(lines, beam=1), t.translate(lines, beam=3)
    assert t.lean_decoder() is not None and t.lean_decoder() is t.lean_decoder()
    t.fast_decode = False
    assert t.lean_decoder() is None
    assert (t.translate(lines, beam=1), t.translate(lines, beam=3)) == fast
    t.fast_decode = True
    before = t.lean_decoder()
    with torch.no_grad():  # training it further: the next call prepares a new lean step
        t.model.decoder.layers[0].self_attn.q_proj.weight.mul_(1.5)
    assert t.lean_decoder() is not before
    t.fast_decode = False
    general = t.translate(lines, beam=1)
    t.fast_decode = True
    assert t.translate(lines, beam=1) == general


def test_latency_timing_decodes_as_translation_does(monkeypatch):
    from dynaseq.metrics.latency import decode_latency_ms

    moe = model(moe=MoEConfig(n_experts=2, k=1))
    with pytest.raises(ValueError, match="no lean decoding step"):
        decode_latency_ms(moe, 5, 5, repeats=1, lean=True)
    assert decode_latency_ms(moe, 5, 5, repeats=1) > 0  # the general step
    prepared = []
    original = LeanDecoder.prepare
    monkeypatch.setattr(LeanDecoder, "prepare",
                        classmethod(lambda cls, m: prepared.append(m) or original(m)))
    dense = model()
    decode_latency_ms(dense, 5, 5, repeats=1)  # default: the lean step, prepared once
    decode_latency_ms(dense, 5, 5, repeats=1, lean=False)
    assert prepared == [dense]
    lean = original(dense)  # a prepared lean step is used as it is
    decode_latency_ms(dense, 5, 5, repeats=1, lean=lean)
    assert prepared == [dense]
    with pytest.raises(ValueError, match="lean must be a LeanDecoder of model"):
        decode_latency_ms(model(), 5, 5, repeats=1, lean=lean)


def test_a_cache_of_no_steps_is_refused():
    with pytest.raises(ValueError, match="at least one step"):
        LeanDecoder.prepare(model()).init_state(capacity=0)


def test_a_step_tally_keeps_each_rows_counts_as_rows_leave():
    """Counts follow the active rows; a row that leaves keeps its counts under its original
    index; one number adds to every active row; (B, M) counts keep their shape."""
    tally = StepTally(3)
    tally.add("a", torch.tensor([1, 2, 3]))
    tally.add("m", torch.tensor([[1, 0], [0, 1], [1, 1]]))
    tally.step()
    tally.reorder(torch.tensor([0, 2]))  # row 1 finished
    tally.add("a", 10)
    tally.add("m", torch.tensor([[1, 1], [0, 0]]))
    tally.step()
    tally.reorder(torch.tensor([1]))  # row 0 finished; row 2 goes on alone
    tally.add("a", torch.tensor([100]))
    tally.step()
    counts = tally.counts()
    assert counts["a"].tolist() == [11, 2, 113]
    assert counts["m"].tolist() == [[2, 1], [0, 1], [1, 1]]
    assert counts["steps"].tolist() == [2, 1, 3]


def test_greedy_search_counts_steps_only_through_a_lean_decoder():
    m = model()
    src = padded_sources(4, 1, eos=3)
    lean = LeanDecoder.prepare(m)
    tally = StepTally(src.size(0))
    hyps = greedy_search(lean, src, max_len_b=12, tally=tally)
    assert hyps == greedy_search(m, src, max_len_b=12)
    assert tally.counts()["steps"].tolist() == [len(h) + 1 for h in hyps]  # eos's step too
    with pytest.raises(ValueError, match="lean decoder"):
        greedy_search(m, src, tally=StepTally(src.size(0)))


@pytest.mark.parametrize("kind", ["dense", "cct"])
def test_the_source_is_encoded_through_the_lean_encoder_pass(kind):
    """Equal to the model's encoder at every valid position; a call that asks for compute
    traces (``aux``) gets the model's own pass; padding rows are not computed."""
    from dynaseq.nn.outputs import AuxOutputs
    from dynaseq.techniques.cct.gating import BudgetControl

    kw = {"cct": CCTConfig(ffn_pieces=2, control_hidden=8)} if kind == "cct" else {}
    m = model(**kw)
    lean = LeanDecoder.prepare(m)
    assert lean.encoder_layers is not None
    src = sources()
    assert bool(src.eq(m.pad_id).any())
    control = None
    if kind == "cct":
        control = BudgetControl(torch.arange(src.size(0)) % m.n_controls,
                                {"encoder": torch.linspace(-1, 1, src.size(0)),
                                 "decoder": torch.linspace(1, -1, src.size(0))})
    with torch.no_grad():
        ref = m.encode(src, control)
    got = lean.encode(src, control)
    valid = ~ref.pad_mask
    torch.testing.assert_close(got.out[valid], ref.out[valid], rtol=1e-5, atol=1e-5)
    assert torch.equal(got.pad_mask, ref.pad_mask)
    for a, b in ((got.control, ref.control), (got.gate_offset, ref.gate_offset)):
        assert (a is None and b is None) or torch.equal(a, b)
    traced = lean.encode(src, control, aux=AuxOutputs())
    torch.testing.assert_close(traced.out, ref.out, rtol=0, atol=0)


def _reorders_in_place(k, v, index, moved) -> bool:
    """A :class:`StepCache` of ``k``, ``v`` (5 steps) reordered by ``index`` (``moved``)
    holds ``k[index]``, ``v[index]`` exactly; whether it kept its storage."""
    from dynaseq.nn.lean_step import StepCache

    cache = StepCache(8)
    for t in range(5):
        cache.append(k[:, :, t: t + 1], v[:, :, t: t + 1])
    storage = cache.k.data_ptr()
    cache.reorder(index, moved)
    got_k, got_v = cache.filled()
    torch.testing.assert_close(got_k, k[index], rtol=0, atol=0)
    torch.testing.assert_close(got_v, v[index], rtol=0, atol=0)
    return cache.k.data_ptr() == storage


def test_a_reorder_that_keeps_the_row_count_copies_only_the_moved_rows_in_place():
    """``StepCache.reorder`` with :func:`moved_rows` equals the full gather and writes into
    the same storage; an index that keeps more rows than there are (beams) gathers."""
    from dynaseq.nn.lean_step import moved_rows

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, 2, 5, 4, generator=g), torch.randn(6, 2, 5, 4, generator=g)
    index = torch.tensor([0, 0, 2, 5, 4, 3])
    for moved in (None, moved_rows(index, 6)):
        assert _reorders_in_place(k, v, index, moved) == (moved is not None)
    assert moved_rows(index, 6).tolist() == [1, 3, 5]
    assert moved_rows(torch.arange(6), 6).numel() == 0
    assert moved_rows(torch.tensor([0, 2]), 6).tolist() == [1]  # fewer rows: kept ones
    assert moved_rows(torch.tensor([0, 0, 1, 1, 2, 2, 3]), 6) is None  # more: a gather


@pytest.mark.parametrize("index, in_place", [([0, 5, 2, 3], True), ([5, 4, 3, 2], False),
                                             ([0, 1, 2], True)])
def test_a_reorder_that_drops_rows_copies_few_moved_rows_in_place(index, in_place):
    """Dropping rows (greedy search swaps the rows that go on from the end into the places
    of those that finished): ``StepCache.reorder`` and ``CrossKeys.index_select`` equal the
    gather; with at most half the kept rows moved they write into the same storage and keep
    its first rows as a view, with more they gather."""
    from dynaseq.nn.lean_step import CrossKeys, moved_rows

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, 2, 5, 4, generator=g), torch.randn(6, 2, 5, 4, generator=g)
    index = torch.tensor(index)
    moved = moved_rows(index, 6)
    assert _reorders_in_place(k, v, index, moved) == in_place
    mask = torch.rand(6, 1, 1, 5, generator=g) > 0.3
    keys = CrossKeys(k.clone(), v.clone(), mask.clone())
    storage = keys.k.data_ptr()
    got = keys.index_select(index, moved)
    for a, b in ((got.k, k), (got.v, v), (got.mask, mask)):
        torch.testing.assert_close(a, b[index], rtol=0, atol=0)
    assert (got.k.data_ptr() == storage) == in_place
    if in_place:  # a mask every row shares stays as it is
        one = CrossKeys(k.clone(), v.clone(), mask[:1].clone())
        assert torch.equal(one.index_select(index, moved).mask, mask[:1])


@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_a_block_of_queries_over_shared_keys_equals_each_query_over_its_copy(mask):
    """``attend_keys`` with keys shared by groups of 3 rows equals SDPA of every row over
    its own copy of its group's keys (eq. 1), for no mask, a bool and a float mask."""
    from dynaseq.nn.lean_step import CrossKeys, attend_keys

    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(4, 2, 5, 8, generator=g), torch.randn(4, 2, 5, 8, generator=g)
    q = torch.randn(12, 2, 1, 8, generator=g)
    m = {"none": None, "bool": torch.rand(4, 1, 1, 5, generator=g) > 0.3,
         "float": torch.randn(4, 1, 1, 5, generator=g)}[mask]
    if m is not None and m.dtype == torch.bool:
        m[:, ..., 0] = True  # every row attends some key
    shared = CrossKeys(k, v, m).shared(3)
    copies = CrossKeys(k, v, m).index_select(torch.arange(4).repeat_interleave(3))
    assert copies.group == 1 and shared.group == 3 and shared.k is k
    torch.testing.assert_close(attend_keys(q, shared), attend_keys(q, copies),
                               rtol=1e-5, atol=1e-5)
    # dropping a group keeps the others' keys shared
    kept = shared.index_select(torch.tensor([0, 0, 0, 9, 9, 9]))
    assert kept.group == 3 and torch.equal(kept.k, k[[0, 3]])


@pytest.mark.parametrize("kind", ["dense", "dmb"])
def test_beams_share_their_sentences_cross_keys_and_decode_as_the_general_step(
        kind, monkeypatch):
    """With sharing from one sentence on, a lean beam search keeps one row of cross keys
    per sentence and gives the general step's hypotheses as sentences finish apart."""
    import dynaseq.models.lean as lean_module

    monkeypatch.setattr(lean_module, "SHARE_MIN", 1)
    m = model(seed=4, **({"dmb": DMBConfig(n_branches=3)} if kind == "dmb" else {}))
    lean = LeanDecoder.prepare(m)
    src = sources(n=6, seed=5)
    state = lean.init_state()
    lean.decode_step(torch.full((6, 1), m.bos_id), lean.encode(src), state)
    state.expand_beams(torch.arange(6).repeat_interleave(4), 4)
    assert [(keys.group, keys.k.size(0)) for keys in state.cross] == [(4, 6)] * 2
    assert_same_searches(m, lean, src, beams=(2, 4), max_len_b=12)
    states = []  # beam search itself shares: the state it decoded with
    monkeypatch.setattr(lean, "init_state", lambda: states.append(LeanState(2, 32, True))
                        or states[-1])
    beam_search(lean, src, beam=4, max_len_b=12)
    assert [keys.group for keys in states[0].cross] == [4, 4]


def test_below_share_min_sentences_each_beam_keeps_a_copy():
    """Fewer sentences than SHARE_MIN copy the keys per beam; the dense and CCT cross parts
    attend shared keys (a model's state shares when every layer's part does)."""
    from dynaseq.nn.lean_step import SHARE_MIN

    m = model(seed=4)
    lean = LeanDecoder.prepare(m)
    n = SHARE_MIN - 1
    state = lean.init_state()
    lean.decode_step(torch.full((n, 1), m.bos_id), lean.encode(sources(n=n)), state)
    state.expand_beams(torch.arange(n).repeat_interleave(4), 4)
    assert [(keys.group, keys.k.size(0)) for keys in state.cross] == [(1, 4 * n)] * 2
    cct = model(cct=CCTConfig(ffn_pieces=2, control_hidden=8))
    assert LeanDecoder.prepare(cct).init_state().share_keys
    assert lean.init_state().share_keys
