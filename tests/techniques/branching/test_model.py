"""Transformer-DMB and the top-2 MoE baseline as whole models: config -> build -> training with
the routing losses -> merged inference; incremental decoding, gradients for DDP, MACs."""

from __future__ import annotations

import copy
import gc
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import dynaseq
from dynaseq.core import checkpoint as ckpt
from dynaseq.core.config import from_dict
from dynaseq.core.errors import ConfigError
from dynaseq.metrics import pair_macs, ptr
from dynaseq.nn import MultiHeadAttention
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.techniques.branching import (
    BranchedAttention,
    BranchedFeedForward,
    MoEAttention,
    MoEFeedForward,
    Router,
    merge_shared_,
    seq2seq_routing_loss,
)
from dynaseq.techniques.branching.config import DMBConfig, MoEConfig
from dynaseq.techniques.cct.config import CCTConfig
from dynaseq.train.loop import train

from helpers import micro_config, run_cli, train_one_and_two_processes

V = 60


def _model(dropout: float = 0.0, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, ffn_dim=48, n_heads=4, encoder_layers=2, decoder_layers=2,
                      dropout=dropout, **kw)
    return build_seq2seq(cfg, V)


def _randomize_shared(model: torch.nn.Module) -> None:
    """θ_S starts at zero; give it values so that merging has something to fold."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("shared_weight", "shared_bias")):
                p.normal_(std=0.1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(4, V, (3, 9), generator=gen)
    src[1, 6:] = 0  # padding
    tgt = torch.randint(4, V, (3, 7), generator=gen)
    tgt[2, 5:] = 0
    return src, tgt


KINDS = {"dmb": {"dmb": DMBConfig()}, "dmb_ffn_only": {"dmb": DMBConfig(attention=False)},
         "moe": {"moe": MoEConfig()}}


# ------------------------------------------------------------------------------- structure


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_sublayer_is_branched_and_named(kind):
    m = _model(**KINDS[kind])
    ffn_type, attn_type = ((MoEFeedForward, MoEAttention) if kind == "moe"
                           else (BranchedFeedForward, BranchedAttention))
    if kind == "dmb_ffn_only":
        attn_type = MultiHeadAttention
    for stack in (m.encoder, m.decoder):
        for layer in stack.layers:
            assert isinstance(layer.ffn, ffn_type)
            assert isinstance(layer.self_attn, attn_type)
            if stack is m.decoder:
                assert isinstance(layer.cross_attn, attn_type)
    if kind != "dmb_ffn_only":
        assert m.decoder.layers[1].cross_attn.name == "decoder.layers.1.cross_attn"
    assert m.encoder.layers[0].ffn.name == "encoder.layers.0.ffn"
    assert m.n_controls == 0


def test_shared_private_option_and_same_parameters_for_moe_and_merged_dmb():
    def count(model):
        return sum(p.numel() for p in model.parameters())

    dmb, moe = _model(dmb=DMBConfig()), _model(moe=MoEConfig())
    plain = _model(dmb=DMBConfig(shared_private=False))
    assert not any("shared" in name for name, _ in plain.named_parameters())
    assert count(dmb) > count(plain)
    merge_shared_(dmb)
    assert count(dmb) == count(plain)
    # the same experts as branches; the gates differ: DMB W_g + b_g, MoE W + W_noise
    n_gates = 2 * 2 + 3 * 2  # encoder: attn + ffn, decoder: self + cross + ffn; 2 layers each
    d, n = 32, 4
    assert count(moe) - count(dmb) == n_gates * (2 * n * d - (n * d + n))


# ------------------------------------------------------------------- outputs and inference


@pytest.mark.parametrize("kind", list(KINDS))
def test_incremental_decoding_equals_the_full_pass(kind):
    m = _model(**KINDS[kind]).eval()
    _randomize_shared(m)
    src, tgt = _batch()
    tgt = tgt.clamp_min(4)  # no padding inside the decoded prefix
    with torch.no_grad():
        full = m(src, tgt).logits
        enc, state = m.encode(src), m.init_state()
        steps = torch.stack([m.decode_step(tgt[:, i:i + 1], enc, state)
                             for i in range(tgt.size(1))], 1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["dmb", "dmb_ffn_only"])
def test_merged_model_gives_identical_logits(kind):
    m = _model(**KINDS[kind]).eval()
    _randomize_shared(m)
    merged = copy.deepcopy(m)
    assert merge_shared_(merged) > 0
    assert not any("shared" in k for k in merged.state_dict())
    src, tgt = _batch()
    with torch.no_grad():
        assert torch.equal(m(src, tgt).logits, merged(src, tgt).logits)
        enc_a, enc_b = m.encode(src), merged.encode(src)
        sa, sb = m.init_state(), merged.init_state()
        for i in range(3):
            step = tgt[:, i:i + 1].clamp_min(4)
            assert torch.equal(m.decode_step(step, enc_a, sa), merged.decode_step(step, enc_b, sb))


# ------------------------------------------------------------- gradients (DDP needs them all)


def _force_branch_zero(model: torch.nn.Module) -> None:
    """Every DMB gate sends every token to branch 0: branches 1..N-1 get no rows."""
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Router):
                mod.proj.weight.mul_(0.01)
                mod.proj.bias.copy_(torch.tensor([8.0, 0.0, 0.0, 0.0]))


def _loss(model, src, tgt, **flags):
    out = model(src, tgt)
    ce = F.cross_entropy(out.logits.flatten(0, 1), tgt.flatten(), ignore_index=0)
    return ce + 0.1 * seq2seq_routing_loss(out.aux, src, tgt, 0, **flags)


@pytest.mark.parametrize("flags", [{}, {"diversity": False, "entropy": False}])
def test_every_parameter_gets_a_gradient_even_with_empty_branches(flags):
    m = _model(dmb=DMBConfig()).train()
    _force_branch_zero(m)
    src, tgt = _batch()
    _loss(m, src, tgt, **flags).backward()
    missing = [name for name, p in m.named_parameters() if p.grad is None]
    assert missing == []
    lin = m.encoder.layers[0].ffn.fc1
    assert lin.weight.grad[1:].abs().sum() == 0  # empty branches: zero, not None
    assert lin.weight.grad[0].abs().sum() > 0 and lin.shared_weight.grad.abs().sum() > 0
    router_grad = m.encoder.layers[0].ffn.router.proj.weight.grad.abs().sum()
    # the gate learns through the auxiliary losses only (eq. 17-20)
    assert (router_grad > 0) == (flags == {})


@pytest.mark.parametrize("kind", ["dmb", "moe"])
def test_ddp_steps_with_empty_branches(kind, tmp_path):
    """A one-process DDP group already refuses a second step when a parameter got no gradient
    in the first: branches without tokens and the gates must all take part."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    m = _model(**KINDS[kind]).train()
    if kind == "dmb":
        _force_branch_zero(m)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    ddp = None
    try:
        ddp = DistributedDataParallel(m)
        src, tgt = _batch()
        for _ in range(3):
            out = ddp(src, tgt)
            ce = F.cross_entropy(out.logits.flatten(0, 1), tgt.flatten(), ignore_index=0)
            (ce + 0.1 * seq2seq_routing_loss(out.aux, src, tgt, 0)).backward()
    finally:
        # the DDP reducer holds the group: freed after the group is destroyed, its gloo
        # threads were seen to hang joining at exit, so free it first
        del ddp
        gc.collect()
        dist.destroy_process_group()


