"""Load a run directory and translate, score or evaluate text with it.

Example::

    import dynaseq
    t = dynaseq.load("runs/demo/run")
    t.translate(["kalo mintu sum 3 4 end"], beam=4)
    t.translate(["kalo mintu sum 3 4 end", "sum 1 2 end"], budget=[1.0, 0.5])  # CCT: per row

A budget is an argument of each call, looked up per row (control symbol and calibrated gate
offsets, :class:`~dynaseq.techniques.cct.gating.BudgetControl`) and never written into the model:
one batch may hold rows at different budgets, and threads may share one Translator.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import sacrebleu
import torch
from torch import nn

from dynaseq.core.arguments import as_real, check_int, check_number, check_text
from dynaseq.core.checkpoint import load_weights, read_meta
from dynaseq.core.errors import DynaseqError
from dynaseq.core.progress import progress_bar
from dynaseq.data import Tokenizer, collate, collate_source, make_corpus
from dynaseq.metrics.macs import pair_macs, ptr
from dynaseq.models.lean import LeanDecoder
from dynaseq.models.search import (
    Counted,
    Expires,
    Sentences,
    beam_search,
    counted_greedy_search,
    greedy_search,
    refilled_greedy_search,
)
from dynaseq.nn.lean_step import autocast_on, refreshed
from dynaseq.nn.losses import label_smoothed_loss
from dynaseq.nn.modes import evaluating
from dynaseq.nn.outputs import AuxOutputs
from dynaseq.tasks.loading import ShortRepr, load_predictor
from dynaseq.tasks.translation.config import (
    TASK,
    DecodeConfig,
    ModelConfig,
    RunConfig,
    length_penalty_bound,
)
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.techniques.branching import merge_shared_
from dynaseq.techniques.cct.calibration import BudgetCalibration, budget_offsets, same_budget
from dynaseq.techniques.cct.calibration_file import (
    read_calibrations,
    save_calibrations,
)
from dynaseq.techniques.cct.gating import (
    ALL_GATES_ON,
    GATE_SUBNETWORKS,
    BudgetControl,
    every_gate_open,
)

BatchCounts = Callable[[list[int], torch.Tensor, AuxOutputs, dict[str, torch.Tensor]], None]
"""``on_batch(idx, src, aux, counts)`` of :func:`decode_corpus`: the input indices of a
decoded batch, its source ``(B, S)`` as decoded, the encoder's records (``aux``) and each
row's decoding counts (:meth:`~dynaseq.nn.lean_step.StepTally.counts`)."""



@dataclass(frozen=True)
class LinesDone:
    """Sentences of a :func:`decode_corpus` batch whose search ended at one step, while it
    goes on for the others.

    idx: their indices in the corpus; tokens: their final tokens (no bos/eos); src: the
    batch's source ``(B, S)`` as decoded; rows: their rows in it; counted: what the decode
    counted so far (``on_batch``'s counting: final for these rows), or None; batch: the
    batch's number in the call (from 0, in the order :func:`budget_batches` gives).
    """

    idx: list[int]
    tokens: list[list[int]]
    src: torch.Tensor
    rows: list[int]
    counted: Counted | None = None
    batch: int = 0


Control = int | torch.Tensor | BudgetControl | None
"""A corpus call's control: one for every sentence (an id, or a :class:`BudgetControl` with
one id and float offsets), or one per sentence (``(N,)`` ids, or a :class:`BudgetControl`
with ``(N,)`` ids and offsets)."""


def _tensor_parts(control: Control) -> list[torch.Tensor]:
    """The tensors of ``control``: a :class:`BudgetControl`'s per-row ids and offsets, or
    the ``(N,)`` ids themselves."""
    if isinstance(control, BudgetControl):
        return [v for v in (control.ids, *control.offsets.values())
                if isinstance(v, torch.Tensor)]
    return [control] if isinstance(control, torch.Tensor) else []


def _per_row(control: Control, n: int) -> list[torch.Tensor]:
    """The per-sentence parts of ``control`` (ids, offsets), each checked to be ``(n,)``;
    ``[]`` where one control serves every sentence."""
    per_row = _tensor_parts(control)
    for v in per_row:
        if v.shape != (n,):
            raise ValueError(f"a per-sentence control needs one entry per sentence, shape "
                             f"({n},), got {tuple(v.shape)}")
    return per_row


