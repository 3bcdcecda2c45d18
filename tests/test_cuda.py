"""The library on a CUDA device: each run kind trains there, and what it computes there
equals what it computes on the CPU (the same checkpoint loaded on both).

Skipped where no CUDA device is present (CI and the 2-core development machine); run on a
GPU machine with ``python -m pytest tests/test_cuda.py``. Matrix products in float32 on the
GPU round differently from the CPU's (TF32 stays off: PyTorch's default), so logits and
losses are compared within a tolerance and decoded tokens exactly.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import dynaseq
from dynaseq.techniques.branching.config import DMBConfig, MoEConfig
from dynaseq.techniques.cct.config import CCTConfig
from dynaseq.train.loop import train

from encoder_helpers import classify_config, mlm_config
from helpers import lm_config, micro_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

BUDGETS = [(1.0, 1.0), (0.5, 0.5), (0.33, 0.33)]
TECHNIQUES = {
    "dense": {},
    "cct": {"cct": CCTConfig(ffn_pieces=2, control_hidden=8, noise_ramp_steps=4,
                             budgets=BUDGETS)},
    "dmb": {"dmb": DMBConfig(n_branches=3)},
    "moe": {"moe": MoEConfig()},
}


def _lines(paths, n: int = 24) -> tuple[list[str], list[str]]:
    src = paths["test.src"].read_text().splitlines()[:n]
    ref = paths["test.tgt"].read_text().splitlines()[:n]
    return src, ref


@pytest.fixture(scope="module", params=sorted(TECHNIQUES))
def cuda_run(request, tmp_path_factory, synthetic_paths):
    """A translation run of each technique trained 30 updates on the GPU."""
    run = tmp_path_factory.mktemp(f"cuda_{request.param}") / "run"
    cfg = micro_config(run, synthetic_paths, max_steps=30, valid_every=15, save_every=15,
                       valid_bleu_lines=8, device="cuda")
    for k, v in TECHNIQUES[request.param].items():
        setattr(cfg.model, k, v)
    assert train(cfg, progress=False).state.step == 30
    return request.param, run


def test_training_on_cuda_validates(cuda_run):
    _, run = cuda_run
    valid = [e for e in map(json.loads, (run / "log.jsonl").read_text().splitlines())
             if e.get("event") == "valid"]
    assert [e["step"] for e in valid] == [15, 30]
    assert all(math.isfinite(e["loss"]) for e in valid)


def test_translations_on_cuda_equal_the_cpu(cuda_run, synthetic_paths):
    kind, run = cuda_run
    src, _ = _lines(synthetic_paths)
    gpu, cpu = dynaseq.load(run, device="cuda"), dynaseq.load(run, device="cpu")
    assert next(gpu.model.parameters()).is_cuda
    budgets = [None] if kind != "cct" else [None, 0.5, 0.33]
    for budget in budgets:
        for beam in (1, 3):
            assert gpu.translate(src, beam=beam, budget=budget) == \
                cpu.translate(src, beam=beam, budget=budget), (kind, budget, beam)


def test_scores_on_cuda_equal_the_cpu(cuda_run, synthetic_paths):
    kind, run = cuda_run
    src, ref = _lines(synthetic_paths)
    gpu, cpu = dynaseq.load(run, device="cuda"), dynaseq.load(run, device="cpu")
    budget = 0.5 if kind == "cct" else None
    a, b = gpu.score(src, ref, budget=budget), cpu.score(src, ref, budget=budget)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5)


def test_cct_on_cuda_mixed_budgets_equal_each_budget_alone(cuda_run, synthetic_paths):
    kind, run = cuda_run
    if kind != "cct":
        pytest.skip("budgets are the CCT's")
    src, _ = _lines(synthetic_paths, 18)
    t = dynaseq.load(run, device="cuda")
    per_row = [[1.0, 0.5, 0.33][i % 3] for i in range(len(src))]
    mixed = t.translate(src, budget=per_row)
    for b in (1.0, 0.5, 0.33):
        rows = [i for i, r in enumerate(per_row) if r == b]
        alone = t.translate([src[i] for i in rows], budget=b)
        assert [mixed[i] for i in rows] == alone, b


def test_cct_lean_step_on_cuda_equals_the_general_step(cuda_run, synthetic_paths):
    kind, run = cuda_run
    if kind not in ("dense", "cct"):
        pytest.skip("dense and CCT models decode through the lean step")
    src, _ = _lines(synthetic_paths)
    t = dynaseq.load(run, device="cuda")
    assert t.lean_decoder() is not None
    budget = [[1.0, 0.5, 0.33][i % 3] for i in range(len(src))] if kind == "cct" else None
    lean = t.translate(src, budget=budget)
    t.fast_decode = False
    assert t.translate(src, budget=budget) == lean


def test_cct_realized_compute_on_cuda_equals_the_cpu(cuda_run, synthetic_paths):
    kind, run = cuda_run
    if kind != "cct":
        pytest.skip("realized compute is the CCT's")
    src, ref = _lines(synthetic_paths, 12)
    gpu, cpu = dynaseq.load(run, device="cuda"), dynaseq.load(run, device="cpu")
    a = gpu.realized_compute(src, ref, budget=0.5)
    b = cpu.realized_compute(src, ref, budget=0.5)
    for key in ("fraction", "macs_per_token", "max_macs_per_token"):
        assert a[key] == pytest.approx(b[key], rel=1e-3), key


def test_cct_served_compute_counted_on_cuda_equals_the_cpu(cuda_run, synthetic_paths):
    """The server's batch (greedy, lean step, compute counted while decoding) on CUDA gives
    the CPU's translations and realized compute."""
    kind, run = cuda_run
    if kind != "cct":
        pytest.skip("realized compute is the CCT's")
    pytest.importorskip("pydantic", reason="the serve extra is not installed")
    from dynaseq.serve.batcher import Job
    from dynaseq.serve.endpoints import TranslateWork, run_translate

    src, _ = _lines(synthetic_paths, 12)
    budgets = [[1.0, 0.5, 0.33][i % 3] for i in range(len(src))]
    outs = []
    for device in ("cuda", "cpu"):
        t = dynaseq.load(run, device=device)
        jobs = [Job(group=("translate", 1), run=None, rows=1,
                    payload=TranslateWork([line], t.tokenizer.encode([line]), b, None, False))
                for line, b in zip(src, budgets, strict=True)]
        outs.append(run_translate(t, 1, True, jobs))
    gpu, cpu = outs
    assert [texts for texts, _ in gpu] == [texts for texts, _ in cpu]
    for (_, [a]), (_, [b]) in zip(gpu, cpu, strict=True):  # a gate at its threshold may
        for key in ("fraction", "macs_per_token"):          # round the other way on a GPU
            assert a[key] == pytest.approx(b[key], rel=1e-3), key


