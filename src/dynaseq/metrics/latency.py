"""CPU/GPU latency of decoding a fixed-length sentence (the DMB paper's protocol)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from dynaseq.models.lean import LeanDecoder
from dynaseq.models.search import Counted, beam_search, counted_greedy_search, greedy_search
from dynaseq.nn.modes import evaluating


def median_ms(model: nn.Module, run: Callable[[], object], repeats: int) -> float:
    """Median wall time (ms) of ``repeats`` calls of ``run`` with ``model`` in eval mode,
    after one warm-up call (GPU work synchronized before each clock read); the model's
    training mode is restored."""
    device = next(model.parameters()).device
    times = []
    with evaluating(model):
        for i in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i > 0:
                times.append(time.perf_counter() - t0)
    return 1000.0 * statistics.median(times)


class AfterDecode(Protocol):
    """What a server does with each decoded batch besides decoding, timed with it (e.g. the
    realized compute of each line)."""

    def counts(self, control: Any, n_rows: int) -> bool:
        """Whether a greedy decode of ``n_rows`` rows at ``control`` through a lean decoder
        should count what it runs (:data:`Counted`), as the server's does."""

    def __call__(self, src: Tensor, hyps: list[list[int]], control: Any,
                 counted: Counted | None) -> object:
        """``src`` (B, S) padded with eos, the hypotheses (no bos/eos), ``control``, and
        what the decode counted (None where it did not)."""


def search(searcher: Any, src: Tensor, beam: int, after: AfterDecode | None,
           **kwargs: Any) -> tuple[list[list[int]], Counted | None]:
    """Greedy (``beam`` 1) or beam search of ``src`` with ``kwargs`` (the searches'), counting
    what it runs when ``after`` asks for it (greedy, a lean decoder): the hypotheses and
    the counts (or None)."""
    if beam != 1:
        return beam_search(searcher, src, beam=beam, **kwargs), None
    if not (after is not None and isinstance(searcher, LeanDecoder)
            and after.counts(kwargs.get("control"), src.size(0))):
        return greedy_search(searcher, src, **kwargs), None
    return counted_greedy_search(searcher, src, **kwargs)


@torch.inference_mode()
def decode_latency_ms(model: nn.Module, src_len: int = 30, tgt_len: int = 30, beam: int = 1,
                      batch: int = 1, repeats: int = 5, seed: int = 0,
                      control: object = None, lean: bool | LeanDecoder | None = None,
                      after: AfterDecode | None = None) -> float:
    """Median wall time (ms) to translate ``batch`` sentences of ``src_len`` tokens into
    exactly ``tgt_len`` tokens (eos is forbidden before, forced after), after one warm-up.

    Fixing the output length makes models comparable whatever they would generate.
    ``control``: the control-symbol id (trained budget) of a CCT model, or its
    :class:`~dynaseq.techniques.cct.gating.BudgetControl`. ``lean``: None (the default)
    decodes as translation does, through :class:`~dynaseq.models.lean.LeanDecoder` where the
    model has one (dense, CCT, DMB; prepared once, outside the timing) and the general step
    otherwise; True requires the lean step (a model without one is refused), False the
    general one; a prepared :class:`~dynaseq.models.lean.LeanDecoder` of ``model`` decodes
    through that one (a benchmark's variant of the lean step). ``after``: work timed with
    each decode (:class:`AfterDecode`).
    """
    device = next(model.parameters()).device
    vocab = model.decoder.output_proj.out_features
    gen = torch.Generator().manual_seed(seed)
    low = max(model.pad_id, model.bos_id, model.eos_id) + 1
    src = torch.randint(low, vocab, (batch, src_len), generator=gen)
    src[:, -1] = model.eos_id
    src = src.to(device)
    kwargs = {"max_len_a": 0.0, "max_len_b": tgt_len + 1, "min_len": tgt_len,
              "max_positions": model.decoder.positions.max_positions, "control": control}

    if isinstance(lean, LeanDecoder):
        if lean.model is not model:
            raise ValueError("lean must be a LeanDecoder of model")
        searcher = lean
    else:
        searcher = model if lean is False else LeanDecoder.prepare(model)
    if searcher is None:
        if lean:
            raise ValueError("this model has no lean decoding step (MoE, int8 CCT and "
                             "relative-position models keep the general one)")
        searcher = model

    def run() -> None:
        out, counted = search(searcher, src, beam, after, **kwargs)
        assert all(len(o) == tgt_len for o in out), "fixed-length decoding"
        if after is not None:
            after(src, out, control, counted)

    return median_ms(model, run, repeats)
