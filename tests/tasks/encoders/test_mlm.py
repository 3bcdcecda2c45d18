"""MLM pre-training: packing, masking statistics, exact resume, evaluation."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

import dynaseq
from dynaseq.core.checkpoint import list_checkpoints
from dynaseq.core.errors import DynaseqError
from dynaseq.tasks.encoder.vocab import EncoderVocab
from dynaseq.tasks.mlm.data import MaskSpec, mask_tokens, pack_blocks
from dynaseq.tasks.mlm.predictor import MaskedLM
from dynaseq.train.loop import train

from encoder_helpers import mlm_config, read_events
from helpers import run_cli


def test_vocabulary_reserves_the_special_ids(mlm_run):
    vocab = EncoderVocab.load(mlm_run / "spm.model")
    assert (vocab.pad_id, vocab.cls_id, vocab.sep_id, vocab.mask_id) == (0, 4, 5, 6)
    assert vocab.first_word_id == 7
    ids = vocab.encode(["[MASK] of [CLS]"])[0]
    assert vocab.mask_id in ids and vocab.cls_id in ids  # never split


def test_packing_fills_blocks_with_lines_and_separators(mlm_run):
    vocab = EncoderVocab.load(mlm_run / "spm.model")
    lines = [[10, 11, 12], [], [13, 14], [15]]
    blocks = pack_blocks(lines, 4, vocab)
    assert blocks.tolist() == [[4, 10, 11, 12], [4, 5, 13, 14], [4, 5, 15, 5]]
    assert pack_blocks([[10, 11]], 4, vocab).tolist() == [[4, 10, 11, 5]]
    assert pack_blocks([[10, 11, 12]], 4, vocab).tolist() == [[4, 10, 11, 12], [4, 5, 0, 0]]


def test_masking_statistics(mlm_run):
    vocab = EncoderVocab.load(mlm_run / "spm.model")
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(vocab.first_word_id, vocab.size, (400, 128), generator=gen)
    blocks[:, 0] = vocab.cls_id
    blocks[:, 50] = vocab.sep_id
    blocks[:5, 100:] = vocab.pad_id
    b = mask_tokens(blocks, vocab, MaskSpec(), torch.Generator().manual_seed(1))
    maskable = int((blocks >= vocab.first_word_id).sum())
    chosen = int(b.select.sum())
    # never a special position; targets are the original ids at the chosen positions
    assert not b.select[:, 0].any() and not b.select[:, 50].any()
    assert not b.select[:5, 100:].any()
    assert torch.equal(b.targets, blocks[b.select])
    assert torch.equal(b.inputs[~b.select], blocks[~b.select])  # the rest untouched
    assert chosen / maskable == pytest.approx(0.15, abs=0.005)  # ~50k draws: sd 0.0016
    got = b.inputs[b.select]
    masked = float((got == vocab.mask_id).float().mean())
    kept = float((got == b.targets).float().mean())
    randomized = 1 - masked - kept
    assert masked == pytest.approx(0.8, abs=0.01)
    # a random replacement may draw the original id (1 in V-7): counted as kept
    assert kept == pytest.approx(0.1 + 0.1 / (vocab.size - 7), abs=0.01)
    assert randomized == pytest.approx(0.1, abs=0.01)
    assert bool((got[(got != vocab.mask_id) & (got != b.targets)] >= vocab.first_word_id).all())
    # the same generator seed gives the same masks (resume, DDP ranks)
    again = mask_tokens(blocks, vocab, MaskSpec(), torch.Generator().manual_seed(1))
    assert torch.equal(again.inputs, b.inputs) and torch.equal(again.select, b.select)


def test_shard_keeps_each_rows_targets(mlm_run):
    vocab = EncoderVocab.load(mlm_run / "spm.model")
    blocks = torch.randint(7, vocab.size, (5, 16), generator=torch.Generator().manual_seed(2))
    b = mask_tokens(blocks, vocab, MaskSpec(mask_prob=0.5), torch.Generator().manual_seed(3))
    for rank in range(2):
        s = b.shard(rank, 2)
        assert torch.equal(s.targets, blocks[rank::2][s.select])


def test_mlm_run_trains_logs_and_evaluates(mlm_run):
    m = dynaseq.load(mlm_run)
    assert isinstance(m, MaskedLM)
    r = m.evaluate("valid")
    assert r["n_masked"] > 0 and 0 <= r["accuracy"] <= 1 and r["loss"] > 0
    assert r == {**m.evaluate("valid"), "checkpoint": r["checkpoint"]}  # fixed masks
    proc = run_cli("evaluate", str(mlm_run), "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    proc = run_cli("evaluate", str(mlm_run), "--budget", "0.5")
    assert proc.returncode == 2 and b"no compute-budget knob" in proc.stderr


def test_mlm_resume_is_exact(tmp_path, text_corpus):
    """12 updates in one go == 6 updates, a stop, and 6 more from the checkpoint (the
    inverse-sqrt schedule does not depend on max_steps); masks, batch order, dropout and
    CCT-free weights all continue exactly."""
    sched = "train.schedule=inverse_sqrt"
    train(mlm_config(tmp_path / "a", text_corpus, sched), progress=False)
    train(mlm_config(tmp_path / "b", text_corpus, sched, "train.max_steps=6"), progress=False)
    train(mlm_config(tmp_path / "b", text_corpus, sched), progress=False)
    a = load_file(str(list_checkpoints(tmp_path / "a")[-1] / "model.safetensors"))
    b = load_file(str(list_checkpoints(tmp_path / "b")[-1] / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_cct_mlm_trains_at_budgets(tmp_path, text_corpus, mlm_run):
    run = tmp_path / "cct"
    cfg = mlm_config(run, text_corpus, "train.max_steps=4", "train.valid_every=4",
                     "train.save_every=4", "model.cct.ffn_pieces=2", "model.cct.control_hidden=8",
                     "model.cct.noise_ramp_steps=4")
    assert cfg.model.cct.budgets == [0.8, 0.8, 0.8, 0.5, 0.33, 0.2]  # the paper's P_BERT
    result = train(cfg, progress=False)
    logs = [h for h in result.history if h.get("event") == "train"]
    assert logs and all("budget_loss" in h for h in logs)
    m = dynaseq.load(run)
    for b in (0.8, 0.5, 0.2):
        assert m.evaluate("valid", budget=b)["budget"] == b
    with pytest.raises(dynaseq.DynaseqError, match="was not trained"):
        m.evaluate("valid", budget=0.6)
    shutil.rmtree(run)


@pytest.mark.slow
def test_two_process_ddp_mlm_matches_one_process(tmp_path, text_corpus):
    """torchrun, 2 CPU processes (gloo): both ranks mask the same full batch and train on
    their rows; the loop's normalisation by the update's masked tokens over all ranks makes
    the losses those of one process."""
    import os
    import subprocess
    import sys

    from dynaseq.core.config import save_config

    from helpers import REPO, free_port

    extra = ["train.max_steps=4", "train.log_every=1", "model.dropout=0.0",
             "model.attention_dropout=0.0", "train.valid_every=100", "train.save_every=100"]
    train(mlm_config(tmp_path / "one", text_corpus, *extra), progress=False)
    cfg = mlm_config(tmp_path / "two", text_corpus, *extra)
    save_config(cfg, tmp_path / "two.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", free_port(), "-m", "dynaseq", "train", str(tmp_path / "two.yaml"),
         "--quiet"], cwd=REPO, capture_output=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]

    def losses(run):
        from encoder_helpers import read_events

        return [r["loss"] for r in read_events(run) if r["event"] == "train"]

    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == len(two) == 4
    assert two == pytest.approx(one, rel=1e-4)


def test_cct_mlm_keeps_best_only_once_every_sequence_draws_its_budget(tmp_path, text_corpus):
    """As for translation: best/ waits for the budget curriculum (validations every 2
    updates; update k draws a budget for a share (k - 2) / 4 of its sequences, all from
    update 6 on, so step 8 is the first validation that may be kept)."""
    cfg = mlm_config(tmp_path / "run", text_corpus, "train.valid_every=2", "train.save_every=4",
                     "model.cct.ffn_pieces=2", "model.cct.control_hidden=8",
                     "model.cct.noise_ramp_steps=4", "model.cct.budget_start_step=2",
                     "model.cct.budget_ramp_steps=4")
    train(cfg, progress=False)
    events = read_events(tmp_path / "run")
    assert [e["step"] for e in events if e["event"] == "valid"] == [2, 4, 6, 8, 10, 12]
    best = [e["step"] for e in events if e["event"] == "best"]
    assert best and best[0] == 8 and set(best) <= {8, 10, 12}


def test_cct_gate_warmup_trains_soft_gates_without_noise_or_budget_loss(tmp_path, text_corpus):
    """``gate_warmup_steps=4``: the first 4 updates (steps 0-3, logged as 1-4) add no budget
    term (logged still) and their gates get no noise; the noise ramp starts at step 4, and
    best/ waits for it."""
    from dynaseq.core.errors import ConfigError
    from dynaseq.techniques.cct.config import EncoderCCTConfig
    from dynaseq.techniques.cct.gating import Gate
    from dynaseq.techniques.cct.training import EncoderCCTTraining

    c = EncoderCCTConfig(gate_warmup_steps=4, noise_ramp_steps=2)
    assert [c.budget_weight_at(k) for k in (0, 3, 4, 9)] == [0.0, 0.0, 0.3, 0.3]
    t = EncoderCCTTraining(c, seed=1)
    assert [t.keeps_best(k) for k in (3, 4)] == [False, True]
    with pytest.raises(ConfigError, match="gate_warmup_steps must be >= 0"):
        EncoderCCTConfig(gate_warmup_steps=-1)
    common = ("train.max_steps=6", "train.valid_every=2", "train.save_every=4",
              "train.log_every=1", "model.cct.ffn_pieces=2", "model.cct.control_hidden=8",
              "model.cct.noise_ramp_steps=2")
    warm = train(mlm_config(tmp_path / "warm", text_corpus, *common,
                            "model.cct.gate_warmup_steps=4"), progress=False)
    # the same run with neither noise nor budget loss: equal until the warm-up ends
    soft = train(mlm_config(tmp_path / "soft", text_corpus, *common, "model.cct.alpha_max=0",
                            "model.cct.budget_weight=0"), progress=False)
    losses = [{h["step"]: h["loss"] for h in r.history if h.get("event") == "train"}
              for r in (warm, soft)]
    assert [losses[0][k] for k in (1, 2, 3, 4)] == [losses[1][k] for k in (1, 2, 3, 4)]
    assert losses[0][5] != losses[1][5]  # the fifth update adds the budget term (and noise)
    assert all(h["budget_loss"] > 0 for h in warm.history if h.get("event") == "train")
    gates = [m for m in dynaseq.load(tmp_path / "warm").model.modules() if isinstance(m, Gate)]
    assert gates and all(g.schedule.start == 4 and float(g.schedule.alpha(5)) == 2.5
                         for g in gates)
    best = [e["step"] for e in read_events(tmp_path / "warm") if e["event"] == "best"]
    assert best and min(best) >= 4


def test_mlm_evaluation_masks_do_not_depend_on_the_batch_size(mlm_run):
    m = dynaseq.load(mlm_run)
    runs = [m.evaluate("valid", batch_size=b) for b in (1, 3, 16)]
    assert len({r["n_masked"] for r in runs}) == 1
    for r in runs[1:]:
        assert r["loss"] == pytest.approx(runs[0]["loss"], rel=1e-5)
        assert r["accuracy"] == runs[0]["accuracy"]
    with pytest.raises(DynaseqError, match="batch_size must be an integer >= 1, got 0"):
        m.evaluate("valid", batch_size=0)
