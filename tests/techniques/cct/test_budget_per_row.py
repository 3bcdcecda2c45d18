"""One request, one budget: a CCT's budget (control symbol + calibrated gate offsets) is an
argument of each call, per row, and nothing about it is written into the model."""

from __future__ import annotations

import threading

import pytest
import torch

import dynaseq
from dynaseq.core.errors import DynaseqError
from dynaseq.data import collate, make_corpus
from dynaseq.techniques.cct.gating import ALL_GATES_ON, GATE_SUBNETWORKS
from dynaseq.techniques.cct.layers import (
    BudgetControl,
    Gate,
    realized_macs_by_layer,
    realized_macs_by_row,
)

BUDGETS = [1.0, 0.5, 0.33]  # 1.0 trained as is; 0.5 trained, calibrated; 0.33 calibrated only


@pytest.fixture(scope="module")
def calibrated(cct_run, synthetic_paths):
    """The shared CCT run, loaded once, with budgets 0.5 and 0.33 calibrated in memory (the
    run directory is not written), and the first test lines with their references."""
    run, _ = cct_run
    t = dynaseq.load(run)
    src = synthetic_paths["valid.src"].read_text().splitlines()[:30]
    ref = synthetic_paths["valid.tgt"].read_text().splitlines()[:30]
    fitted = t.calibrate(src, ref, budgets=[0.5, 0.33], tol=0.02)
    # non-zero offsets, so the per-row offsets path is what these tests exercise
    assert all(any(v != 0.0 for v in c.offsets.values()) for c in fitted), fitted
    lines = synthetic_paths["test.src"].read_text().splitlines()[:6]
    refs = synthetic_paths["test.tgt"].read_text().splitlines()[:6]
    return t, lines, refs


def _interleaved(items: list, k: int) -> list:
    """Each item k times in a row: [a, a, a, b, b, b, ...]."""
    return [x for x in items for _ in range(k)]


def _model_state(model: torch.nn.Module) -> dict[str, object]:
    """Every tensor (parameters, persistent and non-persistent buffers) and every plain
    attribute of every module."""
    state: dict[str, object] = {f"tensor {k}": v.detach().clone()
                                for k, v in model.state_dict(keep_vars=True).items()}
    state.update({f"buffer {k}": v.clone() for k, v in model.named_buffers()})
    for name, m in model.named_modules():
        for k, v in vars(m).items():
            if not k.startswith("_") and not isinstance(v, torch.Tensor):
                state[f"attr {name}.{k}"] = repr(v)
    return state


def _assert_same_state(before: dict[str, object], after: dict[str, object]) -> None:
    assert before.keys() == after.keys()
    for k, v in before.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, after[k]), k
        else:
            assert v == after[k], k


def test_rows_at_different_budgets_share_a_batch_and_translate_as_alone(calibrated):
    t, lines, refs = calibrated
    n, k = len(lines), len(BUDGETS)
    mixed_lines = _interleaved(lines, k)  # line i at budget j is row i·k + j
    mixed_budgets = BUDGETS * n
    assert len(mixed_lines) <= t.config.decode.batch_size  # one batch holds every budget
    for beam in (1, 2):
        alone = {b: t.translate(lines, beam=beam, budget=b) for b in BUDGETS}
        mixed = t.translate(mixed_lines, beam=beam, budget=mixed_budgets)
        for i in range(n):
            for j, b in enumerate(BUDGETS):
                assert mixed[i * k + j] == alone[b][i], (beam, i, b)
    # scores: each pair's tokens once per budget, so the mixed loss is the mean of the three
    alone_scores = [t.score(lines, refs, budget=b) for b in BUDGETS]
    assert len({s["loss"] for s in alone_scores}) == k  # the budgets do differ
    mixed_score = t.score(mixed_lines, _interleaved(refs, k), budget=mixed_budgets)
    assert mixed_score["n_tokens"] == sum(s["n_tokens"] for s in alone_scores)
    assert mixed_score["loss"] == pytest.approx(sum(s["loss"] for s in alone_scores) / k,
                                                rel=1e-5)


