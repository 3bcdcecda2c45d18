"""CCT control networks and gates (Bapna, Arivazhagan, Firat 2020, section 2.1).

A control network ``G`` maps each token to one logit per gated piece of work (eq. 4)::

    G(x) = ReLU(x W1 + b) W2

and a :class:`Gate` turns logits into gates:

* training (``module.training``): soft gates trained in expectation with noise (eq. 3),
  ``g = σ(G(x) + α·N(0, 1))``, α rising linearly from 0 to ``alpha_max`` over ``ramp_steps``
  (:class:`NoiseSchedule`) and then held;
* inference: hard gates ``g = 1[σ(G(x)) >= 0.5] = 1[G(x) >= 0]`` (eq. 2), no noise.

``Gate.gate_override`` (or :func:`force_gates` over a whole model) pins every gate to a
constant, e.g. 1.0 to run the full network (an experiment's switch, written into the
modules; inference calls never use it).

A per-call, per-row **offset** δ moves the inference threshold, ``g = 1[G(x) + δ_b >= 0]``
for the tokens of row b: the knob that :mod:`~dynaseq.techniques.cct.calibration` turns to make a
budget's realized compute hit it. It is an argument of the call, never module state: a
:class:`BudgetControl` carries each row's control-symbol id and its offsets per gated
sub-network (``"encoder"``, ``"decoder"``); the model hands each gate the ``(B,)`` offsets of
its sub-network. So one batch may hold rows at different calibrated budgets, and concurrent
callers share one loaded model. δ = +inf opens every gate (the full network), -inf closes
every gate.

Gated sub-layers report what their gates did through :class:`GateTrace` and
:class:`MacsRecord` entries in the per-call ``AuxOutputs``.

Example::

    control, gate = ControlNet(32, n_gates=1), Gate(NoiseSchedule(ramp_steps=1000))
    g = gate(control(x))      # x (B, T, 32) -> g (B, T, 1)
    g = gate.eval()(control(x), offset=torch.tensor([0.0, 0.7]))  # B = 2, row 1 opens more
    set_gate_step(model, step)  # once per training step, from the training loop
    model(src, tgt_in, BudgetControl(torch.tensor([1, 2]), {"decoder": torch.tensor([0.3, -0.1])}))
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dynaseq.nn.int8 import KEEP_FLOAT, register_int8
from dynaseq.nn.outputs import MACS_TRACE, AuxOutputs, MacsRecord  # noqa: F401  (re-exported)

GATE_TRACE = "cct.gates"
"""``AuxOutputs.traces`` key of the :class:`GateTrace` entries."""


@dataclass(frozen=True)
class NoiseSchedule:
    """α(step) = alpha_max · clamp((step - start) / ramp_steps, 0, 1): the noise scale of
    eq. 3.

    The paper ramps α from 0 to 5 over the whole training run (300k steps) and then holds
    it; set ``ramp_steps`` to the planned number of updates. ``ramp_steps=0`` uses
    ``alpha_max`` from step ``start`` on (the paper's "discrete from the start" ablation).
    ``start`` (default 0): updates before it have no noise (a CCT-BERT's gate warm-up,
    :class:`~dynaseq.techniques.cct.config.EncoderCCTConfig`).
    """

    alpha_max: float = 5.0
    ramp_steps: int = 10_000
    start: int = 0

    def __post_init__(self) -> None:
        if not self.alpha_max >= 0:
            raise ValueError(f"alpha_max must be >= 0, got {self.alpha_max}")
        if self.ramp_steps < 0:
            raise ValueError(f"ramp_steps must be >= 0, got {self.ramp_steps}")
        if self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")

    def alpha(self, step: int | Tensor) -> Tensor:
        """Noise scale at ``step`` (an int or a 0-d tensor), as a float 0-d tensor."""
        step = torch.as_tensor(step, dtype=torch.float32)
        if step.dim() != 0:
            raise ValueError("step must be a scalar")
        step = step - self.start
        if self.ramp_steps == 0:
            return torch.where(step >= 0, self.alpha_max, 0.0)
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

    forward(logits, offset=None): logits ``(B, ...)`` -> gates ``(B, ...)``, same shape and
    dtype; at inference exactly 0.0 or 1.0. ``offset`` (inference only; ignored in training,
    where the gates are eq. 3's soft ones, and under ``gate_override``): a float for every
    row or a ``(B,)`` tensor, one per row, broadcast over the row's tokens and gates, added
    to the logits before the threshold: ``1[logits + offset_b >= 0]``; a positive offset
    opens more gates, +inf all of them. The gate holds no offset of its own: a call's
    offsets never outlive it.
    """

    def __init__(self, schedule: NoiseSchedule | None = None, hard_budget: bool = False) -> None:
        super().__init__()
        self.schedule = schedule if schedule is not None else NoiseSchedule()
        self.hard_budget = hard_budget
        self.register_buffer("step", torch.zeros((), dtype=torch.long), persistent=False)
        self.gate_override: float | None = None

    def alpha(self) -> Tensor:
        return self.schedule.alpha(self.step)

    def forward(self, logits: Tensor, offset: Tensor | float | None = None) -> Tensor:
        if self.training:
            if self.gate_override is not None:
                return torch.full_like(logits, self.gate_override)
            alpha = self.alpha().to(logits.device, logits.dtype)
            return torch.sigmoid(logits + alpha * torch.randn_like(logits))
        return self.hard(logits, offset).to(logits.dtype)

    def hard(self, logits: Tensor, offset: Tensor | float | None = None) -> Tensor:
        """The inference decision as a bool tensor of ``logits``' shape, in either mode:
        ``G(x) + δ_b >= 0`` (eq. 2), or everywhere ``gate_override >= 0.5`` when pinned."""
        if self.gate_override is not None:
            return torch.full(logits.shape, self.gate_override >= 0.5, dtype=torch.bool,
                              device=logits.device)
        if offset is None:
            return logits >= 0
        if isinstance(offset, Tensor):
            assert offset.shape == logits.shape[:1], "offset: one per row (B,)"
            offset = offset.view(-1, *(1,) * (logits.dim() - 1))  # (B, 1, ..., 1)
        return logits >= -offset  # g = 1[G(x) + δ_b >= 0] (eq. 2)

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
                f"hard_budget={self.hard_budget}, gate_override={self.gate_override}")


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