# ------------------------------------------------------------------------------- training


@pytest.fixture(scope="module", params=["dmb", "moe"])
def branch_run(request, tmp_path_factory, synthetic_paths):
    run = tmp_path_factory.mktemp(request.param) / "run"
    cfg = micro_config(run, synthetic_paths, max_steps=6, log_every=1, valid_every=6,
                       save_every=6, valid_bleu_lines=4)
    if request.param == "dmb":
        cfg.model.dmb = DMBConfig(n_branches=3)
    else:
        cfg.model.moe = MoEConfig(n_experts=3, k=2)
    result = train(cfg, progress=False)
    return request.param, run, cfg, result


def _events(run, kind):
    recs = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    return [r for r in recs if r["event"] == kind]


def test_training_logs_the_routing_loss(branch_run):
    kind, run, _, result = branch_run
    recs = _events(run, "train")
    assert result.state.step == 6 and len(recs) == 6
    assert all(math.isfinite(r["loss"]) and r["routing_loss"] > 0 for r in recs)
    assert "budget_loss" not in recs[0]
    if kind == "dmb":  # eq. 31 without α: per gate diversity (>= 0) + entropy (<= log N)
        assert all(r["routing_loss"] < math.log(3) + 3 for r in recs)


def test_checkpoints_keep_the_shared_part_and_training_resumes(branch_run):
    kind, run, cfg, _ = branch_run
    saved = load_file(str(ckpt.step_dir(run, 6) / ckpt.WEIGHTS))
    has_shared = any(k.endswith("shared_weight") for k in saved)
    assert has_shared == (kind == "dmb")
    if kind == "dmb":
        assert any(v.abs().sum() > 0 for k, v in saved.items() if k.endswith("shared_weight"))
    more = copy.deepcopy(cfg)
    more.train.max_steps = 8
    assert train(more, progress=False).state.step == 8
    assert _events(run, "resume")[-1]["step"] == 6


