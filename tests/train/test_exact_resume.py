"""Exact resume for every run kind: a run stopped by SIGTERM or killed with SIGKILL
(``kill -9``) and started again with the same command ends with the same weights, bit for
bit, as the run that was never stopped, and logs the same losses for every update after the
resume.

One helper (:func:`_check_exact_resume`) runs each kind three ways: uninterrupted to
``N`` updates; stopped at an update between checkpoints and resumed to ``N``; and compares.
The kinds: a dense, a CCT, a DMB and an MoE translation model, and language models with the
carried per-layer state alone, a jointly trained neural cache, the Hebbian softmax and
token-level distillation. Dropout is on and validation runs between checkpoints (and, under
SIGTERM, at the stop), so the RNG, the data position and every carried state must come back.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dynaseq.core import checkpoint as ckpt
from dynaseq.core.config import save_config
from dynaseq.tasks.registry import task_for
from dynaseq.techniques.branching.config import DMBConfig, MoEConfig
from dynaseq.techniques.cct.config import CCTConfig
from dynaseq.train.loop import train

from helpers import lm_config, micro_config, signal_at_step, train_killed_at

N = 7  # updates of every run
EVERY = {"save_every": 2, "valid_every": 3, "log_every": 1, "keep_last": 3,
         "average_last_k": 3}
#: log fields that measure time, not training
TIMING = {"tokens_per_s", "elapsed_s", "time"}


def _translation(model_kw: dict) -> Callable:
    def make(run_dir: Path, tmp_path: Path, synthetic_paths, teacher) -> object:
        cfg = micro_config(run_dir, synthetic_paths, max_steps=N, valid_bleu_lines=4, **EVERY)
        for k, v in model_kw.items():
            setattr(cfg.model, k, v)
        return cfg
    return make


def _lm(*extra: str, distill: bool = False) -> Callable:
    def make(run_dir: Path, tmp_path: Path, synthetic_paths, teacher) -> object:
        more = [f"train.distill={{topk_dir: {teacher()}}}"] if distill else []
        return lm_config(tmp_path, f"run_dir={run_dir}", f"train.max_steps={N}",
                         *(f"train.{k}={v}" for k, v in EVERY.items()), "model.dropout=0.1",
                         *extra, *more)
    return make


KINDS: dict[str, Callable] = {
    "dense": _translation({}),
    "cct": _translation({"cct": CCTConfig(ffn_pieces=2, control_hidden=8,
                                          budgets=[(1.0, 1.0), (0.5, 0.5), (0.33, 0.33)],
                                          noise_ramp_steps=4)}),
    "dmb": _translation({"dmb": DMBConfig(n_branches=3)}),
    "moe": _translation({"moe": MoEConfig()}),
    "lm": _lm(),
    "lm_cache": _lm("model.cache={n_cache: 20, theta: 0.05, lam: 0.2, train: true}"),
    "lm_hebbian": _lm("model.hebbian={gamma: 0.01}"),
    "lm_distill": _lm(distill=True),
}


@pytest.fixture(scope="module")
def lm_teacher(tmp_path_factory) -> Callable[[], Path]:
    """A function giving the top-5 directory of a tiny trained LM teacher (built on first use,
    on the same corpus as :func:`helpers.lm_config` writes)."""
    made: list[Path] = []

    def get() -> Path:
        if not made:
            from dynaseq.compress.lm_distill import dump_lm_teacher
            from dynaseq.tasks.lm.predictor import LanguageModel

            tmp = tmp_path_factory.mktemp("teacher")
            train(lm_config(tmp, "train.max_steps=3"), progress=False)
            dump_lm_teacher(LanguageModel.load(tmp / "run"), tmp / "top5", k=5)
            made.append(tmp / "top5")
        return made[0]

    return get


def _train_records(run: Path) -> dict[int, dict]:
    """Step -> its ``train`` log record without timings (the latest record of each step: a
    resumed run logs again the updates after its checkpoint)."""
    recs = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k not in TIMING}
            for r in recs if r["event"] == "train"}


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.step_dir(run, step) / ckpt.WEIGHTS))


def assert_same_run(reference: Path, resumed: Path, resumed_from: int) -> None:
    """``resumed`` (resumed at update ``resumed_from``) ends with ``reference``'s weights bit
    for bit and logged the same losses for every update after ``resumed_from``."""
    a, b = _weights(reference, N), _weights(resumed, N)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # the same checkpoints kept and averaged: a stop's off-schedule checkpoint is gone
    assert ([p.name for p in ckpt.list_checkpoints(resumed)]
            == [p.name for p in ckpt.list_checkpoints(reference)])
    a, b = (load_file(str(r / "averaged" / ckpt.WEIGHTS)) for r in (reference, resumed))
    assert all(torch.equal(a[name], b[name]) for name in a)
    want, got = _train_records(reference), _train_records(resumed)
    assert sorted(got) == list(range(1, N + 1))
    for step in range(resumed_from + 1, N + 1):
        assert got[step] == want[step], step


def _check_exact_resume(kind: str, signum: int, tmp_path: Path, synthetic_paths,
                        lm_teacher) -> None:
    """Train ``kind`` uninterrupted, then stopped by ``signum`` after update 5 and resumed
    with the same config; the two must be the same run."""
    make = KINDS[kind]
    train(make(tmp_path / "reference", tmp_path, synthetic_paths, lm_teacher), progress=False)
    cfg = make(tmp_path / "stopped", tmp_path, synthetic_paths, lm_teacher)
    stop_at = 5
    if signum == signal.SIGTERM:  # in this process: the loop's own handler checkpoints at 5
        result = train(signal_at_step(task_for(cfg), stop_at, signum), progress=False)
        assert result.stopped_by_signal == signum and result.state.step == stop_at
        resumed_from = stop_at
    else:  # kill -9 after update 5: the latest checkpoint is update 4's
        save_config(cfg, tmp_path / "stopped.yaml")
        proc = train_killed_at(tmp_path / "stopped.yaml", stop_at, signum)
        assert proc.returncode == -signum, proc.stderr.decode()[-2000:]
        resumed_from = stop_at - 1
    assert ckpt.read_meta(ckpt.list_checkpoints(tmp_path / "stopped")[-1])["step"] == resumed_from
    result = train(cfg, progress=False)  # the same command again
    assert result.state.step == N
    assert_same_run(tmp_path / "reference", tmp_path / "stopped", resumed_from)


@pytest.mark.parametrize("kind", list(KINDS))
def test_resume_after_sigterm_is_exact(kind, tmp_path, synthetic_paths, lm_teacher):
    _check_exact_resume(kind, signal.SIGTERM, tmp_path, synthetic_paths, lm_teacher)


#: kill -9 runs in a new process (~3 s each): two kinds in the default run (a translation
#: model, and the LM whose trained cache memory must come back), the others under ``slow``
KILL_9_FAST = ("dense", "lm_cache")


@pytest.mark.parametrize("kind", [k if k in KILL_9_FAST else pytest.param(k, marks=pytest.mark.slow)
                                  for k in KINDS])
def test_resume_after_kill_9_is_exact(kind, tmp_path, synthetic_paths, lm_teacher):
    _check_exact_resume(kind, signal.SIGKILL, tmp_path, synthetic_paths, lm_teacher)


def test_a_run_that_used_its_minutes_trains_nothing_when_run_again(tmp_path, synthetic_paths):
    """As with ``max_steps``: the same command again stops before any update (it trained one
    more each time, wrote a checkpoint and averaged another set)."""
    cfg = micro_config(tmp_path / "run", synthetic_paths, max_steps=10_000, max_minutes=1e-9,
                       average_last_k=2)
    first = train(cfg, progress=False)
    assert first.state.step == 1  # the limit is checked after each update
    kept = [p.name for p in ckpt.list_checkpoints(tmp_path / "run")]
    again = train(cfg, progress=False)
    assert again.state.step == 1
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run")] == kept
    stops = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in stops if r["event"] == "stop"] == ["max_minutes"] * 2
