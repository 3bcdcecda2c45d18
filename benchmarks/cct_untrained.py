"""Build an untrained CCT and dense model at base or big size, for timing budgets at scale.

``cct_speed.py`` times the trained CCT of ``small`` size (d=256, 3+3 layers). There the
parts no gate can skip (embeddings, output layer and loss, control nets) take about 0.4 of
budget 1's scoring time, which caps what any budget can save (Amdahl). At larger sizes that
ungated share shrinks: the gated sub-layers grow with d², the output layer, control nets
and gating bookkeeping only with d. ``--size base`` (d=512, FFN 2048, 8 heads) and ``--size
big`` (d=1024, FFN 4096, 16 heads; the CCT paper's model is Transformer Big), both 6+6
layers. Training either to budget adherence is out of reach on 2 CPU cores, so this script
builds both models with random weights (seed 0) and **calibrates** the CCT's gate offsets
(:mod:`dynaseq.techniques.cct.calibration`) so that each budget's realized compute on held-out
pairs meets it. The gates then skip the work of a real budget's share of tokens, and the
timings of ``cct_speed.py --no-free-beam`` (teacher-forced scoring and fixed-length beam
decoding) are real wall-clock measurements of the implementation at that size. What they do
not show is quality, nor a trained model's gate patterns (which tokens are on).

    python benchmarks/cct_untrained.py --size base [--calibration-lines 100]
    python benchmarks/cct_speed.py --rounds 5 --score-lines 500 --decode-lines 200 \\
        --fixed-len 16 --no-free-beam --name cct_speed_base \\
        --cct runs/bench/cct_base_untrained --dense runs/bench/dense_base_untrained

(``--size big``: runs/bench/{cct,dense}_big_untrained, ``--name cct_speed_big``.) Writes the
two run directories (config.yaml, spm.model of the trained small CCT, weights in ``best/``;
the CCT's calibration.json) and prints the calibration.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from dynaseq.core import checkpoint as ckpt
from dynaseq.core.config import save_config
from dynaseq.data import Tokenizer, read_lines
from dynaseq.tasks.registry import load_config
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.tasks.translation.predictor import Translator

import _lib

DATA = _lib.MULTI30K
CCT_RUN = _lib.cct_quality_run("cct")  # its tokenizer serves the untrained models
SIZES = ("base", "big")
BUDGETS = [(1.0, 1.0), (0.5, 0.5), (0.33, 0.33), (0.2, 0.2)]


def runs(size: str) -> dict[str, tuple[str, list[str]]]:
    """Run dir -> (config, overrides) of the CCT (first) and the dense model of ``size``."""
    shape = [f"model.size={size}", "model.encoder_layers=6", "model.decoder_layers=6"]
    return {f"{_lib.RUNS}/cct_{size}_untrained": ("configs/multi30k_cct_small.yaml",
                                                  [*shape, "model.cct.control_hidden=128"]),
            f"{_lib.RUNS}/dense_{size}_untrained": ("configs/multi30k_small.yaml", shape)}


def build(run: str, config: str, overrides: list[str], tok: Tokenizer) -> None:
    """Write an untrained (seed 0) model of ``config`` + ``overrides`` as run ``run``."""
    cfg = load_config(config, [f"run_dir={run}", *overrides])
    out = Path(run)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    shutil.copy(Path(CCT_RUN) / "spm.model", out / "spm.model")
    torch.manual_seed(0)
    model = build_seq2seq(cfg.model, tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    ckpt.write_checkpoint(out / "best", model, {"step": 0, "untrained": True})
    print(f"{run}: {n_params / 1e6:.1f}M parameters, d={cfg.model.d_model}, "
          f"{cfg.model.encoder_layers}+{cfg.model.decoder_layers} layers")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=SIZES, default="base", help="model size (6+6 layers)")
    p.add_argument("--calibration-lines", type=int, default=100,
                   help="validation pairs the gate offsets are fitted on")
    args = p.parse_args()
    tok = Tokenizer.load(Path(CCT_RUN) / "spm.model")
    pair = runs(args.size)
    for run, (config, overrides) in pair.items():
        build(run, config, overrides, tok)
    cct_run = next(iter(pair))
    t = Translator.load(cct_run)
    n = args.calibration_lines
    src = read_lines(DATA / "val.en.gz")[:n]
    ref = read_lines(DATA / "val.fr.gz")[:n]
    # budget 1: offsets that open every gate (realized exactly 1.0), the others within 0.01
    fitted = [*t.calibrate(src, ref, budgets=BUDGETS[:1], tol=1e-6),
              *t.calibrate(src, ref, budgets=BUDGETS[1:], tol=0.01)]
    for cal in fitted:
        print(f"budget {cal.budget}: offsets {cal.offsets}, realized {cal.realized}, "
              f"uncalibrated {cal.uncalibrated}")
    t.save_calibration(cct_run, {"src": str(DATA / "val.en.gz"), "lines": n,
                                 "note": "untrained model: offsets only set its compute"})


if __name__ == "__main__":
    main()