def test_rows_at_different_budgets_score_and_count_macs_per_row_as_alone(calibrated):
    t, lines, refs = calibrated
    m = t.model
    corpus, _ = make_corpus(t.tokenizer.encode(lines), t.tokenizer.encode(refs),
                            t.config.data.max_len, long_lines="truncate")
    b = collate(corpus, list(range(len(corpus))), m.pad_id, m.bos_id, m.eos_id)
    n, k = b.src.size(0), len(BUDGETS)
    logits, macs = {}, {}
    with torch.no_grad():
        for budget in BUDGETS:
            out = m(b.src, b.tgt_in, t.control_for(budget))
            logits[budget] = out.logits
            macs[budget] = realized_macs_by_row(out.aux)
        rows = torch.arange(n).repeat_interleave(k)  # row i·k + j: pair i at budget j
        out = m(b.src[rows], b.tgt_in[rows], t.control_for(BUDGETS * n, n * k))
    mixed_macs = realized_macs_by_row(out.aux)
    assert mixed_macs.keys() == macs[1.0].keys()
    totals = {int(sum(v.sum() for v in macs[budget].values())) for budget in BUDGETS}
    assert len(totals) == k  # the budgets run different gates (1.0 is uncalibrated)
    for j, budget in enumerate(BUDGETS):
        torch.testing.assert_close(out.logits[j::k], logits[budget], rtol=1e-5, atol=1e-5)
        for layer, per_row in mixed_macs.items():
            assert per_row[j::k].tolist() == macs[budget][layer].tolist(), (budget, layer)
    # the realized compute the translator reports, each line at its own budget
    alone = [t.realized_compute(lines, refs, budget)["macs_per_token"] for budget in BUDGETS]
    mixed = t.realized_compute(_interleaved(lines, k), _interleaved(refs, k),
                               BUDGETS * len(lines))["macs_per_token"]
    for part in ("encoder", "decoder"):
        assert mixed[part] == pytest.approx(sum(a[part] for a in alone) / k, rel=1e-9)


def _mixed_batch(calibrated):
    """The model, the test lines as one teacher-forced batch, and rows at BUDGETS in turn."""
    t, lines, refs = calibrated
    m = t.model
    corpus, _ = make_corpus(t.tokenizer.encode(lines), t.tokenizer.encode(refs),
                            t.config.data.max_len, long_lines="truncate")
    b = collate(corpus, list(range(len(corpus))), m.pad_id, m.bos_id, m.eos_id)
    return m, b, t.control_for(_interleaved(BUDGETS, 2), len(corpus))


def test_per_row_macs_are_what_the_row_costs_alone(calibrated):
    m, b, control = _mixed_batch(calibrated)
    with torch.no_grad():
        per_row = realized_macs_by_row(m(b.src, b.tgt_in, control).aux)
        for i in range(b.src.size(0)):  # the same padded row, alone in its batch
            rec = realized_macs_by_layer(m(b.src[i:i + 1], b.tgt_in[i:i + 1],
                                           control.select(torch.tensor([i]))).aux)
            for layer, counts in rec.items():
                assert per_row[layer][i] == sum(counts.values()), (i, layer)


def test_a_rows_own_count_leaves_out_the_padding_its_batch_gave_it(calibrated):
    """Given each stack's own positions, a row's MACs (at its budget, and with every gate
    open) are those of the row run alone without padding, however long the other rows
    are: encoder, decoder and cross-attention alike. Without them the padding counts."""
    m, b, control = _mixed_batch(calibrated)
    valid = {"encoder": b.src.ne(m.pad_id), "decoder": b.tgt_in.ne(m.pad_id)}
    assert not bool(valid["encoder"].all()) and not bool(valid["decoder"].all())
    with torch.no_grad():
        aux = m(b.src, b.tgt_in, control).aux
        for all_on in (False, True):
            own = realized_macs_by_row(aux, all_on, valid)
            padded = realized_macs_by_row(aux, all_on)
            for i in range(b.src.size(0)):
                s, t = (int(v[i].sum()) for v in (valid["encoder"], valid["decoder"]))
                alone = realized_macs_by_row(m(b.src[i:i + 1, :s], b.tgt_in[i:i + 1, :t],
                                               control.select(torch.tensor([i]))).aux, all_on)
                assert alone.keys() == own.keys()
                for layer, counts in alone.items():
                    assert own[layer][i] == counts[0], (all_on, i, layer)
            assert all(bool((padded[k] >= own[k]).all()) for k in own)
            assert any(bool((padded[k] > own[k]).any()) for k in own)


