"""The DMB sub-layers' lean decoding-step parts (``techniques/branching/lean_step.py``): each
step's logits, greedy and beam tokens equal the general step's, with shared parts unmerged or
merged, float or int8, with and without fast paths, with rows of one step in different
branches; a batch-1 step runs one plain matmul per projection and router; MoE keeps the
general step; the encoder runs through lean parts too, with the module's outputs."""

from __future__ import annotations

import pytest
import torch

from dynaseq.compress.int8 import quantize_int8
from dynaseq.models.lean import LeanDecoder
from dynaseq.models.search import greedy_search
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.techniques.branching import merge_shared_
from dynaseq.techniques.branching.config import DMBConfig, MoEConfig
from dynaseq.techniques.branching.lean_step import ROW_RUNS, first_max
from dynaseq.techniques.branching.routing import Router

from helpers import assert_same_searches, count_ops, padded_sources, step_ops

EOS = 3
LAYERS = 2


def model(seed: int = 0, merged: bool = True, int8: bool = False, **dmb):
    """A DMB model with 4 branches whose shared parts hold values (so merging matters), eos
    likely enough that rows finish apart, and routers that spread tokens over branches;
    ``int8``: quantized as ``dynaseq quantize`` does."""
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, ffn_dim=64, n_heads=4, encoder_layers=1,
                      decoder_layers=LAYERS, dropout=0.0, dmb=DMBConfig(n_branches=4, **dmb))
    m = build_seq2seq(cfg, vocab_size=30).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "shared" in name:
                p.normal_(0, 0.05)
            if "router" in name and name.endswith("weight"):
                p.mul_(8)
        m.decoder.output_proj.weight.mul_(4)
        m.decoder.output_proj.weight[EOS] *= 1.5
    if merged:
        merge_shared_(m)
    return quantize_int8(m) if int8 else m


def sources(n: int = 7, seed: int = 1) -> torch.Tensor:
    return padded_sources(n, seed, eos=EOS)


CASES = [dict(merged=True), dict(merged=False), dict(merged=True, fast_paths=False),
         dict(merged=True, attention=False), dict(int8=True),
         dict(int8=True, fast_paths=False)]