def test_a_cuda_checkpoint_resumes_on_the_cpu(tmp_path, synthetic_paths):
    """A run trained on the GPU goes on on the CPU from its last checkpoint."""
    run = tmp_path / "run"
    train(micro_config(run, synthetic_paths, max_steps=10, device="cuda"), progress=False)
    result = train(micro_config(run, synthetic_paths, max_steps=20, device="cpu"),
                   progress=False)
    assert result.state.step == 20


def test_language_model_on_cuda_equals_the_cpu(tmp_path):
    cfg = lm_config(tmp_path, "train.device=cuda")
    train(cfg, progress=False)
    from dynaseq.tasks.lm.predictor import LanguageModel

    gpu = LanguageModel.load(tmp_path / "run", device="cuda")
    cpu = LanguageModel.load(tmp_path / "run", device="cpu")
    a, b = gpu.evaluate("valid"), cpu.evaluate("valid")
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert isinstance(gpu.generate("w1 w2", n_tokens=5), str)


def _sentiment_table(path, n: int):
    """An SST-2-layout table (``sentence``, ``label``) of ``n`` made-up rows (the shared
    GLUE data does not travel to a GPU machine)."""
    words = ["good", "fine", "great", "bad", "dull", "poor"]
    rows = [f"a {words[i % 6]} film {i % 7} and {words[(i * 5) % 6]}\t{int(i % 6 < 3)}"
            for i in range(n)]
    path.write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    return path


def test_encoder_classifier_on_cuda_equals_the_cpu(tmp_path):
    data = {"train": _sentiment_table(tmp_path / "train.tsv", 200),
            "dev": _sentiment_table(tmp_path / "dev.tsv", 40)}
    cfg = classify_config(tmp_path / "run", data, "train.device=cuda", "model.cct.ffn_pieces=2",
                          "model.cct.control_hidden=8", "model.cct.noise_ramp_steps=4")
    train(cfg, progress=False)
    from dynaseq.tasks.classify.predictor import Classifier

    gpu = Classifier.load(tmp_path / "run", device="cuda")
    cpu = Classifier.load(tmp_path / "run", device="cpu")
    lines = [r.split("\t")[0] for r in data["dev"].read_text().splitlines()[1:]]
    for budget in (0.8, 0.33, [0.8, 0.2] * (len(lines) // 2)):
        assert gpu.classify(lines, budget=budget) == cpu.classify(lines, budget=budget)


def test_mlm_pretraining_runs_on_cuda(tmp_path):
    text = [f"the {w} film {i} was {w} and long" for i, w in
            enumerate(["good", "bad", "fine", "dull"] * 60)]
    (tmp_path / "train.txt").write_text("\n".join(text[:200]) + "\n")
    (tmp_path / "valid.txt").write_text("\n".join(text[200:]) + "\n")
    cfg = mlm_config(tmp_path / "run", {"train": tmp_path / "train.txt",
                                        "valid": tmp_path / "valid.txt"}, "train.device=cuda")
    assert train(cfg, progress=False).state.step == 12