def test_all_on_counts_of_one_call_are_those_of_a_call_with_every_gate_open(calibrated):
    """``per_row_full`` (recorded by the call at the rows' budgets) equals the per-row
    MACs of the same batch run again with every gate open, sub-layer by sub-layer."""
    m, b, control = _mixed_batch(calibrated)
    opened = BudgetControl(control.ids, dict.fromkeys(GATE_SUBNETWORKS, ALL_GATES_ON))
    with torch.no_grad():
        at_budget = m(b.src, b.tgt_in, control).aux
        full = realized_macs_by_row(m(b.src, b.tgt_in, opened).aux)
    one_call = realized_macs_by_row(at_budget, all_on=True)
    assert one_call.keys() == full.keys()
    for layer, per_row in full.items():
        assert torch.equal(one_call[layer], per_row), layer
    ran = realized_macs_by_row(at_budget)
    assert any(bool((ran[k] < full[k]).any()) for k in full)  # the budgets closed gates


def test_served_compute_is_the_two_call_count(calibrated):
    """The server's compute of a line (one teacher-forced call, no output layer) equals
    the count of two calls: at the line's budget, and with every gate open."""
    from dynaseq.serve.compute import realized_per_row

    t, lines, _ = calibrated
    m = t.model
    budgets = _interleaved(BUDGETS, 2)
    src = t.tokenizer.encode(lines)
    hyps = t.tokenizer.encode(t.translate(lines, budget=budgets))
    for i, (s, h) in enumerate(zip(src, hyps, strict=True)):
        control = t.control_for([budgets[i]], 1)
        [got] = realized_per_row(m, [s], [h], control)
        opened = BudgetControl(control.ids, dict.fromkeys(GATE_SUBNETWORKS, ALL_GATES_ON))
        x, y = torch.tensor([[*s, m.eos_id]]), torch.tensor([[m.bos_id, *h]])
        per = {}
        for name, setting in (("ran", control), ("full", opened)):
            with torch.no_grad():
                counts = realized_macs_by_row(m(x, y, setting).aux)
            per[name] = {sub: sum(int(v[0]) for k, v in counts.items()
                                  if k.split(".")[0] == sub) for sub in GATE_SUBNETWORKS}
        for sub, n in (("encoder", x.size(1)), ("decoder", y.size(1))):
            assert got["macs_per_token"][sub] == per["ran"][sub] / n, (i, sub)
            assert got["fraction"][sub] == pytest.approx(per["ran"][sub] / per["full"][sub])


def test_a_served_lines_compute_does_not_depend_on_what_it_was_batched_with(calibrated):
    """The server's compute of each line of a batch mixing budgets and lengths equals the
    line's compute served alone."""
    from dynaseq.serve.compute import realized_per_row

    t, lines, _ = calibrated
    budgets = _interleaved(BUDGETS, 2)
    src = t.tokenizer.encode(lines)
    assert len({len(x) for x in src}) > 1
    hyps = t.tokenizer.encode(t.translate(lines, budget=budgets))
    batched = realized_per_row(t.model, src, hyps, t.control_for(budgets, len(lines)))
    for i, got in enumerate(batched):
        [alone] = realized_per_row(t.model, [src[i]], [hyps[i]], t.control_for([budgets[i]], 1))
        assert got == alone, i