IDS = ["merged", "unmerged", "no-fast-paths", "ffn-only", "int8", "int8-no-fast-paths"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_greedy_and_beam_give_the_general_steps_tokens(case):
    m = model(**case)
    lean = LeanDecoder.prepare(m)
    assert lean is not None
    src = sources()
    greedy = assert_same_searches(m, lean, src, beams=(1, 3), max_len_b=30)
    row = src[2:3, : int(src[2].ne(0).sum())]  # batch 1: every step runs one branch
    assert greedy_search(lean, row, max_len_b=30) == [greedy[2]]


# runs of rows; blocks by branch (float) or groups (int8, no fast paths); groups (> 64 rows)
@pytest.mark.parametrize("rows", [5, ROW_RUNS + 3, 70])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_steps_logits_equal_the_general_step_with_rows_in_different_branches(case, rows):
    m = model(seed=5, **case)
    lean = LeanDecoder.prepare(m)
    src = sources(n=rows, seed=6)
    enc = m.encode(src)
    general, fast = m.init_state(), lean.init_state(2)  # the cache doubles on the way
    tokens = torch.full((rows, 1), m.bos_id)
    g = torch.Generator().manual_seed(7)
    router = m.decoder.layers[0].ffn.router
    mixed = 0
    with torch.no_grad():
        for _ in range(10):
            want = m.decode_step(tokens, enc, general)
            got = lean.decode_step(tokens, enc, fast)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            x = m.decoder.embed(tokens) + m.decoder.positions(1, general.step - 1)
            mixed += len(set(router(x).branch.flatten().tolist())) > 1
            tokens = torch.randint(4, 30, (rows, 1), generator=g)
    assert mixed > 0, "the rows of some step chose different branches"
    with torch.no_grad(), count_ops() as ops:
        lean.decode_step(tokens, enc, fast)
    in_blocks = (rows == ROW_RUNS + 3 and not case.get("int8")
                 and case.get("fast_paths", True))
    assert ("baddbmm.default" in ops.names) == in_blocks



@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_lean_encoder_of_a_dmb_model_gives_the_modules_outputs(case):
    m = model(seed=2, **case)
    lean = LeanDecoder.prepare(m)
    assert lean.encoder_layers is not None
    src = sources(n=3, seed=9)  # rows padded by 0 to 2 positions: small calls, in blocks
    with torch.no_grad():
        want = m.encode(src)
        with count_ops() as ops:
            got = lean.encode(src)
    valid = ~want.pad_mask
    assert torch.equal(got.pad_mask, want.pad_mask)
    torch.testing.assert_close(got.out[valid], want.out[valid], rtol=1e-5, atol=1e-5)
    float_blocks = not case.get("int8") and case.get("fast_paths", True)
    assert ("baddbmm.default" in ops.names) == float_blocks  # blocks: float projections only


def test_the_lean_encoders_first_token_output_is_its_whole_outputs_first_token():
    """``encode_first`` (what a first-token head reads) of DMB's lean encoder part."""
    from dynaseq.models.lean_encoder import lean_layers, run_layers, valid_tokens

    m = model(seed=3)
    layers = lean_layers(m.encoder.layers)
    src = sources(n=3, seed=4)
    with torch.no_grad():
        x, pad_mask = m.encoder.embed_inputs(src, None)
        valid = valid_tokens(pad_mask)
        whole = run_layers(layers, range(len(layers)), x, valid, None)
        first = run_layers(layers, range(len(layers)), x, valid, None, first_only=True)
    torch.testing.assert_close(first, whole[:, :1], rtol=1e-5, atol=1e-5)


def test_a_batch_1_step_runs_one_plain_matmul_per_projection_and_router():
    counts = step_ops(LeanDecoder.prepare(model()), sources(n=1), steps=4)
    for names in counts[1:]:  # (the first also projects the memory, its tokens grouped)
        assert not {"cat.default", "sort.default", "_grouped_mm.default",
                    "index_select.default"} & set(names), names
    linears = [sum(n in ("addmm.default", "mm.default") for n in names) for names in counts]
    routers = [names.count("addmv.default") for names in counts]
    # per layer: fused qkv, self out, cross q, cross out, fc1, fc2, and three routers as
    # one matrix-vector product each; then the output layer; the first step also routes the
    # encoder output in each layer and projects its keys and values, one batched product
    # over its tokens laid out in blocks by branch
    assert linears == [LAYERS * 7 + 1] + [LAYERS * 6 + 1] * 3
    assert routers == [LAYERS * 3] * 4
    assert counts[0].count("baddbmm.default") == LAYERS
    assert "_grouped_mm.default" not in counts[0]


@pytest.mark.parametrize("logits", [
    [0.5, 2.0, -1.0, 2.0], [3.0, 3.0, 3.0], [-1.0], [float("-inf"), float("-inf"), -5.0],
    [1.0, float("nan"), 9.0, float("nan")], [float("inf"), 1.0, float("inf")],
    [0.0, -0.0, 0.0], [float("nan")]])
def test_first_max_is_torch_argmax_on_one_row(logits):
    """Ties go to the first; a NaN wins over any number, the first NaN over later ones."""
    assert first_max(logits) == int(torch.tensor(logits).argmax())


def test_tied_router_logits_pick_the_lower_branch_as_the_module_does():
    """Every decoder router with branches 1 and 2 tied (equal rows): the module's argmax
    takes branch 1, and so must the lean step's host-side pick (branch 2 holds other
    weights, so taking it changes the tokens)."""
    m = model(seed=5)
    with torch.no_grad():
        for router in m.decoder.modules():
            if isinstance(router, Router):
                router.proj.weight[2] = router.proj.weight[1]
                router.proj.bias[2] = router.proj.bias[1]
    lean = LeanDecoder.prepare(m)
    for rows in (1, 5):
        src = sources(n=rows, seed=6)
        enc = m.encode(src)
        general, fast = m.init_state(), lean.init_state(8)
        tokens = torch.full((rows, 1), m.bos_id)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for _ in range(10):
                want = m.decode_step(tokens, enc, general)
                torch.testing.assert_close(lean.decode_step(tokens, enc, fast), want,
                                           rtol=1e-5, atol=1e-5)
                tokens = torch.randint(4, 30, (rows, 1), generator=g)


def test_the_fused_copy_takes_the_models_dtype_and_device():
    """The fused cross-attention keys/values projection is made where the model's weights
    are: a float64 model decodes through it (before: float32 weights, a dtype error; on a
    GPU, CPU weights)."""
    m = model().double()
    lean = LeanDecoder.prepare(m)
    kv = lean.layers[0].cross_attn.kv
    assert kv.weight.dtype == torch.float64
    assert kv.weight.device == m.decoder.output_proj.weight.device
    src = sources()
    assert greedy_search(lean, src, max_len_b=20) == greedy_search(m, src, max_len_b=20)


def test_a_changed_projection_makes_the_fused_copy_stale():
    m = model()
    lean = LeanDecoder.prepare(m)
    assert lean.is_current()
    with torch.no_grad():
        m.decoder.layers[1].cross_attn.k_proj.weight.add_(0.1)
    assert not lean.is_current()
    src = sources()
    assert greedy_search(LeanDecoder.prepare(m), src) == greedy_search(m, src)


def test_moe_keeps_the_general_step():
    torch.manual_seed(0)
    moe = build_seq2seq(ModelConfig(d_model=32, ffn_dim=64, n_heads=4, encoder_layers=1,
                                    decoder_layers=1, moe=MoEConfig(n_experts=4, k=2)), 30)
    assert LeanDecoder.prepare(moe.eval()) is None