GATE_SUBNETWORKS = ("encoder", "decoder")
"""The gated sub-networks of an encoder-decoder CCT: the first component of a gate's module
path, and the keys of :attr:`BudgetControl.offsets` and of a calibration's offsets."""

ALL_GATES_ON = math.inf
"""The offset that opens every gate: ``1[G(x) + inf >= 0]`` is 1 (the full network)."""


def full_budget_offsets(budget: Sequence[float],
                        subnetworks: Sequence[str] = GATE_SUBNETWORKS) -> dict[str, float]:
    """:data:`ALL_GATES_ON` for each sub-network whose budget fraction is 1.

    A budget of 1 runs every gated MAC of its sub-network, so no gate there has a decision to
    make: every gate opens, whatever its control network would say (and a lean decoding step
    does not run those control networks). A budget's calls add these to its offsets (they
    replace a calibrated offset, which can only approach 1)."""
    return {s: ALL_GATES_ON for s, b in zip(subnetworks, budget, strict=True) if b >= 1.0}


@dataclass(frozen=True)
class BudgetControl:
    """The budget of every row of one call: its control symbol and its gate offsets.

    Passed as a model call's ``control`` argument (where a plain id or ``(B,)`` ids also
    work) and never stored: rows of one batch may run at different (calibrated) budgets.

    ids: ``(B,)`` long control-symbol ids, or one int for every row.
    offsets: sub-network (``"encoder"`` / ``"decoder"``, :data:`GATE_SUBNETWORKS`) -> its
        gates' inference offsets δ (``g = 1[G(x) + δ_b >= 0]``): a ``(B,)`` float tensor, one
        per row, or one float for every row. A sub-network not named gets no offset
        (δ = 0). :data:`ALL_GATES_ON` (+inf) runs the full network.

    Example::

        BudgetControl(1, {"encoder": 0.875, "decoder": 0.875})    # every row, budget 0.5
        BudgetControl(torch.tensor([0, 1]),                        # B = 2: two budgets
                      {"decoder": torch.tensor([0.0, 0.875])})
    """

    ids: Tensor | int
    offsets: Mapping[str, Tensor | float] = field(default_factory=dict)

    @classmethod
    def per_row(cls, ids: Sequence[int], offsets: Sequence[Mapping[str, float] | None],
                device: torch.device | str | None = None) -> BudgetControl:
        """One row per entry: ``ids[b]`` with the offsets ``offsets[b]`` (None or a missing
        sub-network: 0), e.g. each row's budget looked up in a table of calibrations."""
        if len(ids) != len(offsets):
            raise ValueError(f"{len(ids)} control ids but {len(offsets)} rows of offsets")
        subs = list(dict.fromkeys(k for row in offsets if row for k in row))
        table = {k: torch.tensor([float((row or {}).get(k, 0.0)) for row in offsets],
                                 device=device) for k in subs}
        return cls(torch.tensor([int(i) for i in ids], dtype=torch.long, device=device), table)

    def select(self, index: Tensor) -> BudgetControl:
        """The rows ``index`` ``(B',)`` of a per-row control (one for every row: itself)."""
        ids = self.ids if isinstance(self.ids, int) else self.ids.index_select(0, index)
        offsets = {k: v.index_select(0, index) if isinstance(v, Tensor) else v
                   for k, v in self.offsets.items()}
        return BudgetControl(ids, offsets)

    def row_offsets(self, batch: int, device: torch.device,
                    subnetworks: tuple[str, ...] = GATE_SUBNETWORKS) -> dict[str, Tensor]:
        """``{sub-network: (B,) float32 offsets}`` for the sub-networks with an offset.

        Raises ValueError for an unknown sub-network, a tensor that is not ``(B,)``, or a
        NaN offset.
        """
        unknown = set(self.offsets) - set(subnetworks)
        if unknown:
            raise ValueError(f"no gates in sub-network(s) {sorted(unknown)} of this model "
                             f"(it has {list(subnetworks)})")
        out = {}
        for sub, value in self.offsets.items():
            if isinstance(value, Tensor):
                if value.shape != (batch,):
                    raise ValueError(f"the {sub} gate offsets must be one per row, shape "
                                     f"({batch},), got {tuple(value.shape)}")
                value = value.to(device=device, dtype=torch.float32)
            else:
                value = torch.full((batch,), float(value), device=device)
            if bool(value.isnan().any()):
                raise ValueError(f"the {sub} gate offsets hold NaN")
            out[sub] = value
        return out

    def all_open(self, batch: int, subnetworks: tuple[str, ...] = GATE_SUBNETWORKS
                 ) -> list[bool]:
        """Per row, whether every gate of every sub-network is open whatever the control
        networks say: its offset is :data:`ALL_GATES_ON` in each of ``subnetworks``."""
        if any(sub not in self.offsets for sub in subnetworks):
            return [False] * batch
        rows = self.row_offsets(batch, torch.device("cpu"), subnetworks)
        return torch.stack([v == ALL_GATES_ON for v in rows.values()]).all(0).tolist()


