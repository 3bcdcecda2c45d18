"""Per-layer exits (BranchyNet, Shallow-Deep, PABEE): each rule against hand-made logits
histories, the loss weights, batched exit = each row alone (= the model truncated at the
row's exit layer), rows that left and their padding not computed, bad arguments."""

from __future__ import annotations

import math

import pytest
import torch

from dynaseq.core.errors import ConfigError
from dynaseq.metrics.encoder_profile import encoder_macs, flop_counter_encoder_macs
from dynaseq.models.multi_exit import MultiExitEncoderModel
from dynaseq.tasks.encoder.config import EncoderModelConfig
from dynaseq.tasks.encoder.model import build_encoder_model
from dynaseq.techniques.depth.config import DepthConfig
from dynaseq.techniques.depth.exits import LAYER_ROWS, DepthExit
from dynaseq.techniques.depth.multi_exit import (
    EXIT_LAYER,
    EXIT_LOGITS,
    EXIT_RULES,
    ExitsConfig,
    LayerExit,
    weighted_exit_loss,
)

from encoder_helpers import padded_tokens

LENGTHS = [12, 3, 7, 9, 5, 1, 10, 4]
LAYERS = 6


def _model(share: str = "none", **kw) -> MultiExitEncoderModel:
    torch.manual_seed(0)
    cfg = EncoderModelConfig(d_model=32, ffn_dim=64, n_heads=2, layers=LAYERS, max_positions=64,
                             share_layers=share, exits=ExitsConfig(**kw), dropout=0.0,
                             attention_dropout=0.0, classifier_dropout=0.0)
    model = build_encoder_model(cfg, 100, head=3).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # confident, varied internal classifiers: rows exit at many layers
        for k in range(LAYERS):
            head = model.classifier(k)
            head.pooler.weight.copy_(2 * torch.eye(32))  # pooled = tanh(2 LN(h_0))
            head.pooler.bias.zero_()
            head.out.weight.copy_(0.5 * torch.randn(3, 32, generator=gen))
    return model


def _tokens() -> torch.Tensor:
    return padded_tokens(LENGTHS)


def _history(*labels_per_layer: list[int], c: int = 3) -> torch.Tensor:
    """(R, k, C) logits whose argmax per row and layer are the given labels."""
    rows = list(zip(*labels_per_layer, strict=True))
    return torch.stack([torch.stack([torch.nn.functional.one_hot(torch.tensor(y), c).float()
                                     for y in row]) for row in rows])


def test_entropy_rule_matches_a_hand_computed_example():
    rule = EXIT_RULES["branchynet"]
    # last-layer probabilities (1, 0, 0)-ish, uniform, and (.5, .5, 0)-ish
    last = torch.tensor([[20.0, 0.0, 0.0], [1.0, 1.0, 1.0], [5.0, 5.0, -30.0]])
    history = torch.stack([torch.zeros_like(last), last], 1)  # only the last layer counts
    # normalized entropies: ~0, 1, ln 2 / ln 3 = 0.631
    assert rule.done(history, torch.tensor(0.5)).tolist() == [True, False, False]
    assert rule.done(history, torch.tensor(0.65)).tolist() == [True, False, True]
    assert rule.done(history, torch.tensor(0.0)).tolist() == [False, False, False]
    per_row = torch.tensor([0.6, 1.0, 0.7])
    assert rule.done(history, per_row).tolist() == [True, False, True]
    assert math.isclose(math.log(2) / math.log(3), 0.6309, abs_tol=1e-4)


def test_max_prob_rule_matches_a_hand_computed_example():
    rule = EXIT_RULES["shallow-deep"]
    # max probabilities: e^2 / (e^2 + 2) = 0.787, 1/3, 0.5
    last = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [3.0, 3.0, -40.0]])
    history = last[:, None]
    assert rule.done(history, torch.tensor(0.7)).tolist() == [True, False, False]
    assert rule.done(history, torch.tensor(0.3)).tolist() == [True, True, True]
    assert rule.done(history, torch.tensor(0.8)).tolist() == [False, False, False]
    assert rule.done(history, torch.tensor(1.0)).tolist() == [False, False, False]
    assert rule.done(history, torch.tensor([0.9, 0.3, 0.4])).tolist() == [False, True, True]


