"""The CCT's lean decoding step (techniques/cct/lean_step.py) decodes as the general step:
every step's logits, greedy and beam tokens, with every gate on, off, mixed within a row
and across the rows of one batch; gated-off sub-layers are not entered."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dynaseq.models.lean import LeanDecoder, is_lean
from dynaseq.models.search import beam_search, greedy_search
from dynaseq.nn.layouts import Layouts, call_key
from dynaseq.nn.lean_step import lean_part
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.techniques.cct.config import CCTConfig
from dynaseq.techniques.cct.gating import BudgetControl, force_gates
from dynaseq.techniques.cct.lean_step import GatedFeedForward

from helpers import AtenMode

EOS, V = 3, 30
ON, OFF = math.inf, -math.inf


def cct_model(seed: int = 0, **cct):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, ffn_dim=64, n_heads=4, encoder_layers=1, decoder_layers=2,
                      dropout=0.0, cct=CCTConfig(**{"ffn_pieces": 4, "control_hidden": 8,
                                                    **cct}))
    m = build_seq2seq(cfg, vocab_size=V).eval()
    with torch.no_grad():
        for p in m.parameters():  # LayerNorms and biases away from their 1 / 0 init
            p.add_(0.1 * torch.randn_like(p))
        m.decoder.output_proj.weight.mul_(4)  # peaky outputs, eos likely enough that
        m.decoder.output_proj.weight[EOS] *= 1.5  # lengths vary
    return m


def sources(n: int = 6, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (n, 8), generator=g)
    for i in range(n):  # rows of different lengths: padding in the cross-attention
        src[i, 8 - (i % 4):] = 0
        src[i, 7 - (i % 4)] = EOS
    return src


def control(offsets, n: int) -> BudgetControl:
    """Control id 0 with decoder offsets: one for every row, or one per row."""
    off = torch.tensor([float(o) for o in offsets]) if isinstance(offsets, list) else offsets
    return BudgetControl(torch.zeros(n, dtype=torch.long), {"decoder": off, "encoder": 0.0})


# every gate on, every gate off, the control nets' own decisions (mixed within rows), and
# rows of one batch at different offsets
OFFSETS = {"on": ON, "off": OFF, "zero": 0.0, "rows": [ON, 0.0, OFF, 0.5, -0.5, 0.0]}


@pytest.mark.parametrize("name", list(OFFSETS))
@pytest.mark.parametrize("capacity", [1, 32])
@pytest.mark.parametrize("fuse_waste", [0.0, GatedFeedForward.FUSE_WASTE, math.inf])
def test_each_steps_logits_equal_the_general_step(name, capacity, fuse_waste, monkeypatch):
    """fuse_waste: mixed FFN gates always per piece (0), as shipped, always fused and
    masked (inf)."""
    monkeypatch.setattr(GatedFeedForward, "FUSE_WASTE", fuse_waste)
    m = cct_model()
    lean = LeanDecoder.prepare(m)
    src = sources()
    enc = m.encode(src, control(OFFSETS[name], src.size(0)))
    general, fast = m.init_state(), lean.init_state(capacity)
    tokens = torch.full((src.size(0), 1), m.bos_id)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _ in range(10):
            want = m.decode_step(tokens, enc, general)
            got = lean.decode_step(tokens, enc, fast)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            tokens = torch.randint(4, V, (src.size(0), 1), generator=g)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("name", ["on", "zero"])
def test_steps_of_a_few_rows_give_the_general_steps_logits(rows, name):
    """Batch 1 and 3, past the feed-forward's timed trials of its second layers' layouts
    (:meth:`GatedFeedForward._second`)."""
    m = cct_model(seed=4)
    lean = LeanDecoder.prepare(m)
    src = sources()[:rows]
    enc = m.encode(src, control(OFFSETS[name], rows))
    general, fast = m.init_state(), lean.init_state()
    tokens = torch.full((rows, 1), m.bos_id)
    with torch.no_grad():
        for step in range(2 * Layouts.TRIALS + 2):
            torch.testing.assert_close(lean.decode_step(tokens, enc, fast),
                                       m.decode_step(tokens, enc, general),
                                       rtol=1e-4, atol=1e-4)
            tokens = torch.full((rows, 1), 4 + step)
    if name == "on":
        assert all(w.ffn.second_layouts.settled and w.ffn.second_layouts.chosen
                   for w in lean.layers)


@pytest.mark.parametrize("rows", [1, 2, 8, 9, 30])
@pytest.mark.parametrize("layout", [0, 1])
def test_ffn_second_layers_give_each_pieces_fc2_in_either_layout(rows, layout):
    """Against the ``(M, f, d)`` stack (0) or each piece's ``(d, f)`` weight on the left (1,
    a copy made once), pinned by a choice: both give each piece's fc2, over every span."""
    m = cct_model(seed=6)
    ffn = m.decoder.layers[0].ffn
    part = lean_part(ffn, "ffn")
    h = torch.randn(rows, 4, 16, generator=torch.Generator().manual_seed(rows))  # (N, M, f)
    for lo, hi in ((0, 4), (1, 3)):
        part.second_layouts.chosen[(call_key(rows), hi - lo)] = layout
        with torch.no_grad():
            want = torch.stack([F.linear(h[:, i - lo], p.ffn.fc2.weight, p.ffn.fc2.bias)
                                for i, p in enumerate(ffn.pieces) if lo <= i < hi])
            torch.testing.assert_close(part._second(h[:, :hi - lo], lo, hi), want,
                                       rtol=1e-5, atol=1e-5)
    assert (part.w2_rows is not None) == (layout == 1)


