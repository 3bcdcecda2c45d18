"""DMB attention: per-token routed projections, caches (step-by-step == full pass), merge,
MACs, drop-in for MultiHeadAttention inside Encoder/DecoderLayer."""

import copy

import pytest
import torch
import torch.nn.functional as F

from dynaseq.metrics.macs import _counter
from dynaseq.nn import AuxOutputs, DecoderLayer, KVCache, padding_to_attn_mask
from dynaseq.techniques.branching import (
    BranchedAttention,
    BranchedLinear,
    Router,
    dmb_attention,
    dmb_feedforward,
    merge_shared_,
    route_traces,
)
from dynaseq.techniques.cct.layers import realized_macs_by_layer

D, H, N = 16, 4, 4


def _randomize_shared(module):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("shared_weight", "shared_bias")):
                p.normal_(std=0.1)


def _rowwise(proj, x, branch):
    """Each row of x through its own branch's effective weights."""
    w, b = proj.branch_parameters()
    flat, br = x.reshape(-1, x.size(-1)), branch.reshape(-1)
    return torch.stack([F.linear(flat[i], w[br[i]], b[br[i]]) for i in range(br.numel())]) \
        .view(*x.shape[:-1], -1)


def _reference(attn, x, memory=None, mask=None, causal=False):
    """Explicit DMB attention: q/out by the query token's branch, k/v by the key token's."""
    src = x if memory is None else memory
    bq, bkv = attn.router(x).branch, attn.router(src).branch
    b, t, _ = x.shape

    def heads(y):
        return y.view(b, y.size(1), H, D // H).transpose(1, 2)

    q = heads(_rowwise(attn.q_proj, x, bq))
    k, v = heads(_rowwise(attn.k_proj, src, bkv)), heads(_rowwise(attn.v_proj, src, bkv))
    scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if causal:
        scores = scores.masked_fill(torch.ones(t, src.size(1), dtype=torch.bool).triu(1),
                                    float("-inf"))
    h = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, D)
    return _rowwise(attn.out_proj, h, bq)


@pytest.fixture
def attn():
    torch.manual_seed(0)
    a = dmb_attention(D, H, N).eval()
    _randomize_shared(a)
    return a


def test_self_and_cross_attention_match_the_per_token_reference(attn):
    x, mem = torch.randn(2, 5, D), torch.randn(2, 7, D)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 4:] = True
    mask = padding_to_attn_mask(pad)
    torch.testing.assert_close(attn(x, is_causal=True), _reference(attn, x, causal=True))
    torch.testing.assert_close(attn(x, mem, attn_mask=mask), _reference(attn, x, mem, mask))


def test_projections_run_once_per_token(attn, linear_rows):
    x, mem = torch.randn(2, 5, D), torch.randn(2, 7, D)
    aux = AuxOutputs()
    attn(x, mem, aux=aux)
    q_tr, m_tr = route_traces(aux)
    assert (q_tr.stream, m_tr.stream) == ("input", "memory")
    q_counts = torch.bincount(q_tr.branch.flatten(), minlength=N).tolist()
    m_counts = torch.bincount(m_tr.branch.flatten(), minlength=N).tolist()
    # call order: q (query groups), k and v (memory groups), out (query groups)
    assert linear_rows.rows((D, D)) == q_counts + m_counts + m_counts + q_counts
    assert linear_rows.rows((N, D)) == [10, 14]  # the gate, once per query and memory token


def test_incremental_self_attention_equals_the_full_pass(attn):
    x = torch.randn(3, 6, D)
    full = attn(x, is_causal=True)
    everything = torch.ones(3, 1, 1, 6, dtype=torch.bool)
    torch.testing.assert_close(attn(x, attn_mask=everything, is_causal=True), full)
    cache = attn.new_cache()
    steps = [attn(x[:, i:i + 1], is_causal=True, cache=cache) for i in range(4)]
    steps.append(attn(x[:, 4:6], is_causal=True, cache=cache))  # two new steps at once
    torch.testing.assert_close(torch.cat(steps, 1), full)
    assert cache.length == 6


def test_decoder_layer_step_by_step_equals_teacher_forcing():
    torch.manual_seed(0)
    layer = DecoderLayer(D, dmb_attention(D, H, N), dmb_attention(D, H, N),
                         dmb_feedforward(D, 32, N)).eval()
    _randomize_shared(layer)
    x, mem = torch.randn(2, 6, D), torch.randn(2, 5, D)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[0, 3:] = True
    mask = padding_to_attn_mask(pad)
    full = layer(x, mem, mask)
    self_cache, cross_cache = KVCache(), KVCache(static=True)
    aux = AuxOutputs()
    steps = [layer(x[:, i:i + 1], mem, mask, self_cache=self_cache, cross_cache=cross_cache,
                   aux=aux) for i in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full)
    # the memory is routed and projected once, when the static cache is filled
    assert [t.stream for t in route_traces(aux)].count("memory") == 1


def test_merged_equals_unmerged(attn):
    x, mem = torch.randn(2, 5, D), torch.randn(2, 7, D)
    merged = copy.deepcopy(attn)
    assert merge_shared_(merged) == 4
    assert torch.equal(merged(x, is_causal=True), attn(x, is_causal=True))
    assert torch.equal(merged(x, mem), attn(x, mem))


def test_gradients_reach_the_gate_only_through_traces():
    torch.manual_seed(0)
    attn = dmb_attention(D, H, N)
    aux = AuxOutputs()
    attn(torch.randn(2, 5, D), torch.randn(2, 3, D), aux=aux).sum().backward()
    assert attn.router.proj.weight.grad is None
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj):
        assert proj.shared_weight.grad.abs().sum() > 0


def test_macs_match_the_flop_counter_and_realized_records(attn):
    x, mem = torch.randn(2, 5, D), torch.randn(2, 7, D)
    aux = AuxOutputs()
    with torch.no_grad(), _counter() as fc:
        attn(x, mem, aux=aux)
    cross = attn.macs(10, 7, 14, cross=True)
    assert cross["q_proj"] == 10 * D * D and cross["k_proj"] == 14 * D * D
    assert cross["gate_q"] == 10 * D * N and cross["gate_kv"] == 14 * D * N
    assert cross["attn_scores"] == cross["attn_values"] == 2 * 5 * 7 * D  # 10 queries x 7 keys
    assert realized_macs_by_layer(aux) == {"attention": cross}
    assert fc.get_total_flops() / 2 == sum(cross.values())
    # self-attention reuses the query decisions for keys and values
    assert attn.macs(5, 5)["gate_kv"] == 0
    assert attn.macs(1, 7, n_kv_tokens=0, cross=True)["k_proj"] == 0


@pytest.mark.parametrize("make, match", [
    (lambda: dmb_attention(10, 3), "not divisible"),
    (lambda: dmb_attention(D, H, dropout=1.0), "dropout"),
    (lambda: BranchedAttention(D, H, Router(D, 2), *[BranchedLinear(D, D, 4)] * 4),
     "q_proj has 4 branches"),
    (lambda: BranchedAttention(D, H, Router(D, 4), torch.nn.Linear(D, D),
                               *[BranchedLinear(D, D, 4)] * 3), "BranchedLinear"),
    (lambda: BranchedAttention(D, H, Router(D, 4), *[BranchedLinear(D, 8, 4)] * 4),
     "16 -> 16"),
    (lambda: BranchedAttention(D, H, Router(8, 4), *[BranchedLinear(D, D, 4)] * 4),
     "router reads width 8"),
])
def test_bad_arguments_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()
