"""``calibration.json`` of a CCT run (translation or encoder): the gate offsets ``dynaseq
calibrate`` fitted for the run's checkpoint (a file made for another checkpoint is ignored,
with a warning). The checkpoint is recorded relative to the run, so an exported model
directory, its own checkpoint, records ``"."``; with it the SHA-256 of the checkpoint's
weights, since training on, ``dynaseq average`` or a resumed run rewrite ``best/`` and
``averaged/`` in place: offsets fitted on the weights before are then ignored too (a file
written before the digest was recorded is read as before)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from dynaseq.core.checkpoint import weights_digest
from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import atomic_write
from dynaseq.core.rundir import check_not_shipped, read_run_config, run_path
from dynaseq.techniques.cct.calibration import BudgetCalibration

CALIBRATION_FILE = "calibration.json"


def checkpoint_id(run: Path, ckpt: Path) -> str:
    """The checkpoint's path relative to the run (absolute if outside it)."""
    try:
        return str(ckpt.resolve().relative_to(run.resolve()))
    except ValueError:
        return str(ckpt.resolve())


def read_calibrations(run: Path, ckpt: Path, n_controls: int, parts: int = 1,
                      digest: str | None = None) -> list[BudgetCalibration]:
    """The calibrations in ``run/calibration.json`` made for checkpoint ``ckpt`` of a model
    with ``n_controls`` control symbols, each budget of ``parts`` fractions (2: encoder and
    decoder, 1: an encoder), fitted on the weights of SHA-256 ``digest`` (those loaded;
    default the checkpoint's now). No file: none. A file made for another checkpoint or
    other weights: none, with a warning. An unreadable file: a :class:`DynaseqError`."""
    path = run / CALIBRATION_FILE
    if not path.is_file():
        return []
    try:
        payload = json.loads(path.read_text())
        cals = [BudgetCalibration.from_json(d) for d in payload["budgets"]]
        made_for = payload["checkpoint"]
        fitted_on = payload.get("weights_sha256")
        for c in cals:
            if len(c.budget) != parts or not 0 <= c.control < n_controls:
                raise ValueError(f"budget {list(c.budget)} / control {c.control} is not one "
                                 f"of this encoder's {n_controls} control symbols")
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise DynaseqError(f"{path} is not a calibration file ({type(e).__name__}: {e}); "
                           "delete it or run dynaseq calibrate again") from None
    if made_for != checkpoint_id(run, ckpt):
        warnings.warn(f"{path} was made for checkpoint {made_for}, not "
                      f"{checkpoint_id(run, ckpt)}: its gate offsets are not used (run "
                      "dynaseq calibrate again)", stacklevel=3)
        return []
    if fitted_on is not None and fitted_on != (digest or weights_digest(ckpt)):
        warnings.warn(f"{path} was fitted on other weights of checkpoint {made_for}, which "
                      "has changed since (trained on or averaged again): its gate offsets are "
                      "not used (run dynaseq calibrate again)", stacklevel=3)
        return []
    return cals


def write_calibrations(run: Path, ckpt: Path, cals: list[BudgetCalibration],
                       data: dict, new_model: bool = False, digest: str | None = None
                       ) -> Path:
    """Write ``cals`` to ``run/calibration.json`` (atomically), tied to checkpoint ``ckpt``
    and the SHA-256 of its weights (:func:`weights_digest`); ``data`` describes the
    calibration data; ``digest``: the SHA-256 of the weights they were fitted on (those a
    predictor loaded: the checkpoint may have been rewritten since, and then a later load
    ignores them; default the checkpoint's now). ``run`` must be a run or exported model
    directory (CheckpointError otherwise: a file elsewhere is read by no load), and not the
    model shipped in the package (DynaseqError), unless it is a ``new_model`` being written
    (``dynaseq export``, which makes the shipped one)."""
    run = run_path(run)
    read_run_config(run)
    if not new_model:
        check_not_shipped(run, CALIBRATION_FILE)
    path = run / CALIBRATION_FILE
    atomic_write(path, json.dumps({"checkpoint": checkpoint_id(run, ckpt),
                                   "weights_sha256": digest or weights_digest(ckpt),
                                   "data": data,
                                   "budgets": [c.to_json() for c in cals]}, indent=1))
    return path


def save_calibrations(run_dir: str | Path, ckpt: Path, cals: list[BudgetCalibration],
                      data: dict | None, digest: str | None) -> Path:
    """A predictor's :meth:`save_calibration`: :func:`write_calibrations` of ``cals``
    fitted on the weights of SHA-256 ``digest`` that it loaded from ``ckpt``; a DynaseqError
    when the checkpoint was rewritten since (a training run replaced ``best/``: the offsets
    would be tied to weights they were not fitted on)."""
    if digest is not None and weights_digest(ckpt) not in (digest, None):
        raise DynaseqError(f"{ckpt} was rewritten (by a training run?) after it was loaded: "
                           "its calibration would not fit it; calibrate again")
    return write_calibrations(Path(run_dir), ckpt, cals, data or {}, digest=digest)
