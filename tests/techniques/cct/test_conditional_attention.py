import pytest
import torch
from torch import nn

from dynaseq.nn import (
    AuxOutputs,
    DecoderLayer,
    EncoderLayer,
    KVCache,
    dense_attention,
    padding_to_attn_mask,
)
from dynaseq.techniques.cct.conditional_attention import allowed_mask
from dynaseq.techniques.cct.layers import (
    ConditionalAttention,
    ControlNet,
    Gate,
    GatedKVCache,
    conditional_attention,
    conditional_feedforward,
    force_gates,
)

D, H = 32, 4


def _inputs(seed=0, b=3, t=6, s=5):
    g = torch.Generator().manual_seed(seed)
    x, mem = torch.randn(b, t, D, generator=g), torch.randn(b, s, D, generator=g)
    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[1, 3:] = True
    return x, mem, padding_to_attn_mask(pad)


def _modes(attn, x, **kw):
    """(hard, soft) outputs of the same module: eval vs train mode."""
    attn.eval()
    hard = attn(x, **kw)
    attn.train()
    soft = attn(x, **kw)
    attn.eval()
    return hard, soft


@pytest.mark.parametrize("kind", ["self_padded", "causal", "cross"])
def test_all_gates_on_hard_equals_soft(kind):
    torch.manual_seed(0)
    attn = conditional_attention(D, H, control_hidden=16)
    x, mem, mask = _inputs()
    kw = {"self_padded": {"memory": None, "attn_mask": padding_to_attn_mask(
              torch.tensor([[0] * 6, [0] * 4 + [1] * 2, [0] * 6], dtype=torch.bool))},
          "causal": {"is_causal": True}, "cross": {"memory": mem, "attn_mask": mask}}[kind]
    with force_gates(attn, 1.0):
        hard, soft = _modes(attn, x, **kw)
    torch.testing.assert_close(hard, soft)


def test_all_gates_on_without_norms_equals_dense_attention():
    torch.manual_seed(0)
    mha = dense_attention(D, H)
    attn = ConditionalAttention(D, H, mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj,
                                q_control=ControlNet(D, 1, 8), kv_control=ControlNet(D, 1, 8),
                                gate=Gate(), k_norm=nn.Identity(), v_norm=nn.Identity(),
                                out_norm=nn.Identity())
    x, mem, mask = _inputs()
    mha.eval()
    with force_gates(attn, 1.0):
        for kw in ({"is_causal": True}, {"memory": mem, "attn_mask": mask}):
            hard, soft = _modes(attn, x, **kw)
            torch.testing.assert_close(hard, mha(x, **kw))
            torch.testing.assert_close(soft, mha(x, **kw))


def _zero_row_reference(attn, x, mem, mask, q_on, kv_on):
    """Eq. 12-13 written out with 0/1 gates: off keys are zero rows inside the softmax."""
    b, t, _ = x.shape
    k = kv_on[..., None] * attn.k_norm(attn.k_proj(mem))
    v = kv_on[..., None] * attn.v_norm(attn.v_proj(mem))
    q = attn.q_proj(x)

    def heads(z):
        return z.view(b, -1, H, D // H).transpose(1, 2)

    scores = heads(q) @ heads(k).transpose(-1, -2) / (D // H) ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    a = (scores.softmax(-1) @ heads(v)).transpose(1, 2).reshape(b, t, D)
    return q_on[..., None] * attn.out_proj(attn.out_norm(a))


def test_hard_is_the_zero_one_limit_of_soft(steer, pattern):
    """A hand-set pattern: hard inference = soft training computation with those 0/1 gates."""
    torch.manual_seed(0)
    attn = conditional_attention(D, H, control_hidden=16)
    steer(attn.q_control, [0])
    steer(attn.kv_control, [1])
    x, mem, mask = _inputs()
    q_on = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]).bool()
    kv_on = torch.tensor([[1, 0, 0, 1, 1], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0]]).bool()
    x, mem = pattern(x, 0, q_on), pattern(mem, 1, kv_on)
    hard, soft = _modes(attn, x, memory=mem, attn_mask=mask)
    torch.testing.assert_close(hard, soft)
    torch.testing.assert_close(hard, _zero_row_reference(attn, x, mem, mask, q_on.float(),
                                                         kv_on.float()))
    assert torch.equal(hard[~q_on], torch.zeros(int((~q_on).sum()), D))  # exactly 0
    # sequence 2 has every key off: its open queries see only zero rows -> attention 0
    assert torch.isfinite(hard).all()


