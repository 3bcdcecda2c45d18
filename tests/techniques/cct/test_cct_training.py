"""A CCT model end to end: config -> training with the budget loss -> budgeted inference."""

from __future__ import annotations

import json

import pytest
import torch

import dynaseq
from dynaseq.core.errors import DynaseqError
from dynaseq.tasks.translation.predictor import control_for_budget
from dynaseq.techniques.cct.config import CCTConfig

from helpers import (
    assert_ddp_matches_one_process,
    micro_config,
    run_cli,
    train_one_and_two_processes,
)


def test_training_logs_a_budget_loss(cct_run):
    run, result = cct_run
    recs = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if r["event"] == "train"]
    assert len(train_recs) == 8 and all(r["budget_loss"] >= 0 for r in train_recs)
    assert result.state.step == 8


def test_budgeted_translation_and_refusals(cct_run, synthetic_paths):
    run, _ = cct_run
    t = dynaseq.load(run)
    assert t.model.n_controls == 3
    lines = synthetic_paths["test.src"].read_text().splitlines()[:3]
    for budget in (None, 0.5, (1.0, 0.33)):
        assert len(t.translate(lines, beam=2, budget=budget)) == 3
    with pytest.raises(DynaseqError, match=r"budget \(0.2, 0.2\) was not trained; trained"):
        t.translate(lines, budget=0.2)
    proc = run_cli("translate", str(run), "--budget", "0.7", stdin=b"x\n")
    assert proc.returncode == 2 and b"was not trained" in proc.stderr
    assert b"(1, 0.33)" in proc.stderr
    proc = run_cli("translate", str(run), "--budget", "1,0.33", stdin=b"x\n")
    assert proc.returncode == 0, proc.stderr.decode()


def test_control_for_budget_rules():
    from dynaseq.tasks.translation.config import ModelConfig
    from dynaseq.techniques.branching.config import DMBConfig, MoEConfig

    cfg = ModelConfig(cct=CCTConfig(budgets=[(0.5, 0.5), (1.0, 1.0), (1.0, 1.0)]))
    assert control_for_budget(cfg) == 1  # the largest, first of equals
    assert control_for_budget(cfg, 0.5) == 0
    with pytest.raises(DynaseqError, match="this is a dense model, which has no compute"):
        control_for_budget(ModelConfig(), 0.5)
    with pytest.raises(DynaseqError, match="this is a DMB model, which has no compute"):
        control_for_budget(ModelConfig(dmb=DMBConfig()), 0.5)
    with pytest.raises(DynaseqError, match="this is a MoE model, which has no compute"):
        control_for_budget(ModelConfig(moe=MoEConfig()), 0.5)
    assert control_for_budget(ModelConfig()) is None


def test_control_symbol_changes_the_computation(cct_run):
    run, _ = cct_run
    model = dynaseq.load(run).model
    src = torch.tensor([[5, 6, 7, 3]])
    tgt = torch.tensor([[2, 9, 10]])
    with torch.no_grad():
        a = model(src, tgt, torch.tensor([0])).logits
        b = model(src, tgt, torch.tensor([1])).logits
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match="needs a control symbol"):
        model(src, tgt)


def test_evaluate_reports_realized_fraction(cct_run, synthetic_paths):
    run, _ = cct_run
    proc = run_cli("evaluate", str(run), "--src", str(synthetic_paths["valid.src"]), "--ref",
                   str(synthetic_paths["valid.tgt"]), "--json", "--beam", "1",
                   "--budget", "1,0.33")
    assert proc.returncode == 0, proc.stderr.decode()
    res = json.loads(proc.stdout)
    assert res["budget"] == [1.0, 0.33]
    frac = res["realized_fraction"]
    assert set(frac) == {"encoder", "decoder", "total"}
    assert all(0.0 <= v <= 1.0 for v in frac.values())


def test_realized_fraction_is_one_with_every_gate_on_and_small_with_all_off(cct_run,
                                                                            synthetic_paths):
    from dynaseq.techniques.cct.layers import BudgetControl, force_gates, realized_fraction

    run, _ = cct_run
    model = dynaseq.load(run).model
    pairs = [(torch.tensor([[5, 6, 7, 3]]), torch.tensor([[2, 9, 10]]))]
    with force_gates(model, 1.0):
        on = realized_fraction(model, pairs, control=0)
    assert on["fraction"] == {"encoder": 1.0, "decoder": 1.0, "total": 1.0}
    on = realized_fraction(model, pairs, BudgetControl(0, {"encoder": float("inf"),
                                                           "decoder": float("inf")}))
    assert on["fraction"] == {"encoder": 1.0, "decoder": 1.0, "total": 1.0}
    # every gate closed by the call (the full-network pass opens them per call too, so a
    # module-wide force_gates(model, 0.0) would pin both passes)
    off = realized_fraction(model, pairs, BudgetControl(0, {"encoder": -float("inf"),
                                                            "decoder": -float("inf")}))
    # only the control networks still run
    assert 0.0 < off["fraction"]["total"] < 0.2


