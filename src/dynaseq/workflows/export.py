"""``dynaseq export RUN --out DIR``: a run directory -> a self-contained model directory.

The model directory holds what inference needs and nothing of the machine it was trained on:

- ``config.json``: ``{"format": "dynaseq-model", "version": 1, "config": {...}}``, the run
  config with its model, decoding and data *settings* but no file paths (the data section's
  :attr:`PATHS` fields are dropped, the ``train`` section and ``run_dir`` left at defaults);
- ``model.safetensors`` and ``meta.json`` (the chosen checkpoint's weights, byte for byte,
  its metadata and SHA-256): the directory is its own checkpoint;
- the task's tokenizer or vocabulary files (the predictor's ``EXPORT_FILES``);
- ``calibration.json`` when the run has one for that checkpoint (CCT budgets);
- ``README.md``: a model card (task, model, data it was trained on, scores, budgets, how it
  was trained).

``dynaseq.load(DIR)`` and every command that reads a run directory read it the same way
(:func:`dynaseq.core.rundir.open_run`, :func:`dynaseq.core.checkpoint.resolve_checkpoint`),
for every run kind, with bit-identical outputs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynaseq.core.checkpoint import WEIGHTS, read_meta, resolve_checkpoint, write_meta
from dynaseq.core.config import to_dict
from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import atomic_write, sha256_file, user_path
from dynaseq.core.rundir import (
    MODEL_CONFIG,
    MODEL_FORMAT,
    MODEL_VERSION,
    check_new_run_dir,
    open_run,
    read_run_config,
    writing_new_dir,
)
from dynaseq.metrics.profile import count_params
from dynaseq.tasks.registry import PREDICTORS, RUN_CONFIGS, load
from dynaseq.techniques.cct.calibration_file import CALIBRATION_FILE as CALIBRATION
from dynaseq.techniques.cct.calibration_file import write_calibrations


@dataclass
class ExportReport:
    run_dir: Path
    out_dir: Path
    checkpoint: Path
    files: list[str]


def portable_config(cfg: Any) -> dict[str, Any]:
    """The run config as a mapping without training paths: ``run_dir`` and ``train`` dropped
    (their defaults apply on load), and the data section's file fields (``PATHS``) removed."""
    raw = to_dict(cfg)
    raw.pop("run_dir", None)
    raw.pop("train", None)
    paths = getattr(type(cfg.data), "PATHS", ())
    raw["data"] = {k: v for k, v in raw["data"].items() if k not in paths}
    return raw


def model_card(cfg: Any, meta: dict[str, Any], run: Path, ckpt: Path, n_params: int,
               calibration: dict[str, Any] | None, origin: str | None = None) -> str:
    """The ``README.md`` of an exported model: what it is, what it was trained on, its
    validation scores, its budgets and how it was trained. ``origin``: the run an exported
    ``run`` was itself exported from (its training settings were not kept: not recorded)."""
    task = next(name for name, cls in RUN_CONFIGS.items() if isinstance(cfg, cls))
    model = to_dict(cfg.model)
    technique = next((k for k in ("cct", "dmb", "moe") if model.get(k)), None)
    shape = {k: v for k, v in model.items() if not isinstance(v, (dict, list)) and v is not None}
    data = {k: getattr(cfg.data, k) for k in getattr(type(cfg.data), "PATHS", ())
            if getattr(cfg.data, k) is not None}
    tc = cfg.train
    lines = [f"# dynaseq model: {task}{f' ({technique})' if technique else ''}", "",
             "Load it with `dynaseq.load(DIR)` or give `DIR` to any `dynaseq` command that "
             "takes a run directory.", "",
             "## Model", "", f"- task: `{task}`; parameters: {n_params:,}",
             f"- dimensions: {', '.join(f'{k}={v}' for k, v in shape.items())}"]
    if technique:
        lines.append(f"- {technique}: `{json.dumps(model[technique])}`")
    if meta.get("quantization"):
        lines.append(f"- weights: {meta['quantization']}")
    lines += ["", "## Training", "",
              f"- data: {', '.join(f'{k} `{v}`' for k, v in data.items()) or 'not recorded'}",
              f"- from run `{run}`, checkpoint `{ckpt.name}` (step {meta.get('step', '?')})"
              + (f", an exported model of `{origin}`" if origin else ""),
              "- optimiser: not recorded" if origin else
              f"- optimiser: lr {tc.lr:g} ({tc.schedule}, warm-up {tc.warmup_steps}), "
              f"max_steps {tc.max_steps}, seed {tc.seed}, label smoothing {tc.label_smoothing:g}"]
    metrics = meta.get("metrics") or meta.get("valid") or {}
    if metrics:
        lines += ["", "## Validation scores (at the checkpoint)", "",
                  *(f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}"
                    for k, v in metrics.items())]
    if technique == "cct":
        trained = cfg.model.cct.controls  # (encoder, decoder) pairs; an encoder's fractions
        parts = "(encoder, decoder) " if trained and _is_pair(trained[0]) else "encoder "
        lines += ["", "## Budgets", "", f"Trained {parts}budgets: " + ", ".join(
            _budget_text(b) for b in trained) + "."]
        for c in (calibration or {}).get("budgets", []):
            realized = ", ".join(f"{k} {v:.3f}" for k, v in c["realized"].items())
            lines.append(f"- calibrated {_budget_text(c['budget'])}: realized compute "
                         f"{realized} (gate offsets {c['offsets']})")
    return "\n".join(lines) + "\n"


