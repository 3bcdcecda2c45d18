"""Label-smoothed cross-entropy (Szegedy et al. 2016), summed over non-pad tokens."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def label_smoothed_loss(logits: Tensor, target: Tensor, smoothing: float,
                        pad_id: int) -> tuple[Tensor, Tensor, int]:
    """logits (B, T, V), target (B, T) -> (loss_sum, nll_sum, n_tokens).

    loss = (1 - ε) · NLL + ε · mean_v(-log p_v), via ``F.cross_entropy(label_smoothing=ε)``;
    pad positions are ignored. nll_sum is the plain negative log-likelihood (for perplexity).
    """
    flat_logits = logits.reshape(-1, logits.size(-1)).float()
    flat_target = target.reshape(-1)
    loss = F.cross_entropy(flat_logits, flat_target, ignore_index=pad_id,
                           label_smoothing=smoothing, reduction="sum")
    if smoothing == 0.0:
        nll = loss.detach()
    else:
        nll = F.cross_entropy(flat_logits.detach(), flat_target, ignore_index=pad_id,
                              reduction="sum")
    return loss, nll, int(flat_target.ne(pad_id).sum())
