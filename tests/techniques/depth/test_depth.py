"""Adaptive depth (ALBERTa): RevPC against a hand-computed example, the exit rule, batched
early exit (= each row alone = the model truncated at the row's depth), rows and padding that
left not computed, relative position scores, and the ablation switches."""

from __future__ import annotations

import pytest
import torch

from dynaseq.core.errors import ConfigError
from dynaseq.nn.relative_scores import RelativeScores
from dynaseq.tasks.encoder.config import EncoderModelConfig
from dynaseq.tasks.encoder.model import build_encoder_model
from dynaseq.techniques.depth.config import DepthConfig
from dynaseq.techniques.depth.exits import DEPTH_RUN, LAYER_ROWS, DepthExit
from dynaseq.techniques.depth.predictor import StructurePredictor, exit_depths, revpc

from encoder_helpers import padded_tokens

LENGTHS = [12, 3, 7, 9, 5, 1]


def _model(**kw):
    torch.manual_seed(0)
    depth = kw.pop("depth", DepthConfig(first_group=2))
    cfg = EncoderModelConfig(d_model=32, ffn_dim=64, n_heads=2, layers=6, max_positions=64,
                             relative_positions=kw.pop("relative_positions", 8), depth=depth,
                             dropout=0.0, attention_dropout=0.0, classifier_dropout=0.0, **kw)
    return build_encoder_model(cfg, 100, head=3).eval()


def _tokens() -> torch.Tensor:
    return padded_tokens(LENGTHS)


def test_revpc_matches_a_hand_computed_example():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]])  # depths 0, 1, 2, 3
    # reverse [.4 .3 .2 .1] -> cumsum [.4 .7 .9 1] -> reverse [1 .9 .7 .4] -> drop depth 0
    assert torch.allclose(revpc(probs), torch.tensor([[0.9, 0.7, 0.4]]))
    p = revpc(probs)
    assert exit_depths(p, 0.95).tolist() == [0]
    assert exit_depths(p, 0.8).tolist() == [1]
    assert exit_depths(p, 0.5).tolist() == [2]
    assert exit_depths(p, 0.1).tolist() == [3]
    # per-row γ; a non-monotone p (no RevPC) stops at its first p_i < γ
    p2 = torch.tensor([[0.9, 0.7, 0.4], [0.9, 0.2, 0.8]])
    assert exit_depths(p2, torch.tensor([0.5, 0.5])).tolist() == [2, 1]


def test_predictor_starts_near_full_depth_and_is_monotone():
    pred = StructurePredictor(16, 8, n_adaptive=4, first_group=1)
    p = pred(torch.randn(3, 5, 16))
    assert p.shape == (3, 4)
    assert bool((p[:, 1:] <= p[:, :-1] + 1e-7).all()) and bool((p > 0.5).all())
    no_revpc = StructurePredictor(16, 8, n_adaptive=4, first_group=1, use_revpc=False)
    assert no_revpc.out.out_features == 4 and no_revpc(torch.randn(2, 5, 16)).shape == (2, 4)


def _truncated(model, tokens, k):
    """Reference: the model truncated after k adaptive layers, run row by row through the
    same modules by hand (no early-exit machinery)."""
    enc = model.encoder
    outs = []
    for b, n in enumerate(LENGTHS):
        t = tokens[b:b + 1, :n]
        x = enc.embeddings(t)
        for i in enc.plan[:enc.predictor.first_group]:
            x = enc.layers[i](x, None)
        p = enc.predictor(x)
        kk = int(k[b]) if isinstance(k, torch.Tensor) else k
        for j, i in enumerate(enc.plan[enc.predictor.first_group:][:kk]):
            x = enc.layers[i](x, None, scale=p[:, j, None, None])
        outs.append(enc.norm(x)[0])
    return outs


@pytest.mark.parametrize("share", ["none", "all"])
def test_batched_exit_equals_each_row_alone_and_the_truncated_model(share):
    model = _model(share_layers=share)
    tok = _tokens()
    depths = torch.tensor([4, 0, 2, 4, 1, 3])
    with torch.no_grad():
        out = model(tok, exit=DepthExit(depth=depths))
        ref = _truncated(model, tok, depths)
        for b, n in enumerate(LENGTHS):
            alone = model(tok[b:b + 1, :n], exit=DepthExit(depth=int(depths[b])))
            assert torch.allclose(out.hidden[b, :n], ref[b], atol=1e-5)
            assert torch.allclose(alone.hidden[0], ref[b], atol=1e-5)
            assert torch.allclose(out.logits[b], alone.logits[0], atol=1e-5)
            assert bool((out.hidden[b, n:] == 0).all())  # padding is not computed
    assert out.aux.traces[DEPTH_RUN][0].tolist() == depths.tolist()