def test_control_sampling_follows_the_list_and_the_curriculum():
    from dynaseq.techniques.cct.training import sample_controls as _sample_controls

    ids = torch.tensor(CCTConfig(budgets=[(1.0, 1.0), (1.0, 1.0), (0.5, 0.5),
                                          (0.2, 0.2)]).sampling_ids)
    assert ids.tolist() == [0, 0, 1, 2]
    drawn = torch.cat([_sample_controls(ids, 500, 0, step, 0) for step in range(20)])
    share = torch.bincount(drawn, minlength=3).float() / drawn.numel()
    torch.testing.assert_close(share, torch.tensor([0.5, 0.25, 0.25]), atol=0.02, rtol=0)
    assert torch.equal(_sample_controls(ids, 64, 0, 7, 1), _sample_controls(ids, 64, 0, 7, 1))
    assert not _sample_controls(ids, 500, 0, 3, 0, share=0.0).any()  # all full budget
    half = torch.cat([_sample_controls(ids, 500, 0, s, 0, share=0.5) for s in range(20)])
    assert abs(float((half == 0).float().mean()) - 0.75) < 0.02  # 0.5 + 0.5 * 0.5
    # a dense model has no technique plug-in, so its batches carry no control ids
    from dynaseq.tasks.translation.config import RunConfig
    from dynaseq.tasks.translation.task import TranslationTask

    dense = RunConfig()
    dense.data.train_src = dense.data.train_tgt = "unused"
    assert TranslationTask(dense).techniques == []


def test_output_norms_and_control_init_std_shape_the_built_model():
    """``output_norms=False`` drops the LayerNorms on K, V, the attention output and each FFN
    piece's output (input LayerNorms stay); the model then still meets "gates forced on, hard
    = soft". ``control_init_std`` sets the control embeddings' init scale."""
    from torch import nn

    from dynaseq.tasks.translation.config import ModelConfig
    from dynaseq.tasks.translation.model import build_seq2seq
    from dynaseq.techniques.cct.layers import force_gates

    def build(**cct):
        torch.manual_seed(0)
        cfg = ModelConfig(d_model=32, ffn_dim=64, n_heads=4, encoder_layers=1, decoder_layers=1,
                          dropout=0.0, cct=CCTConfig(ffn_pieces=2, control_hidden=8,
                                                     budgets=[(1.0, 1.0), (0.5, 0.5)], **cct))
        return build_seq2seq(cfg, 40, 0, 1, 2)

    plain = build(output_norms=False, control_init_std=0.0)
    attn, ffn = plain.decoder.layers[0].cross_attn, plain.decoder.layers[0].ffn
    assert all(isinstance(m, nn.Identity) for m in (attn.k_norm, attn.v_norm, attn.out_norm))
    assert all(isinstance(p.out_norm, nn.Identity) and isinstance(p.in_norm, nn.LayerNorm)
               for p in ffn.pieces)
    assert torch.equal(plain.control_embed.weight, torch.zeros_like(plain.control_embed.weight))
    normed = build()
    assert isinstance(normed.encoder.layers[0].self_attn.k_norm, nn.LayerNorm)
    assert isinstance(normed.encoder.layers[0].ffn.pieces[0].out_norm, nn.LayerNorm)
    assert normed.control_embed.weight.std() > 0.5  # the default scale, 1
    src, tgt = torch.tensor([[5, 6, 7, 2]]), torch.tensor([[1, 8, 9]])
    with force_gates(plain, 1.0), torch.no_grad():
        soft = plain.train()(src, tgt, 1).logits
        hard = plain.eval()(src, tgt, 1).logits
    torch.testing.assert_close(hard, soft)
    with pytest.raises(DynaseqError, match="control_init_std must be >= 0"):
        CCTConfig(control_init_std=-1.0)


def test_two_process_ddp_trains_a_cct_as_one_process(tmp_path, synthetic_paths):
    """torchrun, 2 CPU processes (gloo): a CCT logs the same loss, NLL and budget loss at every
    update (within 1e-6) and ends with the same weights (within 1e-3·lr) as one process. The
    budget loss is a batch statistic (eq. 5-7): its sums run over both ranks' rows
    (``sum_over_ranks``), so its value and gradient are the whole batch's, as in one process.
    Dropout and gate noise are off: their random draws differ by rank."""
    kw = {"max_steps": 6, "log_every": 1, "valid_every": 1000, "save_every": 1000}
    single = micro_config(tmp_path / "single", synthetic_paths, **kw)
    double = micro_config(tmp_path / "ddp", synthetic_paths, **kw)
    for cfg in (single, double):
        cfg.model.dropout = 0.0
        cfg.model.cct = CCTConfig(ffn_pieces=2, control_hidden=8, alpha_max=0.0,
                                  budgets=[(1.0, 1.0), (0.5, 0.5), (0.33, 0.33)])
    one, two = train_one_and_two_processes(single, double)
    assert_ddp_matches_one_process(one, two, 6, single.train.lr,
                                   ("loss", "nll", "budget_loss"))


def test_best_is_kept_only_once_every_sequence_draws_its_budget(tmp_path, synthetic_paths):
    """Before the budget curriculum is complete the lower budgets are untrained, while the
    full budget's validation score (what best/ compares) can be at its highest: best/ waits
    for the first validation after budget_start_step + budget_ramp_steps."""
    from dynaseq.train.loop import train

    cfg = micro_config(tmp_path / "run", synthetic_paths, max_steps=12, log_every=1,
                       valid_every=2, save_every=4, valid_bleu_lines=4)
    cfg.model.cct = CCTConfig(ffn_pieces=2, control_hidden=8, noise_ramp_steps=4,
                              budgets=[(1.0, 1.0), (0.5, 0.5)], budget_start_step=4,
                              budget_ramp_steps=4)
    train(cfg, progress=False)
    events = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").open()]
    valid = [e["step"] for e in events if e["event"] == "valid"]
    best = [e["step"] for e in events if e["event"] == "best"]
    assert valid == [2, 4, 6, 8, 10, 12]
    # update k (0-based) draws a budget for a share (k - 4) / 4 of its sequences: all from
    # update 8 on, which ends at step 9, so step 10 is the first validation that may be kept
    assert best and best[0] == 10 and set(best) <= {10, 12}
    meta = json.loads((tmp_path / "run" / "best" / "meta.json").read_text())
    assert meta["step"] == best[-1]
