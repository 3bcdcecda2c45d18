"""CCT control networks and gates (Bapna, Arivazhagan, Firat 2020, section 2.1).

A control network ``G`` maps each token to one logit per gated piece of work (eq. 4)::

    G(x) = ReLU(x W1 + b) W2

and a :class:`Gate` turns logits into gates:

* training (``module.training``): soft gates trained in expectation with noise (eq. 3),
  ``g = σ(G(x) + α·N(0, 1))``, α rising linearly from 0 to ``alpha_max`` over ``ramp_steps``
  (:class:`NoiseSchedule`) and then held;
* inference: hard gates ``g = 1[σ(G(x)) >= 0.5] = 1[G(x) >= 0]`` (eq. 2), no noise.

``Gate.gate_override`` (or :func:`force_gates` over a whole model) pins every gate to a
constant, e.g. 1.0 to run the full network. ``Gate.offset`` (or :func:`shift_gates` per
sub-network) moves the inference threshold, ``g = 1[G(x) + offset >= 0]``: the knob that
:mod:`~dynaseq.adaptive.calibration` turns to make a budget's realized compute hit it.
Gated sub-layers report what their gates did through :class:`GateTrace` and
:class:`MacsRecord` entries in the per-call ``AuxOutputs``.

Example::

    control, gate = ControlNet(32, n_gates=1), Gate(NoiseSchedule(ramp_steps=1000))
    g = gate(control(x))      # x (B, T, 32) -> g (B, T, 1)
    set_gate_step(model, step)  # once per training step, from the training loop
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dynaseq.nn.int8 import KEEP_FLOAT, register_int8

GATE_TRACE = "cct.gates"
"""``AuxOutputs.traces`` key of the :class:`GateTrace` entries."""
MACS_TRACE = "cct.macs"
"""``AuxOutputs.traces`` key of the :class:`MacsRecord` entries (inference only)."""


@dataclass(frozen=True)
class NoiseSchedule:
    """α(step) = alpha_max · min(step / ramp_steps, 1): the noise scale of eq. 3.

    The paper ramps α from 0 to 5 over the whole training run (300k steps) and then holds
    it; set ``ramp_steps`` to the planned number of updates. ``ramp_steps=0`` uses
    ``alpha_max`` from the first step (the paper's "discrete from the start" ablation).
    """

    alpha_max: float = 5.0
    ramp_steps: int = 10_000

    def __post_init__(self) -> None:
        if not self.alpha_max >= 0:
            raise ValueError(f"alpha_max must be >= 0, got {self.alpha_max}")
        if self.ramp_steps < 0:
            raise ValueError(f"ramp_steps must be >= 0, got {self.ramp_steps}")

    def alpha(self, step: int | Tensor) -> Tensor:
        """Noise scale at ``step`` (an int or a 0-d tensor), as a float 0-d tensor."""
        step = torch.as_tensor(step, dtype=torch.float32)
        if step.dim() != 0:
            raise ValueError("step must be a scalar")
        if self.ramp_steps == 0:
            return torch.full_like(step, self.alpha_max)
        return self.alpha_max * (step.clamp_min(0) / self.ramp_steps).clamp_max(1.0)


class ControlNet(nn.Module):
    """G(x) = ReLU(x W1 + b) W2 (eq. 4): ``(..., d_model)`` -> ``(..., n_gates)`` logits.

    Args:
        d_model: input width.
        n_gates: logits per token (1 for an attention gate, M for the M feed-forward pieces,
            whose gate g_F maps a token to (0, 1)^M, eq. 15).
        hidden: hidden width (the paper found 64-256 to work alike; default 128).

    MACs per token: ``d_model·hidden + hidden·n_gates``.
    """

    def __init__(self, d_model: int, n_gates: int = 1, hidden: int = 128) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("n_gates", n_gates), ("hidden", hidden)):
            if value < 1:
                raise ValueError(f"ControlNet {name} must be >= 1, got {value}")
        self.w1 = nn.Linear(d_model, hidden)
        self.w2 = nn.Linear(hidden, n_gates, bias=False)
        nn.init.xavier_uniform_(self.w1.weight)
        nn.init.zeros_(self.w1.bias)
        nn.init.xavier_uniform_(self.w2.weight)

    @property
    def n_gates(self) -> int:
        return self.w2.out_features

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.w1(x).relu())

    def macs(self, n_tokens: int) -> int:
        """Multiply-adds of running the control net on ``n_tokens`` tokens."""
        return n_tokens * (self.w1.in_features * self.w1.out_features
                           + self.w2.in_features * self.w2.out_features)


class Gate(nn.Module):
    """Logits -> gates: noisy sigmoid in training (eq. 3), 0/1 threshold at inference (eq. 2).

    ``step`` (a non-persistent buffer: checkpoints hold weights only) is the training step
    that sets the noise scale α; the training loop sets it (:func:`set_gate_step`).
    ``gate_override`` pins every gate: in training the gates equal it; at inference they are
    ``1`` if it is >= 0.5, else ``0``. ``None`` (default) lets the control network decide.
    ``offset`` (inference only, default 0) is added to the logits before the threshold:
    ``1[logits + offset >= 0]``; a positive offset opens more gates.

    forward: logits ``(...)`` -> gates ``(...)``, same shape and dtype; at inference
    exactly 0.0 or 1.0.
    """

    def __init__(self, schedule: NoiseSchedule | None = None, hard_budget: bool = False) -> None:
        super().__init__()
        self.schedule = schedule if schedule is not None else NoiseSchedule()
        self.hard_budget = hard_budget
        self.register_buffer("step", torch.zeros((), dtype=torch.long), persistent=False)
        self.gate_override: float | None = None
        self.offset = 0.0

    def alpha(self) -> Tensor:
        return self.schedule.alpha(self.step)

    def forward(self, logits: Tensor) -> Tensor:
        if self.gate_override is not None:
            value = self.gate_override if self.training else float(self.gate_override >= 0.5)
            return torch.full_like(logits, value)
        if self.training:
            alpha = self.alpha().to(logits.device, logits.dtype)
            return torch.sigmoid(logits + alpha * torch.randn_like(logits))
        return (logits >= -self.offset).to(logits.dtype)

    def for_budget(self, logits: Tensor, gates: Tensor) -> Tensor:
        """The gate values the budget loss counts, for ``gates = self(logits)``.

        By default (the paper) the training gates themselves. With ``hard_budget`` (training
        only, no override): the decision inference will take, ``1[logit >= 0]``, with the
        gradient of ``σ(logit)`` (straight-through), so the loss steers the compute that will
        really run instead of the noisy soft gates' expectation, which differs from it for
        logits near 0.
        """
        if not (self.training and self.hard_budget and self.gate_override is None):
            return gates
        soft = torch.sigmoid(logits)
        return (logits >= 0).to(soft.dtype) + soft - soft.detach()

    def extra_repr(self) -> str:
        return (f"alpha_max={self.schedule.alpha_max}, ramp_steps={self.schedule.ramp_steps}, "
                f"hard_budget={self.hard_budget}, "
                f"gate_override={self.gate_override}, offset={self.offset}")


def set_gate_step(model: nn.Module, step: int) -> None:
    """Set the training step (hence the noise scale α) of every :class:`Gate` in ``model``."""
    for m in model.modules():
        if isinstance(m, Gate):
            m.step.fill_(step)


@contextmanager
def force_gates(model: nn.Module, value: float | None = 1.0) -> Iterator[nn.Module]:
    """Pin every :class:`Gate` in ``model`` to ``value`` inside the block, then restore.

    ``force_gates(model, 1.0)`` runs the full network; ``0.0`` skips every gated sub-layer.
    """
    gates = [m for m in model.modules() if isinstance(m, Gate)]
    saved = [g.gate_override for g in gates]
    for g in gates:
        g.gate_override = value
    try:
        yield model
    finally:
        for g, old in zip(gates, saved, strict=True):
            g.gate_override = old


@contextmanager
def shift_gates(model: nn.Module, offsets: Mapping[str, float]) -> Iterator[nn.Module]:
    """Inside the block, add ``offsets[j]`` to the inference logits of every :class:`Gate` of
    sub-network ``j`` (the first component of its module path, ``"encoder"`` / ``"decoder"``),
    then restore. Sub-networks not named keep their offsets.
    """
    named = [(name.split(".")[0], m) for name, m in model.named_modules() if isinstance(m, Gate)]
    unknown = set(offsets) - {sub for sub, _ in named}
    if unknown:
        raise ValueError(f"no gates in sub-network(s) {sorted(unknown)} of this model")
    saved = [m.offset for _, m in named]
    for sub, m in named:
        if sub in offsets:
            m.offset = float(offsets[sub])
    try:
        yield model
    finally:
        for (_, m), old in zip(named, saved, strict=True):
            m.offset = old


@dataclass
class GateTrace:
    """What one gate did in one call of a gated sub-layer.

    layer: the sub-layer's ``name`` (e.g. ``"encoder.layers.0.self_attn"``, set by
        :func:`dynaseq.adaptive.cct.name_conditional_sublayers`).
    gate: ``"q"`` or ``"kv"`` (attention), ``"ffn"`` (the M feed-forward pieces), or
        ``"control"``: the control network itself, which always runs (values all 1, no
        gradient); it enters the budget so that the budget is a fraction of everything the
        gated sub-layers execute, control nets included (see :func:`control_trace`).
    values: ``(B, T, G)`` gates per token: the soft (noisy) gates in training, with their
        graph (the budget loss differentiates them); at inference 0/1 for "ran / did not".
    cost: MACs that one open gate spends on one token, broadcastable to ``values``.
    stream: ``"input"`` if the tokens are the sub-layer's input ``x``, ``"memory"`` if they
        are the cross-attention memory (the encoder output).
    """

    layer: str
    gate: str
    values: Tensor
    cost: Tensor
    stream: str = "input"


@dataclass
class MacsRecord:
    """MACs one call of a gated sub-layer actually executed at inference, per matrix."""

    layer: str
    macs: dict[str, int]


def control_trace(layer: str, control: ControlNet, gates: Tensor, stream: str) -> GateTrace:
    """The always-on cost of ``control`` on the tokens of ``gates`` ``(B, T, G)``.

    A :class:`GateTrace` with gate ``"control"``, values 1 ``(B, T, 1)`` and cost the control
    net's MACs per token. The budget loss then counts the control nets in both the budget
    and the utilization, so a trained budget p makes everything the gated sub-layers run
    (the realized fraction that inference reports) about p of its maximum, instead of
    p of the gated work plus the control nets on top.
    """
    ones = gates.new_ones(gates.shape[:-1] + (1,)).detach()
    cost = torch.tensor(float(control.macs(1)), dtype=gates.dtype, device=gates.device)
    return GateTrace(layer, "control", ones, cost, stream)


# a control net decides which gates are on: int8 rounding could flip a decision
register_int8(ControlNet, KEEP_FLOAT)