def test_translator_merges_and_matches_the_unmerged_checkpoint(branch_run, synthetic_paths):
    kind, run, cfg, _ = branch_run
    t = dynaseq.load(run, checkpoint="latest")
    assert not any("shared" in k for k in t.model.state_dict())
    unmerged = build_seq2seq(cfg.model, t.tokenizer.vocab_size, t.tokenizer.pad_id,
                             t.tokenizer.bos_id, t.tokenizer.eos_id).eval()
    ckpt.load_weights(unmerged, t.checkpoint)
    src, tgt = _batch()
    with torch.no_grad():
        assert torch.equal(unmerged(src, tgt).logits, t.model(src, tgt).logits)
    lines = synthetic_paths["test.src"].read_text().splitlines()[:4]
    out = t.translate(lines, beam=2)
    assert len(out) == 4 and out == t.translate(lines, beam=2)
    assert len(t.translate(lines[:2], beam=1)) == 2


def test_evaluate_json_reports_paper_macs_and_ptr(branch_run, synthetic_paths):
    kind, run, _, _ = branch_run
    if kind != "dmb":
        pytest.skip("one CLI round trip is enough")
    proc = run_cli("evaluate", str(run), "--src", str(synthetic_paths["valid.src"]), "--ref",
                   str(synthetic_paths["valid.tgt"]), "--json", "--beam", "1")
    assert proc.returncode == 0, proc.stderr.decode()
    res = json.loads(proc.stdout)
    model = dynaseq.load(run).model
    assert res["macs_pair"] == pair_macs(model, 30, 30)
    assert res["ptr"] == pytest.approx(res["bleu"] / math.sqrt(res["macs_pair"]) * 1e4)
    # 1+1 layers: 2 encoder units (attention, FFN), 4 decoder units (cross-attention: 2 streams)
    usage = res["branch_usage"]
    assert len(usage) == 2 + 4 and all(len(s) == 3 for s in usage.values())
    assert all(sum(s) == pytest.approx(1.0) for s in usage.values())
    assert res["collapsed"] == [n for n, s in usage.items() if max(s) > 0.9]
    assert ("routing collapsed" in proc.stderr.decode()) == bool(res["collapsed"])


# ------------------------------------------------------------------------------ MACs, PTR


def test_tiny_models_reproduce_the_papers_table_1():
    """Tan et al. 2021, Table I (WMT14 En-De, tiny: d=128, ffn 512, 6+6 layers, 37k shared
    vocabulary, tied embeddings): #Params 7.5M / 15.8M / 15.8M and #Mult-Adds 229.0M /
    229.6M / 313.2M for Transformer / Transformer-DMB / Transformer-MoE; PTR 13.9 at 21.0 BLEU."""
    expected = {"dense": (7.5e6, 229.0e6), "dmb": (15.8e6, 229.6e6), "moe": (15.8e6, 313.2e6)}
    for kind, (params, macs) in expected.items():
        raw = {"size": "tiny", "encoder_layers": 6, "decoder_layers": 6}
        if kind != "dense":
            raw[kind] = {}
        model = build_seq2seq(from_dict(ModelConfig, raw), 37_000)
        merge_shared_(model)
        n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        assert n == pytest.approx(params, rel=0.01), kind
        assert pair_macs(model) == pytest.approx(macs, rel=0.01), kind
    assert round(ptr(21.0, 229.0e6), 1) == 13.9


