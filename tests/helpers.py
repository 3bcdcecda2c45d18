"""Helpers shared by the tests (importable as ``helpers``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dynaseq.config import DataConfig, DecodeConfig, ModelConfig, RunConfig, TrainConfig

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def micro_config(run_dir: Path, paths: dict[str, Path], **train_kw) -> RunConfig:
    """A 1+1-layer, d=32 model: trains a step in a few milliseconds."""
    train = {"seed": 3, "lr": 3e-3, "warmup_steps": 10, "max_steps": 20, "log_every": 5,
             "valid_every": 10, "save_every": 10, "keep_last": 3, "valid_bleu_lines": 20,
             **train_kw}
    return RunConfig(
        run_dir=str(run_dir),
        model=ModelConfig(d_model=32, ffn_dim=64, n_heads=2, encoder_layers=1, decoder_layers=1,
                          dropout=0.1),
        data=DataConfig(train_src=str(paths["train.src"]), train_tgt=str(paths["train.tgt"]),
                        valid_src=str(paths["valid.src"]), valid_tgt=str(paths["valid.tgt"]),
                        vocab_size=200, max_tokens=800, max_len=64),
        train=TrainConfig(**train),
        decode=DecodeConfig(beam=2, batch_size=32),
    )


def run_cli(*args: str, stdin: bytes | None = None, cwd: Path | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m dynaseq ARGS`` and capture text output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "dynaseq", *args], input=stdin,
                          capture_output=True, cwd=cwd or REPO, timeout=timeout, env=env)
