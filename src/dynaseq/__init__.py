"""dynaseq: neural sequence models whose computation is chosen at run time.

Example::

    import dynaseq
    translator = dynaseq.load("runs/demo/run")      # any run kind: its task's Predictor
    print(translator.translate(["kalo mintu"], beam=4, budget=0.5))
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dynaseq.core.errors import CheckpointError, ConfigError, DynaseqError

if TYPE_CHECKING:
    from dynaseq.tasks.protocol import Predictor

__version__ = "0.1.0"


def load(run_dir: str | Path, checkpoint: str = "auto", device: str = "auto",
         precision: str = "fp32") -> Predictor:
    """Load a trained run directory of any kind: a translation run gives a
    :class:`~dynaseq.tasks.translation.predictor.Translator`, a language-model run a
    :class:`~dynaseq.tasks.lm.predictor.LanguageModel` (both
    :class:`~dynaseq.tasks.protocol.Predictor`). ``precision="bf16"`` runs the model's
    products in bfloat16: outputs within bfloat16's rounding of float32's; on a CPU with
    AVX512-BF16, classification in 0.6-0.75x the float32 time, decoding gaining less
    (``benchmarks/results/precision.md``)."""
    from dynaseq.tasks.registry import load as load_run

    return load_run(run_dir, checkpoint=checkpoint, device=device, precision=precision)


__all__ = ["CheckpointError", "ConfigError", "DynaseqError", "__version__", "load"]