def test_all_on_counts_from_the_lengths_equal_those_the_pass_records(calibrated):
    """A line at a budget of 1 in both sub-networks is reported without a forward pass
    (:func:`all_on_macs`); that count equals the all-on count a teacher-forced pass
    records for the line's own tokens, and the served report at budget 1 equals it."""
    from dynaseq.serve.compute import all_on_macs, all_open_reports, realized_per_row

    m, b, control = _mixed_batch(calibrated)
    valid = {"encoder": b.src.ne(m.pad_id), "decoder": b.tgt_in.ne(m.pad_id)}
    with torch.no_grad():
        recorded = realized_macs_by_row(m(b.src, b.tgt_in, control).aux, True, valid)
    for i in range(b.src.size(0)):
        s, t = (int(v[i].sum()) for v in (valid["encoder"], valid["decoder"]))
        want = {sub: sum(int(v[i]) for k, v in recorded.items() if k.split(".")[0] == sub)
                for sub in GATE_SUBNETWORKS}
        assert all_on_macs(m, s, t) == want, i
    tr, lines, _ = calibrated
    src = tr.tokenizer.encode(lines)
    hyps = tr.tokenizer.encode(tr.translate(lines, budget=1.0))
    control = tr.control_for([1.0] * len(lines), len(lines))
    assert all(control.all_open(len(lines)))
    served = realized_per_row(m, src, hyps, control)
    for row, s, h in zip(served, src, hyps, strict=True):
        counts = all_on_macs(m, len(s) + 1, len(h) + 1)
        assert row["fraction"] == {"encoder": 1.0, "decoder": 1.0, "total": 1.0}
        assert row["macs_per_token"]["encoder"] == counts["encoder"] / (len(s) + 1)
        assert row["macs_per_token"]["decoder"] == counts["decoder"] / (len(h) + 1)
    cache: dict = {}  # the lines answered as they finish: the same, from the lengths alone
    assert all_open_reports(m, src, hyps, cache) == served and cache
    assert all_open_reports(m, src, hyps, cache) == served


@pytest.mark.parametrize("batch_size", [None, 1])
def test_compute_counted_while_decoding_equals_the_teacher_forced_count(calibrated,
                                                                       batch_size):
    """A greedy decode through the lean step counts each row's open gates step by step
    (:class:`StepTally`, rows leaving as they finish); the compute formed from those counts
    and the encoder's records equals the teacher-forced pass's, line by line, for a batch
    mixing budgets (every gate open, calibrated, trained) and lengths, and for each line
    alone (batch 1: the parts read one row's gates without a mask; a line at the full
    budget is then decoded without counting, and ``on_batch`` is not called for it)."""
    from dynaseq.serve.compute import counted_per_row, realized_per_row
    from dynaseq.tasks.translation.predictor import decode_corpus

    t, lines, _ = calibrated
    budgets = _interleaved(BUDGETS, 2)
    src = t.tokenizer.encode(lines)
    control = t.control_for(budgets, len(lines))
    counted: dict[int, dict] = {}
    seen_steps = []

    def on_batch(idx, rows, aux, counts):
        seen_steps.extend(counts["steps"].tolist())
        counted.update(zip(idx, counted_per_row(t.model, rows, aux, counts), strict=True))

    hyps = decode_corpus(t.model, src, beam=1, batch_size=batch_size or len(src),
                         control=control, lean=t.lean_decoder(), on_batch=on_batch)
    assert t.tokenizer.decode(hyps) == t.translate(lines, beam=1, budget=budgets)
    assert len(set(seen_steps)) > 1  # rows left the batch at different steps
    want = realized_per_row(t.model, src, hyps, control)
    full = control.all_open(len(src))
    assert sorted(counted) == [i for i in range(len(src)) if batch_size is None or not full[i]]
    assert [counted[i] for i in sorted(counted)] == [want[i] for i in sorted(counted)]
    with pytest.raises(ValueError, match="greedy decoding through a lean decoder"):
        decode_corpus(t.model, src, beam=2, control=control, lean=t.lean_decoder(),
                      on_batch=on_batch)


def test_compute_formed_as_lines_finish_equals_the_teacher_forced_count(calibrated,
                                                                      monkeypatch):
    """The same count, formed for each group of lines when it finishes (``on_done`` with
    the counts so far, :class:`CountedRows` made once per batch), line by line equal to
    the teacher-forced pass's; each line is handed over once, with its final tokens."""
    from dynaseq.serve.compute import CountedRows, realized_per_row
    from dynaseq.tasks.translation.predictor import decode_corpus

    t, lines, _ = calibrated
    budgets = _interleaved(BUDGETS, 2)
    src = t.tokenizer.encode(lines)
    control = t.control_for(budgets, len(lines))
    early: dict[int, tuple[list[int], dict]] = {}
    counters = []

    def on_done(done):
        aux, counts = done.counted
        if not counters:
            counters.append(CountedRows(t.model, done.src, aux))
        reports = counters[0].reports(counts, done.rows)
        for i, tokens, rep in zip(done.idx, done.tokens, reports, strict=True):
            assert i not in early
            early[i] = (tokens, rep)

    batches = []
    hyps = decode_corpus(t.model, src, beam=1, batch_size=len(src), control=control,
                         lean=t.lean_decoder(), on_batch=lambda *a: batches.append(a),
                         on_done=on_done)
    assert [early[i][0] for i in range(len(src))] == hyps
    want = realized_per_row(t.model, src, hyps, control)
    assert [early[i][1] for i in range(len(src))] == want
    # a server's cache of all-open counts by lengths: filled once, then only read
    (idx, rows_src, aux, counts), = batches
    cache: dict = {}
    first = CountedRows(t.model, rows_src, aux, cache).reports(counts)
    assert cache and first == [want[i] for i in idx]

    def refuse(*args):
        raise AssertionError("all-open counts recomputed")

    monkeypatch.setattr("dynaseq.serve.compute.all_on_macs", refuse)
    assert CountedRows(t.model, rows_src, aux, cache).reports(counts) == first