def budget_batches(control: Control, lengths: Sequence[int], batch_size: int
                   ) -> list[list[int]]:
    """The batches, as sentence indices, in which :func:`decode_corpus` decodes sentences of
    ``lengths``: consecutive ``batch_size`` sentences by length, and, where ``control`` gives
    each sentence its own budget, by budget first (its control id and offsets), so that a
    batch holds one budget where the corpus allows (and then runs as that budget's call,
    :func:`one_budget`).

    Why: a decoding step's gated sub-layers run for a batch whenever one of its rows opens
    them, through the gathers and per-row decisions of the mixed path, and rows at the full
    budget alone skip the control networks. On the Multi30k CCT, 192 lines (72 at (1, 1),
    120 at (.2, .2)) took 0.81x the time of length-sorted mixed batches batched by budget
    (``benchmarks/results/mixed_budgets_multi30k.md``). One batch that mixes two budgets is
    left as it is: decoded as its budgets' two parts it took 1.10x the mixed batch's time
    there (0.79x on the smaller demo model, ``mixed_budgets.md``)."""
    n = len(lengths)
    per_row = _per_row(control, n)
    if not per_row:
        order = sorted(range(n), key=lambda i: lengths[i])
    else:
        keys = list(zip(*(v.tolist() for v in per_row), strict=True))
        order = sorted(range(n), key=lambda i: (keys[i], lengths[i]))
    return [order[k: k + batch_size] for k in range(0, n, batch_size)]


def control_rows(control: Control, n: int, idx: list[int],
                 device: torch.device) -> Control:
    """The control of the sentences ``idx`` of a corpus of ``n`` (see :data:`Control`)."""
    per_row = _per_row(control, n)
    if not per_row:
        return control  # one for every sentence
    index = torch.tensor(idx, dtype=torch.long, device=per_row[0].device)
    if isinstance(control, BudgetControl):
        return control.select(index)
    return control.index_select(0, index).to(device)


def one_budget(control: Control) -> Control:
    """A per-row :class:`BudgetControl` whose rows all have one budget, as that budget's
    control for every row (one id, float offsets), so that its batch takes the paths of one
    budget: offsets of +inf run no control networks (:func:`~dynaseq.techniques.cct.
    lean_step._fixed`), where a per-row tensor of +inf ran them and compared every gate.
    The same gates open: a float offset is the tensor's float32 value. Other controls as
    they are."""
    if not isinstance(control, BudgetControl):
        return control
    parts = _tensor_parts(control)
    if not parts or any(v.numel() == 0 or bool((v != v[0]).any()) for v in parts):
        return control
    ids = control.ids if isinstance(control.ids, int) else int(control.ids[0])
    return BudgetControl(ids, {k: float(v[0]) if isinstance(v, torch.Tensor) else v
                               for k, v in control.offsets.items()})


def check_decode(model: nn.Module, beam: int, length_penalty: float) -> None:
    """Refuse (:class:`DynaseqError`) a beam wider than ``model``'s target vocabulary or,
    for beam search, a length penalty whose ``n^lp`` leaves float range for an output as
    long as the model's positions allow (:func:`length_penalty_bound`)."""
    vocab = model.decoder.output_proj.out_features
    if beam > vocab:
        raise DynaseqError(f"beam {beam} is wider than the target vocabulary ({vocab} tokens)")
    bound = length_penalty_bound(model.decoder.positions.max_positions)
    if beam > 1 and not abs(length_penalty) <= bound:
        raise DynaseqError(f"length penalty must be within +-{bound:g}, got {length_penalty}")


def check_pairs(src: list[str], ref: list[str]) -> None:
    """Refuse (:class:`DynaseqError`) sources or references that are not lists of text
    (:func:`~dynaseq.data.tokenizer.check_text`), or lists of different lengths."""
    check_text(src)
    check_text(ref)
    if len(src) != len(ref):
        raise DynaseqError(f"source has {len(src)} lines but reference has {len(ref)}")


def decode_settings(d: DecodeConfig, beam: int | None, length_penalty: float | None,
                    batch_size: int | None, max_len_a: float | None,
                    max_len_b: int | None) -> dict[str, Any]:
    """The search settings of one call, each None taken from the run's ``decode`` section,
    as :func:`decode_corpus`'s keywords; a :class:`DynaseqError` for a beam or batch size
    that is not a positive integer, or a length limit that is negative or not a number."""
    out = {"beam": d.beam if beam is None else beam,
           "batch_size": d.batch_size if batch_size is None else batch_size,
           "length_penalty": d.length_penalty if length_penalty is None else length_penalty,
           "max_len_a": d.max_len_a if max_len_a is None else max_len_a,
           "max_len_b": d.max_len_b if max_len_b is None else max_len_b}
    for name in ("beam", "batch_size", "max_len_b"):
        out[name] = check_int(name, out[name], least=0 if name == "max_len_b" else 1)
    out["length_penalty"] = check_number("length_penalty", out["length_penalty"])
    out["max_len_a"] = check_number("max_len_a", out["max_len_a"], least=0)
    return out


