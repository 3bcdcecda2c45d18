"""Load a fine-tuned run and classify sentences (or pairs) with it, or evaluate it on a
labelled file with the task's official metrics.

Example::

    import dynaseq
    c = dynaseq.load("runs/sst2_small")                        # a Classifier
    c.classify(["a charming journey", "bleak and desperate"])  # ["1", "0"]
    c.classify(["A man plays.\tA person plays."])              # a pair task: tab-separated
    c.classify(lines, budget=0.5)                              # CCT-BERT: a trained budget
    c.evaluate("dev.tsv", keep_layers=3)                       # LayerDrop: 3 layers kept
    c.evaluate("glue/SST-2/dev.tsv")                           # {"accuracy": ..., ...}
    c.evaluate("dev.tsv", exit_rule="pabee", patience=2)       # a multi-exit model (PABEE)

A budget is an argument of each call (one for every line, or a list with one per line),
looked up per row and never written into the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from dynaseq.core.arguments import check_int, check_path, check_str, int_or
from dynaseq.core.errors import DynaseqError
from dynaseq.core.progress import progress_bar
from dynaseq.metrics.classification import classification_metrics, regression_metrics
from dynaseq.models.encoder import EncoderModel
from dynaseq.models.lean_encoder import LeanEncoder
from dynaseq.nn.lean_step import autocast_on, refreshed
from dynaseq.nn.modes import evaluating
from dynaseq.nn.outputs import AuxOutputs
from dynaseq.tasks.classify.config import TASK, ClassifyRunConfig
from dynaseq.tasks.classify.data import Row, collate_rows, encode_examples
from dynaseq.tasks.classify.glue import Examples, TableLayout, read_table
from dynaseq.tasks.encoder.budget import (
    Budget,
    Budgets,
    Gamma,
    Threshold,
    as_fraction,
    control_for,
    exit_for,
    layer_exit_for,
    layers_for,
    nearest_trained,
    trained_budget,
)
from dynaseq.tasks.encoder.model import build_encoder_model
from dynaseq.tasks.encoder.vocab import SPM_FILE, EncoderVocab
from dynaseq.tasks.loading import ShortRepr, load_predictor
from dynaseq.techniques.cct.calibration import (
    BudgetCalibration,
    calibrate_budget,
    distinct_budgets,
    merge_calibrations,
)
from dynaseq.techniques.cct.calibration_file import read_calibrations, save_calibrations
from dynaseq.techniques.cct.gating import ALL_GATES_ON, BudgetControl
from dynaseq.techniques.cct.layers import realized_macs_by_layer, realized_macs_by_row
from dynaseq.techniques.depth.exits import DEPTH_RUN, DepthExit
from dynaseq.techniques.depth.multi_exit import EXIT_LAYER, LayerExit

Exit = DepthExit | LayerExit | None
"""A call's early exit: adaptive depth's (γ or depth), a multi-exit model's per-layer rule,
or None."""
Patience = int | list[int] | None

Control = int | Tensor | BudgetControl | None
"""One control for every row (an id, or a :class:`BudgetControl` with float offsets), one per
row (``(N,)`` ids, or a BudgetControl with ``(N,)`` ids and offsets), or None (dense)."""


def _rows_control(control: Control, idx: list[int], device: torch.device) -> Control:
    index = torch.tensor(idx, device=device)
    if isinstance(control, BudgetControl):
        return control.select(index)
    if isinstance(control, Tensor):
        return control.to(device).index_select(0, index)
    return control


def _rows_exit(exit: Exit, idx: list[int]) -> Exit:
    """The exit of rows ``idx`` (a per-row γ, depth, threshold or patience is indexed, one
    for all is kept)."""
    return None if exit is None else exit.select(torch.tensor(idx))


@dataclass
class RealizedCompute:
    """What an adaptive encoder ran over :func:`predict_logits`' rows (it fills this in).

    CCT encoders (sub-layers without gates are not counted):
    ran, full: MACs executed, and what every gate on would execute, over all batches
        (:func:`realized_macs_by_layer`: the packed layout's padding slots included; from
        the lean pass, :meth:`add_rows`, the sum of the rows');
    tokens: the non-padding tokens;
    row_ran, row_full: ``(N,)`` long, in row order, the same per row over the row's own
        tokens (:func:`realized_macs_by_row` with the batch's padding left out: what the row
        costs alone, whatever budgets and lengths the other rows had);
    row_tokens: ``(N,)`` long, each row's non-padding tokens.

    Adaptive-depth and multi-exit encoders (early exit): layers: layer applications over
    all rows, the first group included; rows: the rows counted; row_layers: ``(N,)`` long,
    each row's.
    """

    ran: int = 0
    full: int = 0
    tokens: int = 0
    row_ran: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    row_full: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    row_tokens: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    layers: int = 0
    rows: int = 0
    row_layers: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def start(self, n_rows: int) -> None:
        """Zero every count for ``n_rows`` rows."""
        self.ran = self.full = self.tokens = self.layers = self.rows = 0
        self.row_ran, self.row_full, self.row_tokens, self.row_layers = (
            torch.zeros(n_rows, dtype=torch.long) for _ in range(4))

    def add(self, idx: list[int], tokens: Tensor, pad_id: int, ran: AuxOutputs,
            full: AuxOutputs) -> None:
        """Count one batch: rows ``idx`` as ``tokens`` ``(B, S)``, run at their budgets
        (``ran``) and with every gate on (``full``)."""
        index = torch.tensor(idx)
        self.ran += _macs_total(ran)
        self.full += _macs_total(full)
        valid = {"encoder": tokens.ne(pad_id)}
        self.row_ran[index] = _macs_per_row(ran, len(idx), valid)
        self.row_full[index] = _macs_per_row(full, len(idx), valid)
        n = tokens.ne(pad_id).sum(1).cpu()  # (B,)
        self.tokens += int(n.sum())
        self.row_tokens[index] = n

    def add_rows(self, idx: list[int], n_tokens: Tensor, row_ran: Tensor,
                 row_full: Tensor) -> None:
        """Count one batch from its rows' own numbers (the lean pass's gate counts): rows
        ``idx`` of ``n_tokens``, ``row_ran`` and ``row_full`` ``(B,)`` each; the totals
        are their sums (no packing slots: that pass packs nothing it counts)."""
        index = torch.tensor(idx)
        self.row_ran[index], self.row_full[index] = row_ran, row_full
        self.row_tokens[index] = n_tokens
        self.ran += int(row_ran.sum())
        self.full += int(row_full.sum())
        self.tokens += int(n_tokens.sum())

    def add_depth(self, idx: list[int], depth_run: Tensor, first_group: int) -> None:
        """Count one batch of early exit: rows ``idx`` ran (B,) adaptive layers each."""
        layers = depth_run.cpu() + first_group
        self.layers += int(layers.sum())
        self.rows += len(idx)
        self.row_layers[torch.tensor(idx)] = layers

    @property
    def avg_layers(self) -> float:
        return self.layers / self.rows


def _macs_total(aux: AuxOutputs) -> int:
    return sum(sum(c.values()) for c in realized_macs_by_layer(aux).values())


def _macs_per_row(aux: AuxOutputs, n_rows: int, valid: dict[str, Tensor]) -> Tensor:
    """(B,) long on the CPU: each row's MACs over every gated sub-layer, of its own
    (``valid``) positions."""
    total = torch.zeros(n_rows, dtype=torch.long)
    for per_row in realized_macs_by_row(aux, valid=valid).values():
        total += per_row.cpu()
    return total


def _sequence(lines: object) -> list:
    """``lines`` as a list, if it is a list or tuple of lines (not one string)."""
    if isinstance(lines, str) or not isinstance(lines, list | tuple):
        raise DynaseqError(f"lines must be a list of strings (or of pairs), not "
                           f"{type(lines).__name__}")
    return list(lines)


@torch.inference_mode()
def predict_logits(model: EncoderModel, rows: list[Row], batch_size: int,
                   device: torch.device, control: Control = None,
                   compute: RealizedCompute | None = None, progress: bool = False,
                   exit: Exit = None,
                   layers: tuple[int, ...] | None = None,
                   lean: LeanEncoder | None = None) -> Tensor:
    """(N, n_out) logits of the rows, in batches of similar length (output in row order).

    ``compute``: receives what ran (:class:`RealizedCompute`): for CCT models the MACs the
    gated sub-layers executed and would execute with every gate on, over the same batches,
    in total and per row; for an adaptive-depth or multi-exit model at an ``exit`` (early
    exit, one for every row or per row) the layers its rows ran. ``layers``: the plan
    positions to run (a model pruned to a fixed depth; None: all). ``progress``: a bar of
    rows on a terminal. ``lean``: :meth:`LeanEncoder.prepare` of ``model``, which runs the
    batches; it counts ``compute`` per row from its gates (:meth:`RealizedCompute.add_rows`),
    with no second pass. With an ``exit`` or ``layers`` the model's pass runs through its
    lean layers (:meth:`LeanEncoder.output`), unless gated compute is to be counted."""
    lean_layers = lean  # the model's pass through the lean layers (exits, layer subsets)
    if exit is not None or layers is not None:
        lean = None
        if compute is not None and model.n_controls:
            lean_layers = None  # the gate traces of the model's pass are counted
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    out = torch.empty(len(rows), model.head.n_out)
    if compute is not None:
        compute.start(len(rows))
    with evaluating(model), progress_bar(len(rows), "row", "classify", progress) as bar:
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            tokens, segments = (t.to(device) for t in
                                collate_rows([rows[j] for j in idx], model.pad_id))
            rows_control = _rows_control(control, idx, device)
            if lean is not None:
                counts = [] if compute is not None and model.n_controls else None
                logits = lean(tokens, segments, rows_control, counts)
                out[torch.tensor(idx)] = logits.float().cpu()
                if counts is not None:
                    n = tokens.ne(model.pad_id).sum(1)
                    compute.add_rows(idx, n.cpu(), *(t.cpu() for t in lean.row_macs(counts, n)))
                bar.update(len(idx))
                continue
            res = (model if lean_layers is None else lean_layers.output)(
                tokens, segments, rows_control, exit=_rows_exit(exit, idx), layers=layers)
            out[torch.tensor(idx)] = res.logits.float().cpu()
            if compute is not None:
                if model.n_controls:
                    ids = (rows_control.ids if isinstance(rows_control, BudgetControl)
                           else rows_control)
                    opened = BudgetControl(ids, {"encoder": ALL_GATES_ON})
                    full = model(tokens, segments, opened, layers=layers)
                    compute.add(idx, tokens, model.pad_id, res.aux, full.aux)
                if DEPTH_RUN in res.aux.traces:
                    compute.add_depth(idx, res.aux.traces[DEPTH_RUN][0],
                                      model.encoder.predictor.first_group)
                if EXIT_LAYER in res.aux.traces:  # multi-exit: every layer a row ran
                    compute.add_depth(idx, res.aux.traces[EXIT_LAYER][0], 0)
            bar.update(len(idx))
    return out


def depth_report(exit: DepthExit | LayerExit, compute: RealizedCompute,
                 layers: int) -> dict[str, object]:
    """What an early-exit evaluation reports: its exit (``gamma``/``depth``, or
    ``exit_rule`` and its ``threshold``/``patience``) and the layers its rows ran."""
    avg = compute.avg_layers
    if isinstance(exit, LayerExit):
        return {**exit.describe(), "avg_layers": avg, "depth_fraction": avg / layers}
    g, d = exit.gamma, exit.depth
    return {"gamma": g.tolist() if isinstance(g, Tensor) else g,
            "depth": d.tolist() if isinstance(d, Tensor) else d,
            "avg_layers": avg, "depth_fraction": avg / layers}


def keep_layers_report(layers: tuple[int, ...], depth: int) -> dict[str, object]:
    """What an evaluation pruned to a fixed depth reports: the kept plan positions and the
    layers every row ran (``avg_layers``, ``depth_fraction`` as for adaptive depth)."""
    return {"keep_layers": len(layers), "layers_run": list(layers),
            "avg_layers": float(len(layers)), "depth_fraction": len(layers) / depth}


def decide(logits: Tensor, layout: TableLayout) -> list[str] | list[float]:
    """Each row's label (argmax, in ``layout.labels``) or score (a regression)."""
    if layout.regression:
        return [float(x) for x in logits[:, 0]]
    return [layout.labels[int(i)] for i in logits.argmax(-1)]


