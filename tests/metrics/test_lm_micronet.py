"""MicroNet score of language models: ops per token fed one at a time, storage, score."""

from __future__ import annotations

import json

import pytest
import torch

from dynaseq.cli import main
from dynaseq.metrics.lm_profile import micronet_profile
from dynaseq.metrics.micronet import parameter_storage
from dynaseq.tasks.lm.config import LMCacheConfig, LMModelConfig
from dynaseq.tasks.lm.model import build_lm
from dynaseq.train.loop import train

from helpers import lm_config

TINY = dict(d_model=16, n_layers=2, n_heads=2, ffn_dim=24, context=3, extended_context=8,
            cutoffs=[5, 12], dropout=0.0)


def test_ops_counter_positive_stable_and_score_formula():
    torch.manual_seed(0)
    model = build_lm(LMModelConfig(**TINY), 30).eval()
    a = micronet_profile(model, n_tokens=6)
    b = micronet_profile(model, n_tokens=6)
    assert a == b  # same tokens: identical counts
    ops = a["ops_per_token"]
    assert ops["mults"] > 0 and ops["adds"] > 0
    assert ops["total"] == pytest.approx(ops["mults"] + ops["adds"])
    # at least the dense matmuls of one step: 2 layers x (4 d·d + 2 d·ffn) + the softmax head
    assert ops["mults"] > 2 * (4 * 16 * 16 + 2 * 16 * 24) + 16 * 7
    n_params = sum(p.numel() for p in model.parameters())  # zero biases may be stored sparse
    assert a["params_storage"] == parameter_storage(model).total <= n_params
    assert a["score"] == pytest.approx(a["params_storage"] / 159e6 + ops["total"] / 318e6)
    # a neural cache adds its per-token cost
    cached = build_lm(LMModelConfig(**TINY, cache=LMCacheConfig(n_cache=100)), 30).eval()
    cached.load_state_dict(model.state_dict(), strict=False)
    c = micronet_profile(cached, n_tokens=6)
    extra = cached.cache.ops_per_token(16, vocab_size=30)
    assert c["ops_per_token"]["total"] - ops["total"] == pytest.approx(extra.total)


def test_profile_json_reports_micronet(tmp_path, capsys):
    train(lm_config(tmp_path, "train.max_steps=2"), progress=False)
    capsys.readouterr()
    assert main(["profile", str(tmp_path / "run"), "--json", "--repeats", "1"]) == 0
    mn = json.loads(capsys.readouterr().out)["micronet"]
    assert set(mn) == {"params_storage", "ops_per_token", "score"}
    assert set(mn["ops_per_token"]) == {"mults", "adds", "total"} and mn["score"] > 0
    assert main(["profile", str(tmp_path / "run"), "--repeats", "1"]) == 0
    assert "MicroNet: storage" in capsys.readouterr().out
