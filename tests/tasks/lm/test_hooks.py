"""Config hooks of LM training: neural cache, Hebbian softmax, token-level distillation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dynaseq.cli import main
from dynaseq.compress.lm_distill import dump_lm_teacher, open_teacher_topk
from dynaseq.core import checkpoint as ckpt
from dynaseq.core.config import save_config
from dynaseq.core.errors import DynaseqError
from dynaseq.data.lm_corpus import StreamBatches
from dynaseq.tasks.lm.config import LMCacheConfig, LMHebbianConfig, LMModelConfig
from dynaseq.tasks.lm.hooks import ConfigLoss, hebbian_after_step
from dynaseq.tasks.lm.model import build_lm
from dynaseq.tasks.lm.predictor import LanguageModel, cache_adjust, evaluate_stream
from dynaseq.tasks.lm.task import lm_loss
from dynaseq.train.loop import setup, train

from helpers import lm_config

TINY = dict(d_model=16, n_layers=1, n_heads=2, ffn_dim=16, context=3, extended_context=6,
            cutoffs=[5, 12], dropout=0.0)


def test_log_prob_at_matches_full_distribution():
    torch.manual_seed(0)
    model = build_lm(LMModelConfig(**TINY), 30).eval()
    h = torch.randn(7, 16)
    ids = torch.randint(0, 30, (7, 4))
    full = model.softmax.log_prob(h)
    torch.testing.assert_close(model.softmax.log_prob_at(h, ids), full.gather(1, ids))
    torch.testing.assert_close(model.softmax.log_prob_at(h, ids[:, :1]).squeeze(1),
                               model.softmax(h, ids[:, 0].contiguous()))


def test_cache_with_lambda_zero_equals_plain_ppl(tmp_path):
    train(lm_config(tmp_path, "train.max_steps=3"), progress=False)
    lm = LanguageModel.load(tmp_path / "run")
    assert lm.model.cache is None  # off by default
    plain = lm.evaluate("valid")
    res = lm.evaluate("valid", with_cache=True)  # no cache in the run: the defaults
    assert res["cache"]["source"] == "default" and res["cache"]["n_cache"] == 2000
    assert res["ppl"] == plain["ppl"] and math.isfinite(res["ppl_cache"])
    from dynaseq.nn.neural_cache import NeuralCache

    cache = NeuralCache(50, theta=0.1, lam=0.5)
    with torch.no_grad():
        cache.lam_raw.fill_(-math.inf)  # λ = 0 exactly
    ids = lm.ids("valid")
    r = evaluate_stream(lm.model, ids, lm.config.data.eval_batch_size, 12,
                        adjust=cache_adjust(cache))
    assert r["ppl_adjusted"] == r["ppl"] == pytest.approx(plain["ppl"], rel=1e-9)


def test_cache_trained_jointly_saved_and_reset(tmp_path, capsys):
    cfg = lm_config(tmp_path, "model.cache={n_cache: 24, theta: 0.05, lam: 0.2}",
                    "train.max_steps=6", "train.log_every=1")
    s = setup(cfg)
    assert isinstance(s.task.hooks.loss, ConfigLoss) and s.task.hooks.loss.train_cache
    from dynaseq.train.loop import fit

    fit(s, progress=False)
    logs = [e for e in s.log.history if e["event"] == "train"]
    assert all("nll_cache" in e and "cache_lam" in e for e in logs)
    weights = ckpt.read_meta(tmp_path / "run" / "best")  # saved with the model
    assert weights["step"] > 0
    lm = LanguageModel.load(tmp_path / "run")
    assert lm.model.cache is not None and lm.model.cache.n_cache == 24
    assert float(lm.model.cache.theta.detach()) != pytest.approx(0.05, abs=1e-7)  # trained
    assert main(["evaluate", str(tmp_path / "run"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert {"ppl", "ppl_cache"} <= set(res) and res["cache"]["source"] == "run"
    # the memory restarts with the streams (window 0 of an epoch)
    loss = s.task.hooks.loss
    x, y = s.task.train[0]
    out = s.model(x)
    loss(s.model, out, y, step=len(s.task.train) * 2)
    assert loss.memory.size == y.size(1)


def test_cache_loss_with_lambda_zero_equals_plain_loss(tmp_path):
    torch.manual_seed(0)
    cfg = LMModelConfig(**TINY, cache=LMCacheConfig(n_cache=8, theta=0.1, lam=0.3))
    model = build_lm(cfg, 30)
    with torch.no_grad():
        model.cache.lam_raw.fill_(-math.inf)
    x, y = torch.randint(0, 30, (2, 6)), torch.randint(0, 30, (2, 6))
    out = model(x)
    hook = ConfigLoss(n_windows=5, window_len=6, train_cache=True)
    hook(model, out, y, 0)
    mixed = hook(model, out, y, 1)  # the memory now holds the first call's pairs
    assert mixed.loss.item() == lm_loss(model, out, y, 1).loss.item()


def test_hebbian_updates_rows_and_counts(tmp_path):
    torch.manual_seed(0)
    model = build_lm(LMModelConfig(**TINY), 30)
    assert model.hebbian is None
    model = build_lm(LMModelConfig(**TINY, hebbian=LMHebbianConfig(match_norm=False)), 30)
    x = torch.randint(0, 30, (2, 6))
    y = torch.tensor([[1, 1, 2, 20, 20, 3], [1, 4, 4, 4, 25, 3]])
    out = model(x)
    head = model.softmax.head.weight.detach().clone()
    hebbian_after_step(model, out, y)
    h = out.hidden.detach().reshape(-1, 16)
    flat = y.reshape(-1)
    for word in (1, 2, 3, 4):  # λ = 1/count: n sightings move the row 1/n of the way
        n = int((flat == word).sum())
        want = (1 - 1 / n) * head[word] + h[flat == word].mean(0) / n
        torch.testing.assert_close(model.softmax.head.weight[word], want)
    torch.testing.assert_close(model.softmax.head.weight[2], h[flat == 2][0])  # seen once
    torch.testing.assert_close(model.softmax.head.weight[0], head[0])  # unseen: unchanged
    assert int(model.hebbian[0].counts[4]) == 3 and int(model.hebbian[2].counts[20 - 12]) == 2
    # wired into training, counts saved in the checkpoint
    train(lm_config(tmp_path, "model.hebbian={gamma: 0.01}", "train.max_steps=3"),
          progress=False)
    lm = LanguageModel.load(tmp_path / "run")
    assert sum(int(st.counts.sum()) for st in lm.model.hebbian) == 3 * 4 * 12


def test_distillation_loss_order_and_mismatch(tmp_path, capsys):
    train(lm_config(tmp_path, "train.max_steps=3"), progress=False)
    teacher = LanguageModel.load(tmp_path / "run")
    topk_dir = tmp_path / "top5"
    assert main(["distill-data", str(tmp_path / "run"), "--out", str(topk_dir), "--k", "5",
                 "--quiet"]) == 0
    cfg = lm_config(tmp_path, f"run_dir={tmp_path / 'student'}",
                    f"train.distill={{topk_dir: {topk_dir}, lam_max: 0.0, lam_min: 0.0}}")
    s = setup(cfg)
    reader = open_teacher_topk(topk_dir, s.task.train, s.task.vocab)
    assert reader.n_tokens == s.task.train.n_tokens and reader.k == 5
    # the order contract: window i's rows are the teacher's top-k of y_i, row-major
    state = None
    for i in range(3):
        x, y = s.task.train[i]
        o = teacher.model(x, state)
        state = o.state
        want = teacher.model.softmax.log_prob(o.hidden.reshape(-1, 32)).topk(5).indices
        start = x.size(0) * i * s.task.train.window
        assert torch.equal(reader[slice(start, start + y.numel())][0], want)
    # λ = 0: the distillation loss equals the plain loss
    x, y = s.task.train[1]
    out = s.model(x)
    d = s.task.hooks.loss(s.model, out, y, 1)
    torch.testing.assert_close(d.loss, lm_loss(s.model, out, y, 1).loss)
    assert d.logs["distill_lambda"] == 0.0
    # annealing λ over max_steps
    s2 = setup(lm_config(tmp_path, f"run_dir={tmp_path / 'student2'}",
                         f"train.distill={{topk_dir: {topk_dir}}}"))
    assert s2.task.hooks.loss.lam(0) == 0.5 and s2.task.hooks.loss.lam(12) == pytest.approx(0.05)
    # a student with another stream layout is refused before its run dir is written
    bad = lm_config(tmp_path, f"run_dir={tmp_path / 'bad'}", "data.batch_size=3",
                    f"train.distill={{topk_dir: {topk_dir}}}")
    save_config(bad, tmp_path / "bad.yaml")
    capsys.readouterr()
    assert main(["train", str(tmp_path / "bad.yaml"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynaseq: error:") and "data.batch_size" in err
    assert err.count("\n") == 1 and not (tmp_path / "bad").exists()
    with pytest.raises(DynaseqError, match="model.extended_context"):
        open_teacher_topk(topk_dir, StreamBatches(teacher.ids("train"), 4, 10), s.task.vocab)
    with pytest.raises(DynaseqError, match="already exists"):
        dump_lm_teacher(teacher, topk_dir, k=5)
