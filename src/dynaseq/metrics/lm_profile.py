"""``dynaseq profile`` for language models: parameters, MACs per generated token, the
wall time of one incremental step at two document positions (MicroNet's short per-layer
context: the time at position 10,000 should match the time at position 100) and the
MicroNet score (:func:`micronet_profile`).

Example::

    micronet_profile(model)   # {"params_storage": ..., "ops_per_token": {...}, "score": ...}
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from dynaseq.core.distributed import precision_of
from dynaseq.metrics.micronet import MicroNetOpCounter, micronet_score, parameter_storage
from dynaseq.metrics.profile import count_params
from dynaseq.models.lm import LMState, TransformerLM
from dynaseq.nn.modes import evaluating


def lm_macs_per_token(model: TransformerLM) -> dict[str, int]:
    """Analytic multiply-adds to generate one token with a full next-word distribution,
    the caches holding C-1 positions (embedding lookups are free; adaptive-input
    up-projections are counted for tail words only, so they are left out)."""
    total: dict[str, int] = {}
    for layer in model.layers:
        attn = layer.self_attn
        parts = attn.macs(n_keys=attn.context)
        parts.update(layer.ffn.macs(1))
        for k, v in parts.items():
            total[k] = total.get(k, 0) + v
    total.update(model.softmax.macs(1, full=True))
    total["total"] = sum(total.values())
    return total


@torch.inference_mode()
def prefill(model: TransformerLM, tokens: torch.Tensor, window: int) -> LMState | None:
    """Run ``tokens`` (B, P) through the model in windows; return the incremental state."""
    state = None
    for start in range(0, tokens.size(1), window):
        state = model(tokens[:, start:start + window], state).state
    return state


@torch.inference_mode()
def step_ms(model: TransformerLM, positions: tuple[int, ...] = (100, 10_000), steps: int = 20,
            window: int = 512, seed: int = 0) -> dict[int, float]:
    """Median ms for one incremental step (``model.step``: full distribution + sampling),
    batch 1, after each of ``positions`` tokens of random text. The positions take turns
    step by step, so a change in machine load affects them alike."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    n = max(positions) + steps + 3
    text = torch.randint(0, model.vocab_size, (1, n), generator=gen).to(device)
    with evaluating(model):
        states = {p: prefill(model, text[:, :p], window) for p in positions}
        times: dict[int, list[float]] = {p: [] for p in positions}
        for i in range(steps + 2):
            for p in positions:
                t0 = time.perf_counter()
                out = model.step(text[:, p + i], states[p])
                torch.multinomial(out.log_probs.exp(), 1)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i >= 2:  # warm-up
                    times[p].append(time.perf_counter() - t0)
                states[p] = out.state
    return {p: 1000.0 * statistics.median(t) for p, t in times.items()}


@torch.inference_mode()
def micronet_profile(model: TransformerLM, n_tokens: int = 16, seed: int = 0
                     ) -> dict[str, Any]:
    """MicroNet score of ``model`` (MicroNet §2.1; :mod:`dynaseq.metrics.micronet`).

    - ``params_storage``: 32-bit-equivalent parameter storage (QAT widths, sparse tensors
      counted by the challenge rules; Hebbian counts are buffers needed only in training).
    - ``ops_per_token``: math operations of :meth:`TransformerLM.step` (one token in, the
      full next-word distribution out), counted by :class:`MicroNetOpCounter` over
      ``n_tokens`` random tokens fed one at a time after C tokens have filled the per-layer
      caches; ``mults`` (quantized multiplies at b/32; exp/div/log count as multiplies) and
      ``adds`` (32-bit) per token. A run with a neural cache adds
      :meth:`NeuralCache.ops_per_token` for a full cache and the full distribution
      (its exps and divisions counted with the multiplies).
    - ``score`` = params_storage / 159M + ops_per_token.total / 318M.
    """
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    c = model.context
    text = torch.randint(0, model.vocab_size, (1, c + n_tokens), generator=gen).to(device)
    with evaluating(model):
        state = prefill(model, text[:, :c], c)
        counter = MicroNetOpCounter(model)
        with counter:
            for t in range(n_tokens):
                state = model.step(text[:, c + t], state).state
    mults = counter.counts.mults32 / n_tokens
    adds = counter.counts.adds32 / n_tokens
    if model.cache is not None:
        ops = model.cache.ops_per_token(model.d_model, vocab_size=model.vocab_size)
        mults += ops.mults + ops.exps + ops.divs
        adds += ops.adds
    storage = parameter_storage(model).total
    score = micronet_score(storage, mults + adds)
    return {"params_storage": storage,
            "ops_per_token": {"mults": mults, "adds": adds, "total": mults + adds},
            "score": score.score}


def profile_lm(model: TransformerLM, positions: tuple[int, ...] = (100, 10_000),
               steps: int = 20) -> dict[str, Any]:
    """Params, MACs per token, ms per generated token at each of ``positions`` and the
    MicroNet score (``micronet``, :func:`micronet_profile`)."""
    ms = {str(p): v for p, v in step_ms(model, positions, steps).items()}
    first, last = ms[str(positions[0])], ms[str(positions[-1])]
    return {
        "params": count_params(model),
        "context": model.context,
        "macs_per_token": lm_macs_per_token(model),
        "ms_per_token": ms,
        "ratio_last_first": last / first,
        "micronet": micronet_profile(model),
        "device": str(next(model.parameters()).device),
        "precision": precision_of(model),
        "threads": torch.get_num_threads(),
    }
