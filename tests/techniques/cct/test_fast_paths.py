"""Inference fast paths of the CCT sub-layers: a call whose gates are all off does not enter
the gated work, one whose gates are all on runs without gather/scatter, and both give what
the general path (``fast_paths=False``) gives, in outputs and in MAC records, down to
greedy and beam decoding of a whole model."""

from __future__ import annotations

import math

import pytest
import torch

from dynaseq.models.search import beam_search, greedy_search
from dynaseq.nn import AuxOutputs, DecoderLayer, padding_to_attn_mask
from dynaseq.nn.outputs import MACS_TRACE
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.techniques.cct.config import CCTConfig
from dynaseq.techniques.cct.layers import (
    BudgetControl,
    GatedKVCache,
    conditional_attention,
    conditional_feedforward,
    realized_macs_by_layer,
)

from helpers import AtenMode

D, H, F, M = 32, 4, 64, 4
GATHER_OPS = {"index_select", "index_add", "index_add_", "index_copy", "index_copy_",
              "nonzero", "gather"}


class AtenOps(AtenMode):
    """Records the name of every aten op that runs inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def seen(self, func, args, kwargs) -> None:
        self.names.append(str(func).split(".")[1])  # "aten.index_select.default"


def _pair(make):
    """The same sub-layer (same weights) with and without fast paths, in eval mode."""
    torch.manual_seed(0)
    fast = make(fast_paths=True).eval()
    general = make(fast_paths=False).eval()
    general.load_state_dict(fast.state_dict())
    return fast, general


def _ffn(fast_paths):
    return conditional_feedforward(D, F, M, control_hidden=16, fast_paths=fast_paths)


def _attn(fast_paths):
    return conditional_attention(D, H, control_hidden=16, fast_paths=fast_paths)


def _calls(modules) -> tuple[list[int], list]:
    """Count the forward calls of ``modules`` (a one-element list, and the hook handles)."""
    n = [0]

    def hook(*_):
        n[0] += 1

    return n, [m.register_forward_hook(hook) for m in modules]


def _macs(aux: AuxOutputs) -> list[dict[str, int]]:
    return [rec.macs for rec in aux.traces[MACS_TRACE]]


# pattern name -> (B, T, M) gates of the FFN pieces (0/1), B=2, T=3
FFN_PATTERNS = {
    "all_on": torch.ones(2, 3, M),
    "all_off": torch.zeros(2, 3, M),
    "mixed": torch.tensor([[[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]],
                           [[1, 0, 0, 1], [1, 0, 1, 1], [1, 0, 1, 0]]]).float(),
}


@pytest.mark.parametrize("name", FFN_PATTERNS)
def test_ffn_fast_path_equals_the_general_path(steer, name):
    fast, general = _pair(_ffn)
    for ffn in (fast, general):
        steer(ffn.control, list(range(M)))
    on = FFN_PATTERNS[name]
    x = torch.randn(2, 3, D)
    x[..., :M] = on * 2 - 1
    aux_fast, aux_general = AuxOutputs(), AuxOutputs()
    with torch.no_grad():
        out_fast, out_general = fast(x, aux=aux_fast), general(x, aux=aux_general)
    assert torch.equal(out_fast, out_general)
    assert _macs(aux_fast) == _macs(aux_general)
    if name == "all_off":
        assert torch.equal(out_fast, torch.zeros_like(x))


def test_ffn_all_on_runs_no_gather_and_all_off_enters_no_piece():
    fast, _ = _pair(_ffn)
    x = torch.randn(1, 1, D)
    with torch.no_grad(), AtenOps() as ops:
        fast(x, gate_offset=torch.tensor([math.inf]))
    assert not GATHER_OPS & set(ops.names)
    n, hooks = _calls(fast.pieces)
    with torch.no_grad():
        out = fast(x, gate_offset=torch.tensor([-math.inf]))
    assert n[0] == 0 and torch.equal(out, torch.zeros_like(x))
    for h in hooks:
        h.remove()


def _gate_steered_attn(steer, fast_paths):
    attn = _attn(fast_paths)
    steer(attn.q_control, [0])
    steer(attn.kv_control, [1])
    return attn


# (q_on (B, T), kv_on (B, S)) for self-attention (S = T) and cross-attention, B=2, T=3, S=4
ATTN_PATTERNS = {
    "all_on": ([[1, 1, 1], [1, 1, 1]], [[1, 1, 1, 1], [1, 1, 1, 1]]),
    "all_off": ([[0, 0, 0], [0, 0, 0]], [[0, 0, 0, 0], [0, 0, 0, 0]]),
    "queries_off": ([[0, 0, 0], [0, 0, 0]], [[1, 0, 1, 1], [1, 1, 1, 1]]),
    "keys_off": ([[1, 1, 1], [1, 1, 1]], [[0, 0, 0, 0], [0, 0, 0, 0]]),
    "mixed": ([[1, 0, 1], [0, 0, 0]], [[1, 0, 0, 1], [1, 0, 1, 1]]),
    "queries_on_keys_mixed": ([[1, 1, 1], [1, 1, 1]], [[1, 1, 1, 1], [0, 1, 0, 1]]),
}


@pytest.mark.parametrize("kind", ["causal", "cross"])
@pytest.mark.parametrize("name", ATTN_PATTERNS)
def test_attention_fast_path_equals_the_general_path(steer, pattern, kind, name):
    torch.manual_seed(0)
    fast, general = _pair(lambda fast_paths: _gate_steered_attn(steer, fast_paths))
    q_on, kv_on = (torch.tensor(p).bool() for p in ATTN_PATTERNS[name])
    x = torch.randn(2, 3, D)
    mem = torch.randn(2, 4, D)
    pad = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 1]]).bool()
    if kind == "causal":
        x = pattern(pattern(x, 0, q_on), 1, kv_on[:, :3])
        kw = {"is_causal": True}
    else:
        x, mem = pattern(x, 0, q_on), pattern(mem, 1, kv_on)
        kw = {"memory": mem, "attn_mask": padding_to_attn_mask(pad)}
    aux_fast, aux_general = AuxOutputs(), AuxOutputs()
    with torch.no_grad():
        out_fast = fast(x, aux=aux_fast, **kw)
        out_general = general(x, aux=aux_general, **kw)
    torch.testing.assert_close(out_fast, out_general, rtol=0, atol=1e-6)
    assert torch.equal(out_fast[~q_on], torch.zeros(int((~q_on).sum()), D))
    assert _macs(aux_fast) == _macs(aux_general)


def _decoder_layer(fast_paths: bool) -> DecoderLayer:
    return DecoderLayer(D, _attn(fast_paths), _attn(fast_paths), _ffn(fast_paths))


def test_gated_off_decoding_step_enters_no_sublayer_and_keeps_the_cache():
    """Batch 1, every gate off: no projection, FFN piece or attention runs, the residual
    passes unchanged, and the self-attention cache still records the step (a zero key row
    that is off), so later steps see the same keys as the full-sequence pass."""
    fast, _ = _pair(_decoder_layer)
    gated = [getattr(attn, name) for attn in (fast.self_attn, fast.cross_attn)
             for name in ("q_proj", "k_proj", "v_proj", "out_proj", "k_norm", "v_norm",
                          "out_norm")] + list(fast.ffn.pieces)
    mem = torch.randn(1, 5, D)
    self_cache, cross_cache = GatedKVCache(), GatedKVCache(static=True)
    off, on = torch.tensor([-math.inf]), torch.tensor([math.inf])
    n, hooks = _calls(gated)
    with torch.no_grad():
        fast(torch.randn(1, 1, D), mem, None, self_cache=self_cache, cross_cache=cross_cache,
             gate_offset=on)  # step 0 opens every gate: the caches hold projected keys
        assert n[0] == len(gated)  # the hooks see each module that runs
        n[0] = 0
        x = torch.randn(1, 1, D)
        with AtenOps() as ops:
            out = fast(x, mem, None, self_cache=self_cache, cross_cache=cross_cache,
                       gate_offset=off)
        for h in hooks:
            h.remove()
    assert n[0] == 0
    assert "scaled_dot_product_attention" not in " ".join(ops.names)
    assert not GATHER_OPS & set(ops.names)
    assert torch.equal(out, x)
    assert self_cache.length == 2 and self_cache.on.tolist() == [[True, False]]
    assert torch.equal(self_cache.k[0, 1], torch.zeros(D))


def test_all_on_decoding_step_runs_no_gather_or_scatter():
    """Every gate on at batch 1: plain dense steps; the general path gathers and scatters."""
    ran = {}
    for layer, fast_paths in zip(_pair(_decoder_layer), (True, False), strict=True):
        mem = torch.randn(1, 5, D)
        self_cache, cross_cache = GatedKVCache(), GatedKVCache(static=True)
        on = torch.tensor([math.inf])
        with torch.no_grad(), AtenOps() as ops:
            for _ in range(3):
                layer(torch.randn(1, 1, D), mem, None, self_cache=self_cache,
                      cross_cache=cross_cache, gate_offset=on)
        ran[fast_paths] = GATHER_OPS & set(ops.names)
    assert not ran[True] and ran[False]


def _models(**cct) -> tuple[torch.nn.Module, torch.nn.Module]:
    """An untrained CCT seq2seq with and without fast paths (same weights), eval mode."""
    models = []
    for fast_paths in (True, False):
        torch.manual_seed(0)
        cfg = ModelConfig(d_model=D, ffn_dim=F, n_heads=H, encoder_layers=2, decoder_layers=2,
                          cct=CCTConfig(control_hidden=16, fast_paths=fast_paths, **cct))
        models.append(build_seq2seq(cfg, 40).eval())
    models[1].load_state_dict(models[0].state_dict())
    return models[0], models[1]


OFFSETS = {"all_on": math.inf, "all_off": -math.inf, "mixed": 0.0, "mostly_on": 1.0}


@pytest.mark.parametrize("name", OFFSETS)
def test_decoding_is_the_same_with_and_without_fast_paths(name):
    fast, general = _models()
    gen = torch.Generator().manual_seed(2)
    src = torch.randint(4, 40, (3, 7), generator=gen)
    src[1, 5:] = 0
    off = OFFSETS[name]
    control = BudgetControl(0, {"encoder": off, "decoder": off})
    kw = {"max_len_a": 0.0, "max_len_b": 8, "control": control}
    for row in (src[:1], src):  # batch 1 (every step one row) and a padded batch
        assert greedy_search(fast, row, **kw) == greedy_search(general, row, **kw)
        assert beam_search(fast, row, beam=3, **kw) == beam_search(general, row, beam=3, **kw)
    tgt = torch.randint(4, 40, (3, 6), generator=gen)
    with torch.no_grad():
        out_fast, out_general = fast(src, tgt, control), general(src, tgt, control)
    torch.testing.assert_close(out_fast.logits, out_general.logits, rtol=0, atol=1e-5)
    assert realized_macs_by_layer(out_fast.aux) == realized_macs_by_layer(out_general.aux)


def test_mixed_offsets_give_mixed_gates():
    """The ``mixed`` decoding case above really mixes open and closed gates."""
    fast, _ = _models()
    src = torch.randint(4, 40, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        aux = fast(src, src[:, :5], BudgetControl(0, {"encoder": 0.0, "decoder": 0.0})).aux
    values = torch.cat([t.values.flatten() for t in aux.traces["cct.gates"]
                        if t.gate != "control"])
    assert 0.1 < float(values.mean()) < 0.9


@pytest.mark.parametrize("section", ["CCTConfig", "EncoderCCTConfig"])
def test_the_config_switch_reaches_every_gated_sublayer(section):
    from dynaseq.techniques.cct import config
    from dynaseq.techniques.cct.builder import cct_sublayers

    dims = ModelConfig(d_model=D, ffn_dim=F, n_heads=H)
    for fast_paths in (True, False):
        parts = cct_sublayers(getattr(config, section)(fast_paths=fast_paths), dims)
        assert parts.attention().fast_paths is fast_paths
        assert parts.ffn().fast_paths is fast_paths
