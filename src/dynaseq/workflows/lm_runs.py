"""Language-model run directory -> new run directory: pruning, quantization-aware training
and the neural-cache search (MicroNet §3.5, §4.2, §4.3). ``dynaseq prune``, ``quantize``
and ``cache-search`` call these.

Each reads ``run_dir`` only and writes ``out_dir`` as a complete run (``config.yaml`` with
``run_dir`` set to it, ``vocab.txt``, ``best/`` with plain weights, a JSON report, the
fine-tuning ``log.jsonl``), built in a temporary sibling directory and renamed into place
at the end: bad input or a failure leaves no ``out_dir`` behind.

Fine-tuning (``steps`` > 0) continues the run's training config (its loss: cache,
distillation; the Hebbian update is left out, it would write into masked or quantized
rows) for ``steps`` updates from the start of the training stream, at ``lr`` (default
0.1 × train.lr) with a cosine schedule and a warm-up of min(train.warmup_steps, steps/10).
A fresh optimizer on a converged model costs perplexity at first (measured on a pruned
WikiText-2 core: 600 such updates, in float or with 9- or 16-bit QAT alike, take valid
perplexity 138.5 → 145.7–145.9; it takes thousands of updates to win it back), so QAT keeps its
best validated state, the calibrated start included.

Example::

    prune_lm_run("runs/lm", "runs/lm_pruned", sparsity=0.4, steps=200)
    qat_lm_run("runs/lm_pruned", "runs/lm_q9", bits=9, steps=200)
    cache_search_run("runs/lm_q9", "runs/lm_q9_cache", cache_sizes=[3000])
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dynaseq.compress.prune import (
    GradualPruner,
    SensitivityResult,
    _check_sparsity,
    _resolve,
    _source_param,
    add_mask,
    get_mask,
    prunable_parameters,
    remove_parametrization,
    sensitivity_analysis,
    sparsity_report,
    thresholds_for_target,
)
from dynaseq.compress.qat import check_bits, check_representable, convert_qat_
from dynaseq.core import checkpoint as ckpt
from dynaseq.core.config import save_config, to_dict
from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import user_path
from dynaseq.core.progress import progress_bar
from dynaseq.core.rundir import check_new_run_dir, writing_new_dir
from dynaseq.data.lm_corpus import VOCAB_FILE
from dynaseq.models.lm import TransformerLM
from dynaseq.nn.neural_cache import NeuralCache, local_search
from dynaseq.tasks.lm.config import LMCacheConfig, LMDistillConfig
from dynaseq.tasks.lm.predictor import (
    DEFAULT_CACHE,
    LanguageModel,
    apply_qat_structure,
    evaluate_stream,
)

DEFAULT_GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
QAT_VALIDATIONS = 6  # validations during QAT fine-tuning; the best (or none) is kept


# --------------------------------------------------------------------------- run dirs

@contextmanager
def new_run_dir(run_dir: Path, out_dir: Path) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``out_dir`` when the block succeeds
    (``out_dir`` checked first: it must be new or empty, and outside ``run_dir``)."""
    check_new_run_dir(run_dir, out_dir)
    with writing_new_dir(out_dir) as tmp:
        yield tmp


def _write_run(tmp: Path, out_dir: Path, lm: LanguageModel, model: TransformerLM,
               report_name: str, report: dict[str, Any]) -> None:
    """config (run_dir = out_dir), vocabulary, ``best/`` weights and the JSON report."""
    cfg = copy.deepcopy(lm.config)
    cfg.run_dir = str(out_dir)
    save_config(cfg, tmp / "config.yaml")
    lm.vocab.save(tmp / VOCAB_FILE)
    for stale in ("checkpoints", "best", "averaged"):  # fine-tuning leftovers
        shutil.rmtree(tmp / stale, ignore_errors=True)
    ckpt.write_checkpoint(tmp / "best", model, {"step": report.get("steps", 0),
                                                "source": report["source_run"],
                                                report_name: True})
    (tmp / f"{report_name}.json").write_text(json.dumps(report, indent=1) + "\n")