def test_threads_at_different_budgets_on_one_model_match_running_one_after_the_other(
        calibrated):
    t, lines, refs = calibrated
    budgets = [0.5, 0.33, 1.0]  # two calibrated budgets (offsets) and an uncalibrated one

    def job(budget) -> tuple[list[str], dict[str, float]]:
        return t.translate(lines, beam=1, budget=budget), t.score(lines, refs, budget=budget)

    expected = {b: job(b) for b in budgets}
    assert len({e[1]["loss"] for e in expected.values()}) == len(budgets)
    for _ in range(4):
        barrier = threading.Barrier(len(budgets))
        results: dict[float, object] = {}

        def run(budget, barrier=barrier, results=results) -> None:
            barrier.wait()
            try:
                results[budget] = [job(budget) for _ in range(3)]
            except Exception as e:  # reported by the main thread
                results[budget] = e

        threads = [threading.Thread(target=run, args=(b,)) for b in budgets]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=300)
        for b in budgets:
            assert not isinstance(results[b], Exception), results[b]
            for hyps, score in results[b]:
                assert hyps == expected[b][0], b
                assert score == expected[b][1], b


def test_a_calibrated_call_changes_no_module_state(calibrated):
    t, lines, refs = calibrated
    assert not any(hasattr(g, "offset") for g in t.model.modules() if isinstance(g, Gate))
    before = _model_state(t.model)
    t.translate(lines, beam=2, budget=0.33)
    t.translate(lines, beam=1, budget=[0.5, 0.33, 1.0, 0.5, 0.33, 1.0])
    t.score(lines, refs, budget=0.5)
    t.evaluate(lines, refs, beam=1, budget=[0.33] * len(lines))
    with t.at_budget(0.33) as control:
        assert isinstance(control, BudgetControl) and control.offsets
        _assert_same_state(before, _model_state(t.model))  # nothing applied inside either
    _assert_same_state(before, _model_state(t.model))


def test_bad_per_row_budgets_are_refused_with_a_clear_message(calibrated):
    t, lines, refs = calibrated
    with pytest.raises(DynaseqError, match=r"2 budgets for 6 lines: give one budget, or a "
                                           r"list with one per line"):
        t.translate(lines, budget=[0.5, 0.33])
    with pytest.raises(DynaseqError, match=r"2 budgets for 6 lines"):
        t.score(lines, refs, budget=[0.5, 0.33])
    with pytest.raises(DynaseqError, match=r"a budget is a fraction in \(0, 1\], got 1.5"):
        t.translate(lines, budget=[0.5, 1.5, 1.0, 1.0, 1.0, 1.0])
    with pytest.raises(DynaseqError, match=r"a budget is a fraction in \(0, 1\], got 0"):
        t.translate(lines, budget=0)
    with pytest.raises(DynaseqError, match=r"budget \(0.9, 0.9\) was not trained"):
        t.translate(lines, budget=[0.5, 0.9, 1.0, 1.0, 1.0, 1.0])
    src = torch.tensor([[5, 6, 3], [7, 3, 0]])
    with pytest.raises(ValueError, match=r"control ids must be one per sequence, shape \(2,\)"):
        t.model.encode(src, torch.tensor([0, 1, 2]))


def test_dense_models_refuse_per_row_budgets(trained_run):
    t = dynaseq.load(trained_run)
    with pytest.raises(DynaseqError, match="no compute-budget knob"):
        t.translate(["a b"], budget=[0.5])
    assert t.translate(["a b"], budget=[None]) == t.translate(["a b"])


