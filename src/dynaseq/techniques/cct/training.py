"""How a CCT trains (Bapna et al. 2020, sec. 2.2-2.4), as a plug-in of the training loop.

:class:`CCTTraining` is what the translation task asks of a model with a ``model.cct``
section: before each update it sets the gates' step (the noise scale α of eq. 4 ramps with
it); it draws one control symbol per sequence (multi-budget training, sec. 2.2), with the
optional full-budget curriculum; and it adds the budget loss (eq. 5-9, weighted by λ) and
the optional in-place self-distillation term to each micro-batch's loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dynaseq.core.config import TrainConfig
from dynaseq.core.distributed import sum_over_ranks
from dynaseq.techniques.cct.config import CCTConfig, EncoderCCTConfig
from dynaseq.techniques.cct.gating import set_gate_step
from dynaseq.techniques.cct.layers import encoder_budget_loss, seq2seq_budget_loss
from dynaseq.techniques.cct.self_distill import inplace_distill_term


def sample_controls(sampling_ids: Tensor, batch: int, seed: int, step: int, micro: int,
                    share: float = 1.0) -> Tensor:
    """One control symbol per sequence ``(batch,)``: a uniformly drawn entry of the
    configured budget list (CCT sec. 2.2), mapped to its symbol (``sampling_ids``, see
    ``CCTConfig``); with probability ``1 - share`` the full budget (symbol 0) instead
    (``budget_ramp_steps``).

    Drawn from (seed, step, micro-batch) alone, so every rank and every resume draws the
    same ids for the same batch.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 131 + micro)
    ids = sampling_ids[torch.randint(sampling_ids.numel(), (batch,), generator=gen)]
    if share < 1.0:
        ids = torch.where(torch.rand(batch, generator=gen) < share, ids, torch.zeros_like(ids))
    return ids


@dataclass
class CCTTraining:
    """The CCT's training schedule and losses (see the module doc)."""

    cct: CCTConfig
    seed: int
    label_smoothing: float
    sampling_ids: Tensor = field(init=False)  # (n,) control symbol of each budgets entry
    budgets: Tensor = field(init=False)  # (N, 2): (encoder, decoder) budget per symbol

    def __post_init__(self) -> None:
        self.sampling_ids = torch.tensor(self.cct.sampling_ids, dtype=torch.long)
        self.budgets = torch.tensor(self.cct.controls, dtype=torch.float32)

    @classmethod
    def from_config(cls, cct: CCTConfig, train: TrainConfig) -> CCTTraining:
        return cls(cct, train.seed, train.label_smoothing)

    def before_update(self, model: nn.Module, step: int) -> None:
        set_gate_step(model, step)

    def keeps_best(self, step: int) -> bool:
        """Whether the model after update ``step`` may become the run's ``best/``: only once
        every sequence draws its budget (``budget_start_step + budget_ramp_steps``). Before,
        the lower budgets are untrained, while the full budget's validation score, which
        best-keeping compares, is often at its highest."""
        return self.cct.sampled_share(step) >= 1.0

    def controls(self, n_rows: int, step: int, micro: int) -> Tensor:
        """(n_rows,) control ids of micro-batch ``micro`` of update ``step``."""
        return sample_controls(self.sampling_ids, n_rows, self.seed, step, micro, self.cct.sampled_share(step))

    def loss(self, model: nn.Module, out, src: Tensor, tgt_in: Tensor, tgt_out: Tensor,
             control: Tensor | None, n_tokens: int, pad_id: int) -> tuple[Tensor, dict[str, float]]:
        """What to add to the micro-batch's summed loss, and its per-token-sum logs.

        The budget loss is a per-batch mean, weighted by tokens so that the loop's division by
        all tokens of the update averages it (logged without λ as ``budget_loss``). Under DDP
        its batch sums cover the micro-batch's rows on every rank
        (:func:`~dynaseq.core.distributed.sum_over_ranks`), so its value and gradient are the
        one-process run's.
        """
        assert control is not None
        budgets = self.budgets.to(src.device)
        extra = out.logits.new_zeros(())
        if self.cct.distill_weight:  # the teacher pass runs on the bare model, outside DDP
            extra = extra + inplace_distill_term(
                model, src, tgt_in, tgt_out, control, out.logits, self.cct.largest_control,
                self.cct.distill_weight, self.label_smoothing, pad_id)
        blo = seq2seq_budget_loss(out.aux, src, tgt_in, pad_id, control, budgets, 1.0,
                                  sum_over_ranks)
        extra = extra + self.cct.budget_weight * blo * n_tokens
        return extra, {"budget_loss": float(blo.detach()) * n_tokens}


@dataclass
class EncoderCCTTraining:
    """CCT-BERT's training plug-in (Bapna et al. 2020 sec. 5) for the encoder tasks (MLM
    pre-training and fine-tuning): the gates' step before each update (noise ramp), one
    control symbol per sequence drawn from ``cct.budgets`` (from (seed, step, micro-batch),
    as :func:`sample_controls`), and λ·L_c added to the task loss: ``L^mlm + λ L^c`` in
    pre-training, λ scaled to the task loss when fine-tuning (the run's ``budget_weight``)."""

    cct: EncoderCCTConfig
    seed: int
    sampling_ids: Tensor = field(init=False)
    budgets: Tensor = field(init=False)  # (N,) budget per control symbol

    def __post_init__(self) -> None:
        self.sampling_ids = torch.tensor(self.cct.sampling_ids, dtype=torch.long)
        self.budgets = torch.tensor(self.cct.controls, dtype=torch.float32)

    @classmethod
    def from_config(cls, cct: EncoderCCTConfig, train: TrainConfig) -> EncoderCCTTraining:
        return cls(cct, train.seed)

    def before_update(self, model: nn.Module, step: int) -> None:
        set_gate_step(model, step)

    def keeps_best(self, step: int) -> bool:
        """As :meth:`CCTTraining.keeps_best`, and not during the gate warm-up (the soft
        gates' validation is not the trained CCT's)."""
        return step >= self.cct.gate_warmup_steps and CCTTraining.keeps_best(self, step)

    def controls(self, n_rows: int, step: int, micro: int) -> Tensor:
        """(n_rows,) control ids of micro-batch ``micro`` of update ``step``."""
        return sample_controls(self.sampling_ids, n_rows, self.seed, step, micro,
                               self.cct.sampled_share(step))

    def loss(self, aux, valid: Tensor, control: Tensor, n_units: int, step: int = 0
             ) -> tuple[Tensor, dict[str, float]]:
        """λ·L_c weighted by the micro-batch's loss units ``n_units`` (masked tokens, or
        sequences), so the loop's division by the update's units averages it; and its
        per-unit-sum log ``budget_loss`` (without λ)."""
        blo = encoder_budget_loss(aux, valid, control, self.budgets.to(valid.device))
        weight = self.cct.budget_weight_at(step)  # 0 during the gate warm-up
        return weight * blo * n_units, {"budget_loss": float(blo.detach()) * n_units}
