"""The lean encoder pass (models/lean_encoder.LeanEncoder) against the model's own forward:
dense and CCT encoders, padding, single, per-row and fixed budgets, gated-off work and
padding not computed, staleness, and which models get one; early exits (ALBERTa with
relative positions, per-layer rules) and LayerDrop subsets through the lean layers."""

from __future__ import annotations

import pytest
import torch

from dynaseq.models.lean_encoder import LeanEncoder
from dynaseq.tasks.classify.predictor import RealizedCompute, predict_logits
from dynaseq.tasks.encoder.config import EncoderModelConfig
from dynaseq.tasks.encoder.model import build_encoder_model
from dynaseq.techniques.cct.config import EncoderCCTConfig
from dynaseq.techniques.cct.gating import ALL_GATES_ON, BudgetControl
from dynaseq.techniques.depth.config import DepthConfig
from dynaseq.techniques.depth.exits import DEPTH_RUN, LAYER_ROWS, DepthExit
from dynaseq.techniques.depth.multi_exit import EXIT_LAYER, ExitsConfig, LayerExit

from encoder_helpers import padded_tokens
from helpers import count_ops

V = 60
LENGTHS = [9, 4, 12, 1, 7]


def _model(cct: bool, seed: int = 0, **kw):
    cfg = {"d_model": 32, "ffn_dim": 64, "n_heads": 4, "layers": 3, "max_positions": 64,
           "dropout": 0.0, "attention_dropout": 0.0, "classifier_dropout": 0.0, **kw}
    if cct:
        cfg["cct"] = EncoderCCTConfig(ffn_pieces=4, control_hidden=8, budgets=[0.8, 0.5, 0.2],
                                      alpha_max=0.0)
    torch.manual_seed(seed)
    model = build_encoder_model(EncoderModelConfig(**cfg), V, 3).eval()
    if cct:  # control nets that open some gates and close others
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "control" in name and name.endswith("w2.weight"):
                    p.normal_(0, 2.0)
    return model


def _inputs(lengths=LENGTHS, seed: int = 1):
    tokens = padded_tokens(lengths, V, seed)
    segments = (torch.arange(tokens.size(1)) >= 3).long().expand_as(tokens).clone()
    return tokens, segments