def every_gate_open(control: object, batch: int) -> bool:
    """Whether ``control`` runs the full network for each of its ``batch`` rows whatever
    the control networks say: a :class:`BudgetControl` whose every row is
    :meth:`~BudgetControl.all_open` (then nothing is left to count or decide)."""
    return isinstance(control, BudgetControl) and all(control.all_open(batch))


@dataclass
class GateTrace:
    """What one gate did in one call of a gated sub-layer.

    layer: the sub-layer's ``name`` (e.g. ``"encoder.layers.0.self_attn"``, set by
        :func:`dynaseq.techniques.cct.layers.name_conditional_sublayers`).
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


def trace_gate(aux: AuxOutputs, layer: str, gate: str, values: Tensor, cost: Tensor,
               control: ControlNet, stream: str = "input") -> None:
    """Record under :data:`GATE_TRACE` of ``aux`` what gate ``gate`` of sub-layer ``layer``
    did (``values`` ``(B, T, G)``, ``cost`` per open gate and token, see :class:`GateTrace`)
    and the always-on cost of the ``control`` net that decided it (:func:`control_trace`)."""
    aux.add_trace(GATE_TRACE, GateTrace(layer, gate, values, cost, stream))
    aux.add_trace(GATE_TRACE, control_trace(layer, control, values, stream))


# a control net decides which gates are on: int8 rounding could flip a decision
register_int8(ControlNet, KEEP_FLOAT)