def _valid_ppl(lm: LanguageModel, max_tokens: int | None) -> tuple[Callable[[], float], Any]:
    ids = lm.ids("valid")
    cfg = lm.config

    def evaluate() -> float:
        return evaluate_stream(lm.model, ids, cfg.data.eval_batch_size,
                               cfg.model.extended_context, lm.device, max_tokens)["ppl"]

    return evaluate, ids


def finetune(lm: LanguageModel, tmp: Path, steps: int, lr: float | None = None,
             before_step: Callable[[TransformerLM, int], None] | None = None,
             progress: bool = False, valid_every: int | None = None,
             keep_best_from: float | None = None, distill: str | Path | None = None,
             ) -> dict[str, Any]:
    """Continue training ``lm.model`` (changed in place) in ``tmp`` for ``steps`` updates,
    validating every ``valid_every`` updates (default: once, at the end).

    ``keep_best_from``: the validation loss of the model before fine-tuning. The model is
    then left at its best validated state — the best step, or the starting weights when no
    step beat them (``kept_step`` 0) — instead of the last one.

    ``distill``: a ``dynaseq distill-data`` top-k directory (e.g. of the unpruned model
    itself) to distill from while fine-tuning (``train.distill``, λ annealed 0.5 → 0.05)."""
    from dynaseq.train.loop import fit, setup

    cfg = copy.deepcopy(lm.config)
    cfg.run_dir = str(tmp)
    tc = cfg.train
    tc.lr = lr if lr is not None else 0.1 * tc.lr
    tc.max_steps, tc.warmup_steps = steps, min(tc.warmup_steps, steps // 10)
    tc.save_every = tc.log_every = steps
    tc.valid_every = min(valid_every or steps, steps)
    tc.average_last_k, tc.keep_last, tc.max_minutes, tc.max_epochs = 0, 1, None, 1_000_000
    tc.schedule, tc.device = "cosine", lm.device.type
    if distill is not None:
        tc.distill = LMDistillConfig(topk_dir=str(distill))
    lm.vocab.save(tmp / VOCAB_FILE)  # setup reuses it: same ids
    s = setup(cfg)
    s.task.model = lm.model.train()
    s.task.hooks.after_step.clear()  # no Hebbian update while masked / quantized
    if before_step is not None:
        s.task.hooks.before_step.append(before_step)
    start = copy.deepcopy(lm.model.state_dict()) if keep_best_from is not None else None
    result = fit(s, progress=progress)
    lm.model.eval()
    valid = [h for h in result.history or [] if h.get("event") == "valid"]
    out = {"steps": result.state.step, "lr": tc.lr,
           "valid": {k: v for k, v in valid[-1].items() if k in ("loss", "ppl")} if valid else {},
           "valid_curve": [[h["step"], h["ppl"]] for h in valid]}
    if start is not None:
        best = min(valid, key=lambda h: h["loss"]) if valid else None
        if best is not None and best["loss"] < keep_best_from:
            ckpt.load_weights(lm.model, tmp / "best")
            out["kept_step"] = best["step"]
        else:
            lm.model.load_state_dict(start)
            out["kept_step"] = 0
    return out


def _open_source(run_dir: str | Path, out_dir: str | Path, steps: int, checkpoint: str,
                 device: str) -> tuple[Path, Path, LanguageModel]:
    """Check ``steps`` and the new run directory ``out_dir`` (nothing written), then load
    the source run."""
    if steps < 0:
        raise DynaseqError(f"--steps must be >= 0, got {steps}")
    run, out = user_path(run_dir), user_path(out_dir)
    check_new_run_dir(run, out)
    return run, out, LanguageModel.load(run, checkpoint=checkpoint, device=device)


# --------------------------------------------------------------------------- prune

def load_sensitivity(path: str | Path, model: TransformerLM) -> SensitivityResult:
    """The sensitivity curves of an earlier ``prune_report.json`` (of the same source model),
    checked against ``model``'s prunable matrices (names and sizes)."""
    path = Path(path)
    try:
        rep = json.loads(path.read_text(encoding="utf-8"))
        curves = {n: [(float(s), float(p)) for s, p in c] for n, c in rep["curves"].items()}
        sizes = {n: int(v) for n, v in rep["sizes"].items()}
        baseline = float(rep["baseline_ppl"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise DynaseqError(f"--sensitivity {path}: not a prune report with sensitivity "
                           f"curves ({type(e).__name__}: {e})") from None
    if not curves:
        raise DynaseqError(f"--sensitivity {path}: the report has no sensitivity curves "
                           "(it was pruned at sparsity 0)")
    names = prunable_parameters(model)
    if sorted(curves) != sorted(names) or sorted(sizes) != sorted(names):
        raise DynaseqError(f"--sensitivity {path}: its matrices do not match this model's "
                           f"prunable matrices ({len(curves)} vs {len(names)})")
    for n in names:
        got = _source_param(*_resolve(model, n)).numel()  # as sensitivity_analysis counts
        if sizes[n] != got:
            raise DynaseqError(f"--sensitivity {path}: {n} has {sizes[n]} elements there, "
                               f"{got} in this model")
    return SensitivityResult(baseline=baseline, curves=curves, sizes=sizes)


def prune_lm_run(run_dir: str | Path, out_dir: str | Path, sparsity: float, steps: int = 0,
                 grid: Sequence[float] | None = None, valid_tokens: int | None = 20_000,
                 lr: float | None = None, checkpoint: str = "auto", device: str = "auto",
                 progress: bool = False, sensitivity: str | Path | None = None,
                 distill: str | Path | None = None) -> dict[str, Any]:
    """Sensitivity analysis per matrix on the first ``valid_tokens`` validation tokens,
    binary-searched per-matrix targets for the overall ``sparsity`` (parameter-weighted over
    :func:`prunable_parameters`), then automated gradual pruning over ``steps`` fine-tuning
    updates (AGP reaches the targets at 3/4 of them, pruning every 1/10 of that; one shot
    without fine-tuning when ``steps`` is 0). At ``sparsity`` 0 nothing is analysed or
    pruned: dense fine-tuning, the control for a pruned run. ``sensitivity``: the
    ``prune_report.json`` of an earlier pruning of the same model, whose curves are reused
    instead of the sweep (e.g. for a longer schedule or another target). ``distill``: a
    top-k directory to distill from while fine-tuning (see :func:`finetune`). Returns the
    report written to ``out_dir/prune_report.json``."""
    target = _check_sparsity(sparsity)
    grid = sorted({_check_sparsity(g, "grid sparsity") for g in (grid or DEFAULT_GRID)})
    run, out, lm = _open_source(run_dir, out_dir, steps, checkpoint, device)
    if lm.config.model.qat_bits is not None:
        raise DynaseqError(f"{run} is quantized; prune before quantizing")
    if distill is not None and not (Path(distill) / "meta.json").is_file():
        raise DynaseqError(f"--distill {distill} is not a teacher top-k directory (no "
                           "meta.json; write one with 'dynaseq distill-data RUN --out DIR')")
    model = lm.model
    evaluate, _ = _valid_ppl(lm, valid_tokens)
    names = prunable_parameters(model)
    if sensitivity is not None and target > 0:
        sens = load_sensitivity(sensitivity, model)
        grid = sorted({s for c in sens.curves.values() for s, _ in c if s > 0})
    else:  # at sparsity 0 (a dense control) every target is 0 whatever the curves
        sweep = grid if target > 0 else []
        n_evals = 1 + len(names) * len([s for s in sweep if s > 0])
        with progress_bar(n_evals, "eval", "sensitivity", progress) as bar:
            def counted() -> float:
                ppl = evaluate()
                bar.update(1)
                return ppl

            sens = sensitivity_analysis(model, counted, sweep, names)
    plan = thresholds_for_target(sens.curves, sens.sizes, target)
    with new_run_dir(run, out) as tmp:
        end = steps * 3 // 4
        pruner = GradualPruner(model, plan.sparsities, start_step=0, end_step=end,
                               frequency=max(1, end // 10))
        pruner.ensure_masks()
        tuned: dict[str, Any] = {"steps": 0}
        if steps > 0:
            tuned = finetune(lm, tmp, steps, lr, lambda _m, step: pruner.step(step), progress,
                             distill=distill)
        else:
            pruner.step(0)
        pruner.finalize()
        rep = sparsity_report(model, names)
        report = {
            "source_run": str(run), "checkpoint": str(lm.checkpoint), "target": target,
            "sensitivity_from": None if sensitivity is None else str(sensitivity),
            "distill_from": None if distill is None else str(distill), "grid": grid,
            "valid_tokens": valid_tokens, "baseline_ppl": sens.baseline,
            "curves": sens.curves, "sizes": sens.sizes, "threshold_ppl": plan.threshold,
            "per_matrix_targets": plan.sparsities, "planned_sparsity": plan.achieved,
            "achieved_sparsity": rep.overall,
            "per_matrix_achieved": {n: rep.sparsity(n) for n in names},
            "valid_ppl_after": evaluate(), **tuned,
        }
        _write_run(tmp, out, lm, model, "prune_report", report)
    return report


# --------------------------------------------------------------------------- QAT

def keep_pruned_zeros(model: TransformerLM) -> list[tuple[torch.nn.Module, str]]:
    """Mask the exact zeros of every prunable matrix (also those QAT leaves in float, like
    the tied embeddings), so fine-tuning cannot revive pruned weights."""
    masked = []
    for name in prunable_parameters(model):
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        w = getattr(mod, attr).detach()
        if bool((w == 0).any()):
            add_mask(mod, attr, (w != 0).to(w.dtype))
            masked.append((mod, attr))
    return masked


@torch.no_grad()
def calibrate_activations(lm: LanguageModel, n_windows: int = 8) -> None:
    """Without fine-tuning: feed the first training windows in training mode so the
    activation observers see real statistics."""
    from dynaseq.data.lm_corpus import StreamBatches, read_lm_lines

    cfg = lm.config
    ids = lm.vocab.encode_lines(read_lm_lines(lm.split_path("train"), min_lines=2))
    state = None
    lm.model.train()
    try:
        for i, (x, _) in enumerate(StreamBatches(ids, cfg.data.batch_size,
                                                 cfg.model.extended_context)):
            if i >= n_windows:
                break
            state = lm.model(x.to(lm.device), state).state
    finally:
        lm.model.eval()


def qat_lm_run(run_dir: str | Path, out_dir: str | Path, bits: int, steps: int = 0,
               lr: float | None = None, checkpoint: str = "auto", device: str = "auto",
               progress: bool = False) -> dict[str, Any]:
    """QAT at ``bits``: activation ranges calibrated on the first training windows, then
    fine-tuning for ``steps`` updates (pruned zeros kept) validated :data:`QAT_VALIDATIONS`
    times, keeping the best validated state — the calibrated start when no fine-tuning step
    beats it (``kept_step`` 0) — then conversion and :func:`check_representable`
    (DynaseqError if any weight is not exactly representable). The new run's config records
    ``model.qat_bits``. Returns ``quantize_report.json``."""
    check_bits(bits)
    run, out, lm = _open_source(run_dir, out_dir, steps, checkpoint, device)
    if lm.config.model.qat_bits is not None:
        raise DynaseqError(f"{run} is already quantized ({lm.config.model.qat_bits} bits)")
    model = lm.model
    evaluate, _ = _valid_ppl(lm, lm.config.data.valid_max_tokens)
    before = evaluate()
    with new_run_dir(run, out) as tmp:
        masked = keep_pruned_zeros(model)
        apply_qat_structure(model, bits, convert=False)
        calibrate_activations(lm)
        ptq = evaluate()  # quantized, before any fine-tuning
        tuned: dict[str, Any] = {"steps": 0}
        if steps > 0:
            tuned = finetune(lm, tmp, steps, lr, progress=progress,
                             valid_every=max(1, steps // QAT_VALIDATIONS),
                             keep_best_from=math.log(ptq))
        convert_qat_(model)
        for mod, attr in masked:  # float (embedding) matrices: bake the zeros in
            if get_mask(mod, attr) is not None:
                remove_parametrization(mod, attr, leave_parametrized=True)
        check = check_representable(model, bits)
        if not check.ok:
            raise DynaseqError("quantized weights are not exactly representable at "
                               f"{bits} bits: {'; '.join(check.failures[:3])}")
        lm.config.model.qat_bits = bits
        report = {"source_run": str(run), "checkpoint": str(lm.checkpoint), "bits": bits,
                  "valid_ppl_before": before, "valid_ppl_calibrated": ptq,
                  "valid_ppl_after": evaluate(),
                  "representable": check.modules, **tuned}
        _write_run(tmp, out, lm, model, "quantize_report", report)
    return report


# --------------------------------------------------------------------------- cache search

def cache_search_run(run_dir: str | Path, out_dir: str | Path,
                     cache_sizes: Sequence[int] = (), max_evals: int = 40,
                     valid_tokens: int | None = None, checkpoint: str = "auto",
                     device: str = "auto", n_cache: int | None = None,
                     progress: bool = False) -> dict[str, Any]:
    """Local search over θ, λ (then each of ``cache_sizes``) minimising the cache perplexity
    on the first ``valid_tokens`` validation tokens (all when None), starting from the
    run's cache (or :data:`DEFAULT_CACHE`), at cache size ``n_cache`` when given (e.g. a
    small cache that keeps the extra ops low) instead of the run's. The model's states are computed once; each
    evaluation only reruns the cache. The new run's ``model.cache`` holds the best values
    (``train`` kept, false for a run that had no cache). ``progress``: bars of validation
    windows and of evaluations on a terminal. Returns ``cache_search.json``."""
    if max_evals < 1:
        raise DynaseqError(f"--max-evals must be >= 1, got {max_evals}")
    for n in [*cache_sizes, *([] if n_cache is None else [n_cache])]:
        if n < 1:
            raise DynaseqError(f"cache sizes must be >= 1, got {n}")
    run, out = user_path(run_dir), user_path(out_dir)
    check_new_run_dir(run, out)
    lm = LanguageModel.load(run, checkpoint=checkpoint, device=device)
    model, cfg = lm.model, lm.config
    windows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def keep(hidden: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        windows.append((hidden, logp, targets))
        return logp

    plain = evaluate_stream(model, lm.ids("valid"), cfg.data.eval_batch_size,
                            cfg.model.extended_context, lm.device, valid_tokens, keep,
                            progress)
    bar = progress_bar(max_evals + 1, "eval", "cache-search", progress)

    @torch.no_grad()
    def cache_ppl(theta: float, lam: float, n_cache: int) -> float:
        cache, memory, nll = NeuralCache(n_cache, theta, lam).to(lm.device), None, 0.0
        for h, lp, y in windows:
            mixed, memory = cache.target_log_prob(lp, h, y, memory)
            nll -= float(mixed.double().sum())
        bar.update(1)
        return math.exp(nll / plain["tokens"])

    start = cfg.model.cache or DEFAULT_CACHE
    if model.cache is not None:
        start = LMCacheConfig(model.cache.n_cache, float(model.cache.theta.detach()),
                              float(model.cache.lam.detach()), start.train)
    if n_cache is not None:
        start = replace(start, n_cache=n_cache)
    before = cache_ppl(start.theta, start.lam, start.n_cache)
    with bar:
        found = local_search(cache_ppl, start.theta, start.lam, start.n_cache,
                             cache_sizes=list(cache_sizes), max_evals=max_evals)
    best = LMCacheConfig(found.n_cache, found.theta, found.lam, start.train)
    if found.score > before:  # never worse than where it started
        best = start
    with new_run_dir(run, out) as tmp:
        if model.cache is None:
            model.cache = NeuralCache(best.n_cache, best.theta, best.lam).to(lm.device)
            model.cache.requires_grad_(False)
        else:
            model.cache.set_params(best.theta, best.lam, best.n_cache)
        lm.config.model.cache = best
        report = {"source_run": str(run), "checkpoint": str(lm.checkpoint),
                  "valid_tokens": plain["tokens"], "valid_ppl": plain["ppl"],
                  "before": {**to_dict(start), "ppl_cache": before},
                  "after": {**to_dict(best), "ppl_cache": min(found.score, before)},
                  "evaluations": [vars(p) for p in found.trajectory]}
        _write_run(tmp, out, lm, model, "cache_search", report)
    return report
