"""Quantization-aware training: fake quantization, STE, convert, representability, pruning."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dynaseq.compress.prune import GradualPruner, sparsity_report
from dynaseq.compress.qat import (
    QATConfig,
    check_representable,
    convert_qat_,
    fake_quantize_weight,
    prepare_qat_,
    qat_bit_widths,
    weight_scale,
)
from dynaseq.core.errors import DynaseqError


class TinyLM(nn.Module):
    """Embedding -> LayerNorm -> fc1 -> ReLU -> fc2 -> logits (fc1 is fed by the norm)."""

    def __init__(self, vocab: int = 20, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 16)
        self.fc2 = nn.Linear(16, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        return self.fc2(torch.relu(self.fc1(self.norm(self.embed(tokens)))))


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 20, (4, 6), generator=g), torch.randint(0, 20, (4, 6), generator=g)


def _train(model: nn.Module, steps: int = 5) -> None:
    x, y = _batch()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()


def _distinct_per_row(w: torch.Tensor) -> int:
    return max(int(torch.unique(r).numel()) for r in w)


def test_scale_is_exact_friendly():
    w = torch.randn(5, 7)
    for bits in (2, 4, 8, 9, 16):
        s = weight_scale(w, bits)
        assert s.shape == (5,)
        assert torch.all(s >= w.abs().amax(1) / (2 ** (bits - 1) - 1))
        mant, _ = torch.frexp(s)  # at most 24 - bits significant bits
        scaled = mant * 2.0 ** (24 - bits)
        assert torch.equal(scaled, torch.round(scaled))
    assert weight_scale(w, 9, per_channel=False).shape == (1,)


@pytest.mark.parametrize("bits", [2, 4, 8, 9, 16])
def test_prepare_convert_representable(bits):
    torch.manual_seed(bits)
    m = TinyLM()
    x, _ = _batch()
    report = prepare_qat_(m, QATConfig(bits=bits), example_inputs=(x,))
    assert report.weights == ["fc1", "fc2"]  # the embedding is never quantized
    assert report.skipped_activations == ["fc1"]  # its input is a LayerNorm output
    assert report.activations == ["fc2"]
    # during training the forward pass uses <= 2^b values per output row
    _train(m, 3)
    m(x)
    assert _distinct_per_row(m.fc2.weight) <= 2 ** bits
    emb_before = m.embed.weight.detach().clone()
    convert_qat_(m)
    assert torch.equal(m.embed.weight, emb_before)
    for lin in (m.fc1, m.fc2):
        assert isinstance(lin.weight, nn.Parameter)
        assert lin.weight_scale.shape == (lin.out_features,)
        assert _distinct_per_row(lin.weight.detach()) <= 2 ** bits
        k = lin.weight / lin.weight_scale[:, None]
        assert torch.equal(k, torch.round(k))
        assert k.abs().max() <= 2 ** (bits - 1) - 1
    rep = check_representable(m, bits)
    assert rep.ok, rep.failures
    assert rep.modules["fc2"]["max_distinct_per_scale"] <= 2 ** bits
    sd = m.state_dict()
    assert "fc1.weight" in sd and "fc1.weight_scale" in sd
    assert not any("parametrizations" in k for k in sd)
    # the converted model runs, with activations still fake-quantized by frozen observers
    scale_before = m.fc2.input_fake_quant.scale.clone()
    m.train()
    m(x)
    assert torch.equal(m.fc2.input_fake_quant.scale, scale_before)
    # checking at another width fails
    assert not check_representable(m, 16 if bits != 16 else 8).ok


def test_reload_converted_state_dict():
    m = TinyLM()
    prepare_qat_(m, 9)
    _train(m, 2)
    convert_qat_(m)
    fresh = TinyLM()
    prepare_qat_(fresh, 9)
    convert_qat_(fresh)
    fresh.load_state_dict(m.state_dict())
    x, _ = _batch()
    m.eval()
    fresh.eval()
    torch.testing.assert_close(fresh(x), m(x))
    assert check_representable(fresh, 9).ok
    assert qat_bit_widths(fresh) == {"fc1.weight": (9, 9), "fc2.weight": (9, 9)}


def test_straight_through_gradient():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    prepare_qat_(lin, QATConfig(bits=3, quantize_activations=False))
    x = torch.randn(5, 4)
    y = lin(x)
    orig = lin.parametrizations.weight.original
    wq = fake_quantize_weight(orig.detach(), 3)
    torch.testing.assert_close(y, x @ wq.T + lin.bias)
    y.sum().backward()
    # STE: d/dw of sum(x w^T) = column sums of x for every output row, as if unquantized
    torch.testing.assert_close(orig.grad, x.sum(0).expand(3, 4))
    assert lin.bias.grad is not None


def test_activation_quantization_grad_and_levels():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    prepare_qat_(lin, QATConfig(bits=4))
    x = torch.randn(8, 4, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    fq = lin.input_fake_quant
    q = fq(x.detach())
    k = q / fq.scale
    assert torch.allclose(k, torch.round(k), atol=1e-4) and k.abs().max() <= 7


@pytest.mark.parametrize("bad", [0, 1, 17, 32, 8.5, True, "9"])
def test_bad_bit_width(bad):
    with pytest.raises(DynaseqError, match="2..16"):
        QATConfig(bits=bad)
    with pytest.raises(DynaseqError, match="2..16"):
        prepare_qat_(TinyLM(), bad)
    with pytest.raises(DynaseqError, match="2..16"):
        check_representable(TinyLM(), bad)


def test_errors_without_layers():
    with pytest.raises(DynaseqError, match="no non-embedding"):
        prepare_qat_(nn.Sequential(nn.Embedding(3, 2)), 8)
    with pytest.raises(DynaseqError, match="prepare_qat_"):
        convert_qat_(TinyLM())
    assert not check_representable(TinyLM(), 8).ok
    m = TinyLM()
    prepare_qat_(m, 8)
    with pytest.raises(DynaseqError, match="already prepared"):
        prepare_qat_(m, 8)


def test_embedding_predicate_and_per_tensor():
    m = TinyLM()
    rep = prepare_qat_(m, QATConfig(bits=8, per_channel=False,
                                    is_embedding=lambda name, mod: name == "fc2"))
    assert rep.weights == ["fc1"]
    convert_qat_(m)
    assert m.fc1.weight_scale.shape == (1,)
    assert int(torch.unique(m.fc1.weight.detach()).numel()) <= 2 ** 8
    assert not hasattr(m.fc2, "weight_scale")
    assert check_representable(m, 8).ok


def test_check_detects_off_grid_weight():
    m = TinyLM()
    prepare_qat_(m, 8)
    convert_qat_(m)
    with torch.no_grad():
        m.fc1.weight[0, 0] += m.fc1.weight_scale[0] * 0.3
    rep = check_representable(m, 8)
    assert not rep.ok and any("fc1" in f for f in rep.failures)


def test_pruned_zeros_stay_zero_through_qat():
    torch.manual_seed(3)
    m = TinyLM()
    pruner = GradualPruner(m, {"fc1.weight": 0.5, "fc2.weight": 0.5}, 0, 2, 1)
    for t in range(3):
        pruner.step(t)
    _train(m, 2)
    zeros_before = {n: m.get_submodule(n).weight == 0 for n in ("fc1", "fc2")}
    prepare_qat_(m, 9)  # reuses the live pruning masks
    _train(m, 5)
    pruner.finalize()  # a no-op for layers under QAT
    convert_qat_(m)
    for n in ("fc1", "fc2"):
        w = m.get_submodule(n).weight
        assert torch.all(w[zeros_before[n]] == 0)
    assert sparsity_report(m, ["fc1.weight"]).per_param["fc1.weight"][0] >= 64
    assert check_representable(m, 9).ok


def test_finalized_pruning_then_qat_keeps_zeros():
    torch.manual_seed(4)
    m = TinyLM()
    pruner = GradualPruner(m, {"fc1.weight": 0.6}, 0, 0, 1)
    pruner.step(0)
    pruner.finalize()
    zero = m.fc1.weight == 0
    assert int(zero.sum()) == round(0.6 * 128)
    prepare_qat_(m, QATConfig(bits=8, keep_zeros=True))
    _train(m, 5)
    convert_qat_(m)
    assert torch.all(m.fc1.weight[zero] == 0)
    assert check_representable(m, 8).ok


def test_direct_weight_reads_are_quantized_and_trainable():
    """A tied layer read as ``.weight`` outside its forward (the adaptive input) works."""
    torch.manual_seed(0)
    head = nn.Linear(8, 20, bias=False)
    mid = nn.Linear(8, 8)
    model = nn.ModuleDict({"head": head, "mid": mid})
    prepare_qat_(model, QATConfig(bits=4, is_embedding=lambda n, m: False))
    pruner = GradualPruner(model, {"head.weight": 0.5}, 0, 2, 1)  # pruning during QAT too
    x, y = _batch()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(4):
        pruner.step(step)
        opt.zero_grad()
        e = nn.functional.embedding(x.flatten(), head.weight)
        assert _distinct_per_row(head.weight.detach()) <= 2 ** 4
        nn.functional.cross_entropy(head(torch.tanh(mid(e))), y.flatten()).backward()
        opt.step()
    assert int((head.weight == 0).sum()) >= 80
    convert_qat_(model)
    assert int((head.weight == 0).sum()) >= 80
    assert check_representable(model, 4).ok


def test_converting_a_deepcopy_leaves_the_original_working():
    import copy

    m = TinyLM()
    GradualPruner(m, {"fc1.weight": 0.5}, 0, 0, 1).step(0)
    prepare_qat_(m, 8)
    twin = copy.deepcopy(m)
    convert_qat_(twin)
    assert check_representable(twin, 8).ok
    x, _ = _batch()
    m(x).sum().backward()  # the original is still prepared and trainable
    convert_qat_(m)
    assert check_representable(m, 8).ok
