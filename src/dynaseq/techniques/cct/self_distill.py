"""In-place self-distillation for multi-budget CCT training.

Not in the CCT paper: the "inplace distillation" of universally slimmable networks (Yu &
Huang 2019), where the narrow sub-networks learn from the widest one's predictions on the
same batch. Here every training batch mixes sequences drawn at the largest budget (the
teacher control) with sequences drawn at lower budgets (students). The student sequences are
run once more at the largest budget, without gradient, and their per-token loss becomes

    L = (1 − β) · L_ls(y) + β · L_soft,      L_soft = − Σ_v p_full(v | ·) · log p_b(v | ·)

with β = ``CCTConfig.distill_weight``; teacher-budget sequences keep ``L_ls`` alone. The full
network's distribution is a richer target than the one-hot reference, and it is the
function the low budgets should approximate: the same model, with less compute.

Cost per update: one extra forward pass (no backward) over the student sequences.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dynaseq.nn.losses import label_smoothed_loss


def soft_target_loss(logits: Tensor, teacher_logits: Tensor, target: Tensor,
                     pad_id: int) -> Tensor:
    """logits, teacher_logits (B, T, V), target (B, T) -> 0-d sum over non-pad positions of
    ``− Σ_v softmax(teacher)_v · log_softmax(logits)_v`` (the teacher gets no gradient)."""
    if logits.shape != teacher_logits.shape or logits.shape[:2] != target.shape:
        raise ValueError(f"shapes disagree: logits {tuple(logits.shape)}, teacher "
                         f"{tuple(teacher_logits.shape)}, target {tuple(target.shape)}")
    p_teacher = teacher_logits.detach().float().softmax(-1)
    per_token = -(p_teacher * logits.float().log_softmax(-1)).sum(-1)
    return per_token.masked_fill(target.eq(pad_id), 0.0).sum()


def inplace_distill_term(model: Callable, src: Tensor, tgt_in: Tensor, tgt_out: Tensor,
                         control: Tensor, logits: Tensor, teacher_control: int,
                         weight: float, smoothing: float, pad_id: int) -> Tensor:
    """What to add to a batch's summed label-smoothed loss for in-place self-distillation.

    Args:
        model: called as ``model(src, tgt_in, control)`` returning an object with ``.logits``
            (a seq2seq model, unwrapped from DDP).
        src (B, S), tgt_in (B, T), tgt_out (B, T): the batch; control (B,): each sequence's
            control symbol; logits (B, T, V): the model's output for it (with gradient).
        teacher_control: the control symbol of the largest budget.
        weight: β in [0, 1].

    Returns ``β · (L_soft − L_ls)`` summed over the student rows' non-pad tokens (0-d), so
    that the batch loss becomes the module docstring's mixture; exactly 0 (and no teacher
    pass) when no row is a student or β = 0.
    """
    students = control.ne(teacher_control).nonzero().squeeze(1)
    if weight == 0.0 or students.numel() == 0:
        return logits.new_zeros(())
    s_src, s_in, s_out = src[students], tgt_in[students], tgt_out[students]
    with torch.no_grad():
        teacher = model(s_src, s_in, torch.full_like(control[students], teacher_control)).logits
    student = logits[students]
    soft = soft_target_loss(student, teacher, s_out, pad_id)
    hard, _, _ = label_smoothed_loss(student, s_out, smoothing, pad_id)
    return weight * (soft - hard)
