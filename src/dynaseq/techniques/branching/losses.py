"""Auxiliary routing losses: DMB diversity + entropy (Tan et al. 2021, eq. 17-20, 31) and the
MoE importance + load losses (Shazeer et al. 2017), computed from one call's route traces.

For one DMB gating unit over a batch of M (non-padding) inputs x_j, with ``S_i = Σ_j a_i(x_j)``
the summed probability of branch i::

    μ   = (1/N) Σ_i S_i                                   (eq. 17)
    σ²  = Σ_i (S_i − μ)²                                  (eq. 18)
    L_d = σ² / μ²                                         (eq. 19)
    L_e = −(1/M) Σ_j Σ_i a_i(x_j) log a_i(x_j)            (eq. 20)

(σ² is written as a sum over branches in eq. 18, not a mean, so ``L_d`` is N times the
squared coefficient of variation with the population variance; this module follows eq. 18.)
For one MoE gate: ``L_importance = CV(Σ_x g(x))²`` and ``L_load = CV(Σ_x P(x, ·))²``
(population variance, as Shazeer et al.). Over the L gating units of the model (eq. 31)::

    L_aux = α · (1/L) Σ_l (L_d,l + L_e,l)        (MoE gates: L_importance,l + L_load,l)

with α = 0.1 in the paper for both DMB and MoE. These losses are the *only* gradient the DMB
gates receive (the branch outputs are not scaled by the gate).

**Padding.** Sub-layers do not know which tokens are padding (an ``EncoderLayer`` passes no
mask to its FFN, a ``DecoderLayer`` none to its causal self-attention), so they only record
their gate logits (:mod:`dynaseq.techniques.branching.traces`); the losses are computed after the
forward pass, by the caller that knows the padding, with a ``valid`` mask per stream. This
is the same convention as the CCT budget loss: a trace of sub-layer ``"encoder.layers.0.ffn"``
(named by :func:`~dynaseq.techniques.branching.name_branching_sublayers`) uses ``valid["encoder"]``,
and the memory tokens of a decoder cross-attention use ``valid["decoder.memory"]``::

    valid = {"encoder": ~src_pad, "decoder": ~tgt_pad, "decoder.memory": ~src_pad}

A single ``(B, T)`` mask serves every trace (a decoder-only or encoder-only model), and
``None`` counts every token. Records of one gating unit (same ``gate_id``) form one batch.

**Scale.** ``dynaseq.train.loop`` adds ``aux.losses`` to the *token-summed* cross-entropy
and then divides by the number of target tokens. To weigh the routing loss by α against the
per-token mean of eq. 31, put ``L_aux · n_target_tokens`` there: ``add_routing_losses(...,
scale=n_tokens)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dynaseq.nn.outputs import AuxOutputs
from dynaseq.techniques.branching.traces import ExpertTrace, RouteTrace, route_traces

Valid = Tensor | Mapping[str, Tensor] | None


def diversity_loss(probs: Tensor) -> Tensor:
    """``L_d = σ²/μ²`` of eq. 17-19 for ``probs`` ``(M, N)`` (rows: a(x_j)); 0 if M = 0."""
    if probs.size(0) == 0:
        return probs.new_zeros(())
    s = probs.sum(0)  # (N,) S_i
    mu = s.sum() / s.numel()
    return ((s - mu) ** 2).sum() / mu ** 2


def entropy_loss(logits: Tensor) -> Tensor:
    """``L_e`` of eq. 20: mean entropy of ``softmax(logits)`` over the rows of ``(M, N)``."""
    if logits.size(0) == 0:
        return logits.new_zeros(())
    log_p = logits.log_softmax(-1)
    return -(log_p.exp() * log_p).sum(-1).mean()


def cv_squared(values: Tensor) -> Tensor:
    """Squared coefficient of variation ``Var(v)/Mean(v)²`` (population variance) of ``(N,)``."""
    mean = values.mean()
    var = ((values - mean) ** 2).mean()
    return var / mean.pow(2).clamp_min(torch.finfo(values.dtype).tiny)


@dataclass
class GateLosses:
    """The losses of one gating unit: ``terms`` holds ``diversity`` and ``entropy`` (DMB)
    or ``importance`` and ``load`` (MoE; ``load`` only from training-mode traces)."""

    layer: str
    kind: str
    n_tokens: int
    terms: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class RoutingLosses:
    """``total``: ``α · (1/L) Σ_l Σ terms_l`` (eq. 31), a scalar with its graph; ``gates``: the
    per-gate terms (gates without any valid token are left out and not counted in L)."""

    total: Tensor
    gates: list[GateLosses]

    def mean(self, term: str) -> Tensor:
        """Average of one term (e.g. ``"diversity"``) over the gates that have it."""
        values = [g.terms[term] for g in self.gates if term in g.terms]
        if not values:
            return self.total.new_zeros(())
        return torch.stack(values).mean()


def valid_rows(trace: RouteTrace | ExpertTrace, valid: Valid, shape: torch.Size) -> Tensor | None:
    """The ``(B, T)`` bool mask of ``trace``'s tokens, None for all (see module docstring)."""
    if valid is None:
        return None
    if isinstance(valid, Tensor):
        mask, key = valid, "valid"
    else:
        sub = trace.layer.split(".")[0]
        key = sub if trace.stream == "input" else f"{sub}.{trace.stream}"
        if key not in valid:
            raise ValueError(f"no padding mask {key!r} for the {trace.stream} tokens of "
                             f"{trace.layer!r} (masks given: {sorted(valid)}); name the "
                             "sub-layers with name_branching_sublayers(model)")
        mask = valid[key]
    if mask.dtype != torch.bool:
        raise ValueError(f"valid mask {key!r} must be bool (True = real token), got {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(f"valid mask {key!r} has shape {tuple(mask.shape)}, but "
                         f"{trace.layer!r} routed {trace.stream} tokens of shape {tuple(shape)}")
    return mask