def decode_corpus(model: nn.Module, src_ids: list[list[int]], *, beam: int = 1,
                  length_penalty: float = 1.0, max_len_a: float = 1.2, max_len_b: int = 10,
                  batch_size: int = 64, min_len: int = 0,
                  device: torch.device | None = None,
                  control: Control = None, progress: bool = False,
                  lean: LeanDecoder | None = None,
                  on_batch: BatchCounts | None = None,
                  expires: Sequence[Expires] | None = None,
                  on_done: Callable[[LinesDone], None] | None = None,
                  continuous: bool = False) -> list[list[int] | None]:
    """Decode token-id sentences (no eos) in batches (:func:`budget_batches`: by length, and
    by budget where each sentence has its own); output in input order.

    ``control``: the budget, for every sentence or per sentence (:data:`Control`); per
    sentence, the sentences are batched by budget, then by length (:func:`budget_batches`),
    and a batch mixes budgets only where one budget's sentences do not fill it.
    ``progress``: a bar of sentences on a terminal.
    ``lean``: :meth:`LeanDecoder.prepare` of ``model`` (dense models), whose decoding step
    the searches then run instead of the model's general one (same tokens, less work).
    ``on_batch``: greedy decoding through ``lean`` only: called after each batch with what
    its decode ran (:data:`BatchCounts`), but for a batch whose every row runs the full
    network (:meth:`BudgetControl.all_open`), which is decoded without counting: its rows
    ran every gate.
    ``expires``: one time per sentence (``time.perf_counter()`` seconds; ``inf``: never),
    or a function giving it at each step (:data:`~dynaseq.models.search.Expires`); a
    sentence still decoding then is dropped and gives None
    (:func:`~dynaseq.models.search.greedy_search`).
    ``on_done``: called as sentences finish (:class:`LinesDone`), before their batch ends.
    ``continuous``: greedy decoding through ``lean``, the rows of finished sentences
    refilled with the next ones (in the same order) while the others go on
    (:func:`~dynaseq.models.search.refilled_greedy_search`, ``batch_size`` rows); the same
    tokens, up to float rounding. Not with ``on_batch``, ``expires`` or ``on_done``.
    A beam wider than the vocabulary, or a length penalty that would overflow, is a
    :class:`DynaseqError` (:func:`check_decode`).
    """
    if expires is not None and len(expires) != len(src_ids):
        raise ValueError(f"expires needs one time per sentence: {len(src_ids)} sentences, "
                         f"{len(expires)} times")
    check_decode(model, beam, length_penalty)
    if on_batch is not None and (beam != 1 or lean is None):
        raise ValueError("per-batch counts come from greedy decoding through a lean decoder")
    assert lean is None or lean.model is model, "a lean decoder of this model"
    searcher = model if lean is None else lean
    device = device or next(model.parameters()).device
    max_pos = model.encoder.positions.max_positions
    out: list[list[int] | None] = [[] for _ in src_ids]
    if continuous:
        if beam != 1 or lean is None or on_batch or expires is not None or on_done:
            raise ValueError("continuous decoding is greedy, through a lean decoder, with no "
                             "per-batch counts, expiry or per-line callback")
        order = [i for idx in budget_batches(control, [len(s) for s in src_ids], batch_size)
                 for i in idx]
        with evaluating(model), progress_bar(len(src_ids), "sent", "decode", progress) as bar:
            def refill(limit: int) -> Sentences | None:
                take, order[:limit] = order[:limit], []
                if not take:
                    return None
                src = collate_source([src_ids[i][: max_pos - 1] for i in take],
                                     model.pad_id, model.eos_id).to(device)
                return Sentences(take, src, one_budget(control_rows(control, len(src_ids),
                                                                    take, device)))

            def finished(i: int, tokens: list[int]) -> None:
                out[i] = tokens
                bar.update(1)

            refilled_greedy_search(lean, refill, finished, max_rows=batch_size,
                                   max_len_a=max_len_a, max_len_b=max_len_b, min_len=min_len,
                                   max_positions=max_pos)
        return out
    with evaluating(model), progress_bar(len(src_ids), "sent", "decode", progress) as bar:
        for number, idx in enumerate(budget_batches(control, [len(s) for s in src_ids],
                                                    batch_size)):
            src = collate_source([src_ids[i][: max_pos - 1] for i in idx],
                                 model.pad_id, model.eos_id).to(device)
            rows = one_budget(control_rows(control, len(src_ids), idx, device))
            due = None if expires is None else [expires[i] for i in idx]
            done = (None if on_done is None else
                    partial(_lines_done, on_done, idx, src, batch=number))
            if beam == 1:
                kw = {"max_len_a": max_len_a, "max_len_b": max_len_b, "min_len": min_len,
                      "max_positions": max_pos, "control": rows, "expires": due}
                if on_batch is None or every_gate_open(rows, len(idx)):
                    hyps = greedy_search(searcher, src, on_done=done, **kw)
                else:
                    hyps, counted = counted_greedy_search(searcher, src, on_counted=done, **kw)
                    on_batch(idx, src, *counted)
            else:
                hyps = beam_search(searcher, src, beam, length_penalty, max_len_a, max_len_b,
                                   min_len, max_pos, rows, expires=due, on_done=done)
            for i, h in zip(idx, hyps, strict=True):
                out[i] = h
            bar.update(len(idx))
    return out