def task_metrics(layout: TableLayout, gold: list, pred: list) -> dict[str, float]:
    """The layout's official metrics of ``pred`` against ``gold``."""
    if layout.regression:
        return regression_metrics(gold, pred, layout.metrics)
    return classification_metrics(gold, pred, layout.metrics, layout.positive)


@dataclass(repr=False)
class Classifier(ShortRepr):
    """A fine-tuned encoder with its vocabulary, config, checkpoint and table layout;
    ``calibrations``: the run's ``calibration.json`` for this checkpoint (CCT-BERT)."""

    #: the run files an exported model carries besides config and weights (the vocabulary)
    EXPORT_FILES: ClassVar[tuple[str, ...]] = (SPM_FILE, "spm.vocab")

    model: EncoderModel
    vocab: EncoderVocab
    config: ClassifyRunConfig
    checkpoint: Path
    device: torch.device
    calibrations: list[BudgetCalibration] = field(default_factory=list)
    #: classify through :class:`LeanEncoder` where the model has one (False: always the
    #: model's own forward pass; tests and benchmarks compare the two)
    fast_encode: bool = True
    #: the SHA-256 of the weights loaded (calibrations are tied to it)
    weights_sha256: str | None = field(default=None, compare=False)
    _lean: LeanEncoder | None = field(default=None, init=False, repr=False, compare=False)

    def lean_encoder(self) -> LeanEncoder | None:
        """The lean encoder classification runs with (None: the model's own forward, for
        models without one, with ``fast_encode`` off or inside the caller's
        ``torch.autocast``: :func:`~dynaseq.nn.lean_step.autocast_on`); prepared once and
        reused while the model's weights and modules stay as they were."""
        if not self.fast_encode or autocast_on(self.model):
            return None
        self._lean = refreshed(self._lean, LeanEncoder.prepare, self.model)
        return self._lean

    def _control(self, budget: Budgets, n_rows: int) -> Control:
        return control_for(self.config.model, budget, n_rows, self.device, self.calibrations)

    def budget_ran(self, budget: Budget) -> float | None:
        """The fraction a call at ``budget`` runs at (the largest trained one for None;
        None for a dense model). Raises DynaseqError for a budget outside (0, 1], one
        neither trained nor calibrated (naming those that are), or any budget of a dense
        model."""
        return trained_budget(self.config.model, budget, self.calibrations)

    def _exit(self, gamma: Gamma, depth: int | None, rule: str | None, threshold: Threshold,
              patience: Patience, n_rows: int) -> Exit:
        cfg = self.config.model  # each refuses its arguments on a model without its exits
        depth_exit = exit_for(cfg, gamma, depth, n_rows)
        layer_exit = layer_exit_for(cfg, rule, threshold, patience, n_rows)
        return depth_exit if depth_exit is not None else layer_exit

    @property
    def layout(self) -> TableLayout:
        return self.config.data.layout()

    @classmethod
    def load(cls, run_dir: str | Path, checkpoint: str = "auto",
             device: str = "auto", precision: str = "fp32") -> Classifier:
        def check(run: Path, cfg: ClassifyRunConfig) -> None:
            if cfg.data.layout().n_outputs < 1:
                raise DynaseqError(f"{run}: the config has no label set")

        return load_predictor(
            run_dir, checkpoint, device, {TASK: ClassifyRunConfig}, "classification",
            vocabulary=lambda run: EncoderVocab.load(run / SPM_FILE), check=check,
            build=lambda cfg, vocab: build_encoder_model(
                cfg.model, vocab.size, cfg.data.layout().n_outputs, vocab.pad_id),
            make=lambda r: cls(r.model, r.vocab, r.config, r.checkpoint, r.device,
                               read_calibrations(r.run, r.checkpoint, r.model.n_controls,
                                                 digest=r.digest),
                               weights_sha256=r.digest),
            precision=precision)

    def _examples(self, lines: list[str] | list[tuple[str, str]]) -> tuple[Examples, list[int]]:
        """Examples of the non-empty inputs and their indices. A pair task needs two
        tab-separated sentences (or a tuple) per line, each stripped (a pair with an empty
        side, ``"\\tb"``, is empty), a single-sentence task one (the line stripped first, so
        a trailing tab is white space)."""
        layout = self.layout
        for n, line in enumerate(_sequence(lines), start=1):
            for part in line if isinstance(line, tuple) else (line,):
                check_str(f"line {n}", part)
        a, b, keep = [], [], []
        for n, line in enumerate(lines):
            parts = (list(line) if isinstance(line, tuple)
                     else (line if layout.is_pair else line.strip()).split("\t"))
            trim = layout.is_pair and not isinstance(line, tuple)  # a line's stray tabs
            while trim and len(parts) > 2 and not parts[-1].strip():
                parts.pop()  # at its end (a spreadsheet's export)
            while trim and len(parts) > 2 and not parts[0].strip():
                parts.pop(0)  # or at its start
            if layout.is_pair and len(parts) != 2 and any(p.strip() for p in parts):
                raise DynaseqError(f"line {n + 1}: {layout.name} is a sentence-pair task: give "
                                   f"two tab-separated sentences per line")
            if not layout.is_pair and len(parts) != 1 and any(p.strip() for p in parts):
                raise DynaseqError(f"line {n + 1}: {layout.name} takes one sentence per line, "
                                   f"got {len(parts)} tab-separated fields")
            if not all(p.strip() for p in parts):
                continue  # an empty sentence: counted and skipped
            keep.append(n)
            a.append(parts[0].strip())
            if layout.is_pair:
                b.append(parts[1].strip())
        return Examples(a, b if layout.is_pair else None, skipped=len(lines) - len(keep)), keep

    def encode(self, lines: list[str] | list[tuple[str, str]]) -> tuple[list[Row], list[int]]:
        """The model input of each non-empty line and the lines' indices (``keep``). A pair
        task needs two tab-separated sentences (or a tuple) per line, a single-sentence task
        one: DynaseqError otherwise."""
        ex, keep = self._examples(lines)
        return encode_examples(self.vocab, ex, self.config.data.max_len), keep

    def classify_rows(self, rows: list[Row], budget: Budgets = None,
                      batch_size: int | None = None, progress: bool = False,
                      compute: RealizedCompute | None = None, gamma: Gamma = None,
                      depth: int | None = None, exit_rule: str | None = None,
                      threshold: Threshold = None, patience: Patience = None,
                      keep_layers: int | None = None) -> list[str | float]:
        """A label (or a regression score) per encoded row (:meth:`encode`), in order.

        ``budget``: one for every row or a list, one per row (batched together whatever
        their budgets); ``gamma``/``depth``: an adaptive-depth model's exit (default the
        run's γ), one or a list; ``exit_rule`` with its ``threshold`` or ``patience``: a
        multi-exit model's (default the run's), one or a list; ``keep_layers``: a fixed
        depth of a model without a predictor; ``compute``: receives what ran
        (:class:`RealizedCompute`)."""
        batch = int_or("batch_size", batch_size, self.config.data.batch_size)
        control = self._control(budget, len(rows))
        exit = self._exit(gamma, depth, exit_rule, threshold, patience, len(rows))
        layers = layers_for(self.config.model, keep_layers)
        if not rows:
            return []
        logits = predict_logits(self.model, rows, batch, self.device, control, compute,
                                progress, exit, layers, self.lean_encoder())
        return decide(logits, self.layout)

    def classify(self, lines: list[str] | list[tuple[str, str]], budget: Budgets = None,
                 batch_size: int | None = None, progress: bool = False,
                 gamma: Gamma = None, depth: int | None = None, exit_rule: str | None = None,
                 threshold: Threshold = None, patience: Patience = None,
                 keep_layers: int | None = None) -> list[str | float | None]:
        """A label (or a regression score) per line, in order; None for an empty line.

        ``budget`` (CCT models): a trained budget for every line, or a list, one per line
        (the lines are batched together whatever their budgets). ``gamma`` (adaptive-depth
        models; default the run's): the exit threshold, one or a list, one per line;
        ``depth``: a fixed number of adaptive layers instead. Multi-exit models
        (``model.exits``): ``exit_rule`` (``branchynet``, ``shallow-deep``, ``pabee``;
        default the run's) with its ``threshold`` or ``patience`` (default the run's; one, or
        a list, one per line). ``keep_layers`` (models without a structure predictor, e.g.
        trained with LayerDrop): run N of the layers, evenly spaced ("every other").
        ``progress``: a bar on a terminal."""
        lines = _sequence(lines)
        int_or("batch_size", batch_size, 0)  # refused before the lines are read
        self._control(budget, len(lines))  # a bad budget is refused before the lines
        self._exit(gamma, depth, exit_rule, threshold, patience, len(lines))  # a bad exit too
        layers_for(self.config.model, keep_layers)
        rows, keep = self.encode(lines)

        def kept(per_line):
            return [per_line[i] for i in keep] if isinstance(per_line, list) else per_line

        out: list[str | float | None] = [None] * len(lines)
        for i, value in zip(keep, self.classify_rows(
                rows, kept(budget), batch_size, progress, gamma=kept(gamma), depth=depth,
                exit_rule=exit_rule, threshold=kept(threshold), patience=kept(patience),
                keep_layers=keep_layers),
                            strict=True):
            out[i] = value
        return out

    def evaluate(self, path: str | Path, budget: Budgets = None,
                 batch_size: int | None = None, progress: bool = False,
                 gamma: Gamma = None, depth: int | None = None, exit_rule: str | None = None,
                 threshold: Threshold = None, patience: Patience = None,
                 keep_layers: int | None = None) -> dict[str, object]:
        """The official metrics on a labelled file in the run's layout (GLUE dev.tsv), the
        rows skipped for an empty sentence; for a CCT model the budget and the compute its
        gated sub-layers really ran (``realized_fraction`` of all gates on,
        ``realized_macs_per_token`` over the non-padding tokens); for an adaptive-depth model
        the exit (``gamma`` or ``depth``) and the layers rows really ran (``avg_layers``,
        first group included, and ``depth_fraction`` of the model's depth); for a multi-exit
        model the same with ``exit_rule`` and its ``threshold`` or ``patience``; pruned to
        ``keep_layers`` (see :meth:`classify`): ``keep_layers``, ``layers_run`` (the plan
        positions), ``avg_layers`` and ``depth_fraction``."""
        layout = self.layout
        batch = int_or("batch_size", batch_size, self.config.data.batch_size)
        check_path("path", path)
        ex = read_table(path, layout)
        if not len(ex):
            raise DynaseqError(f"{path}: every row has an empty sentence")
        control = self._control(budget, len(ex))
        exit = self._exit(gamma, depth, exit_rule, threshold, patience, len(ex))
        layers = layers_for(self.config.model, keep_layers)
        rows = encode_examples(self.vocab, ex, self.config.data.max_len)
        compute = RealizedCompute()
        logits = predict_logits(self.model, rows, batch, self.device, control, compute,
                                progress, exit, layers)
        result: dict[str, object] = {
            "task": layout.name, "path": str(path),
            **task_metrics(layout, ex.targets(), decide(logits, layout)),
            "n_examples": len(ex), "skipped": ex.skipped, "checkpoint": str(self.checkpoint)}
        if self.config.model.cct is not None:
            result["budget"] = ([self.budget_ran(b) for b in budget]
                                if isinstance(budget, list) else self.budget_ran(budget))
            ran = int(compute.row_ran.sum())  # each row over its own tokens: any batching
            result["realized_fraction"] = ran / int(compute.row_full.sum())
            result["realized_macs_per_token"] = ran / int(compute.row_tokens.sum())
        if exit is not None:
            result.update(depth_report(exit, compute, self.config.model.layers))
        if layers is not None:
            result.update(keep_layers_report(layers, self.config.model.layers))
        return result

    def calibrate(self, path: str | Path, budgets: list[float] | None = None,
                  lines: int = 300, tol: float = 0.005, batch_size: int = 32
                  ) -> list[BudgetCalibration]:
        """Fit one gate offset per budget so that its realized compute on the first
        ``lines`` rows of ``path`` (each row over its own tokens, as at batch 1) meets it
        (:func:`~dynaseq.techniques.cct.calibration.calibrate_budget`), keep them on this
        classifier and return them. ``budgets``: default every trained one; an untrained
        budget starts from the nearest trained control symbol. :meth:`save_calibration`
        keeps them with the run. The rows run in batches of ``batch_size`` through the lean
        pass, which counts each row's gates over its own tokens (no padding): the count of
        one row at a time, at a fraction of the passes."""
        cct = self.config.model.cct
        if cct is None:
            raise DynaseqError("this is a dense encoder, which has no compute-budget knob to "
                               "calibrate")
        batch_size, lines = check_int("batch_size", batch_size), check_int("lines", lines)
        if budgets is not None and not isinstance(budgets, list | tuple):  # one budget
            budgets = [budgets]
        check_path("path", path)
        ex = read_table(path, self.layout, labelled=False)
        rows = encode_examples(self.vocab, ex, self.config.data.max_len)[:lines]
        if not rows:
            raise DynaseqError(f"{path}: nothing to calibrate on (every row is empty)")
        lean = self.lean_encoder() if self.model.encoder.predictor is None else None
        if lean is None:  # the model's own pass, one row at a time
            pairs = [(torch.tensor([ids], device=self.device),
                      torch.tensor([segs], device=self.device)) for ids, segs in rows]
            measure = None
        else:
            pairs = []

            def measure(control: BudgetControl) -> dict[str, int]:
                compute = RealizedCompute()
                predict_logits(self.model, rows, batch_size, self.device, control, compute,
                               lean=lean)
                return {"encoder": compute.ran}
        targets = (cct.controls if budgets is None
                   else [b for (b,) in distinct_budgets([(as_fraction(b),) for b in budgets])])
        fitted = [calibrate_budget(self.model, pairs, nearest_trained(self.config.model, b),
                                   (b,), tol=tol, subnetworks=("encoder",), measure=measure)
                  for b in targets]
        self.calibrations = merge_calibrations(self.calibrations, fitted)
        return fitted

    def save_calibration(self, run_dir: str | Path, data: dict | None = None) -> Path:
        """Write :attr:`calibrations` to ``run_dir/calibration.json``, tied to the loaded
        checkpoint. ``run_dir`` must be a run or model directory, not the model shipped in
        the package (DynaseqError)."""
        return save_calibrations(run_dir, self.checkpoint, self.calibrations, data,
                                 self.weights_sha256)
