"""In-place self-distillation: the soft-target loss, the per-batch term, the training loop."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dynaseq.core.errors import ConfigError
from dynaseq.nn.losses import label_smoothed_loss
from dynaseq.techniques.cct.config import CCTConfig
from dynaseq.techniques.cct.self_distill import inplace_distill_term, soft_target_loss
from dynaseq.train.loop import train

from helpers import micro_config

PAD = 0


def _batch(b: int = 4, t: int = 5, v: int = 11):
    g = torch.Generator().manual_seed(0)
    target = torch.randint(1, v, (b, t), generator=g)
    target[0, 3:] = PAD
    target[2, 4:] = PAD
    logits = torch.randn(b, t, v, generator=g)
    return logits, target


def test_soft_target_loss_is_the_nll_for_a_one_hot_teacher_and_the_entropy_for_itself():
    logits, target = _batch()
    one_hot = F.one_hot(target, logits.size(-1)).float() * 1e4
    nll = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD,
                          reduction="sum")
    torch.testing.assert_close(soft_target_loss(logits, one_hot, target, PAD), nll)
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)[target.ne(PAD)].sum()
    torch.testing.assert_close(soft_target_loss(logits, logits, target, PAD), entropy)
    with pytest.raises(ValueError, match="shapes disagree"):
        soft_target_loss(logits, logits[:, :-1], target, PAD)


def test_the_term_turns_student_rows_into_the_mixture_and_leaves_teacher_rows_alone():
    logits, target = _batch()
    teacher_all = torch.randn_like(logits)
    src = torch.arange(4).unsqueeze(1).repeat(1, 3) + 1  # row i's first token is i + 1
    tgt_in = target.clone()
    control = torch.tensor([2, 0, 2, 1])  # control 2 is the largest budget: rows 1, 3 learn
    calls = []

    def teacher(s, t_in, c):
        calls.append((s.clone(), c.clone()))
        return SimpleNamespace(logits=teacher_all[s[:, 0] - 1])

    student = logits.clone().requires_grad_()
    term = inplace_distill_term(teacher, src, tgt_in, target, control, student,
                                teacher_control=2, weight=0.3, smoothing=0.1, pad_id=PAD)
    (s_rows,) = calls
    assert torch.equal(s_rows[0][:, 0], torch.tensor([2, 4])) and s_rows[1].tolist() == [2, 2]
    rows = torch.tensor([1, 3])
    soft = soft_target_loss(logits[rows], teacher_all[rows], target[rows], PAD)
    hard, _, _ = label_smoothed_loss(logits[rows], target[rows], 0.1, PAD)
    torch.testing.assert_close(term, 0.3 * (soft - hard))
    # β = 1: the batch loss is the soft loss on student rows plus the reference loss elsewhere
    full = inplace_distill_term(teacher, src, tgt_in, target, control, student, 2, 1.0, 0.1, PAD)
    ls_all, _, _ = label_smoothed_loss(student, target, 0.1, PAD)
    keep = torch.tensor([0, 2])
    ls_teacher_rows, _, _ = label_smoothed_loss(logits[keep], target[keep], 0.1, PAD)
    torch.testing.assert_close(ls_all + full, ls_teacher_rows + soft)
    (ls_all + full).backward()
    assert student.grad[rows].abs().sum() > 0 and student.grad[keep].abs().sum() > 0
    # nothing to learn: no teacher pass, exactly zero
    calls.clear()
    for c, w in ((torch.full((4,), 2), 0.3), (control, 0.0)):
        zero = inplace_distill_term(teacher, src, tgt_in, target, c, student, 2, w, 0.1, PAD)
        assert float(zero) == 0.0
    assert calls == []


def test_distill_weight_is_checked():
    with pytest.raises(ConfigError, match=r"distill_weight must be in \[0, 1\]"):
        CCTConfig(budgets=[(1.0, 1.0), (0.5, 0.5)], distill_weight=1.5)
    with pytest.raises(ConfigError, match="at least two distinct budgets"):
        CCTConfig(budgets=[(1.0, 1.0), (1.0, 1.0)], distill_weight=0.5)


def test_training_with_self_distillation_adds_the_term(tmp_path, synthetic_paths):
    """Same seed, data and control draws: step 1's loss differs by the distillation term
    alone, and the run trains (loss falls)."""
    losses = {}
    for weight in (0.0, 0.5):
        cfg = micro_config(tmp_path / f"w{weight}", synthetic_paths, max_steps=6, log_every=1,
                           valid_every=6, save_every=6, valid_bleu_lines=0)
        cfg.model.cct = CCTConfig(ffn_pieces=2, control_hidden=8, noise_ramp_steps=4,
                                  budgets=[(1.0, 1.0), (0.5, 0.5)], distill_weight=weight)
        train(cfg, progress=False)
        recs = [json.loads(x) for x in (tmp_path / f"w{weight}" / "log.jsonl").open()]
        losses[weight] = [r["loss"] for r in recs if r["event"] == "train"]
    plain, distilled = losses[0.0], losses[0.5]
    assert len(distilled) == 6 and all(map(torch.isfinite, torch.tensor(distilled)))
    assert distilled[0] != pytest.approx(plain[0], abs=1e-6)
    assert distilled[-1] < distilled[0]
