"""Dense maximum, realized MACs of a hand-set gate pattern, and FlopCounterMode agreeing."""

import torch

from dynaseq.metrics.macs import _counter
from dynaseq.nn import AuxOutputs, DecoderLayer, padding_to_attn_mask
from dynaseq.techniques.cct.layers import (
    GatedKVCache,
    conditional_attention,
    conditional_feedforward,
    force_gates,
    realized_macs_by_layer,
)

D, H, C = 32, 4, 16  # width, heads, control-net width
CTRL = D * C + C  # control-net MACs per token with one gate


def _measured(fn):
    with torch.no_grad(), _counter() as fc:
        fn()
    return fc.get_total_flops() / 2


def test_dense_maximum_has_the_dense_keys_plus_control_nets():
    attn = conditional_attention(D, H, control_hidden=C)
    assert attn.macs(5, 7) == {
        "q_proj": 5 * D * D, "k_proj": 7 * D * D, "v_proj": 7 * D * D,
        "attn_scores": 5 * 7 * D, "attn_values": 5 * 7 * D, "out_proj": 5 * D * D,
        "control_q": 5 * CTRL, "control_kv": 7 * CTRL}
    assert attn.macs(1, 7, n_kv_tokens=0)["k_proj"] == 0
    ffn = conditional_feedforward(D, 64, 4, control_hidden=C)
    assert ffn.macs(5) == {"ffn_in": 5 * D * 64, "ffn_out": 5 * 64 * D,
                           "control_ffn": 5 * (D * C + C * 4)}


def test_attention_realized_macs_for_a_hand_set_pattern(steer, pattern):
    torch.manual_seed(0)
    attn = conditional_attention(D, H, control_hidden=C).eval()
    steer(attn.q_control, [0])
    steer(attn.kv_control, [1])
    q_on = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 0, 0, 0]]).bool()
    kv_gate = torch.tensor([[1, 0, 1, 0, 0], [1, 1, 1, 0, 1]]).bool()
    pad = torch.tensor([[0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]).bool()  # seq 1's last key: padding
    x = pattern(pattern(torch.randn(2, 5, D), 0, q_on), 1, kv_gate)
    aux = AuxOutputs()
    run = lambda: attn(x, attn_mask=padding_to_attn_mask(pad), aux=aux)  # noqa: E731
    measured = _measured(run)
    # 4 open queries; keys computed: 2 in seq 0, 3 in seq 1 (its padding key is skipped);
    # packed attention: 2 sequences x 3 query slots x 3 key slots
    expected = {"q_proj": 4 * D * D, "k_proj": 5 * D * D, "v_proj": 5 * D * D,
                "attn_scores": 2 * 3 * 3 * D, "attn_values": 2 * 3 * 3 * D,
                "out_proj": 4 * D * D, "control_q": 10 * CTRL, "control_kv": 10 * CTRL}
    record = aux.traces["macs"][0]
    assert record.macs == expected
    assert attn.realized_macs(q_on, kv_gate & ~pad) == expected
    assert measured == sum(expected.values())
    assert measured < 2 * sum(attn.macs(5, 5).values())  # macs() is per sequence
    q_trace, q_control, kv_trace, kv_control = aux.traces["cct.gates"]
    assert (q_control.gate, kv_control.gate) == ("control", "control")
    assert torch.equal(q_trace.values[..., 0], q_on.float())
    assert torch.equal(kv_trace.values[..., 0], (kv_gate & ~pad).float())  # what ran


def test_attention_with_every_gate_on_runs_the_dense_maximum():
    torch.manual_seed(0)
    attn = conditional_attention(D, H, control_hidden=C).eval()
    x, mem = torch.randn(1, 4, D), torch.randn(1, 6, D)
    aux = AuxOutputs()
    with force_gates(attn, 1.0):
        measured = _measured(lambda: attn(x, mem, aux=aux))
    assert aux.traces["macs"][0].macs == attn.macs(4, 6)
    assert measured == sum(attn.macs(4, 6).values())


def test_cached_decoding_step_counts_only_what_ran(steer, pattern):
    torch.manual_seed(0)
    attn = conditional_attention(D, H, control_hidden=C).eval()
    steer(attn.q_control, [0])
    steer(attn.kv_control, [1])
    mem = pattern(torch.randn(2, 6, D), 1, torch.tensor([[1, 1, 0, 1, 0, 0]] * 2).bool())
    cache = GatedKVCache(static=True)
    attn(torch.randn(2, 1, D), mem, cache=cache)  # fills the cache: 3 keys on per sequence
    x = pattern(torch.randn(2, 1, D), 0, torch.tensor([[1], [0]]).bool())
    aux = AuxOutputs()
    measured = _measured(lambda: attn(x, mem, cache=cache, aux=aux))
    expected = {"q_proj": D * D, "k_proj": 0, "v_proj": 0, "attn_scores": 3 * D,
                "attn_values": 3 * D, "out_proj": D * D, "control_q": 2 * CTRL,
                "control_kv": 0}
    assert aux.traces["macs"][0].macs == expected
    assert measured == sum(expected.values())


def test_ffn_realized_macs_for_a_hand_set_pattern(steer):
    torch.manual_seed(0)
    ffn = conditional_feedforward(D, 64, 4, control_hidden=C).eval()
    steer(ffn.control, [0, 1, 2, 3])
    on = torch.zeros(2, 3, 4, dtype=torch.bool)
    on[0, 0, 0] = on[1, 2, 0] = True  # piece 0 on 2 tokens
    on[0, :, 2] = True  # piece 2 on 3 tokens, piece 3 on 1, piece 1 on none
    on[1, 1, 3] = True
    x = torch.randn(2, 3, D)
    x[..., :4] = on.float() * 2 - 1
    aux = AuxOutputs()
    measured = _measured(lambda: ffn(x, aux=aux))
    expected = {"ffn_in": 6 * D * 16, "ffn_out": 6 * 16 * D, "control_ffn": 6 * (D * C + C * 4)}
    assert ffn.realized_macs(on) == expected
    assert aux.traces["macs"][0].macs == expected
    assert measured == sum(expected.values())


def test_flop_counter_sees_the_recorded_realized_macs_of_a_decoder_layer():
    """Learned (random) gates, padding, incremental steps: measured == recorded, < dense."""
    torch.manual_seed(3)
    layer = DecoderLayer(D, conditional_attention(D, H, control_hidden=C),
                         conditional_attention(D, H, control_hidden=C),
                         conditional_feedforward(D, 64, 4, control_hidden=C)).eval()
    for name, sub in (("self", layer.self_attn), ("cross", layer.cross_attn), ("ffn", layer.ffn)):
        sub.name = name
    x, mem = torch.randn(3, 5, D), torch.randn(3, 4, D)
    pad = torch.zeros(3, 4, dtype=torch.bool)
    pad[2, 2:] = True
    mask = padding_to_attn_mask(pad)
    aux = AuxOutputs()
    measured = _measured(lambda: layer(x, mem, mask, aux=aux))
    realized = realized_macs_by_layer(aux)
    assert measured == sum(sum(m.values()) for m in realized.values())
    dense = (sum(layer.self_attn.macs(5, 5).values()) + sum(layer.cross_attn.macs(5, 4).values())
             + sum(layer.ffn.macs(5).values())) * 3
    assert 0 < measured < dense

    caches, aux = (GatedKVCache(), GatedKVCache(static=True)), AuxOutputs()
    measured = _measured(lambda: [layer(x[:, i: i + 1], mem, mask, self_cache=caches[0],
                                        cross_cache=caches[1], aux=aux) for i in range(5)])
    assert measured == sum(sum(m.values()) for m in realized_macs_by_layer(aux).values())


def test_flop_counter_agrees_with_the_record_in_every_attention_layout(steer, pattern):
    """Plain, query-packed and fully packed layouts (see test_conditional_attention.LAYOUTS):
    the products that run are what the record says."""
    from tests.techniques.cct.test_conditional_attention import LAYOUTS

    torch.manual_seed(0)
    attn = conditional_attention(D, H, control_hidden=C).eval()
    steer(attn.q_control, [0])
    steer(attn.kv_control, [1])
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, 3:] = True
    for q_on, kv_on in LAYOUTS.values():
        q_on, kv_on = torch.tensor(q_on).bool(), torch.tensor(kv_on).bool()
        x = pattern(torch.randn(3, 6, D), 0, q_on)
        mem = pattern(torch.randn(3, 5, D), 1, kv_on)
        aux = AuxOutputs()
        mask = padding_to_attn_mask(pad)
        measured = _measured(lambda: attn(x, mem, attn_mask=mask, aux=aux))  # noqa: B023
        record = aux.traces["macs"][0].macs
        # keys run where on, not padding, and some query of the sequence is open
        assert record == attn.realized_macs(q_on, kv_on & ~pad & q_on.any(1, keepdim=True))
        assert measured == sum(record.values())


