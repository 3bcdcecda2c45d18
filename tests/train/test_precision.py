"""``train.precision: bf16``: every task and technique trains under bfloat16 autocast
(its matrix products in bfloat16, its weights, gradients and validation in float32), and a
bf16 update stays close to the float32 one."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from dynaseq.core.config import TrainConfig
from dynaseq.core.errors import ConfigError
from dynaseq.data import write_task
from dynaseq.train.loop import train

from encoder_helpers import TINY_MODEL, classify_config, glue_subset, mlm_config, read_events
from helpers import SHARED_DATA, lm_config, micro_config

CCT = ["model.cct.ffn_pieces=2", "model.cct.control_hidden=8", "model.cct.noise_ramp_steps=4"]
DEPTH = ["model.layers=4", "model.depth.first_group=1", "model.depth.predictor_hidden=8",
         "model.relative_positions=4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("precision")
    lines = (SHARED_DATA / "wikitext-2" / "train.txt").read_text().splitlines()
    (root / "train.txt").write_text("\n".join(lines[:400]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[400:460]) + "\n")
    (root / "sst2").mkdir()
    paths = write_task(root / "synthetic", seed=0, n_train=300, n_valid=20, n_test=20)
    return {"text": {"train": root / "train.txt", "valid": root / "valid.txt"},
            "sst2": glue_subset(root / "sst2", "SST-2", 200, 40), "root": root, **paths}


def _translation(run: Path, data, technique: str | None, precision: str):
    from dynaseq.techniques.branching.config import DMBConfig, MoEConfig
    from dynaseq.techniques.cct.config import CCTConfig

    cfg = micro_config(run, data, max_steps=4, log_every=1, valid_every=4, save_every=4,
                       valid_bleu_lines=4, precision=precision)
    if technique == "cct":
        cfg.model.cct = CCTConfig(ffn_pieces=2, control_hidden=8, noise_ramp_steps=4,
                                  budgets=[(1.0, 1.0), (0.5, 0.5)])
    elif technique == "dmb":
        cfg.model.dmb = DMBConfig()
    elif technique == "moe":
        cfg.model.moe = MoEConfig()
    return cfg


def _config(kind: str, run: Path, data, precision: str):
    p = f"train.precision={precision}"
    if kind in ("translation", "cct", "dmb", "moe"):
        return _translation(run, data, None if kind == "translation" else kind, precision)
    if kind == "lm":
        (run.parent / "lm").mkdir(parents=True, exist_ok=True)
        return lm_config(run.parent / "lm", p, "train.max_steps=4", "train.valid_every=4",
                         "train.save_every=4", "train.log_every=1")
    steps = ["train.max_steps=4", "train.valid_every=4", "train.save_every=4",
             "train.log_every=1", p]
    if kind == "mlm":
        return mlm_config(run, data["text"], *steps)
    if kind == "cct_mlm":
        return mlm_config(run, data["text"], *steps, *CCT)
    if kind == "classify":
        return classify_config(run, data["sst2"], *steps)
    if kind == "alberta":
        return classify_config(run, data["sst2"], *steps, *DEPTH)
    raise AssertionError(kind)


KINDS = ["translation", "cct", "dmb", "moe", "lm", "mlm", "cct_mlm", "classify", "alberta"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_trains_in_bf16(tmp_path, data, kind):
    cfg = _config(kind, tmp_path / "run", data, "bf16")
    seen: set[torch.dtype] = set()
    real = nn.Linear.forward

    def forward(self, x):
        out = real(self, x)
        if torch.is_grad_enabled():
            seen.add(out.dtype)
        return out

    nn.Linear.forward = forward
    try:
        result = train(cfg, progress=False)
    finally:
        nn.Linear.forward = real
    assert seen == {torch.bfloat16}  # every training product ran in bfloat16
    run = Path(cfg.run_dir)
    losses = [e["loss"] for e in read_events(run) if e.get("event") == "train"]
    assert losses and all(math.isfinite(x) for x in losses)
    assert result.state.step == 4


def _first_losses(run: Path) -> list[float]:
    return [e["loss"] for e in read_events(run) if e.get("event") == "train"]


def test_bf16_updates_track_fp32_and_keep_float32_weights(tmp_path, data):
    runs = {}
    for precision in ("fp32", "bf16"):
        cfg = _config("mlm", tmp_path / precision, data, precision)
        runs[precision] = train(cfg, progress=False)
    fp32, bf16 = (_first_losses(tmp_path / p) for p in ("fp32", "bf16"))
    assert len(fp32) == len(bf16) == 4
    for a, b in zip(fp32, bf16):  # the same masks and rows: the losses differ by rounding
        assert b == pytest.approx(a, rel=0.02)
    assert fp32 != bf16  # ... and do differ: bf16 really ran
    from safetensors.torch import load_file

    weights = load_file(str(next((tmp_path / "bf16" / "best").glob("*.safetensors"))))
    assert {t.dtype for t in weights.values()} == {torch.float32}


def test_an_unknown_precision_is_refused():
    with pytest.raises(ConfigError, match="precision must be 'fp32' or 'bf16', got 'fp16'"):
        TrainConfig(precision="fp16")
