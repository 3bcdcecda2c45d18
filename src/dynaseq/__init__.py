"""dynaseq: neural sequence models whose computation is chosen at run time.

Example::

    import dynaseq
    translator = dynaseq.load("runs/demo/run")
    print(translator.translate(["kalo mintu"], beam=4))
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dynaseq.errors import CheckpointError, ConfigError, DynaseqError

if TYPE_CHECKING:
    from dynaseq.infer.translator import Translator

__version__ = "0.1.0"


def load(run_dir: str | Path, checkpoint: str = "auto", device: str = "auto") -> Translator:
    """Load a trained run directory; returns a :class:`~dynaseq.infer.translator.Translator`."""
    from dynaseq.infer.translator import Translator

    return Translator.load(run_dir, checkpoint=checkpoint, device=device)


__all__ = ["CheckpointError", "ConfigError", "DynaseqError", "__version__", "load"]