def _lines_done(on_done: Callable[[LinesDone], None], idx: list[int], src: torch.Tensor,
                rows: list[int], tokens: list[list[int]], counted: Counted | None = None, *,
                batch: int = 0) -> None:
    """A search's ``on_done`` (``rows`` of its batch ``src``, number ``batch``) as
    :func:`decode_corpus`'s."""
    on_done(LinesDone([idx[r] for r in rows], tokens, src, rows, counted, batch))


@torch.inference_mode()
def score_corpus(model: nn.Module, src_ids: list[list[int]], tgt_ids: list[list[int]],
                 max_len: int, max_tokens: int = 4096, device: torch.device | None = None,
                 control: Control = None) -> dict[str, float]:
    """Teacher-forced NLL per target token (eos included) and perplexity.

    ``control``: the budget, for every pair or per pair (:data:`Control`). Pairs with an
    empty side are not scored.
    """
    from dynaseq.data import token_batches

    device = device or next(model.parameters()).device
    if len(src_ids) != len(tgt_ids):
        raise DynaseqError(f"{len(src_ids)} source sentences but {len(tgt_ids)} targets")
    kept = [i for i, (s, t) in enumerate(zip(src_ids, tgt_ids, strict=True)) if s and t]
    corpus, _ = make_corpus([src_ids[i] for i in kept], [tgt_ids[i] for i in kept], max_len,
                            long_lines="truncate")
    assert len(corpus) == len(kept), "truncation keeps every non-empty pair"
    if len(corpus) == 0:
        raise DynaseqError("nothing to score: every sentence pair has an empty source or "
                           "target")
    nll_sum, n_tok = 0.0, 0
    with evaluating(model):
        for idx in token_batches(corpus.src_lengths(), corpus.tgt_lengths(), max_tokens,
                                 seed=0, epoch=0, shuffle=False):
            b = collate(corpus, idx, model.pad_id, model.bos_id, model.eos_id).to(device)
            rows = control_rows(control, len(src_ids), [kept[i] for i in idx], device)
            _, nll, n = label_smoothed_loss(model(b.src, b.tgt_in, rows).logits, b.tgt_out, 0.0,
                                            model.pad_id)
            nll_sum += float(nll)
            n_tok += n
    loss = nll_sum / n_tok
    return {"loss": loss, "ppl": math.exp(loss), "n_tokens": n_tok}


Budget = float | tuple[float, float] | None
"""One budget: a fraction for encoder and decoder alike, an ``(encoder, decoder)`` pair, or
None (the largest trained budget)."""
Budgets = Budget | list[Budget]
"""A call's budget: one :data:`Budget` for every line, or a list with one per line."""


def model_kind(cfg: ModelConfig) -> str:
    """``"a CCT model"``, ``"a DMB model"``, ``"a MoE model"`` or ``"a dense model"``."""
    if cfg.cct is not None:
        return "a CCT model"
    return ("a DMB model" if cfg.dmb is not None else "a MoE model"
            if cfg.moe is not None else "a dense model")


def control_for_budget(cfg: ModelConfig, budget: Budget = None) -> int | None:
    """The control-symbol id of a trained budget.

    ``budget``: one fraction for encoder and decoder alike, an ``(encoder, decoder)`` pair,
    or None for the largest trained budget. Dense models take no budget (None -> None).
    """
    if cfg.cct is None:
        if budget is not None:
            raise DynaseqError(f"this is {model_kind(cfg)}, which has no compute-budget knob "
                               "(train it with a model.cct section to get one)")
        return None
    trained = cfg.cct.controls
    if budget is None:
        return cfg.cct.largest_control
    pair = budget_pair(budget)
    for i, trained_pair in enumerate(trained):
        if same_budget(trained_pair, pair):
            return i
    names = ", ".join(f"({e:g}, {d:g})" for e, d in trained)
    raise DynaseqError(f"budget ({pair[0]:g}, {pair[1]:g}) was not trained; "
                       f"trained (encoder, decoder) budgets: {names}")


def budget_pair(budget: float | tuple[float, float]) -> tuple[float, float]:
    """``0.33`` -> ``(0.33, 0.33)``; an ``(encoder, decoder)`` pair as floats, each in (0, 1]."""
    one = isinstance(budget, numbers.Real) or (isinstance(budget, torch.Tensor)
                                               and budget.dim() == 0)  # numpy's, torch's
    if isinstance(budget, str | bytes | bytearray | Mapping | Set):  # no pair, read as one
        raise DynaseqError(f"a budget is one fraction or an (encoder, decoder) pair, got "
                           f"{budget!r}")
    try:
        pair = (as_real(budget),) * 2 if one else tuple(as_real(b) for b in budget)
    except (TypeError, ValueError, RuntimeError):
        raise DynaseqError(f"a budget is one fraction or an (encoder, decoder) pair, got "
                           f"{budget!r}") from None
    if len(pair) != 2:
        raise DynaseqError(f"a budget is one fraction or an (encoder, decoder) pair, got "
                           f"{budget}" + ("; one budget per line is a list" if len(pair) > 2
                                          else ""))
    if not all(0 < b <= 1 for b in pair):
        raise DynaseqError(f"a budget is a fraction in (0, 1], got {budget}")
    return pair