def test_exit_at_full_depth_equals_the_run_without_exit():
    model = _model()
    tok = _tokens()
    with torch.no_grad():
        soft = model(tok)
        full = model(tok, exit=DepthExit(depth=4))
    assert torch.allclose(soft.logits, full.logits, atol=1e-6)


def test_rows_that_left_and_their_padding_are_not_computed():
    model = _model()
    seen: list[tuple[int, int]] = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape[:2])))
             for layer in model.encoder.layers]
    tok = _tokens()
    depths = torch.tensor([1, 0, 2, 4, 1, 3])  # lengths 12 3 7 9 5 1
    with torch.no_grad():
        out = model(tok, exit=DepthExit(depth=depths))
    for h in hooks:
        h.remove()
    # first group: every row, full width; then only the rows still running, cut to the
    # longest of them: layer 1 rows {3, 5, 2, 0, 4} (longest 12), layer 2 {3, 5, 2} (9),
    # layer 3 {3, 5} (9), layer 4 {3} (9)
    assert seen == [(6, 12), (6, 12), (5, 12), (3, 9), (2, 9), (1, 9)]
    assert out.aux.traces[LAYER_ROWS][0] == [5, 3, 2, 1]


def test_mixed_gammas_in_a_batch_equal_each_gamma_alone():
    model = _model()
    with torch.no_grad():  # a predictor that spreads depths over the batch
        model.encoder.predictor.out.weight.normal_(0, 2.0)
    tok = _tokens()
    gammas = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.7, 0.5])
    with torch.no_grad():
        mixed = model(tok, exit=DepthExit(gamma=gammas))
        for b, n in enumerate(LENGTHS):
            alone = model(tok[b:b + 1, :n], exit=DepthExit(gamma=float(gammas[b])))
            assert torch.allclose(mixed.logits[b], alone.logits[0], atol=1e-5)
            assert (mixed.aux.traces[DEPTH_RUN][0][b] == alone.aux.traces[DEPTH_RUN][0][0])


def test_relative_scores_match_the_formula():
    torch.manual_seed(0)
    scores = RelativeScores(d_head=4, max_distance=2)
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    bias = scores(q, k)
    e = scores.embedding.weight
    for h in range(2):
        for i in range(5):
            for j in range(5):
                r = max(-2, min(2, i - j)) + 2
                want = q[0, h, i] @ e[r] + k[0, h, j] @ e[r]
                assert torch.allclose(bias[0, h, i, j], want, atol=1e-6)


def test_ablation_switches_change_the_model():
    full = _model()
    assert full.encoder.embeddings.positions is not None
    assert full.encoder.layers[0].self_attn.position_scores is not None
    no_abs = _model(absolute_positions=False)
    assert no_abs.encoder.embeddings.positions is None
    no_rel = _model(relative_positions=0)
    assert no_rel.encoder.layers[0].self_attn.position_scores is None
    no_revpc = _model(depth=DepthConfig(first_group=2, revpc=False))
    assert not no_revpc.encoder.predictor.use_revpc
    dense = _model(depth=None)
    assert dense.encoder.predictor is None
    with pytest.raises(ValueError, match="no structure predictor"):
        dense(_tokens(), exit=DepthExit(gamma=0.5))


@pytest.mark.parametrize("kw, message", [
    ({"depth": DepthConfig(first_group=6)}, "leaves no adaptive layer"),
    ({"relative_positions": -1}, "relative_positions must be >= 0"),
])
def test_bad_configs_are_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        EncoderModelConfig(d_model=32, ffn_dim=64, n_heads=2, layers=6, **kw)


@pytest.mark.parametrize("gamma", [0.0, 1.0, -0.2, 1.5])
def test_gamma_outside_the_open_interval_is_refused(gamma):
    with pytest.raises(ConfigError, match=r"gamma is an exit threshold in \(0, 1\)"):
        DepthConfig(gamma=gamma)
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        DepthExit(gamma=gamma)


def test_a_depth_above_the_model_is_refused():
    with pytest.raises(ValueError, match="above the model's 4 adaptive layers"):
        _model()(_tokens(), exit=DepthExit(depth=5))


def test_the_depth_weight_ramps_in():
    cfg = DepthConfig(depth_weight=0.4, depth_start_step=10, depth_ramp_steps=20)
    assert [cfg.weight_at(s) for s in (0, 9, 10, 20, 30, 99)] == [0, 0, 0, 0.2, 0.4, 0.4]
    assert DepthConfig(depth_weight=0.4).weight_at(0) == 0.4
    keep = DepthConfig(depth_weight=0.4, keep_steps=5, keep_weight=2.0, depth_start_step=10)
    assert [keep.weight_at(s) for s in (0, 4, 5, 9, 10)] == [-2.0, -2.0, 0, 0, 0.4]
    for bad in ({"depth_ramp_steps": -1}, {"keep_steps": -1}, {"keep_weight": -0.5}):
        with pytest.raises(ConfigError, match="must be >= 0"):
            DepthConfig(**bad)
