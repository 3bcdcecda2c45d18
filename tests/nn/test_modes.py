"""evaluating(): eval mode for a block, and no module-tree walk when the model already is."""

from __future__ import annotations

import pytest
from torch import nn

from dynaseq.nn.modes import evaluating


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Sequential(nn.LayerNorm(4)))


@pytest.fixture
def train_calls(monkeypatch) -> list[bool]:
    """Every ``nn.Module.train(mode)`` call (``eval()`` is ``train(False)``) from now on."""
    calls: list[bool] = []
    original = nn.Module.train

    def counted(self: nn.Module, mode: bool = True) -> nn.Module:
        calls.append(mode)
        return original(self, mode)

    monkeypatch.setattr(nn.Module, "train", counted)
    return calls


def test_a_model_in_eval_mode_is_not_walked(train_calls) -> None:
    m = _model().eval()
    train_calls.clear()
    with evaluating(m) as inside:
        assert inside is m
    assert train_calls == []
    assert not any(x.training for x in m.modules())


def test_a_training_model_is_evaluated_then_restored(train_calls) -> None:
    m = _model().train()
    with evaluating(m):
        assert not any(x.training for x in m.modules())
    assert all(x.training for x in m.modules())
    with pytest.raises(RuntimeError, match="boom"), evaluating(m):
        raise RuntimeError("boom")
    assert all(x.training for x in m.modules())


def test_translating_leaves_a_loaded_model_alone(trained_run, train_calls) -> None:
    """A loaded predictor's model is in eval mode: translating walks no module tree (before,
    every call ran ``eval()`` and ``train(False)`` over the whole model) and gives the same
    output as with the model switched to training mode, which it then restores."""
    from dynaseq import load

    t = load(trained_run)
    lines = ["a b c", "d e"]
    train_calls.clear()
    out = t.translate(lines, beam=1)
    assert train_calls == []
    t.model.train()
    assert t.translate(lines, beam=1) == out
    assert all(x.training for x in t.model.modules())