def test_static_cache_packs_its_keys_once_and_counts_that_width(steer, pattern, monkeypatch):
    """Cross-attention steps reuse one packing of the cached keys (over every sequence), and
    the record counts the width that ran; the output is that of a per-step packing."""
    from dynaseq.techniques.cct import conditional_attention as module

    torch.manual_seed(0)
    attn = conditional_attention(D, H, control_hidden=C).eval()
    steer(attn.q_control, [0])
    steer(attn.kv_control, [1])
    mem = pattern(torch.randn(2, 6, D), 1,
                  torch.tensor([[1, 1, 0, 1, 0, 0], [0, 0, 1, 0, 0, 0]]).bool())
    cache = GatedKVCache(static=True)
    attn(torch.randn(2, 1, D), mem, cache=cache)  # fills the cache: 3 and 1 keys on
    packings, pack = [], module.PackedKeys.of
    monkeypatch.setattr(module.PackedKeys, "of",
                        staticmethod(lambda *a: packings.append(1) or pack(*a)))
    q_on = torch.tensor([[False], [True]])  # seq 1's query only
    x = pattern(torch.randn(2, 1, D), 0, q_on)
    for _ in range(2):
        aux = AuxOutputs()
        measured = _measured(lambda: attn(x, mem, cache=cache, aux=aux))  # noqa: B023
        # seq 1 alone has 1 key on, but the shared packing is 3 wide
        assert aux.traces["macs"][0].macs["attn_scores"] == 1 * 1 * 3 * D
        assert measured == sum(aux.traces["macs"][0].macs.values())
    assert len(packings) == 1
    reference = attn._attend_packed(x, cache.k, cache.v, None, cache.on, module.Packing.of(q_on))
    torch.testing.assert_close(attn(x, mem, cache=cache)[1], reference)