def _values(trace: RouteTrace | ExpertTrace) -> Tensor:
    """The ``(B, T, N)`` per-token gate values of a record (logits or gates)."""
    return trace.logits if isinstance(trace, RouteTrace) else trace.gates


def _rows(x: Tensor, mask: Tensor | None) -> Tensor:
    """``(B, T, N)`` -> ``(M, N)`` rows of the valid tokens."""
    return x.reshape(-1, x.size(-1)) if mask is None else x[mask]


def routing_losses(traces: AuxOutputs | Sequence[RouteTrace | ExpertTrace], valid: Valid = None,
                   *, alpha: float = 0.1, diversity: float = 1.0,
                   entropy: bool = True) -> RoutingLosses:
    """The auxiliary losses of eq. 17-20 and 31 (DMB) / Shazeer et al. (MoE) for one call.

    traces: an ``AuxOutputs`` (its ``ROUTE_TRACE`` records) or the records themselves.
    valid: padding masks (True = real token): a mapping by stream, one ``(B, T)`` mask for
        every trace, or None (every token counts); see the module docstring.
    alpha: α of eq. 31.
    diversity, entropy: False (0) leaves that DMB term out (the paper's Table III ablations;
        MoE gates are not affected). ``diversity`` may also be a weight ≥ 0 of the diversity
        term against the entropy term (1 = eq. 31; ``terms`` keep the unweighted value).
        A DMB gate with neither term still enters ``total`` as
        ``0 · Σ logits``: its gate gets a zero gradient rather than none, so every parameter
        takes part in every step (DDP without ``find_unused_parameters``).

    Returns zero ``total`` when there are no traces or no valid tokens.
    """
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    if not diversity >= 0:
        raise ValueError(f"the diversity weight must be >= 0, got {diversity}")
    weight = {"diversity": float(diversity), "entropy": 1.0}
    records = route_traces(traces) if isinstance(traces, AuxOutputs) else list(traces)
    by_gate: dict[int, list[tuple[RouteTrace | ExpertTrace, Tensor | None]]] = {}
    for tr in records:
        if not isinstance(tr, (RouteTrace, ExpertTrace)):
            raise ValueError(f"not a route trace: {type(tr).__name__}")
        shape = _values(tr).shape[:-1]
        by_gate.setdefault(tr.gate_id, []).append((tr, valid_rows(tr, valid, shape)))
    gates: list[GateLosses] = []
    sums: list[Tensor] = []  # per gate: the sum of its terms
    for items in by_gate.values():
        first = items[0][0]
        if isinstance(first, RouteTrace):
            logits = torch.cat([_rows(tr.logits, m) for tr, m in items])  # (M, N)
            if logits.size(0) == 0:
                continue
            terms: dict[str, Tensor] = {}
            if diversity:
                terms["diversity"] = diversity_loss(logits.softmax(-1))
            if entropy:
                terms["entropy"] = entropy_loss(logits)
            gates.append(GateLosses(first.layer, "dmb", logits.size(0), terms))
            sums.append(sum(weight[k] * v for k, v in terms.items()) if terms
                        else logits.sum() * 0.0)
        else:
            g = torch.cat([_rows(tr.gates, m) for tr, m in items])  # (M, N)
            if g.size(0) == 0:
                continue
            terms = {"importance": cv_squared(g.sum(0))}
            if all(tr.load is not None for tr, _ in items):
                load = torch.cat([_rows(tr.load, m) for tr, m in items])
                terms["load"] = cv_squared(load.sum(0))
            gates.append(GateLosses(first.layer, "moe", g.size(0), terms))
            sums.append(sum(terms.values()))
    if not gates:
        device = _values(records[0]).device if records else None
        return RoutingLosses(torch.zeros((), device=device), [])
    per_gate = torch.stack(sums)  # (L,)
    return RoutingLosses(alpha * per_gate.mean(), gates)