def _assert_same(model, lean, tokens, segments, control):
    with torch.no_grad():
        ref = model(tokens, segments, control)
    hidden, pad = lean.encode(tokens, segments, control)
    valid = ~ref.pad_mask
    torch.testing.assert_close(hidden[valid], ref.hidden[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lean(tokens, segments, control), ref.logits, rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(pad, ref.pad_mask)


def test_dense_encoder_equals_the_model_with_padding_and_segments():
    model = _model(cct=False)
    lean = LeanEncoder.prepare(model)
    assert lean is not None
    _assert_same(model, lean, *_inputs(), None)
    _assert_same(model, lean, *_inputs([6, 6]), None)  # no padding
    relative = _model(cct=False, relative_positions=4)  # its first query: every query's pass
    _assert_same(relative, LeanEncoder.prepare(relative), *_inputs(), None)
    # the feed-forward runs the valid tokens; the last layer runs each row's first token
    # alone past its fused q/k/v product: its output projection and feed-forward
    tokens, segments = _inputs()
    b, s, n_valid = *tokens.shape, sum(LENGTHS)
    layer = [(b * s, 32), (b * s, 32), (n_valid, 32), (n_valid, 64)]
    assert _products(lambda: lean(tokens, segments)) == layer * 2 + [
        (b * s, 32), (b, 32), (b, 32), (b, 64), (b, 32), (b, 32)]


@pytest.mark.parametrize("control", [0, 1, 2, "mixed ids", "mixed offsets", "open", "closed"])
def test_cct_encoder_equals_the_model_at_every_budget(control):
    model = _model(cct=True)
    tokens, segments = _inputs()
    b = tokens.size(0)
    ids = torch.tensor([0, 2, 1, 2, 0])
    control = {"mixed ids": ids,
               "mixed offsets": BudgetControl(ids, {"encoder": torch.tensor(
                   [0.0, 0.4, -0.3, float("inf"), float("-inf")])}),
               "open": BudgetControl(1, {"encoder": ALL_GATES_ON}),
               "closed": BudgetControl(1, {"encoder": torch.full((b,), float("-inf"))}),
               }.get(control, control)
    lean = LeanEncoder.prepare(model)
    assert lean is not None
    _assert_same(model, lean, tokens, segments, control)
    _assert_same(model, lean, *_inputs([8, 8, 8]), 1)  # no padding


def test_batched_equals_one_row_at_a_time_with_mixed_budgets():
    model = _model(cct=True)
    lean = LeanEncoder.prepare(model)
    tokens, segments = _inputs()
    ids = torch.tensor([0, 2, 1, 2, 0])
    both = lean(tokens, segments, ids)
    for i, n in enumerate(LENGTHS):
        alone = lean(tokens[i:i + 1, :n], segments[i:i + 1, :n], ids[i:i + 1])
        torch.testing.assert_close(both[i:i + 1], alone, rtol=1e-5, atol=1e-5)


def _products(fn) -> list[tuple[int, ...]]:
    """The shapes of the input operand of every matrix product ``fn`` runs."""
    with count_ops() as ops:
        fn()
    return ops.products


def test_closed_gates_run_no_sublayer_and_padding_is_not_computed():
    model = _model(cct=True)
    lean = LeanEncoder.prepare(model)
    tokens, segments = _inputs()
    b, n_valid = tokens.size(0), sum(LENGTHS)
    closed = BudgetControl(1, {"encoder": torch.full((b,), float("-inf"))})
    # every gate closed: the control nets do not run either; only the head's two products
    assert _products(lambda: lean(tokens, segments, closed)) == [(b, 32), (b, 32)]
    # every gate open: per layer, the keys/values, the queries and the output projection of
    # the valid tokens only (padding is not computed), the feed-forward's fused first layer
    # over them, its 4 pieces' second layers as one batched product; the last layer: every
    # valid token's keys/values, then each row's first token alone (all the head reads):
    # its query, output projection and feed-forward; then the head
    opened = BudgetControl(1, {"encoder": ALL_GATES_ON})
    shapes = _products(lambda: lean(tokens, segments, opened))
    layer = [(n_valid, 32)] * 4 + [(4, n_valid, 16)]
    assert shapes == layer * 2 + [(n_valid, 32)] + [(b, 32)] * 3 + [(4, b, 16)] + [
        (b, 32)] * 2
    # no padding and every gate open: one fused q/k/v product per layer
    tokens, segments = _inputs([8, 8])
    shapes = _products(lambda: lean(tokens, segments, opened))
    assert shapes == [(16, 32), (16, 32), (16, 32), (4, 16, 16)] * 2 + [
        (16, 32), (2, 32), (2, 32), (2, 32), (4, 2, 16), (2, 32), (2, 32)]
    # counting the gates (realized compute): the last feed-forward runs every token
    counted = _products(lambda: lean(tokens, segments, opened, []))
    assert counted == [(16, 32), (16, 32), (16, 32), (4, 16, 16)] * 3 + [(2, 32), (2, 32)]
    with count_ops() as ops:
        lean(tokens, segments, opened)
    assert "cat.default" not in ops.names


def test_the_control_nets_read_no_padding():
    """Gates decided by the control nets, with padding: no product reads a padded token
    (the attention's control nets ran over every position of the padded batch before)."""
    model = _model(cct=True)
    lean = LeanEncoder.prepare(model)
    tokens, segments = _inputs()
    n_valid = sum(LENGTHS)
    assert n_valid < tokens.numel()
    for control in (1, BudgetControl(torch.tensor([0, 2, 1, 2, 0]),
                                     {"encoder": torch.tensor([0.0, 0.4, -0.3, 9.0, -9.0])})):
        shapes = _products(lambda c=control: lean(tokens, segments, c))
        assert max(shape[-2] if len(shape) == 3 else shape[0] for shape in shapes) <= n_valid
        _assert_same(model, lean, tokens, segments, control)


def test_which_models_get_a_lean_encoder_and_staleness():
    assert LeanEncoder.prepare(torch.nn.Linear(2, 2)) is None
    model = _model(cct=True)
    lean = LeanEncoder.prepare(model)
    assert lean.is_current()
    with torch.no_grad():
        model.encoder.layers[0].ffn.pieces[1].ffn.fc1.weight.add_(1.0)
    assert not lean.is_current()
    lean = LeanEncoder.prepare(model)
    model.encoder.layers[1].ffn = _model(cct=True, seed=3).encoder.layers[1].ffn
    assert not lean.is_current()
    model.train()
    with pytest.raises(ValueError, match="eval mode"):
        lean.encode(*_inputs(), 0)


@pytest.mark.parametrize("control", ["mixed", "open", "closed", 1])
def test_counted_row_macs_equal_the_models_traces(control):
    """Each row's realized and all-open MACs from the lean pass's gate counts equal what the
    model's traces give per row over its own tokens (shared layers counted per application)."""
    from dynaseq.techniques.cct.layers import realized_macs_by_row

    model = _model(cct=True, layers=4, share_layers="groups", layer_groups=2)
    tokens, segments = _inputs()
    b = tokens.size(0)
    ids = torch.tensor([0, 2, 1, 2, 0])
    control = {"mixed": BudgetControl(ids, {"encoder": torch.tensor(
                   [0.0, 0.4, -0.3, float("inf"), float("-inf")])}),
               "open": BudgetControl(1, {"encoder": ALL_GATES_ON}),
               "closed": BudgetControl(1, {"encoder": torch.full((b,), float("-inf"))}),
               }.get(control, control)
    lean = LeanEncoder.prepare(model)
    counts: list = []
    lean(tokens, segments, control, counts)
    assert len(counts) == 4  # one per layer application
    n = tokens.ne(model.pad_id).sum(1)
    ran, full = lean.row_macs(counts, n)
    valid = {"encoder": tokens.ne(model.pad_id)}
    with torch.no_grad():
        ref = realized_macs_by_row(model(tokens, segments, control).aux, False, valid)
        ids_of = control.ids if isinstance(control, BudgetControl) else control
        opened = model(tokens, segments, BudgetControl(ids_of, {"encoder": ALL_GATES_ON}))
        ref_full = realized_macs_by_row(opened.aux, False, valid)
    assert ran.tolist() == sum(ref.values()).tolist()
    assert full.tolist() == sum(ref_full.values()).tolist()
    if control == "closed":
        assert ran.lt(full).all()


def test_profile_latency_times_the_lean_pass_unless_asked_otherwise(monkeypatch):
    from dynaseq.metrics.encoder_profile import encoder_latency_ms

    calls = []
    real = LeanEncoder.__call__
    monkeypatch.setattr(LeanEncoder, "__call__",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    model = _model(cct=True)
    encoder_latency_ms(model, 8, 2, repeats=2, control=1)
    assert len(calls) == 3  # warm-up and two timed calls
    encoder_latency_ms(model, 8, 2, repeats=2, control=1, lean=False)
    encoder_latency_ms(model, 8, 2, repeats=2, control=1, layers=(0, 2))
    assert len(calls) == 3


def _alberta(seed: int = 0):
    model = _model(cct=False, seed=seed, layers=6, share_layers="groups", layer_groups=3,
                   relative_positions=4, depth=DepthConfig(first_group=2))
    with torch.no_grad():  # a predictor that spreads depths over the batch
        model.encoder.predictor.out.weight.normal_(0, 2.0)
    return model


def _assert_outputs_same(ref, got, traces=()):
    valid = ~ref.pad_mask
    torch.testing.assert_close(got.hidden[valid], ref.hidden[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
    for key in traces:
        assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in
                   zip(ref.aux.traces[key], got.aux.traces[key], strict=True)), key


@pytest.mark.parametrize("exit", [DepthExit(gamma=0.5), DepthExit(gamma=0.1),
                                  DepthExit(gamma=torch.tensor([.1, .9, .5, .3, .7])),
                                  DepthExit(depth=torch.tensor([4, 0, 2, 1, 3]))])
def test_adaptive_depth_with_relative_positions_exits_through_the_lean_layers(exit):
    model = _alberta()
    lean = LeanEncoder.prepare(model)
    assert lean is not None
    tokens, segments = _inputs()
    with torch.no_grad():
        ref = model(tokens, segments, exit=exit)
        full = model(tokens, segments)
    got = lean.output(tokens, segments, exit=exit)
    _assert_outputs_same(ref, got, (DEPTH_RUN, LAYER_ROWS))
    assert len(set(ref.aux.traces[DEPTH_RUN][0].tolist())) > 1  # the rows left at many depths
    _assert_same(model, lean, tokens, segments, None)  # no exit: full depth, scaled by p
    torch.testing.assert_close(lean(tokens, segments), full.logits, rtol=1e-5, atol=1e-5)


def test_the_lean_exit_computes_only_the_rows_and_tokens_still_running():
    model = _alberta()
    lean = LeanEncoder.prepare(model)
    tokens, segments = _inputs()  # lengths 9 4 12 1 7
    depths = DepthExit(depth=torch.tensor([4, 0, 2, 1, 3]))
    assert lean.output(tokens, segments, exit=depths).aux.traces[LAYER_ROWS][0] == [4, 3, 2, 1]
    shapes = _products(lambda: lean.output(tokens, segments, exit=depths))
    after = list(zip(shapes, shapes[1:], strict=False))
    # one fused q/k/v product per layer application (the one the relative scores follow):
    # rows x width of the first group (5 x 12), then of the rows still running, cut to the
    # longest of them: {0, 2, 3, 4} x 12, {0, 2, 4} x 12, {0, 4} x 9, {0} x 9
    assert [a[0] for a, b in after if b[1] == 8 and a[1] == 32] == [60, 60, 48, 36, 18, 9]
    # the feed-forward on those rows' own tokens only (no padding): 33, 33, 29, 28, 16, 9
    assert [a[0] for a, b in after if b == (a[0], 64)] == [33, 33, 29, 28, 16, 9]


@pytest.mark.parametrize("rule", [LayerExit("pabee", patience=2),
                                  LayerExit("branchynet", threshold=0.5),
                                  LayerExit("shallow-deep", threshold=0.6)])
def test_per_layer_exit_rules_run_through_the_lean_layers(rule):
    model = _model(cct=False, layers=6, share_layers="all",
                   exits=ExitsConfig(weighting="pabee"))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # confident, varied internal classifiers: rows exit at many layers
        for k in range(6):
            model.classifier(k).out.weight.copy_(3 * torch.randn(3, 32, generator=gen))
    lean = LeanEncoder.prepare(model)
    tokens, segments = _inputs()
    with torch.no_grad():
        ref = model(tokens, segments, exit=rule)
    _assert_outputs_same(ref, lean.output(tokens, segments, exit=rule), (EXIT_LAYER, LAYER_ROWS))
    _assert_same(model, lean, tokens, segments, None)


def test_a_layer_subset_runs_through_the_lean_layers():
    model = _model(cct=False, layers=4)
    lean = LeanEncoder.prepare(model)
    tokens, segments = _inputs()
    with torch.no_grad():
        ref = model(tokens, segments, layers=(0, 2))
    _assert_outputs_same(ref, lean.output(tokens, segments, layers=(0, 2)))
    assert len(_products(lambda: lean.output(tokens, segments, layers=(0, 2)))) == 2 * 4 + 2


def test_classification_with_an_exit_takes_the_lean_layers_and_counts_the_same_depths():
    model = _alberta()
    lean = LeanEncoder.prepare(model)
    rows = [(torch.randint(5, V, (n,), generator=torch.Generator().manual_seed(n)).tolist(),
             [0] * n) for n in [9, 4, 12, 1, 7, 3, 5]]
    got = {}
    for name, fast in (("general", None), ("lean", lean)):
        compute = RealizedCompute()
        logits = predict_logits(model, rows, 3, torch.device("cpu"), compute=compute,
                                exit=DepthExit(gamma=0.5), lean=fast)
        got[name] = (logits, compute.row_layers)
    torch.testing.assert_close(got["lean"][0], got["general"][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got["lean"][1], got["general"][1])
