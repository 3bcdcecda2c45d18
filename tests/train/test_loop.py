"""Training behaviour: learning, exact resume, signals, data filtering, DDP parity."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dynaseq.core import checkpoint as ckpt
from dynaseq.core.config import save_config
from dynaseq.train.loop import train

from helpers import (
    REPO,
    assert_ddp_matches_one_process,
    micro_config,
    train_one_and_two_processes,
)


def events(run: Path, kind: str) -> list[dict]:
    recs = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    return [r for r in recs if r["event"] == kind]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / ckpt.WEIGHTS))


def test_trained_run_has_everything(trained_run):
    assert (trained_run / "config.yaml").is_file() and (trained_run / "spm.model").is_file()
    assert [p.name for p in ckpt.list_checkpoints(trained_run)] == ["step_00000010",
                                                                     "step_00000020"]
    assert (trained_run / "best" / ckpt.WEIGHTS).is_file()
    valid = events(trained_run, "valid")
    best_step = max(valid, key=lambda r: (r["bleu"], -r["step"]))["step"]
    assert ckpt.read_meta(trained_run / "best")["step"] == best_step  # kept by valid BLEU
    meta = ckpt.read_meta(ckpt.list_checkpoints(trained_run)[-1])
    assert meta["step"] == 20 and meta["config"]["model"]["d_model"] == 32
    train_recs = events(trained_run, "train")
    assert train_recs[0]["loss"] > train_recs[-1]["loss"]  # it learns
    assert {"loss", "ppl", "bleu"} <= set(events(trained_run, "valid")[-1])
    assert events(trained_run, "stop")[-1]["reason"] == "max_steps"


def test_resume_is_exact_across_an_epoch_boundary(tmp_path, synthetic_paths):
    def cfg(run, steps):
        c = micro_config(tmp_path / run, synthetic_paths, max_steps=steps, save_every=6,
                         valid_every=6, valid_bleu_lines=5)
        c.data.max_tokens = 4000  # about 10 updates per epoch
        return c

    train(cfg("a", 16), progress=False)
    train(cfg("b", 6), progress=False)
    result = train(cfg("b", 16), progress=False)
    assert result.state.step == 16 and result.state.epoch >= 1
    assert events(tmp_path / "b", "resume")[0]["step"] == 6
    a, b = weights(ckpt.step_dir(tmp_path / "a", 16)), weights(ckpt.step_dir(tmp_path / "b", 16))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_average_last_k_and_max_epochs(tmp_path, synthetic_paths):
    cfg = micro_config(tmp_path / "r", synthetic_paths, max_steps=10_000, max_epochs=1,
                       average_last_k=2, save_every=4, valid_every=100, valid_bleu_lines=5)
    cfg.data.max_tokens = 4000
    result = train(cfg, progress=False)
    assert result.state.epoch == 1 and events(tmp_path / "r", "stop")[-1]["reason"] == "max_epochs"
    assert events(tmp_path / "r", "average")[0]["checkpoints"] == [
        p.name for p in ckpt.list_checkpoints(tmp_path / "r")[-2:]]
    assert (tmp_path / "r" / "averaged" / ckpt.WEIGHTS).is_file()


def test_empty_and_overlong_lines_are_skipped_and_counted(tmp_path, synthetic_paths):
    src = synthetic_paths["train.src"].read_text().splitlines()[:300]
    tgt = synthetic_paths["train.tgt"].read_text().splitlines()[:300]
    src[5], tgt[7] = "", ""
    src[9] = " ".join(["kalo"] * 500)
    (tmp_path / "s").write_text("\n".join(src) + "\n")
    (tmp_path / "t").write_text("\n".join(tgt) + "\n")
    paths = {**synthetic_paths, "train.src": tmp_path / "s", "train.tgt": tmp_path / "t"}
    cfg = micro_config(tmp_path / "r", paths, max_steps=2)
    cfg.data.max_len = 300  # only the 500-word line is over-long
    train(cfg, progress=False)
    stats = events(tmp_path / "r", "data")[0]
    assert (stats["lines"], stats["empty"], stats["too_long"], stats["kept"]) == (300, 2, 1, 297)


def _write_cfg(tmp_path: Path, cfg) -> Path:
    path = tmp_path / f"{Path(cfg.run_dir).name}.yaml"
    save_config(cfg, path)
    return path


def test_sigterm_leaves_a_resumable_checkpoint(tmp_path, synthetic_paths):
    run = tmp_path / "killed"
    cfg = micro_config(run, synthetic_paths, max_steps=100_000, save_every=5, valid_every=10_000,
                       log_every=1)
    path = _write_cfg(tmp_path, cfg)
    proc = subprocess.Popen([sys.executable, "-m", "dynaseq", "train", str(path), "--quiet"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not ckpt.list_checkpoints(run) and time.time() < deadline:
        time.sleep(0.2)
    assert ckpt.list_checkpoints(run), proc.stderr.read() if proc.poll() is not None else ""
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()
    assert b"Traceback" not in err
    latest = ckpt.list_checkpoints(run)[-1]
    stopped_at = ckpt.read_meta(latest)["step"]
    assert events(run, "stop")[-1] == {**events(run, "stop")[-1], "reason": "signal",
                                       "step": stopped_at}
    cfg.train.max_steps = stopped_at + 3
    result = train(cfg, progress=False)
    assert result.state.step == stopped_at + 3
    assert events(run, "resume")[-1]["step"] == stopped_at


def test_two_process_ddp_matches_one_process(tmp_path, synthetic_paths):
    """torchrun, 2 CPU processes (gloo): the same losses at every update (within 1e-6) and the
    same weights (within 1e-3·lr) as one process (dropout off: random draws differ by rank)."""
    kw = {"max_steps": 6, "log_every": 1, "valid_every": 1000, "save_every": 1000}
    single = micro_config(tmp_path / "single", synthetic_paths, **kw)
    double = micro_config(tmp_path / "ddp", synthetic_paths, **kw)
    single.model.dropout = double.model.dropout = 0.0
    one, two = train_one_and_two_processes(single, double)
    assert_ddp_matches_one_process(one, two, 6, single.train.lr)


def test_gradient_accumulation_normalises_over_all_micro_batches(tmp_path, synthetic_paths):
    from dynaseq.data import Tokenizer, collate, make_corpus, read_parallel, token_batches
    from dynaseq.nn.losses import label_smoothed_loss
    from dynaseq.tasks.translation.model import build_seq2seq

    cfg = micro_config(tmp_path / "acc", synthetic_paths, max_steps=1, update_freq=3,
                       log_every=1, valid_every=100)
    cfg.model.dropout = 0.0
    train(cfg, progress=False)
    logged = events(tmp_path / "acc", "train")[0]
    # recompute the first update's loss by hand from the same initial weights and batches
    tok = Tokenizer.load(tmp_path / "acc" / "spm.model")
    src, tgt = read_parallel(cfg.data.train_src, cfg.data.train_tgt)
    corpus, _ = make_corpus(tok.encode(src), tok.encode(tgt), cfg.data.max_len)
    batches = token_batches(corpus.src_lengths(), corpus.tgt_lengths(), cfg.data.max_tokens,
                            cfg.train.seed, 0)[:3]
    torch.manual_seed(cfg.train.seed)
    model = build_seq2seq(cfg.model, tok.vocab_size)
    total, n = 0.0, 0
    with torch.no_grad():
        for idx in batches:
            b = collate(corpus, idx, 0, 2, 3)
            loss, _, k = label_smoothed_loss(model(b.src, b.tgt_in).logits, b.tgt_out,
                                             cfg.train.label_smoothing, 0)
            total, n = total + float(loss), n + k
    assert logged["loss"] == pytest.approx(total / n, rel=1e-5)
    assert train(cfg, progress=False).state.tokens == n