def add_routing_losses(aux: AuxOutputs, valid: Valid = None, *, alpha: float = 0.1,
                       scale: float = 1.0, name: str = "branching", diversity: float = 1.0,
                       entropy: bool = True) -> RoutingLosses:
    """Compute :func:`routing_losses` from ``aux`` and add ``scale · total`` to
    ``aux.losses[name]`` (where the training loop picks auxiliary losses up).

    ``scale``: the number of target tokens when the main loss is a token sum, as in
    ``dynaseq.train.loop`` (see the module docstring). ``diversity``/``entropy``: as in
    :func:`routing_losses`. Returns the unscaled losses.
    """
    losses = routing_losses(aux, valid, alpha=alpha, diversity=diversity, entropy=entropy)
    if losses.gates:
        aux.add_loss(name, losses.total * scale)
    return losses


def seq2seq_valid(src: Tensor, tgt_in: Tensor, pad_id: int) -> dict[str, Tensor]:
    """The ``valid`` mapping of an encoder-decoder batch: src ``(B, S)``, tgt_in ``(B, T)``."""
    src_valid = src.ne(pad_id)
    return {"encoder": src_valid, "decoder": tgt_in.ne(pad_id), "decoder.memory": src_valid}


def seq2seq_routing_loss(aux: AuxOutputs, src: Tensor, tgt_in: Tensor, pad_id: int, *,
                         diversity: float = 1.0, entropy: bool = True) -> Tensor:
    """The routing loss of one encoder-decoder forward pass without its weight:
    ``(1/L) Σ_l Σ terms_l`` (eq. 31 with α = 1), padding excluded; zero without route traces.

    src (B, S), tgt_in (B, T): the batch; ``diversity``/``entropy``: as in
    :func:`routing_losses` (DMB gates only).
    """
    return routing_losses(aux, seq2seq_valid(src, tgt_in, pad_id), alpha=1.0,
                          diversity=diversity, entropy=entropy).total
