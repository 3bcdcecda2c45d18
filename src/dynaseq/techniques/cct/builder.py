"""The CCT's sub-layers for a seq2seq model (Bapna et al. 2020): every attention and FFN
gated (:func:`conditional_attention`, :func:`conditional_feedforward` with M pieces), one
control-symbol embedding per trained budget, and the sub-layers named after their paths."""

from __future__ import annotations

from torch import nn

from dynaseq.nn.layers import Sublayers, TransformerDims
from dynaseq.techniques.cct.conditional_attention import conditional_attention
from dynaseq.techniques.cct.conditional_ffn import conditional_feedforward
from dynaseq.techniques.cct.config import CCTConfig
from dynaseq.techniques.cct.gating import NoiseSchedule
from dynaseq.techniques.cct.layers import name_conditional_sublayers


def cct_sublayers(cct: CCTConfig, cfg: TransformerDims) -> Sublayers:
    """Gated sub-layers of a model of dimensions ``cfg``; the control embedding
    ``(len(controls), d)`` is initialised N(0, ``control_init_std``²)."""
    d = cfg.d_model
    schedule = NoiseSchedule(cct.alpha_max, cct.noise_ramp_steps, cct.noise_start_step)
    hard = cct.budget_estimate == "hard"

    def attention() -> nn.Module:
        return conditional_attention(d, cfg.n_heads, cfg.attention_dropout,
                                     control_hidden=cct.control_hidden, schedule=schedule,
                                     hard_budget=hard, norms=cct.output_norms,
                                     fast_paths=cct.fast_paths)

    def ffn() -> nn.Module:
        return conditional_feedforward(d, cfg.ffn_dim, cct.ffn_pieces, cfg.activation_dropout,
                                       control_hidden=cct.control_hidden, schedule=schedule,
                                       hard_budget=hard, out_norms=cct.output_norms,
                                       fast_paths=cct.fast_paths)

    control = nn.Embedding(len(cct.controls), d)
    nn.init.normal_(control.weight, std=cct.control_init_std)
    return Sublayers(attention, ffn, control, name_conditional_sublayers)
