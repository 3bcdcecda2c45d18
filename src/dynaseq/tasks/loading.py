"""How every task's Predictor loads a run: :func:`load_predictor`.

One path for all of them: the run directory and its config (:func:`open_run`, a run of
another task refused), the vocabulary, the device, then for the checkpoint asked for
(:func:`load_resolved`: with ``auto``/``latest`` a checkpoint that vanishes while it is
read is replaced by the next newest) the model is built, its weights are loaded and the
predictor is made from the :class:`LoadedRun`.

Example (a predictor's ``load``; ``read_vocab``, ``build_model``: the task's own)::

    return load_predictor(run_dir, checkpoint, device, {TASK: MLMRunConfig}, "MLM",
                          vocabulary=read_vocab, build=build_model,
                          make=lambda r: cls(r.model, r.vocab, r.config, r.checkpoint,
                                             r.device))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from dynaseq.core.checkpoint import (
    CheckpointChanged,
    load_resolved,
    load_weights,
    weights_digest,
)
from dynaseq.core.distributed import pick_device, pick_dtype
from dynaseq.core.errors import CheckpointError, DynaseqError
from dynaseq.core.rundir import open_run

V = TypeVar("V")
P = TypeVar("P")

#: ``weights(model, checkpoint_dir, device)`` -> the loaded model and the device it is on.
Weights = Callable[[nn.Module, Path, torch.device], tuple[nn.Module, torch.device]]


@dataclass(frozen=True)
class LoadedRun(Generic[V]):
    """What a predictor is made from: the run directory, its parsed ``config``, its
    vocabulary, the ``model`` with the weights of ``checkpoint`` (eval mode, on
    ``device``) and their SHA-256 ``digest`` (None: no record of it)."""

    run: Path
    config: Any
    vocab: V
    model: nn.Module
    checkpoint: Path
    device: torch.device
    digest: str | None = None


def place_weights(model: nn.Module, path: Path, device: torch.device
                  ) -> tuple[nn.Module, torch.device]:
    """The default weights step: the checkpoint's weights (checksums and dtypes checked by
    :func:`load_weights`), the model in eval mode on ``device``."""
    load_weights(model, path)
    return model.to(device).eval(), device


def load_predictor(run_dir: str | Path, checkpoint: str, device: str,
                   configs: Mapping[str, type], what: str, *,
                   vocabulary: Callable[[Path], V],
                   build: Callable[[Any, V], nn.Module],
                   make: Callable[[LoadedRun[V]], P],
                   weights: Weights = place_weights,
                   check: Callable[[Path, Any], None] | None = None,
                   precision: str = "fp32") -> P:
    """Load a predictor from ``run_dir`` at ``checkpoint`` (``auto``, ``latest``, ``best``,
    ``averaged`` or a step) on ``device`` (``auto``, ``cpu``, ``cuda``) in ``precision``
    (``fp32``; ``bf16``: the weights cast to bfloat16 after loading, so every product runs
    in bfloat16; the searches and scores take their log-probabilities in float32).

    ``configs``: the task's ``{task: run config type}``; ``what``: what a run of it is
    called (a run of another task is refused as "not a {what} run"). ``vocabulary(run)``
    reads the run's vocabulary, ``check(run, config)`` (optional) refuses a run before any
    checkpoint is read, ``build(config, vocab)`` makes the model with fresh weights,
    ``weights`` loads the checkpoint into it (default :func:`place_weights`) and
    ``make(loaded)`` returns the predictor.

    Raises:
        CheckpointError: no run directory, config or checkpoint; corrupt weights.
        ConfigError: a config that does not parse; an unknown precision.
        DynaseqError: a run of another task; ``bf16`` asked of a model with int8 weights.
    """
    dtype = pick_dtype(precision)
    run, cfg = open_run(run_dir, configs, what)
    vocab = vocabulary(run)
    dev = pick_device(device)
    if check is not None:
        check(run, cfg)

    def from_checkpoint(path: Path) -> P:
        digest = weights_digest(path)  # the same before and after: these weights were read
        # float32, as trained and saved, whatever torch's default dtype (precision= casts);
        # outside inference mode, so a copy of a weight sees a later change to it
        with torch.inference_mode(False):
            try:
                model, placed = weights(build(cfg, vocab).float(), path, dev)
            except (CheckpointError, OSError):  # swapped mid-read: read again, not "corrupt"
                if _digest_now(path) != digest:
                    raise CheckpointChanged(f"{path} was rewritten while it was read") from None
                raise
            if dtype != torch.float32:
                if any(isinstance(t, torch.Tensor) and t.dtype == torch.int8
                       for t in model.state_dict().values()):
                    raise DynaseqError(f"{path}: an int8 model runs in int8; precision "
                                       f"{precision} is for a float model")
                model = model.to(dtype)
        if weights_digest(path) != digest:
            raise CheckpointChanged(f"{path} was rewritten while it was read")
        return make(LoadedRun(run, cfg, vocab, model, path, placed, digest))

    return load_resolved(run, checkpoint, from_checkpoint)


def _digest_now(path: Path) -> str | None:
    """:func:`weights_digest` of ``path``, None where it cannot be read now."""
    try:
        return weights_digest(path)
    except (CheckpointError, OSError):
        return None


class ShortRepr:
    """A predictor's one-line ``repr`` (its dataclass says ``repr=False``): its class,
    checkpoint, device, parameter count and, for a model with budgets, its calibrated ones
    (the dataclass default printed the whole module tree, the vocabulary and every
    calibration: thousands of characters)."""

    def __repr__(self) -> str:
        p: Any = self
        n = sum(t.numel() for t in p.model.parameters())
        cals = getattr(p, "calibrations", None)
        budgets = "" if not cals else ", calibrated=[" + ", ".join(
            "(" + ", ".join(f"{b:g}" for b in c.budget) + ")" for c in cals) + "]"
        return (f"{type(p).__name__}(checkpoint='{p.checkpoint}', device={p.device}, "
                f"params={n:,}{budgets})")
