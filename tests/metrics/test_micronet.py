"""MicroNet score: parameter storage, the op counter against hand counts, the score."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dynaseq.compress.prune import GradualPruner
from dynaseq.compress.qat import QATConfig, convert_qat_, prepare_qat_
from dynaseq.core.errors import DynaseqError
from dynaseq.metrics.micronet import (
    MicroNetOpCounter,
    count_ops,
    micronet_score,
    parameter_storage,
    tensor_storage,
)


def _lin_relu_ln() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.LayerNorm(3))


def test_linear_relu_layernorm_hand_count():
    m = _lin_relu_ln()
    _, c = count_ops(m, torch.randn(1, 4), model=m)
    # addmm: 4·3 mults, 3·3 adds + 3 bias adds
    assert c.by_op["addmm"] == [12, 12]
    # relu: 1 "mult" per element (the challenge's reference counter)
    assert c.by_op["relu"] == [3, 0]
    # layer_norm, D = 3: mults 2D+3 (+D weight) = 12, adds 3D−1 (+D bias) = 11
    assert c.by_op["layer_norm"] == [12, 11]
    assert (c.mults, c.adds) == (27, 23)
    assert c.total == 50
    # two tokens at once cost twice as much
    _, c2 = count_ops(m, torch.randn(2, 4), model=m)
    assert c2.total == 100


def test_sparse_and_quantized_matmul_counts():
    m = _lin_relu_ln()
    with torch.no_grad():
        m[0].weight[:, :2] = 0  # each output row keeps 2 of its 4 weights
        m[0].weight[2, 2] = 0  # row 2 keeps 1
    _, c = count_ops(m[0], torch.randn(1, 4), model=m[0])
    # mults = nnz = 5; adds = Σ_j (nnz_j − 1) = 1 + 1 + 0, + 3 bias
    assert c.by_op["addmm"] == [5, 5]
    _, dense = count_ops(m[0], torch.randn(1, 4), model=m[0], sparse=False)
    assert dense.by_op["addmm"] == [12, 12]
    # without the model the weight is unknown: counted dense
    _, unknown = count_ops(m[0], torch.randn(1, 4))
    assert unknown.by_op["addmm"] == [12, 12]

    q = _lin_relu_ln()
    prepare_qat_(q, QATConfig(bits=8))
    convert_qat_(q)
    counter = MicroNetOpCounter(q)
    with torch.no_grad(), counter:
        q(torch.randn(1, 4))
    c = counter.counts
    assert c.by_op["addmm"] == [12, 12]
    # 8-bit multiplies count 8/32; additions always 32-bit; fake-quant conversions are free
    assert c.mults32 == 12 * 8 / 32 + 3 + 12
    assert c.adds32 == 12 + 11
    assert any("fake_quantize" in op for op in c.ignored)
    # the same with calibrated (already observed) activation statistics
    counter.reset()
    with torch.no_grad(), counter:
        q(torch.randn(1, 4))
    assert counter.counts.total == c.total


def test_counter_refuses_unfinalized_pruning():
    m = _lin_relu_ln()
    GradualPruner(m, {"0.weight": 0.5}, 0, 0, 1).step(0)
    with pytest.raises(DynaseqError, match="finalize"):
        MicroNetOpCounter(m)


class TinyAttention(nn.Module):
    """Pre-LN single-head causal attention with a K/V cache, fed one token at a time."""

    def __init__(self, d: int, use_sdpa: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.use_sdpa = use_sdpa

    def forward(self, x: torch.Tensor, cache: list) -> torch.Tensor:  # x (B, 1, d)
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)  # (B, 1, d)
        if cache:
            k = torch.cat([cache[0], k], dim=1)  # (B, S, d)
            v = torch.cat([cache[1], v], dim=1)
        cache[:] = [k, v]
        if self.use_sdpa:
            # 4-D (B, H, L, E) inputs run the fused kernel, counted by its own rule
            a = nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])
            a = a[:, 0]
        else:
            scores = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])  # (B, 1, S)
            a = torch.softmax(scores, dim=-1) @ v  # (B, 1, d)
        return x + self.o(a)


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int = 11, d: int = 4, use_sdpa: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(TinyAttention(d, use_sdpa) for _ in range(2))
        self.out = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # one token at a time
        caches: list[list] = [[] for _ in self.layers]
        logps = []
        for t in range(tokens.shape[1]):
            x = self.embed(tokens[:, t : t + 1])
            for layer, cache in zip(self.layers, caches, strict=True):
                x = layer(x, cache)
            logps.append(torch.log_softmax(self.out(x), dim=-1))
        return torch.cat(logps, dim=1)


def _hand_count(d: int, vocab: int, n_layers: int, n_tokens: int) -> tuple[int, int]:
    mults = adds = 0
    for t in range(n_tokens):
        s = t + 1  # keys/values visible to token t
        for _ in range(n_layers):
            mults += 3 * d + 3  # layer_norm with weight
            adds += 4 * d - 1  # ... and bias
            mults += 4 * d * d  # q, k, v, o projections
            adds += 4 * (d * (d - 1) + d)  # ... with biases
            mults += d * s + s  # q·kᵀ, then the 1/√d scale
            adds += (d - 1) * s
            mults += 2 * s  # softmax over s
            adds += s - 1
            mults += s * d  # probs · v
            adds += (s - 1) * d
            adds += d  # residual
        mults += vocab * d  # output layer
        adds += vocab * (d - 1) + vocab
        mults += vocab + 1  # log_softmax over the vocabulary
        adds += 2 * vocab - 1
    return mults, adds


@pytest.mark.parametrize("use_sdpa", [False, True])
def test_tiny_attention_decoder_one_token_at_a_time(use_sdpa):
    m = TinyDecoder(use_sdpa=use_sdpa)
    tokens = torch.randint(0, 11, (1, 5))
    _, c = count_ops(m, tokens, model=m)
    mults, adds = _hand_count(4, 11, 2, 5)
    assert (c.mults, c.adds) == (mults, adds)
    assert c.per_token(5) == (mults + adds) / 5


def test_storage_half_pruned_9bit_matrix():
    lin = nn.Linear(8, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(1, 33, dtype=torch.float32).view(4, 8))
        lin.weight[:, ::2] = 0  # 16 of 32 entries pruned
    rep = parameter_storage(lin, bits={"weight": 9})
    # 16 non-zeros at 9/32 + a 32-bit bitmask of 1 bit per element = 4.5 + 1
    assert rep.total == pytest.approx(16 * 9 / 32 + 32 / 32) == 5.5
    assert rep.dense_total == pytest.approx(32 * 9 / 32)
    assert parameter_storage(lin, bits={"weight": 9}, sparse=False).total == 9.0
    assert parameter_storage(lin, bits=32).total == pytest.approx(16 + 1)
    # barely sparse tensors are stored dense
    assert tensor_storage(100, 99, 8) == 100 * 8 / 32


def test_storage_after_prune_and_qat_pipeline():
    m = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))
    with torch.no_grad():
        m[1].weight.copy_(torch.arange(1, 33, dtype=torch.float32).view(4, 8) / 32)
    pruner = GradualPruner(m, {"1.weight": 0.5}, 0, 0, 1)
    pruner.step(0)
    pruner.finalize()
    prepare_qat_(m, QATConfig(bits=9, quantize_activations=False))
    convert_qat_(m)
    rep = parameter_storage(m)  # bit widths from QAT
    assert rep.per_tensor["1.weight"] == pytest.approx(5.5)
    assert rep.per_tensor["0.weight"] == 80  # embedding: dense, 32-bit
    assert rep.per_tensor["1.bias"] == 4
    assert rep.per_tensor["1.weight_scale"] == 4  # one fp32 scale per output row
    assert rep.total == pytest.approx(5.5 + 80 + 4 + 4)


def test_tied_weights_counted_once():
    emb = nn.Embedding(10, 4)
    out = nn.Linear(4, 10, bias=False)
    out.weight = emb.weight
    assert parameter_storage(nn.ModuleList([emb, out])).total == 40


def test_micronet_score_normalisation():
    s = micronet_score(159e6, 318e6)
    assert s.score == pytest.approx(2.0)
    # the paper's final model: 1.8M parameters, 8.8M ops -> 0.0387 (rounded inputs)
    assert micronet_score(1.8e6, 8.8e6).score == pytest.approx(0.0387, abs=5e-4)
    assert micronet_score(1.8e6, 8.8e6).as_dict()["params"] == 1.8e6
    with pytest.raises(DynaseqError):
        micronet_score(-1, 0)


def test_cache_style_ops():
    x = torch.randn(3, 5)
    _, c = count_ops(torch.logsumexp, x, dim=-1)
    assert c.by_op["logsumexp"] == [3 * 6, 3 * 4]
    acc = torch.zeros(7)
    _, c = count_ops(lambda: acc.index_add(0, torch.tensor([1, 1, 2]), torch.ones(3)))
    assert c.by_op["index_add"] == [0, 3]
    _, c = count_ops(torch.cumsum, x, dim=1)
    assert c.by_op["cumsum"] == [0, 3 * 4]