def test_patience_rule_counts_unchanged_labels_back_from_the_last_layer():
    rule = EXIT_RULES["pabee"]
    # labels over 4 layers per row; streak = agreements of neighbours back from the last
    h = _history([0, 1, 2, 0],  # layer 1
                 [0, 1, 1, 1],  # layer 2
                 [0, 1, 1, 2],  # layer 3
                 [0, 1, 1, 2])  # layer 4
    # row 0: 0 0 0 0 -> 3; row 1: 1 1 1 1 -> 3; row 2: 2 1 1 1 -> 2; row 3: 0 1 2 2 -> 1
    assert rule.done(h, torch.tensor(3)).tolist() == [True, True, False, False]
    assert rule.done(h, torch.tensor(2)).tolist() == [True, True, True, False]
    assert rule.done(h, torch.tensor(1)).tolist() == [True, True, True, True]
    assert rule.done(h, torch.tensor(4)).tolist() == [False, False, False, False]
    assert rule.done(h, torch.tensor([4, 3, 3, 1])).tolist() == [False, True, False, True]
    # a change at the last layer resets the count; one layer has no agreement yet
    h2 = _history([1, 0], [1, 0], [2, 0])
    assert rule.done(h2, torch.tensor(1)).tolist() == [False, True]
    assert rule.done(_history([1]), torch.tensor(1)).tolist() == [False]


def test_loss_weights_and_the_weighted_loss():
    assert torch.allclose(ExitsConfig(weighting="pabee").loss_weights(4),
                          torch.tensor([1, 2, 3, 4]) / 10)
    assert torch.allclose(ExitsConfig(weighting="uniform").loss_weights(4), torch.full((4,), .25))
    logits = [torch.full((2, 3), float(i)) for i in range(1, 4)]
    loss = weighted_exit_loss(logits, torch.tensor([0.5, 0.25, 0.25]), lambda z: z.sum())
    assert math.isclose(float(loss), 0.5 * 6 + 0.25 * 12 + 0.25 * 18)


def test_training_forward_gives_every_classifier_and_the_plain_output():
    model = _model()
    tok = _tokens()
    with torch.no_grad():
        out = model(tok)
        exits = out.aux.traces[EXIT_LOGITS]
        assert len(exits) == LAYERS and all(z.shape == (len(LENGTHS), 3) for z in exits)
        assert torch.equal(exits[-1], out.logits)
        # full depth through the per-layer loop (a patience no row reaches) = the plain call
        full = model(tok, exit=LayerExit("pabee", patience=LAYERS))
    assert torch.allclose(full.logits, out.logits, atol=1e-5)
    assert full.aux.traces[EXIT_LAYER][0].tolist() == [LAYERS] * len(LENGTHS)
    for b, n in enumerate(LENGTHS):
        assert torch.allclose(full.hidden[b, :n], out.hidden[b, :n], atol=1e-5)


def _truncated(model, tokens, b, k):
    """Reference: row b alone through its first k layers, by hand, and classifier k."""
    enc = model.encoder
    x = enc.embeddings(tokens[b:b + 1, :LENGTHS[b]])
    for i in enc.plan[:k]:
        x = enc.layers[i](x, None)
    return model.classifier(k - 1)(enc.norm(x))[0]


EXITS = [LayerExit("pabee", patience=1), LayerExit("pabee", patience=2),
         LayerExit("branchynet", threshold=0.5), LayerExit("shallow-deep", threshold=0.9),
         LayerExit("shallow-deep", threshold=torch.tensor([.9, .5, .99, .7, .8, .6, .95, .4]))]


@pytest.mark.parametrize("share", ["none", "all"])
@pytest.mark.parametrize("exit", EXITS, ids=lambda e: f"{e.rule}-{e.value}")
def test_batched_exit_equals_each_row_alone_and_the_truncated_model(share, exit):
    model = _model(share)
    tok = _tokens()
    with torch.no_grad():
        out = model(tok, exit=exit)
        ran = out.aux.traces[EXIT_LAYER][0]
        for b, n in enumerate(LENGTHS):
            alone = model(tok[b:b + 1, :n], exit=exit.select(torch.tensor([b])))
            assert alone.aux.traces[EXIT_LAYER][0].tolist() == [int(ran[b])]
            assert torch.allclose(out.logits[b], alone.logits[0], atol=1e-5)
            assert out.logits[b].argmax() == alone.logits[0].argmax()
            assert torch.allclose(out.logits[b], _truncated(model, tok, b, int(ran[b])),
                                  atol=1e-5)
            assert torch.allclose(out.hidden[b, :n], alone.hidden[0], atol=1e-5)
            assert bool((out.hidden[b, n:] == 0).all())  # padding is not computed
    assert len(set(ran.tolist())) > 1, "the rows should leave at different layers"


