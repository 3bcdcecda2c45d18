"""LayerDrop (Fan et al. 2019): reproducible per-micro-batch draws, skipped layers not entered
(forward hooks), "every other" pruning equal to a model built with the kept layers by hand,
the zero term that keeps skipped layers in DDP's step, and the bad inputs."""

from __future__ import annotations

import pytest
import torch

from dynaseq.core.errors import ConfigError, DynaseqError
from dynaseq.models.encoder import LAYERDROP_UNUSED, EncoderModel, TransformerEncoder
from dynaseq.tasks.encoder.budget import layers_for
from dynaseq.tasks.encoder.config import EncoderModelConfig
from dynaseq.tasks.encoder.model import build_encoder_model
from dynaseq.tasks.encoder.training import draw_layers
from dynaseq.techniques.depth.config import DepthConfig
from dynaseq.techniques.depth.layerdrop import every_other, sample_layers


def _cfg(**kw) -> EncoderModelConfig:
    return EncoderModelConfig(d_model=32, ffn_dim=64, n_heads=2, layers=kw.pop("layers", 4),
                              max_positions=64, dropout=0.0, attention_dropout=0.0,
                              classifier_dropout=0.0, **kw)


def _model(**kw) -> EncoderModel:
    torch.manual_seed(0)
    return build_encoder_model(_cfg(**kw), 100, head=3).eval()


def _tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    tok = torch.randint(5, 100, (3, 10), generator=gen)
    tok[1, 6:] = 0
    return tok


def _count_calls(model: EncoderModel) -> tuple[list[int], list]:
    calls = [0] * len(model.encoder.layers)

    def hook(i):
        def count(module, args):
            calls[i] += 1
        return count

    handles = [layer.register_forward_pre_hook(hook(i))
               for i, layer in enumerate(model.encoder.layers)]
    return calls, handles


def test_draws_are_reproducible_and_drop_at_the_rate():
    a = [sample_layers(6, 0.3, seed=7, step=s, micro=m) for s in range(50) for m in range(2)]
    b = [sample_layers(6, 0.3, seed=7, step=s, micro=m) for s in range(50) for m in range(2)]
    assert a == b  # same (seed, step, micro): the same layers (resume, every DDP rank)
    assert len(set(a)) > 10  # different micro-batches drop different layers
    assert a != [sample_layers(6, 0.3, seed=8, step=s, micro=m)
                 for s in range(50) for m in range(2)]
    assert all(list(d) == sorted(set(d)) and all(0 <= i < 6 for i in d) for d in a)
    dropped = 1 - sum(len(d) for d in a) / (6 * len(a))
    assert 0.2 < dropped < 0.4
    assert sample_layers(6, 0.0, seed=7, step=3, micro=0) == tuple(range(6))
    cfg = _cfg(layerdrop=0.3)
    assert draw_layers(cfg, 7, 12, 1) == sample_layers(4, 0.3, 7, 12, 1)
    assert draw_layers(_cfg(), 7, 12, 1) is None  # no LayerDrop: every layer, no argument


def test_every_other_keeps_evenly_spaced_layers_from_the_first():
    assert every_other(6, 3) == (0, 2, 4)
    assert every_other(16, 8) == tuple(range(0, 16, 2))  # fairseq's "every other" example
    assert every_other(4, 4) == (0, 1, 2, 3)
    assert every_other(4, 1) == (0,)
    assert every_other(6, 4) == (0, 1, 3, 4)
    for bad in (0, 7):
        with pytest.raises(ValueError, match=r"not in \[1, 6\]"):
            every_other(6, bad)


@pytest.mark.parametrize("share, layers, want", [
    ("none", (0, 2), [1, 0, 1, 0]),
    ("none", (), [0, 0, 0, 0]),
    ("groups", (1, 2), [1, 1]),   # plan [0, 0, 1, 1]
    ("all", (0, 3), [2]),         # one layer applied at two kept positions
])
def test_skipped_layers_are_not_entered(share, layers, want):
    model = _model(share_layers=share, layer_groups=2)
    calls, handles = _count_calls(model)
    with torch.no_grad():
        model(_tokens(), layers=layers)
        assert calls == want
        model(_tokens())
    for h in handles:
        h.remove()
    assert sum(calls) == sum(want) + model.encoder.depth


def test_keep_layers_equals_a_model_built_with_the_kept_layers_by_hand():
    model = _model(layers=6)
    kept = layers_for(_cfg(layers=6), 3)
    assert kept == (0, 2, 4)
    enc = model.encoder
    by_hand = EncoderModel(TransformerEncoder(enc.embeddings, [enc.layers[i] for i in kept],
                                              32, dropout=0.0), model.head).eval()
    tok = _tokens()
    with torch.no_grad():
        pruned, ref = model(tok, layers=kept), by_hand(tok)
        full = model(tok)
    assert torch.equal(pruned.logits, ref.logits)
    assert torch.equal(pruned.hidden, ref.hidden)
    assert not torch.allclose(full.logits, ref.logits)
    with torch.no_grad():  # keeping every layer is the full model
        assert torch.equal(model(tok, layers=tuple(range(6))).logits, full.logits)


def test_training_skips_layers_and_still_gives_every_parameter_a_gradient():
    """DDP runs without find_unused_parameters: a skipped layer's parameters get a zero
    gradient (through 0 · Σ params in the aux losses) without the layer being entered."""
    model = _model()
    model.train()
    calls, handles = _count_calls(model)
    out = model(_tokens(), layers=(1, 3))
    for h in handles:
        h.remove()
    assert calls == [0, 1, 0, 1]
    loss = out.logits.sum() + sum(out.aux.losses.values())
    assert float(out.aux.losses[LAYERDROP_UNUSED].detach()) == 0.0
    loss.backward()
    for i, layer in enumerate(model.encoder.layers):
        for name, p in layer.named_parameters():
            assert p.grad is not None, (i, name)
            assert bool((p.grad == 0).all()) == (i in (0, 2)), (i, name)
    model.eval()
    with torch.no_grad():  # inference adds no term
        assert LAYERDROP_UNUSED not in model(_tokens(), layers=(1, 3)).aux.losses


def test_bad_layers_and_configs_are_refused():
    model = _model()
    for bad in ((0, 4), (2, 1), (1, 1), (-1,)):
        with pytest.raises(ValueError, match=r"increasing positions in \[0, 4\)"):
            model(_tokens(), layers=bad)
    adaptive = _model(layers=4, depth=DepthConfig(first_group=2))
    with pytest.raises(ValueError, match="without a structure predictor"):
        adaptive(_tokens(), layers=(0, 1))
    for p in (1.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match=r"layerdrop must be in \[0, 1\)"):
            _cfg(layerdrop=p)
    with pytest.raises(ConfigError, match="model.layerdrop is for dense encoders"):
        _cfg(layerdrop=0.2, depth=DepthConfig(first_group=2))
    for n in (0, 5):
        with pytest.raises(DynaseqError, match=r"keep-layers \d is not in \[1, 4\]"):
            layers_for(_cfg(), n)
    with pytest.raises(DynaseqError, match="adaptive-depth model takes --depth or --gamma"):
        layers_for(_cfg(depth=DepthConfig(first_group=2)), 2)
    assert layers_for(_cfg(), None) is None