# (q_on, kv_on) hitting each layout of the inference path; memory padding: seq 1, keys 3-4.
# PACKINGS: how many Packing.of calls (queries, keys) and zero-row softmaxes each layout runs.
PACKINGS = {"packed": (2, 1), "packed_queries": (1, 0), "plain": (0, 0), "packed_keys": (2, 1)}
LAYOUTS = {
    # some queries off, no packed sequence has every key on: queries and keys packed
    "packed": ([[1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]],
               [[1, 0, 0, 1, 1], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0]]),
    # some queries off, seq 0 has every key on: queries packed, keys not (off = zero rows)
    "packed_queries": ([[1, 0, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]],
                       [[1, 1, 1, 1, 1], [1, 0, 1, 1, 1], [0, 1, 0, 0, 1]]),
    # every query open, seq 2 has every key on: plain attention over all keys
    "plain": ([[1] * 6] * 3, [[1, 0, 0, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
    # every query open, no sequence with every key on: keys packed
    "packed_keys": ([[1] * 6] * 3, [[1, 0, 0, 1, 1], [0, 0, 1, 1, 1], [1, 1, 0, 1, 1]]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_is_the_zero_row_computation(steer, pattern, layout, monkeypatch):
    """Whichever layout runs (packed or not), off keys act as zero rows in the softmax."""
    from dynaseq.techniques.cct import conditional_attention as module

    calls = {"pack": 0, "zero_rows": 0}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(module.Packing, "of", classmethod(counted(module.Packing.of.__func__,
                                                                   "pack")))
    monkeypatch.setattr(module, "attend_with_zero_rows",
                        counted(module.attend_with_zero_rows, "zero_rows"))
    torch.manual_seed(0)
    attn = conditional_attention(D, H, control_hidden=16)
    steer(attn.q_control, [0])
    steer(attn.kv_control, [1])
    x, mem, mask = _inputs()
    q_on, kv_on = (torch.tensor(v).bool() for v in LAYOUTS[layout])
    x, mem = pattern(x, 0, q_on), pattern(mem, 1, kv_on)
    hard, soft = _modes(attn, x, memory=mem, attn_mask=mask)
    torch.testing.assert_close(hard, soft)
    torch.testing.assert_close(hard, _zero_row_reference(attn, x, mem, mask, q_on.float(),
                                                         kv_on.float()))
    assert torch.equal(hard[~q_on], torch.zeros(int((~q_on).sum()), D))
    assert (calls["pack"], calls["zero_rows"]) == PACKINGS[layout]  # the eval-mode call


def test_gated_off_sublayers_leave_the_residual_exactly():
    torch.manual_seed(0)
    enc = EncoderLayer(D, conditional_attention(D, H, control_hidden=8),
                       conditional_feedforward(D, 64, 4, control_hidden=8))
    dec = DecoderLayer(D, conditional_attention(D, H, control_hidden=8),
                       conditional_attention(D, H, control_hidden=8),
                       conditional_feedforward(D, 64, 4, control_hidden=8))
    x, mem, mask = _inputs()
    for training in (False, True):
        for layer in (enc, dec):
            layer.train(training)
            with force_gates(layer, 0.0):
                out = enc(x, None) if layer is enc else dec(x, mem, mask)
            assert torch.equal(out, x)


def test_incremental_hard_decoding_equals_full_sequence():
    torch.manual_seed(1)
    layer = DecoderLayer(D, conditional_attention(D, H, control_hidden=16),
                         conditional_attention(D, H, control_hidden=16),
                         conditional_feedforward(D, 64, 4, control_hidden=16)).eval()
    x, mem, mask = _inputs(seed=1, b=3, t=7, s=5)
    aux = AuxOutputs()
    full = layer(x, mem, mask, aux=aux)
    gates = torch.cat([tr.values.flatten() for tr in aux.traces["cct.gates"]])
    assert 0 < gates.mean() < 1  # a mixed pattern: some work ran, some was skipped
    self_cache, cross_cache = GatedKVCache(), GatedKVCache(static=True)
    aux = AuxOutputs()
    steps = [layer(x[:, i: i + 1], mem, mask, self_cache=self_cache, cross_cache=cross_cache,
                   aux=aux) for i in range(7)]
    torch.testing.assert_close(torch.cat(steps, 1), full)
    assert self_cache.length == 7 and cross_cache.length == 5
    kv = [tr for tr in aux.traces["cct.gates"] if tr.gate == "kv"]
    assert len(kv) == 7 + 1  # self-attention K/V every step, cross-attention once


def test_causal_mask_is_built_only_where_it_hides_a_key():
    cpu = torch.device("cpu")
    # decoding step: one query after 4 cached keys sees all 5, so no mask at all
    assert allowed_mask(None, True, 1, 5, 4, cpu) is None
    # 3 queries after 2 cached keys: query t sees keys <= 2 + t
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]).bool()
    assert torch.equal(allowed_mask(None, True, 3, 5, 2, cpu), expected[None, None])
    pad = torch.tensor([[True, True, False, True, True]])[:, None, None, :]
    assert torch.equal(allowed_mask(pad, True, 1, 5, 4, cpu), pad)


def test_gated_cache_reorders_its_flags_and_plain_cache_is_refused():
    cache = GatedKVCache(k=torch.randn(3, 4, 16), v=torch.randn(3, 4, 16),
                         on=torch.tensor([[1, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]).bool())
    on = cache.on
    cache.reorder(torch.tensor([2, 0]))
    assert torch.equal(cache.on, on[[2, 0]]) and cache.k.size(0) == 2
    attn = conditional_attention(D, H).eval()
    with pytest.raises(TypeError, match="GatedKVCache"):
        attn(torch.randn(1, 1, D), is_causal=True, cache=KVCache())


def test_bad_construction_raises():
    with pytest.raises(ValueError, match="divisible"):
        conditional_attention(30, 4)
    with pytest.raises(ValueError, match="one gate"):
        ConditionalAttention(D, H, *(nn.Linear(D, D) for _ in range(4)),
                             q_control=ControlNet(D, 2), kv_control=ControlNet(D), gate=Gate(),
                             k_norm=nn.Identity(), v_norm=nn.Identity(), out_norm=nn.Identity())
    with pytest.raises(ValueError, match="bool"):
        conditional_attention(D, H).eval()(torch.randn(1, 2, D), attn_mask=torch.ones(1, 1, 1, 2))