def test_profile_cli_for_a_dmb_config():
    proc = run_cli("profile", "configs/multi30k_dmb_tiny.yaml", "--json", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr.decode()
    res = json.loads(proc.stdout)
    assert res["macs_pair"]["src_tokens"] == 30 and res["macs_pair"]["total"] > 0
    assert res["macs_per_token_flop_counter"] == res["macs_per_token"]
    proc = run_cli("profile", "configs/multi30k_dmb_tiny.yaml", "--repeats", "1")
    assert proc.returncode == 0 and b"MACs 30->30 pair" in proc.stdout


# ------------------------------------------------------------------------------ refusals


def test_bad_combinations_are_refused_with_a_clear_message(tmp_path):
    with pytest.raises(ConfigError, match="dmb and moe cannot be combined"):
        ModelConfig(dmb=DMBConfig(), moe=MoEConfig())
    with pytest.raises(ConfigError, match="cct and dmb cannot be combined"):
        ModelConfig(cct=CCTConfig(), dmb=DMBConfig())
    with pytest.raises(ConfigError, match="n_experts must exceed k"):
        MoEConfig(n_experts=2, k=2)
    proc = run_cli("train", "configs/multi30k_dmb_tiny.yaml", "model.moe={}",
                   f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    err = proc.stderr.decode()
    assert err.startswith("dynaseq: error: model.dmb and moe cannot be combined")
    assert err.count("\n") == 1


def test_two_process_ddp_trains_a_dmb_model(tmp_path, synthetic_paths):
    """torchrun, 2 CPU processes (gloo): every rank routes its own rows, so some branches get
    no token on a rank in a step; DDP (without find_unused_parameters) must still reduce every
    gradient. The CE part of the first update equals the one-process run's; the routing loss
    is computed per rank (its batch statistics, eq. 17-19, over that rank's rows), so it is
    close to, not equal to, the one-process value."""
    kw = {"max_steps": 6, "log_every": 1, "valid_every": 1000, "save_every": 1000}
    single = micro_config(tmp_path / "single", synthetic_paths, **kw)
    double = micro_config(tmp_path / "ddp", synthetic_paths, **kw)
    for cfg in (single, double):
        cfg.model.dropout = 0.0
        cfg.model.dmb = DMBConfig(n_branches=16)  # many branches: some get no token
    train_one_and_two_processes(single, double)
    one, two = _events(tmp_path / "single", "train"), _events(tmp_path / "ddp", "train")
    assert len(one) == len(two) == 6
    assert two[0]["nll"] == pytest.approx(one[0]["nll"], rel=1e-4)
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=0.01)
        assert b["routing_loss"] == pytest.approx(a["routing_loss"], rel=0.05)
    assert (ckpt.step_dir(tmp_path / "ddp", 6) / ckpt.WEIGHTS).is_file()
    assert _empty_branches_on_rank0(double, tmp_path / "single") > 0


def _empty_branches_on_rank0(cfg, run) -> int:
    """(gate, branch) pairs without a token in rank 0's rows of the first update (initial
    weights): the situation the DDP test is about."""
    from dynaseq.data import Tokenizer, collate, make_corpus, read_parallel, token_batches
    from dynaseq.techniques.branching import route_traces

    tok = Tokenizer.load(run / "spm.model")
    src, tgt = read_parallel(cfg.data.train_src, cfg.data.train_tgt)
    corpus, _ = make_corpus(tok.encode(src), tok.encode(tgt), cfg.data.max_len)
    first = token_batches(corpus.src_lengths(), corpus.tgt_lengths(), cfg.data.max_tokens,
                          cfg.train.seed, 0)[0]
    b = collate(corpus, first, tok.pad_id, tok.bos_id, tok.eos_id).shard(0, 2)
    torch.manual_seed(cfg.train.seed)
    model = build_seq2seq(cfg.model, tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id)
    out = model(b.src, b.tgt_in)
    n = cfg.model.dmb.n_branches
    return sum(int((torch.bincount(tr.branch.flatten(), minlength=n) == 0).sum())
               for tr in route_traces(out.aux))