def _is_pair(budget: object) -> bool:
    return isinstance(budget, list | tuple) and len(budget) > 1


def _budget_text(budget: float | list[float] | tuple[float, ...]) -> str:
    """``0.5`` or ``[0.5]`` -> ``0.5``; ``(1, 0.33)`` -> ``(1, 0.33)``."""
    if not isinstance(budget, list | tuple):
        return f"{budget:g}"
    return f"{budget[0]:g}" if len(budget) == 1 else "(" + ", ".join(
        f"{b:g}" for b in budget) + ")"


def export_model(run_dir: str | Path, out_dir: str | Path,
                 checkpoint: str = "auto") -> ExportReport:
    """Write the model directory ``out_dir`` of ``run_dir``'s checkpoint (see the module doc).

    ``run_dir`` is only read; ``out_dir`` must not exist or be empty, and appears whole or
    not at all.

    Raises:
        DynaseqError: a missing or unreadable run, an existing ``out_dir``, a checkpoint that
            does not load (its weights are checked by loading them once).
    """
    run, out = user_path(run_dir), user_path(out_dir)
    run, cfg = open_run(run, RUN_CONFIGS)
    check_new_run_dir(run, out)
    ckpt = resolve_checkpoint(run, checkpoint)
    predictor = load(run, checkpoint=str(ckpt), device="cpu")  # the weights load and fit
    meta = {k: v for k, v in read_meta(ckpt).items() if k != "sha256"}
    # an exported model keeps no training settings (portable_config): its card says so
    origin = (str(meta.get("exported_from", "a run not recorded"))
              if "train" not in read_run_config(run) else None)
    meta.update(exported_from=str(run), exported_checkpoint=str(ckpt))
    cals = getattr(predictor, "calibrations", None) or []  # those made for this checkpoint
    calibration = None
    if cals:
        data = json.loads((run / CALIBRATION).read_text()).get("data", {})
        calibration = {"budgets": [c.to_json() for c in cals], "data": data}
    files = []
    with writing_new_dir(out) as tmp:
        shutil.copy2(ckpt / WEIGHTS, tmp / WEIGHTS)
        loaded = getattr(predictor, "weights_sha256", None)
        if loaded is not None and sha256_file(tmp / WEIGHTS) != loaded:  # what was checked
            raise DynaseqError(f"{ckpt} was rewritten (by a training run?) while it was "
                               "exported; export again")
        atomic_write(tmp / MODEL_CONFIG, json.dumps(
            {"format": MODEL_FORMAT, "version": MODEL_VERSION,
             "config": portable_config(cfg)}, indent=1))
        for name in PREDICTORS[type(cfg)].EXPORT_FILES:
            if (run / name).is_file():
                shutil.copy2(run / name, tmp / name)
        if calibration is not None:  # the model directory is its own checkpoint
            write_calibrations(tmp, tmp, cals, calibration["data"], new_model=True,
                               digest=loaded)  # the copy's, checked above: not hashed again
        atomic_write(tmp / "README.md", model_card(cfg, meta, run, ckpt,
                                                   count_params(predictor.model), calibration,
                                                   origin))
        write_meta(tmp, meta)  # the SHA-256 of every file, as a checkpoint's meta.json
        files = sorted(p.name for p in tmp.iterdir())
    return ExportReport(run, out, ckpt, files)