def bleu(hyps: list[str], refs: list[str]) -> tuple[float, str]:
    """Corpus sacreBLEU on detokenized text: (score, signature)."""
    metric = sacrebleu.BLEU()
    result = metric.corpus_score(hyps, [refs])
    return float(result.score), str(metric.get_signature())


@dataclass(repr=False)
class Translator(ShortRepr):
    """A trained model with its tokenizer and config, ready for inference.

    :meth:`load` folds the shared part of a DMB model's branches into each branch
    (``merge_shared_``), so the loaded model's state dict has no ``shared_*`` entries.
    A checkpoint written by ``dynaseq quantize`` (``meta.json`` ``"quantization": "int8"``)
    loads as the int8 model of :mod:`dynaseq.compress.int8`, on the CPU.

    ``calibrations`` (CCT models): the run's ``calibration.json`` for the loaded checkpoint
    (:meth:`calibrate`); a calibrated budget runs with its gate offsets, and an untrained
    budget can be run once it is calibrated.

    Budgets are arguments of each call (``budget=0.5``, or a list with one per line), looked
    up per row and passed to the model with the call (:meth:`control_for`); the model is
    never modified, so threads may translate at different budgets on one Translator.

    ``fast_decode``: dense models decode through a :class:`~dynaseq.models.lean.LeanDecoder`
    (prepared on first use, and again whenever the model's weights changed since); False
    runs the model's general decoding step (same tokens, for tests and timings).
    """

    #: the run files an exported model carries besides config and weights (the tokenizer)
    EXPORT_FILES: ClassVar[tuple[str, ...]] = ("spm.model", "spm.vocab")

    model: nn.Module
    tokenizer: Tokenizer
    config: RunConfig
    device: torch.device
    checkpoint: Path
    calibrations: list[BudgetCalibration] = field(default_factory=list)
    fast_decode: bool = True
    #: the SHA-256 of the weights loaded (calibrations are tied to it)
    weights_sha256: str | None = field(default=None, compare=False)
    _lean: LeanDecoder | None = field(default=None, init=False, repr=False, compare=False)

    def lean_decoder(self) -> LeanDecoder | None:
        """The lean decoder translation runs with (None: the model's general step, for
        models that are not dense, with ``fast_decode`` off or inside the caller's
        ``torch.autocast``: :func:`~dynaseq.nn.lean_step.autocast_on`); prepared once and
        reused while the model's weights stay as they were."""
        if not self.fast_decode or autocast_on(self.model):
            return None
        self._lean = refreshed(self._lean, LeanDecoder.prepare, self.model)
        return self._lean

    def budget_setting(self, budget: Budget = None) -> tuple[int | None, BudgetCalibration | None]:
        """The control-symbol id a budget runs with, and its calibration (None if none).

        A calibrated budget (trained or not) takes its calibration's control and offsets;
        otherwise it must be a trained budget (``None``: the largest), else an error names
        the trained and the calibrated budgets.
        """
        cfg = self.config.model
        if cfg.cct is None:
            return control_for_budget(cfg, budget), None
        pair = (cfg.cct.controls[control_for_budget(cfg)] if budget is None
                else budget_pair(budget))
        for cal in self.calibrations:
            if same_budget(cal.budget, pair):
                return cal.control, cal
        try:
            return control_for_budget(cfg, pair), None
        except DynaseqError as e:
            names = ", ".join(f"({c.budget[0]:g}, {c.budget[1]:g})" for c in self.calibrations)
            raise DynaseqError(f"{e}{'; calibrated: ' + names if names else ''} (dynaseq "
                               f"calibrate --budgets {pair[0]:g},{pair[1]:g} can fit it)"
                               ) from None

    def control_for(self, budget: Budgets = None, n_rows: int | None = None) -> Control:
        """The ``control`` argument that runs a call at ``budget``.

        One budget: its control-symbol id, or, when calibrated or 1 for a sub-network, a
        :class:`BudgetControl` with that id and the offsets (every row alike): the
        calibration's, and every gate open where the budget is 1
        (:func:`~dynaseq.techniques.cct.calibration.budget_offsets`). A list: one budget
        per row (``n_rows`` of them, if given), as a :class:`BudgetControl` with ``(N,)``
        ids and offsets, each budget looked up once. Dense models: None. Raises
        :class:`DynaseqError` for a budget neither trained nor calibrated, out of (0, 1], or
        a list of the wrong length.
        """
        if not isinstance(budget, list):
            control, cal = self.budget_setting(budget)
            offsets = self._offsets(control, cal)
            return BudgetControl(control, offsets) if offsets else control
        if n_rows is not None and len(budget) != n_rows:
            raise DynaseqError(f"{len(budget)} budgets for {n_rows} lines: give one budget, "
                               "or a list with one per line")
        if self.config.model.cct is None:
            for b in budget:
                control_for_budget(self.config.model, b)  # a dense model takes no budget
            return None
        settings: dict[object, tuple[int, BudgetCalibration | None]] = {}
        rows = []
        for b in budget:
            key = None if b is None else budget_pair(b)
            if key not in settings:
                settings[key] = self.budget_setting(b)
            rows.append(settings[key])
        return BudgetControl.per_row([c for c, _ in rows],
                                     [self._offsets(c, cal) for c, cal in rows],
                                     device=self.device)

    def _offsets(self, control: int | None, cal: BudgetCalibration | None) -> dict[str, float]:
        """The gate offsets of a budget's calls: the calibration's, with every gate open in a
        sub-network whose budget is 1 (:func:`budget_offsets`). Dense models: none."""
        if control is None:
            return {}
        budget = cal.budget if cal is not None else self.config.model.cct.controls[control]
        return budget_offsets(budget, cal)

    @contextlib.contextmanager
    def at_budget(self, budget: Budgets = None) -> Iterator[Control]:
        """Yields :meth:`control_for` ``(budget)``, the ``control`` argument to pass to the
        model or to the search (kept for ``with t.at_budget(b) as control:`` callers;
        nothing is applied to the model, the offsets travel in the yielded value)."""
        yield self.control_for(budget)

    @classmethod
    def load(cls, run_dir: str | Path, checkpoint: str = "auto",
             device: str = "auto", precision: str = "fp32") -> Translator:
        def weights(model: nn.Module, ckpt: Path,
                    dev: torch.device) -> tuple[nn.Module, torch.device]:
            if read_meta(ckpt).get("quantization") == "int8":  # written by `dynaseq quantize`
                from dynaseq.compress.int8 import load_int8

                if dev.type != "cpu" and device != "auto":
                    raise DynaseqError("an int8 model runs on the CPU only (use --device cpu)")
                return load_int8(model, ckpt), torch.device("cpu")
            load_weights(model, ckpt)
            # DMB: checkpoints keep θ_S and θ_Pk apart (training resumes from them); inference
            # folds θ_S into every branch (same outputs, no shared parameters left to add)
            merge_shared_(model)
            return model.to(dev).eval(), dev

        return load_predictor(
            run_dir, checkpoint, device, {TASK: RunConfig}, "translation",
            vocabulary=lambda run: Tokenizer.load(run / "spm.model"), weights=weights,
            build=lambda cfg, tok: build_seq2seq(cfg.model, tok.vocab_size, tok.pad_id,
                                                 tok.bos_id, tok.eos_id),
            make=lambda r: cls(r.model, r.vocab, r.config, r.device, r.checkpoint,
                               read_calibrations(r.run, r.checkpoint, r.model.n_controls,
                                                 parts=2, digest=r.digest),
                               weights_sha256=r.digest),
            precision=precision)

    def translate(self, lines: list[str], beam: int | None = None,
                  length_penalty: float | None = None, batch_size: int | None = None,
                  max_len_a: float | None = None, max_len_b: int | None = None,
                  budget: Budgets = None, progress: bool = False) -> list[str]:
        """Translate raw sentences; returns detokenized sentences in the same order.

        An empty line, or one with no subwords (all whitespace, say), translates to an
        empty line. ``budget`` (CCT
        models): a trained or calibrated compute budget, ``0.33`` or ``(1.0, 0.33)``,
        default the largest; or a list with one budget per line (``[1.0, 0.5, (1.0, 0.33)]``),
        batched by budget where the lines allow (:func:`budget_batches`). ``progress``: a
        bar on a terminal.
        """
        check_text(lines)
        settings = decode_settings(self.config.decode, beam, length_penalty, batch_size,
                                   max_len_a, max_len_b)
        control = self.control_for(budget, len(lines))
        keep, ids = self.tokenizer.encode_kept(lines)
        if isinstance(control, BudgetControl) and isinstance(budget, list):  # per line
            control = control.select(torch.tensor(keep, dtype=torch.long, device=self.device))
        hyps = decode_corpus(self.model, ids, **settings, device=self.device, control=control,
                             progress=progress, lean=self.lean_decoder())
        out = [""] * len(lines)
        for i, text in zip(keep, self.tokenizer.decode(hyps), strict=True):
            out[i] = text
        return out

    def score(self, src: list[str], ref: list[str], budget: Budgets = None) -> dict[str, float]:
        """Teacher-forced loss (NLL per target token) and perplexity of the references;
        ``budget`` as in :meth:`translate` (a list: one per sentence pair)."""
        check_pairs(src, ref)
        return score_corpus(self.model, self.tokenizer.encode(src), self.tokenizer.encode(ref),
                            self.config.data.max_len, self.config.data.max_tokens, self.device,
                            self.control_for(budget, len(src)))

    def evaluate(self, src: list[str], ref: list[str], beam: int | None = None,
                 budget: Budgets = None, **kwargs) -> dict[str, object]:
        """sacreBLEU of the translations against ``ref`` plus the teacher-forced loss, and the
        DMB paper's performance-time ratio ``ptr`` = BLEU / sqrt(``macs_pair``) · 10^4, with
        ``macs_pair`` the Mult-Adds of a 30 -> 30-token pass, output layer included
        (:func:`~dynaseq.metrics.macs.pair_macs`; CCT models: every gate on).

        ``budget`` as in :meth:`translate`; with a list (one per line) ``budget`` and
        ``gate_offsets`` are reported per line, and the realized compute is over the lines,
        each at its own budget."""
        check_pairs(src, ref)
        if not src:
            raise DynaseqError("nothing to evaluate: no sentence pairs")
        hyps = self.translate(src, beam=beam, budget=budget, **kwargs)
        score, signature = bleu(hyps, ref)
        macs = pair_macs(self.model)
        result = {"bleu": score, "signature": signature, **self.score(src, ref, budget),
                  "n_sentences": len(src), "checkpoint": str(self.checkpoint),
                  "macs_pair": macs, "ptr": ptr(score, macs)}
        if self.config.model.cct is not None:
            if isinstance(budget, list):
                reports = [self.budget_report(b) for b in budget]
                result["budget"] = [r[0] for r in reports]
                result["gate_offsets"] = [r[1] for r in reports]
            else:
                result["budget"], result["gate_offsets"] = self.budget_report(budget)
            compute = self.realized_compute(src, ref, budget)
            result["realized_fraction"] = compute["fraction"]
            result["realized_macs_per_token"] = compute["macs_per_token"]
        if self.config.model.dmb is not None or self.config.model.moe is not None:
            from dynaseq.techniques.branching.usage import collapsed

            result["branch_usage"] = self.branch_usage(src, ref)
            result["collapsed"] = collapsed(result["branch_usage"])
        return result

    def budget_report(self, budget: Budget) -> tuple[list[float], dict[str, object] | None]:
        """``([enc, dec], offsets or None)`` that a budget of a CCT model runs at; an offset
        that opens every gate (a budget of 1) reads ``"+inf"`` (JSON has no infinity)."""
        control, cal = self.budget_setting(budget)
        pair = cal.budget if cal is not None else self.config.model.cct.controls[control]
        offsets = self._offsets(control, cal)
        return list(pair), {k: "+inf" if v == math.inf else v
                            for k, v in offsets.items()} or None

    def branch_usage(self, src: list[str], ref: list[str]) -> dict[str, list[float]]:
        """DMB / MoE models: share of the tokens each branch ran per gating unit, teacher
        forced on the references (:func:`~dynaseq.techniques.branching.usage.branch_usage`)."""
        from dynaseq.data import token_batches
        from dynaseq.techniques.branching.usage import branch_usage

        cfg = self.config.model
        if cfg.dmb is None and cfg.moe is None:
            raise DynaseqError(f"branch_usage is for DMB and MoE models; this is "
                               f"{model_kind(cfg)}")
        check_pairs(src, ref)
        corpus, _ = make_corpus(self.tokenizer.encode(src), self.tokenizer.encode(ref),
                                self.config.data.max_len, long_lines="truncate")
        m = self.model
        batches = (collate(corpus, idx, m.pad_id, m.bos_id, m.eos_id).to(self.device)
                   for idx in token_batches(corpus.src_lengths(), corpus.tgt_lengths(),
                                            self.config.data.max_tokens, seed=0, epoch=0,
                                            shuffle=False))
        return branch_usage(m, ((b.src, b.tgt_in) for b in batches), m.pad_id)

    def realized_compute(self, src: list[str], ref: list[str],
                         budget: Budgets = None, batch_size: int = 32) -> dict[str, object]:
        """CCT models: MACs the gated sub-layers ran on the references (teacher forced),
        per token and as a fraction of the same passes with every gate on; ``budget`` as
        in :meth:`translate` (a list: each pair at its own budget). The pairs run in padded
        batches of ``batch_size``, each counted over its own tokens (:meth:`_macs_ran`), as
        :func:`~dynaseq.techniques.cct.layers.realized_fraction` counts them one at a
        time."""
        from dynaseq.techniques.cct.layers import fraction_report

        if self.config.model.cct is None:
            raise DynaseqError("realized compute is reported for CCT models only")
        check_pairs(src, ref)
        batches = self._pair_batches(src, ref, batch_size)
        if not batches:
            raise DynaseqError("nothing to count: every sentence pair has an empty source "
                               "or target")
        control = self.control_for(budget, len(src) if isinstance(budget, list) else None)
        ids = control.ids if isinstance(control, BudgetControl) else control
        opened = BudgetControl(ids, dict.fromkeys(GATE_SUBNETWORKS, ALL_GATES_ON))
        pad = self.model.pad_id
        return fraction_report(self._macs_ran(batches, control),
                               self._macs_ran(batches, opened),
                               sum(int(b[0].ne(pad).sum()) for b in batches),
                               sum(int(b[1].ne(pad).sum()) for b in batches))

    def _pair_batches(self, src: list[str], ref: list[str], batch_size: int
                      ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The sentence pairs as padded, teacher-forced ``(src, tgt_in, lines)`` batches of
        ``batch_size`` by source length (a side longer than ``data.max_len`` cut to it);
        ``lines`` ``(B,)``: each row's index in ``src`` (pairs with an empty side are left
        out)."""
        batch_size = check_int("batch_size", batch_size)
        src_ids, ref_ids = self.tokenizer.encode(src), self.tokenizer.encode(ref)
        keep = [i for i, (s, r) in enumerate(zip(src_ids, ref_ids, strict=True)) if s and r]
        corpus, _ = make_corpus([src_ids[i] for i in keep], [ref_ids[i] for i in keep],
                                self.config.data.max_len, long_lines="truncate")
        m = self.model
        order = sorted(range(len(corpus)), key=lambda i: len(corpus.src[i]))
        out = []
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            b = collate(corpus, idx, m.pad_id, m.bos_id, m.eos_id)
            out.append((b.src.to(self.device), b.tgt_in.to(self.device),
                        torch.tensor([keep[j] for j in idx], device=self.device)))
        return out

    @torch.inference_mode()
    def _macs_ran(self, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  control: int | BudgetControl) -> dict[str, int]:
        """What the gated sub-networks ran on ``batches`` (:meth:`_pair_batches`) at
        ``control`` (one for every line, or per line of ``src``), each row counted over its
        own tokens (:func:`~dynaseq.techniques.cct.layers.realized_macs_by_row` with the
        padding left out): the count of one pair at a time (a
        :data:`~dynaseq.techniques.cct.calibration.Measure` once ``batches`` is bound)."""
        from dynaseq.techniques.cct.layers import realized_macs_by_row

        m, totals = self.model, {"encoder": 0, "decoder": 0}
        with evaluating(m):  # hard gates, which alone record what ran
            for s, t, lines in batches:
                rows = control.select(lines) if isinstance(control, BudgetControl) else control
                aux = m(s, t, rows).aux
                valid = {"encoder": s.ne(m.pad_id), "decoder": t.ne(m.pad_id)}
                for layer, per_row in realized_macs_by_row(aux, valid=valid).items():
                    totals[layer.split(".")[0]] += int(per_row.sum())
        return totals

    def calibrate(self, src: list[str], ref: list[str],
                  budgets: list[Budget] | None = None, tol: float = 0.005,
                  progress: bool = False, batch_size: int = 32) -> list[BudgetCalibration]:
        """Fit gate offsets so each budget's realized compute on these held-out pairs meets
        it (:func:`~dynaseq.techniques.cct.calibration.calibrate_budget`), keep them on this
        translator, and return them. ``budgets``: default every trained budget; an
        untrained one starts from the nearest trained control symbol. Use
        :meth:`save_calibration` to keep them with the run. The pairs run in padded batches
        of ``batch_size``, each counted over its own tokens (:meth:`_macs_ran`): the
        count of one pair at a time."""
        from dynaseq.techniques.cct.calibration import (
            calibrate_budget,
            distinct_budgets,
            merge_calibrations,
            nearest_control,
        )

        cct = self.config.model.cct
        if cct is None:
            raise DynaseqError(f"this is {model_kind(self.config.model)}, which has no "
                               "compute-budget knob to calibrate")
        check_pairs(src, ref)
        batches = self._pair_batches(src, ref, batch_size)
        if not batches:
            raise DynaseqError("nothing to calibrate on: every sentence pair has an empty "
                               "source or target")
        if budgets is not None and not isinstance(budgets, list):  # one budget
            budgets = [budgets]
        targets = (list(cct.controls) if budgets is None
                   else distinct_budgets([budget_pair(b) for b in budgets]))
        for pair in targets:
            if not all(0 < b <= 1 for b in pair):
                raise DynaseqError(f"a budget is a fraction in (0, 1], got {pair}")
        # a trained budget is its own nearest (distance 0): it keeps its control symbol
        fitted = []
        with progress_bar(len(targets), "budget", "calibrate", progress) as bar:
            for pair in targets:
                fitted.append(calibrate_budget(self.model, [],
                                               nearest_control(cct.controls, pair), pair,
                                               tol=tol, measure=partial(self._macs_ran,
                                                                        batches)))
                bar.update(1)
        self.calibrations = merge_calibrations(self.calibrations, fitted)
        return fitted

    def save_calibration(self, run_dir: str | Path, data: dict | None = None) -> Path:
        """Write :attr:`calibrations` to ``run_dir/calibration.json`` (atomically), tied to
        the loaded checkpoint; ``data`` describes the calibration data. ``run_dir`` must be
        a run or model directory, not the model shipped in the package (DynaseqError)."""
        return save_calibrations(run_dir, self.checkpoint, self.calibrations, data,
                                 self.weights_sha256)
