"""bfloat16. Training (``train.precision: bf16``): every task and technique trains under
autocast (its matrix products in bfloat16, its weights, gradients and validation in
float32), and a bf16 update stays close to the float32 one. Inference (``precision=`` on
``dynaseq.load``, ``--precision``): every kind loads in bfloat16 and answers within
bfloat16's rounding of float32; int8 runs and unknown precisions are refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from dynaseq.core.config import TrainConfig
from dynaseq.core.errors import ConfigError, DynaseqError
from dynaseq.train.loop import train

from encoder_helpers import classify_config, mlm_config, read_events
from helpers import lm_config, micro_config

CCT = ["model.cct.ffn_pieces=2", "model.cct.control_hidden=8", "model.cct.noise_ramp_steps=4"]
DEPTH = ["model.layers=4", "model.depth.first_group=1", "model.depth.predictor_hidden=8",
         "model.relative_positions=4"]


@pytest.fixture(scope="module")
def data(text_corpus, sst2_small, synthetic_paths) -> dict:
    return {"text": text_corpus, "sst2": sst2_small, **synthetic_paths}


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
def test_every_kind_trains_in_bf16(tmp_path, data, kind, monkeypatch):
    cfg = _config(kind, tmp_path / "run", data, "bf16")
    seen: set[torch.dtype] = set()
    real = nn.Linear.forward

    def forward(self, x):
        out = real(self, x)
        if torch.is_grad_enabled():
            seen.add(out.dtype)
        return out

    monkeypatch.setattr(nn.Linear, "forward", forward)
    result = train(cfg, progress=False)
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
    for a, b in zip(fp32, bf16, strict=True):  # the same masks and rows: the losses differ by rounding
        assert b == pytest.approx(a, rel=0.02)
    assert fp32 != bf16  # ... and do differ: bf16 really ran
    from safetensors.torch import load_file

    weights = load_file(str(next((tmp_path / "bf16" / "best").glob("*.safetensors"))))
    assert {t.dtype for t in weights.values()} == {torch.float32}


def test_an_unknown_precision_is_refused():
    from dynaseq.serve.config import ServeConfig

    with pytest.raises(ConfigError, match="precision must be 'fp32' or 'bf16', got 'fp16'"):
        TrainConfig(precision="fp16")
    with pytest.raises(DynaseqError, match="--precision must be fp32 or bf16, got 'fp16'"):
        ServeConfig(precision="fp16")


# --------------------------------------------------------------------------- inference


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data) -> dict[str, Path]:
    """One run of each kind, trained 4 float32 updates."""
    root = tmp_path_factory.mktemp("precision_runs")
    out = {}
    for kind in ("translation", "cct", "dmb", "lm", "mlm", "classify", "alberta"):
        cfg = _config(kind, root / kind / "run", data, "fp32")
        train(cfg, progress=False)
        out[kind] = Path(cfg.run_dir)
    return out


def _pair(run: Path) -> tuple:
    import dynaseq

    fp32, bf16 = dynaseq.load(run), dynaseq.load(run, precision="bf16")
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    return fp32, bf16


@pytest.mark.parametrize("kind", ["translation", "cct", "dmb"])
def test_a_bf16_translator_scores_as_fp32_within_rounding(runs, data, kind):
    fp32, bf16 = _pair(runs[kind])
    src = Path(data["valid.src"]).read_text().splitlines()[:8]
    ref = Path(data["valid.tgt"]).read_text().splitlines()[:8]
    budget = (0.5, 0.5) if kind == "cct" else None
    a, b = fp32.score(src, ref, budget=budget), bf16.score(src, ref, budget=budget)
    assert b["loss"] == pytest.approx(a["loss"], rel=0.02) and b["loss"] != a["loss"]
    for beam in (1, 2):  # the lean greedy step and the beam search run in bfloat16
        out = bf16.translate(src, beam=beam, budget=budget)
        assert len(out) == len(src) and all(isinstance(x, str) for x in out)


def test_a_bf16_classifier_gives_fp32_logits_within_rounding(runs, data):
    from dynaseq.tasks.classify.predictor import predict_logits

    for kind in ("classify", "alberta"):
        fp32, bf16 = _pair(runs[kind])
        lines = [ln.split("\t")[0] for ln in
                 Path(data["sst2"]["dev"]).read_text().splitlines()[1:17]]
        rows, _ = fp32.encode(lines)
        a = predict_logits(fp32.model, rows, 8, fp32.device, lean=fp32.lean_encoder())
        b = predict_logits(bf16.model, rows, 8, bf16.device, lean=bf16.lean_encoder())
        torch.testing.assert_close(b, a, atol=0.05, rtol=0.05)
        assert not torch.equal(a, b)  # bfloat16 really ran
        assert bf16.classify(lines) == [str(x) for x in bf16.classify(lines)]  # labels


def test_bf16_language_models_evaluate_as_fp32_within_rounding(runs):
    for kind in ("lm", "mlm"):
        fp32, bf16 = _pair(runs[kind])
        a, b = fp32.evaluate("valid"), bf16.evaluate("valid")
        assert b["loss"] == pytest.approx(a["loss"], rel=0.02) and b["loss"] != a["loss"]


def test_an_int8_run_refuses_bf16_and_a_bad_precision_is_one_line(runs, tmp_path):
    import dynaseq

    from helpers import run_cli

    def one_line(proc) -> str:
        err = proc.stderr.decode()
        assert proc.returncode == 2 and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
        return err

    out = tmp_path / "int8"
    assert run_cli("quantize", str(runs["translation"]), "--out", str(out)).returncode == 0
    with pytest.raises(DynaseqError, match="an int8 model runs in int8; precision bf16 is "
                                           "for a float model"):
        dynaseq.load(out, precision="bf16")
    assert "an int8 model runs in int8" in one_line(
        run_cli("translate", str(out), "--precision", "bf16", stdin=b"a b c\n"))
    with pytest.raises(ConfigError, match="precision must be 'fp32' or 'bf16', got 'fp16'"):
        dynaseq.load(runs["translation"], precision="fp16")
    assert "invalid choice: 'fp16'" in one_line(
        run_cli("translate", str(runs["translation"]), "--precision", "fp16"))


def test_the_cli_translates_and_classifies_in_bf16(runs, data):
    from helpers import run_cli

    src = "\n".join(Path(data["valid.src"]).read_text().splitlines()[:4]) + "\n"
    for kind, command in (("translation", "translate"), ("classify", "classify")):
        a = run_cli(command, str(runs[kind]), stdin=src.encode())
        b = run_cli(command, str(runs[kind]), "--precision", "bf16", stdin=src.encode())
        assert a.returncode == b.returncode == 0, b.stderr.decode()
        assert len(b.stdout.decode().splitlines()) == 4


def test_a_latency_table_records_its_precision_and_the_server_warns_at_another(runs,
                                                                               tmp_path):
    from dynaseq.metrics.latency_table import LatencyTable, measure_latency_table
    from dynaseq.serve.app import _warn_stale_table

    fp32, bf16 = _pair(runs["translation"])
    table = measure_latency_table(bf16.model, {(1.0, 1.0): None}, [1], [4], repeats=1,
                                  checkpoint=str(bf16.checkpoint))
    assert table.precision == "bf16"
    table = LatencyTable.load(table.save(tmp_path / "table.json"))
    assert table.precision == "bf16"
    with pytest.warns(UserWarning, match="measured at precision bf16, the server runs fp32"):
        _warn_stale_table(table, fp32, "fp32", runs["translation"])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_stale_table(table, bf16, "bf16", runs["translation"])  # the same: silent


def test_profile_reports_the_precision_it_ran_at(runs):
    import json

    from helpers import run_cli

    for precision in ("fp32", "bf16"):
        proc = run_cli("profile", str(runs["classify"]), "--precision", precision, "--json")
        assert proc.returncode == 0, proc.stderr.decode()
        assert json.loads(proc.stdout)["precision"] == precision


def test_a_server_loads_its_model_at_its_precision(runs):
    from dynaseq.serve.config import ServeConfig
    from dynaseq.serve.server import _build_state

    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        state = _build_state(runs["translation"], ServeConfig(precision=precision), "auto",
                             "cpu", None)
        assert {p.dtype for p in state.predictor.model.parameters()} == {dtype}