@pytest.mark.parametrize("exit", EXITS[:4], ids=lambda e: f"{e.rule}-{e.value}")
def test_rows_that_left_and_their_padding_are_not_computed(exit):
    model = _model()
    tok = _tokens()
    with torch.no_grad():  # each row's exit layer, found alone
        ran = [int(model(tok[b:b + 1, :n], exit=exit).aux.traces[EXIT_LAYER][0][0])
               for b, n in enumerate(LENGTHS)]
    seen: list[tuple[int, int]] = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape[:2])))
             for layer in model.encoder.layers]
    with torch.no_grad():
        out = model(tok, exit=exit)
    for h in hooks:
        h.remove()
    # layer k runs the rows whose exit layer is > k, cut to the longest of them
    want = []
    for k in range(LAYERS):
        going = [n for n, r in zip(LENGTHS, ran, strict=True) if r > k]
        if going:
            want.append((len(going), max(going)))
    assert seen == want
    assert out.aux.traces[LAYER_ROWS][0] == [n for n, _ in want]
    assert len(want) > 1 and want[-1][0] < len(LENGTHS)


def test_mixed_parameters_in_a_batch_equal_each_alone():
    model = _model()
    tok = _tokens()
    patience = torch.tensor([1, 5, 2, 3, 1, 2, 4, 1])
    with torch.no_grad():
        mixed = model(tok, exit=LayerExit("pabee", patience=patience))
        for b, n in enumerate(LENGTHS):
            alone = model(tok[b:b + 1, :n], exit=LayerExit("pabee", patience=int(patience[b])))
            assert torch.allclose(mixed.logits[b], alone.logits[0], atol=1e-5)
            assert mixed.aux.traces[EXIT_LAYER][0][b] == alone.aux.traces[EXIT_LAYER][0][0]


def test_the_analytic_count_covers_every_classifier():
    model = _model()
    tok = torch.randint(5, 100, (1, 16))
    analytic = sum(encoder_macs(model, 16).values())
    assert analytic == flop_counter_encoder_macs(model, tok)
    assert analytic == flop_counter_encoder_macs(model, tok,
                                                 exit=LayerExit("pabee", patience=LAYERS))
    assert flop_counter_encoder_macs(model, tok, exit=LayerExit("shallow-deep",
                                                                threshold=0.0)) < analytic / 5


@pytest.mark.parametrize("kw, message", [
    ({"rule": "nope"}, "unknown exit rule 'nope'"),
    ({"rule": "pabee", "threshold": 0.5}, "pabee takes a patience, not a threshold"),
    ({"rule": "branchynet", "patience": 2}, "branchynet takes a threshold, not a patience"),
    ({"rule": "shallow-deep"}, "shallow-deep needs a threshold"),
    ({"rule": "pabee", "patience": 0}, "patience is an integer >= 1"),
    ({"rule": "pabee", "patience": 1.5}, "patience is an integer >= 1"),
    ({"rule": "branchynet", "threshold": 1.5}, r"threshold is in \[0, 1\]"),
    ({"rule": "shallow-deep", "threshold": -0.1}, r"threshold is in \[0, 1\]"),
    ({"rule": "shallow-deep", "threshold": float("nan")}, r"threshold is in \[0, 1\]"),
])
def test_bad_exits_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        LayerExit(**kw)


@pytest.mark.parametrize("kw, message", [
    ({"weighting": "linear"}, "exits.weighting must be one of"),
    ({"rule": "deebert"}, "unknown exit rule"),
    ({"patience": 0}, "patience is an integer >= 1"),
    ({"max_prob_threshold": 2.0}, r"threshold is in \[0, 1\]"),
])
def test_bad_configs_are_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        ExitsConfig(**kw)
    with pytest.raises(ConfigError, match="does not combine with model.depth"):
        EncoderModelConfig(d_model=32, ffn_dim=64, n_heads=2, layers=6, exits=ExitsConfig(),
                           depth=DepthConfig(first_group=2))


def test_a_multi_exit_model_refuses_a_depth_exit_and_regression_rules():
    model = _model()
    with pytest.raises(ValueError, match="no structure predictor"):
        model(_tokens(), exit=DepthExit(depth=1))
    cfg = EncoderModelConfig(d_model=32, ffn_dim=64, n_heads=2, layers=2, exits=ExitsConfig())
    regression = build_encoder_model(cfg, 100, head=1).eval()
    assert regression(_tokens()).logits.shape == (len(LENGTHS), 1)
    with pytest.raises(ValueError, match="regression"):
        regression(_tokens(), exit=LayerExit("pabee", patience=1))
    with pytest.raises(ConfigError, match="for classification runs"):
        build_encoder_model(cfg, 100, head="mlm")
