"""TransformerLM: incremental == full sequence, banded context, sampling, and a tiny CLI run."""

from __future__ import annotations

import json

import pytest
import torch

from dynaseq.cli import main
from dynaseq.core.config import save_config
from dynaseq.core.errors import ConfigError
from dynaseq.models.lm import LMOutput
from dynaseq.tasks.lm.config import LMModelConfig
from dynaseq.tasks.lm.model import build_lm
from dynaseq.tasks.registry import load_config

from helpers import lm_config as _lm_config
from helpers import run_cli

V = 60


def tiny_cfg(**kw) -> LMModelConfig:
    base = dict(d_model=32, n_layers=2, n_heads=2, d_head=12, ffn_dim=64, context=4,
                extended_context=16, cutoffs=[12, 40], dropout=0.0)
    return LMModelConfig(**{**base, **kw})


@pytest.fixture
def model():
    torch.manual_seed(0)
    return build_lm(tiny_cfg(), V).eval()


def test_forward_outputs_and_score(model):
    x = torch.randint(0, V, (3, 9))
    y = torch.randint(0, V, (3, 9))
    out = model(x)
    assert isinstance(out, LMOutput) and out.hidden.shape == (3, 9, 32)
    assert out.state.position == 9 and len(out.state.caches) == 2
    full = model.softmax.log_prob(out.hidden.reshape(-1, 32)).view(3, 9, V)
    torch.testing.assert_close(model.score(x, y), full.gather(2, y[..., None]).squeeze(2))


def test_incremental_log_probs_equal_full_sequence(model):
    """T = 13 > C = 4, so the banded mask and cache eviction are exercised."""
    x = torch.randint(0, V, (2, 13))
    full = model.softmax.log_prob(model(x).hidden.reshape(-1, 32)).view(2, 13, V)
    state, steps = None, []
    for t in range(13):
        st = model.step(x[:, t], state)
        state = st.state
        steps.append(st.log_probs)
        assert all(c.length <= 3 for c in state.caches)
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=1e-5)
    # windows carrying the state give the same as one pass
    a = model(x[:, :6])
    b = model(x[:, 6:], a.state)
    torch.testing.assert_close(torch.cat([a.hidden, b.hidden], 1), model(x).hidden)


def test_total_context_is_layers_times_c_minus_one(model):
    L, C = 2, 4
    reach = L * (C - 1)  # the last position sees back to T-1-reach
    x = torch.randint(0, V, (1, 16))
    last = model(x).hidden[0, -1]
    far = x.clone()
    far[0, 15 - reach - 1] = (far[0, 15 - reach - 1] + 1) % V  # one beyond the reach
    torch.testing.assert_close(model(far).hidden[0, -1], last)
    near = x.clone()
    near[0, 15 - (C - 1)] = (near[0, 15 - (C - 1)] + 1) % V  # within the last C-1
    assert not torch.allclose(model(near).hidden[0, -1], last)
    edge = x.clone()
    edge[0, 15 - reach] = (edge[0, 15 - reach] + 1) % V  # exactly at the reach
    assert not torch.allclose(model(edge).hidden[0, -1], last)


