"""``dynaseq quantize`` for translation runs: a run directory -> a new run directory holding
its int8 version (:func:`dynaseq.compress.int8.quantize_int8`)."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from dynaseq.compress.int8 import is_int8, quantize_int8, save_int8
from dynaseq.core.checkpoint import WEIGHTS
from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import user_path
from dynaseq.core.rundir import check_new_run_dir, dir_size, writing_new_dir
from dynaseq.techniques.cct.calibration_file import CALIBRATION_FILE, write_calibrations


@dataclass
class QuantizeReport:
    """Sizes in bytes: the source checkpoint's weights and the int8 weights; whole run dirs."""

    run_dir: Path
    out_dir: Path
    checkpoint: Path
    weights_before: int
    weights_after: int
    run_before: int
    run_after: int
    calibrated: int = 0  # budgets whose calibration was carried over


def quantize_run(run_dir: str | Path, out_dir: str | Path,
                 checkpoint: str = "auto") -> QuantizeReport:
    """Write a new seq2seq run directory ``out_dir`` holding the int8 version of ``run_dir``.

    ``run_dir`` is only read. ``out_dir`` gets ``config.yaml`` (``run_dir`` set to it),
    the tokenizer files and one checkpoint at the same relative place as the source one
    (``averaged/``, ``best/`` or ``checkpoints/step_N/``, so ``--checkpoint auto`` finds it)
    whose ``meta.json`` records ``"quantization": "int8"``, and the calibration of that
    checkpoint (CCT: fitted on the float model, whose gate logits int8 moves a little;
    ``dynaseq calibrate`` on ``out_dir`` fits it again). Everything is written to a
    temporary sibling directory that is renamed into place at the end: a failure leaves no
    half-written run directory.

    Raises:
        DynaseqError: missing run directory, an existing non-empty ``out_dir``, an
            already-quantized run.
    """
    from dynaseq.core.checkpoint import read_meta
    from dynaseq.core.config import save_config
    from dynaseq.tasks.translation.predictor import Translator

    run, out = user_path(run_dir), user_path(out_dir)
    if not run.is_dir():
        raise DynaseqError(f"run directory not found: {run}")
    check_new_run_dir(run, out)
    t = Translator.load(run, checkpoint=checkpoint, device="cpu")
    if is_int8(t.model):
        raise DynaseqError(f"{run} is already int8-quantized")
    qmodel = quantize_int8(t.model)
    ckpt = t.checkpoint
    try:
        rel = ckpt.resolve().relative_to(run.resolve())
    except ValueError:
        rel = Path("best")
    with writing_new_dir(out) as tmp:
        cfg = copy.deepcopy(t.config)
        cfg.run_dir = str(out)
        save_config(cfg, tmp / "config.yaml")
        for name in ("spm.model", "spm.vocab"):
            if (run / name).is_file():
                shutil.copy2(run / name, tmp / name)
        meta = {k: v for k, v in read_meta(ckpt).items() if k in ("step", "averaged", "valid")}
        meta.update(source_run=str(run), source_checkpoint=str(ckpt))
        save_int8(qmodel, tmp / rel, meta)
        if t.calibrations:  # what they were fitted on, and that it was the float model
            data = json.loads((run / CALIBRATION_FILE).read_text()).get("data", {})
            write_calibrations(tmp, tmp / rel, t.calibrations,
                               {**data, "fitted_on_float_model": str(run)}, new_model=True)
    return QuantizeReport(run, out, ckpt, dir_size(ckpt / WEIGHTS), dir_size(out / rel / WEIGHTS),
                          dir_size(run), dir_size(out), len(t.calibrations))
