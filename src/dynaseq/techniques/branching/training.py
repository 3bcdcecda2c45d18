"""How DMB and MoE models train (Tan et al. 2021, eq. 31), as a plug-in of the training loop.

:class:`RoutingTraining` adds the gates' auxiliary routing loss (diversity + entropy for DMB,
the load-balancing terms for the MoE baseline) to each micro-batch's loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from dynaseq.core.config import TrainConfig
from dynaseq.techniques.branching.config import DMBConfig, MoEConfig
from dynaseq.techniques.branching.losses import seq2seq_routing_loss


@dataclass
class RoutingTraining:
    """The routing loss of a DMB or MoE model, weighted by ``aux_weight`` (α of eq. 31)."""

    aux_weight: float
    diversity: float
    entropy: bool

    @classmethod
    def for_dmb(cls, dmb: DMBConfig, train: TrainConfig) -> RoutingTraining:
        """Diversity (weighted, or off) and entropy terms as ``dmb`` says (eq. 19-20, 31)."""
        return cls(dmb.aux_weight, dmb.diversity_weight if dmb.diversity else 0.0, dmb.entropy)

    @classmethod
    def for_moe(cls, moe: MoEConfig, train: TrainConfig) -> RoutingTraining:
        """The MoE baseline's importance + load losses, both terms on."""
        return cls(moe.aux_weight, 1.0, True)

    def before_update(self, model: nn.Module, step: int) -> None:
        pass

    def keeps_best(self, step: int) -> bool:
        """Routing has no curriculum: any validated model may become ``best/``."""
        return True

    def controls(self, n_rows: int, step: int, micro: int) -> None:
        return None

    def loss(self, model: nn.Module, out, src: Tensor, tgt_in: Tensor, tgt_out: Tensor,
             control: Tensor | None, n_tokens: int, pad_id: int) -> tuple[Tensor, dict[str, float]]:
        """Eq. 31 without α, padding excluded, weighted by tokens like the budget loss, so α
        weighs it against the per-token cross-entropy; logged without α."""
        rlo = seq2seq_routing_loss(out.aux, src, tgt_in, pad_id, diversity=self.diversity,
                                   entropy=self.entropy)
        return self.aux_weight * rlo * n_tokens, {"routing_loss": float(rlo.detach()) * n_tokens}