@pytest.mark.parametrize("word", [5, 35], ids=["head_word", "tail_word"])
def test_a_generation_step_costs_the_same_at_position_10000_as_at_100(model, word):
    """One incremental step (``model.step``: a word in, the full next-word distribution out)
    after 100 and after 10,000 tokens of text: the same multiply-adds (FlopCounterMode) and
    the same math operations, op by op (MicroNet's counter), not only the same cache lengths.
    The step reads the same ``word`` at both positions (a tail word of the adaptive input
    costs its up-projection more than a head word, wherever it is)."""
    from torch.utils.flop_counter import FlopCounterMode

    from dynaseq.metrics.lm_profile import prefill
    from dynaseq.metrics.micronet import MicroNetOpCounter

    text = torch.randint(0, V, (1, 10_000), generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([word])
    costs = {}
    for position in (100, 10_000):
        with torch.no_grad():
            state = prefill(model, text[:, :position], 512)
            assert state.position == position
            flops, ops = FlopCounterMode(display=False), MicroNetOpCounter(model)
            with flops:
                model.step(tokens, state)
            with ops:
                model.step(tokens, state)
        costs[position] = (flops.get_total_flops(), flops.get_flop_counts(), ops.counts.mults,
                           ops.counts.adds, dict(ops.counts.by_op))
    assert costs[100][0] > 0 and costs[100][2] > 0
    assert costs[10_000] == costs[100]


def test_generate_is_seeded_and_greedy_is_deterministic(model):
    prompt = torch.tensor([[1, 2, 3]])
    g = lambda s: model.generate(prompt, 8, 1.0, generator=torch.Generator().manual_seed(s))  # noqa: E731
    assert g(1).shape == (1, 8) and torch.equal(g(1), g(1))
    greedy = model.generate(prompt, 5, temperature=0.0)
    st = model(prompt)
    assert greedy[0, 0] == model.softmax.log_prob(st.hidden[:, -1]).argmax(-1)[0]


def test_untied_model_and_gradients():
    torch.manual_seed(0)
    m = build_lm(tiny_cfg(tie_embeddings=False, dropout=0.1), V)
    x, y = torch.randint(0, V, (2, 8)), torch.randint(0, V, (2, 8))
    (-m.score(x, y).mean()).backward()
    grads = [p.grad for p in m.parameters()]
    assert sum(g is not None for g in grads) >= len(grads) - 2  # unused tail rows may be 0
    tied = build_lm(tiny_cfg(), V)
    n = lambda mod: sum(p.numel() for p in {id(p): p for p in mod.parameters()}.values())  # noqa: E731
    assert n(tied) < n(m)


def test_cutoff_at_or_above_vocabulary_is_refused():
    with pytest.raises(ConfigError, match="not below the vocabulary size 40"):
        build_lm(tiny_cfg(), 40)
    with pytest.raises(ConfigError, match="cutoffs must be increasing"):
        tiny_cfg(cutoffs=[40, 12])
    with pytest.raises(ConfigError, match="adaptive_dims"):
        tiny_cfg(adaptive_dims=[16, 8, 2])


def test_cli_train_evaluate_generate(tmp_path, capsys):
    save_config(_lm_config(tmp_path), tmp_path / "c.yaml")
    assert main(["train", str(tmp_path / "c.yaml"), "--quiet"]) == 0
    run = tmp_path / "run"
    assert (run / "vocab.txt").is_file() and (run / "best" / "model.safetensors").is_file()
    assert load_config(run / "config.yaml").task == "lm"
    capsys.readouterr()
    assert main(["evaluate", str(run), "--split", "test", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert 1 < res["ppl"] < 400 and res["tokens"] > 100 and res["split"] == "test"
    assert main(["generate", str(run), "--prompt", "w1 w2", "--tokens", "7", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("w1 w2") and len(out.split()) >= 2 + 5
    for split in (["--split", "valid"], []):  # valid is the default
        assert main(["evaluate", str(run), *split]) == 0
        assert capsys.readouterr().out.startswith("valid ppl ")
    for target in (str(run), str(tmp_path / "c.yaml")):  # trained, or random weights
        assert main(["profile", target, "--json", "--repeats", "1"]) == 0
        prof = json.loads(capsys.readouterr().out)
        assert prof["params"] > 0 and set(prof["ms_per_token"]) == {"100", "10000"}


def test_cli_generate_subprocess_smoke(tmp_path):
    """The installed entry point end to end (one subprocess: train is in-process above)."""
    from dynaseq.train.loop import train

    train(_lm_config(tmp_path, "train.max_steps=2"), progress=False)
    proc = run_cli("generate", str(tmp_path / "run"), "--tokens", "3", "--temperature", "0")
    assert proc.returncode == 0 and proc.stdout, proc.stderr.decode()


def test_resume_profile_and_python_api(tmp_path):
    from dynaseq.metrics.lm_profile import profile_lm
    from dynaseq.tasks.lm.predictor import LanguageModel
    from dynaseq.tasks.lm.task import LMHooks
    from dynaseq.train.loop import train

    cfg = _lm_config(tmp_path)
    calls = []
    hooks = LMHooks(after_step=[lambda m, out, y: calls.append(y.shape)])
    result = train(cfg, progress=False, hooks=hooks)
    assert result.state.step == 12 and calls == [(4, 12)] * 12
    cfg.train.max_steps = 14
    result = train(cfg, progress=False)
    events = [json.loads(ln) for ln in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert any(e["event"] == "resume" and e["step"] == 12 for e in events)
    assert result.state.step == 14
    lm = LanguageModel.load(tmp_path / "run")
    prof = profile_lm(lm.model, positions=(100, 2000), steps=3)
    assert prof["params"] > 0 and set(prof["ms_per_token"]) == {"100", "2000"}
    assert prof["macs_per_token"]["total"] > 0
    text = lm.generate(None, 4, temperature=0.0)
    assert len(text.split()) >= 1 and text == lm.generate(None, 4, temperature=0.0)


def test_cli_bad_lm_input_leaves_no_run_dir(tmp_path, capsys):
    (tmp_path / "one.txt").write_text(" just one line \n")
    (tmp_path / "ok.txt").write_text(" a b c \n b c d \n")
    base = ["task: lm", "model: {d_model: 16, n_layers: 1, n_heads: 2, ffn_dim: 16, "
            "context: 2, extended_context: 4, cutoffs: [3]}"]
    for name, train, message in (("a", "one.txt", "only 1 non-empty line"),
                                 ("b", "ok.txt", "not below the vocabulary size")):
        cfg = tmp_path / f"{name}.yaml"
        model = base[1].replace("[3]", "[50]") if name == "b" else base[1]
        cfg.write_text("\n".join([base[0], model, f"run_dir: {tmp_path / name}",
                                  f"data: {{train: {tmp_path / train}, batch_size: 1}}"]) + "\n")
        assert main(["train", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dynaseq: error:") and message in err, err
        assert not (tmp_path / name).exists()


def test_bf16_model_scores_close_to_float32(model):
    x, y = torch.randint(0, V, (2, 10)), torch.randint(0, V, (2, 10))
    ref = model.score(x, y)
    low = build_lm(tiny_cfg(), V).eval()
    low.load_state_dict(model.state_dict())
    got = low.to(torch.bfloat16).score(x, y)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=0.15, rtol=0.05)