def test_ffn_second_layers_keep_the_stack_for_bfloat16():
    m = cct_model(seed=6).to(torch.bfloat16)
    ffn = m.decoder.layers[0].ffn
    part = lean_part(ffn, "ffn")
    h = torch.randn(1, 4, 16).to(torch.bfloat16)
    with torch.no_grad():
        want = torch.stack([F.linear(h[:, i], p.ffn.fc2.weight, p.ffn.fc2.bias)
                            for i, p in enumerate(ffn.pieces)])
        torch.testing.assert_close(part._second(h), want, rtol=2e-2, atol=2e-2)
    assert part.second_layouts.n == 1 and part.w2_rows is None


@pytest.mark.parametrize("out_norms", [True, False])
def test_mixed_ffn_gates_fused_and_masked_equal_each_piece_on_its_rows(out_norms):
    """The FFN part's three ways with mixed gates (fused over every row, fused over the
    rows with an open piece, each piece on its own rows) give the module's output."""
    m = cct_model(seed=6, output_norms=out_norms)
    ffn = m.decoder.layers[0].ffn
    part = lean_part(ffn, "ffn")  # the registered part, as the lean decoder builds it
    x = torch.randn(6, 1, 32, generator=torch.Generator().manual_seed(3))
    on = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1], [1, 1, 1, 1],
                       [0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        n = F.layer_norm(x, (32,), None, None, part.eps)
        want = sum(on[:, i, None, None] * p(x) for i, p in enumerate(ffn.pieces))
        torch.testing.assert_close(part._fused(n, on), want, rtol=1e-5, atol=1e-5)
        rows = on.any(1).nonzero().squeeze(1)
        torch.testing.assert_close(part._fused(n[rows], on[rows]), want[rows],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(part._fused(n), sum(p(x) for p in ffn.pieces),
                                   rtol=1e-5, atol=1e-5)


class _Decides:
    """A control net stand-in whose logits open exactly ``on`` ``(B, M)``."""

    def __init__(self, on: torch.Tensor) -> None:
        self.logits = torch.where(on, 1.0, -1.0)[:, None]  # (B, 1, M)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits


@pytest.mark.parametrize("out_norms", [True, False])
@pytest.mark.parametrize("on", [
    [[1, 1, 0, 0]], [[0, 1, 1, 0]], [[0, 0, 1, 1]], [[0, 1, 1, 1]], [[1, 0, 1, 0]],
    [[0, 0, 1, 0]], [[0, 1, 1, 0], [0, 1, 1, 0], [0, 1, 1, 0]],  # spans open for every row
    [[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]],  # a span, masked, on the rows with any
    [[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 1]]])
def test_a_step_runs_only_the_span_of_pieces_that_any_row_opens(on, out_norms,
                                                                  monkeypatch):
    """The pieces before the first and after the last open one run for no row; the step
    still gives the module's output (each piece times its gate, summed)."""
    m = cct_model(seed=6, output_norms=out_norms)
    ffn = m.decoder.layers[0].ffn
    part = lean_part(ffn, "ffn")
    on = torch.tensor(on, dtype=torch.bool)
    monkeypatch.setattr(part, "control", _Decides(on))
    x = torch.randn(on.size(0), 1, 32, generator=torch.Generator().manual_seed(5))
    ran = []
    monkeypatch.setattr(part, "_first", lambda x, lo, hi, first=part._first: (
        ran.append((lo, hi)) or first(x, lo, hi)))
    with torch.no_grad():
        want = sum(on[:, i, None, None] * p(x) for i, p in enumerate(ffn.pieces))
        torch.testing.assert_close(part.step(x, torch.zeros(on.size(0))), want,
                                   rtol=1e-5, atol=1e-5)
    used = on.any(0).nonzero().squeeze(1).tolist()
    if ran:  # fused: exactly the span from the first open piece to the last
        assert ran == [(used[0], used[-1] + 1)]
    else:  # piece by piece (one piece, or too much of the span closed)
        assert used[-1] - used[0] == 0 or on.size(0) > 1
    ran.clear()
    monkeypatch.setattr(GatedFeedForward, "SPANS", False)  # every piece, masked: the same
    with torch.no_grad():
        torch.testing.assert_close(part.step(x, torch.zeros(on.size(0))), want,
                                   rtol=1e-5, atol=1e-5)
    assert ran in ([], [(0, 4)])


@pytest.mark.parametrize("cct", [{}, {"output_norms": False}])
@pytest.mark.parametrize("share_from", [1, 100])
def test_greedy_and_beam_give_the_general_steps_tokens(cct, share_from, monkeypatch):
    """Also with the beams of a sentence sharing its packed cross keys (every offset
    pattern: all queries open, none, mixed within and across rows)."""
    import dynaseq.models.lean as lean_module

    monkeypatch.setattr(lean_module, "SHARE_MIN", share_from)
    m = cct_model(seed=2, **cct)
    lean = LeanDecoder.prepare(m)
    src = sources(seed=3)
    for offsets in OFFSETS.values():
        c = control(offsets, src.size(0))
        want = greedy_search(m, src, max_len_b=30, control=c)
        assert greedy_search(lean, src, max_len_b=30, control=c) == want
        assert beam_search(lean, src, beam=3, max_len_b=30, control=c) == \
            beam_search(m, src, beam=3, max_len_b=30, control=c)


def test_mixed_budgets_in_a_batch_equal_each_budget_alone():
    """Each row alone (batch 1: gates read on the host), with its offset as a per-row tensor
    and as one float, decodes as in the batch."""
    m = cct_model(seed=4)
    lean = LeanDecoder.prepare(m)
    src = sources(seed=5)
    offsets = OFFSETS["rows"]
    batched = greedy_search(lean, src, max_len_b=30, control=control(offsets, src.size(0)))
    for i, off in enumerate(offsets):
        row = src[i: i + 1, : int(src[i].ne(0).sum())]
        assert greedy_search(lean, row, max_len_b=30, control=control([off], 1)) == [batched[i]]
        assert greedy_search(lean, row, max_len_b=30, control=control(off, 1)) == [batched[i]]
        assert greedy_search(m, row, max_len_b=30, control=control(off, 1)) == [batched[i]]


@pytest.mark.parametrize("offset", [0.1, torch.tensor([0.1]),
                                    torch.tensor([0.1], dtype=torch.float64), None, -0.3])
def test_one_rows_gates_on_the_host_compare_as_the_tensor_compare(offset):
    """The batch-1 host compare rounds a float offset to float32 as the tensor compare does:
    logits at, just below and just above float32(-0.1) (which is below -0.1 in double)."""
    from dynaseq.techniques.cct.gating import Gate, NoiseSchedule
    from dynaseq.techniques.cct.lean_step import _one_row

    t = torch.tensor(-0.1, dtype=torch.float32)
    near = [t, torch.nextafter(t, torch.tensor(-1.0)), torch.nextafter(t, torch.tensor(1.0))]
    logits = torch.stack([*near, torch.tensor(0.0), torch.tensor(0.3),
                          torch.tensor(-0.3)]).view(1, 1, -1)
    gate = Gate(NoiseSchedule()).eval()
    want = [int(v) for v in gate.hard(logits[:, 0], offset)[0].tolist()]
    assert _one_row(logits, offset) == want
    assert _one_row(logits.expand(2, 1, -1), offset) is None  # more rows: the tensor path
    assert _one_row(logits.bfloat16(), offset) is None
    for big in (1e39, -1e39):  # beyond float32's range: infinite, as the tensor compare casts
        assert _one_row(logits, big) == [int(v) for v in gate.hard(logits[:, 0], big)[0]]


def test_pinned_gates_are_honoured():
    m = cct_model(seed=6)
    src = sources(seed=7)
    c = control(0.0, src.size(0))
    for value in (0.0, 1.0):
        with force_gates(m, value):
            lean = LeanDecoder.prepare(m)
            assert greedy_search(lean, src, max_len_b=20, control=c) == \
                greedy_search(m, src, max_len_b=20, control=c)


class _Matmuls(AtenMode):
    """Counts the matrix products (``mm``/``addmm``/``bmm``/``baddbmm``) that run."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def seen(self, func, args, kwargs) -> None:
        self.n += func.__name__.split(".")[0] in ("mm", "addmm", "bmm", "baddbmm")


def _step_matmuls(m, offset: float) -> int:
    """Matrix products of one batch-1 step after the first (the cross keys are packed)."""
    lean = LeanDecoder.prepare(m)
    src = sources(n=1)[:, :5]
    enc = m.encode(src, control([offset], 1))
    state = lean.init_state()
    tokens = torch.full((1, 1), m.bos_id)
    lean.decode_step(tokens, enc, state)
    with _Matmuls() as ops:
        lean.decode_step(tokens, enc, state)
    return ops.n


def test_a_gated_off_sub_layer_is_not_entered_and_an_open_one_runs_fused():
    m = cct_model(seed=8)
    layers = len(m.decoder.layers)
    controls = 3 * 2  # per layer: three control nets (self-attention's q and kv fused), 2 each
    fused = 6  # per layer: q/k/v, self out, cross q, cross out, fc1, fc2 (the 4 pieces batched)
    # gates closed by the control nets: they run, no projection, attention or piece does
    assert _step_matmuls(m, -1e6) == layers * controls + 1  # + the output layer
    assert _step_matmuls(m, 1e6) == layers * (controls + fused) + 1
    # one offset of ±inf for every row fixes the decisions: no control net runs either
    assert _step_matmuls(m, OFF) == 1
    assert _step_matmuls(m, ON) == layers * fused + 1


def test_int8_and_norm_free_attention_fall_back_or_run():
    from dynaseq.compress.int8 import quantize_int8

    assert is_lean(cct_model())
    assert not is_lean(quantize_int8(cct_model()))
