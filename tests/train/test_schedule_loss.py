import math

import pytest
import torch

from dynaseq.nn.losses import label_smoothed_loss
from dynaseq.train.schedule import inverse_sqrt_factor, inverse_sqrt_schedule


def test_inverse_sqrt_warmup_then_decay():
    assert inverse_sqrt_factor(0, 4) == pytest.approx(0.25)
    assert inverse_sqrt_factor(3, 4) == pytest.approx(1.0)
    assert inverse_sqrt_factor(15, 4) == pytest.approx(math.sqrt(4 / 16))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = inverse_sqrt_schedule(opt, 4)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0 * math.sqrt(4 / 5), 2.0 * math.sqrt(4 / 6)])


def test_label_smoothing_matches_hand_formula_and_ignores_pad():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    target = torch.tensor([[1, 2, 0], [4, 0, 0]])
    eps = 0.1
    loss, nll, n = label_smoothed_loss(logits, target, eps, pad_id=0)
    logp = logits.log_softmax(-1)
    keep = target.ne(0)
    hand_nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)[keep].sum()
    hand_smooth = -logp.mean(-1)[keep].sum()
    assert n == 3
    torch.testing.assert_close(nll, hand_nll)
    torch.testing.assert_close(loss, (1 - eps) * hand_nll + eps * hand_smooth)