def test_a_corpus_of_per_line_budgets_is_batched_by_budget_then_length():
    from dynaseq.tasks.translation.predictor import budget_batches

    lengths = [5, 1, 4, 2, 3, 6]
    assert budget_batches(None, lengths, 4) == [[1, 3, 4, 2], [0, 5]]  # one budget: length
    assert budget_batches(BudgetControl(1, {"decoder": 0.5}), lengths, 6) == [[1, 3, 4, 2, 0, 5]]
    ids = torch.tensor([0, 1, 0, 1, 0, 1])
    per_row = BudgetControl(ids, {"decoder": torch.tensor([0.0, 2.0, 0.0, 2.0, 0.0, 2.0])})
    # id 0's by length, then id 1's; a batch of two budgets neither of them full stays one
    assert budget_batches(per_row, lengths, 4) == [[4, 2, 0, 1], [3, 5]]
    assert budget_batches(ids, lengths, 6) == [[4, 2, 0, 1, 3, 5]]  # plain per-row ids alike
    same_id = BudgetControl(0, {"decoder": torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])})
    assert budget_batches(same_id, lengths, 6) == [[1, 3, 5, 4, 2, 0]]  # offsets count
    with pytest.raises(ValueError, match="one entry per sentence"):
        budget_batches(ids[:3], lengths, 6)


def test_a_batch_of_the_full_budget_and_one_other_stays_one_batch():
    from dynaseq.tasks.translation.predictor import budget_batches

    inf = ALL_GATES_ON
    lengths = [5, 1, 4, 2, 3, 6]
    full_and_one = BudgetControl(torch.tensor([0, 1, 0, 1, 0, 1]), {
        "encoder": torch.tensor([inf, 0.5, inf, 0.5, inf, 0.5]),
        "decoder": torch.tensor([inf, 0.5, inf, 0.5, inf, 0.5])})
    assert budget_batches(full_and_one, lengths, 6) == [[4, 2, 0, 1, 3, 5]]
    assert budget_batches(full_and_one, lengths, 4) == [[4, 2, 0, 1], [3, 5]]


def test_decoding_per_line_budgets_runs_single_budget_batches_that_translate_as_alone(
        calibrated, monkeypatch):
    from dynaseq.tasks.translation import predictor

    t, lines, _ = calibrated
    budgets = [BUDGETS[1 + i % 2] for i in range(len(lines))]  # alternating 0.5, 0.33
    alone = {b: t.translate(lines, beam=1, budget=b) for b in BUDGETS[1:]}
    seen: list[tuple[int, object]] = []
    search = predictor.greedy_search

    def recording(model, src, *, control, **kw):
        seen.append((src.size(0), control.offsets["decoder"]))
        return search(model, src, control=control, **kw)

    monkeypatch.setattr(predictor, "greedy_search", recording)
    out = t.translate(lines, beam=1, budget=budgets, batch_size=len(lines) // 2)
    assert [n for n, _ in seen] == [len(lines) // 2] * 2
    # each batch at one budget, and run as that budget's call: one float offset for all rows
    assert all(isinstance(off, float) for _, off in seen), seen
    assert len({off for _, off in seen}) == 2
    assert out == [alone[b][i] for i, b in enumerate(budgets)]


def test_a_per_row_control_of_one_budget_runs_as_that_budget():
    from dynaseq.tasks.translation.predictor import one_budget

    inf = ALL_GATES_ON
    same = BudgetControl(torch.tensor([2, 2, 2]), {"encoder": torch.tensor([inf] * 3),
                                                   "decoder": torch.tensor([0.25] * 3)})
    one = one_budget(same)
    assert one.ids == 2 and one.offsets == {"encoder": inf, "decoder": 0.25}
    assert one.all_open(3) == [False] * 3 and one_budget(one) is one
    mixed = BudgetControl(torch.tensor([2, 2, 3]), {"decoder": torch.tensor([0.25] * 3)})
    assert one_budget(mixed) is mixed
    offsets_differ = BudgetControl(1, {"decoder": torch.tensor([0.25, 0.5])})
    assert one_budget(offsets_differ) is offsets_differ
    ids = torch.tensor([1, 1])
    assert one_budget(ids) is ids  # plain ids: as they are
