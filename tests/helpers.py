"""Helpers shared by the tests (importable as ``helpers``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

from dynaseq.core.config import TrainConfig
from dynaseq.tasks.registry import load_config
from dynaseq.tasks.translation.config import DataConfig, DecodeConfig, ModelConfig, RunConfig

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


def calibrated_cct(cct_run, paths: dict[str, Path], tmp_path: Path, lines: int = 16):
    """A copy of the ``cct_run`` fixture's run in ``tmp_path / "run"``, calibrated at 0.4 on
    the first ``lines`` validation pairs and saved: ``(run, translator, src, ref)``."""
    import shutil

    from dynaseq.data import read_lines
    from dynaseq.tasks.translation.predictor import Translator

    run = tmp_path / "run"
    shutil.copytree(cct_run[0], run)
    src = read_lines(paths["valid.src"])[:lines]
    ref = read_lines(paths["valid.tgt"])[:lines]
    t = Translator.load(run)
    t.calibrate(src, ref, budgets=[0.4])
    t.save_calibration(run)
    return run, t, src, ref


def load_benchmark(name: str):
    """The module of ``benchmarks/NAME.py`` (with ``benchmarks/`` on the path while it
    loads, for its ``import _lib``, and the module in ``sys.modules`` while it runs, for
    the dataclasses it defines)."""
    import importlib.util

    where = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(where))
    key = f"_benchmark_{name}"
    try:
        spec = importlib.util.spec_from_file_location(key, where / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(where))
        sys.modules.pop(key, None)
    return module


def free_port() -> str:
    """A TCP port free on 127.0.0.1 now (for torchrun's rendezvous: a fixed port hangs when
    two test runs share the machine)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_cli(*args: str, stdin: bytes | None = None, cwd: Path | None = None,
            timeout: float = 300, env: dict[str, str] | None = None, process: bool = False
            ) -> subprocess.CompletedProcess:
    """Run the ``dynaseq`` command ``ARGS``; its exit status and its output as bytes.

    With ``process``, ``cwd`` or ``env``: a ``python -m dynaseq`` child (``env``: extra
    variables). Otherwise in this process, as :func:`cli_in_process` does: the same status
    and bytes without the ~3 s a child spends importing torch (the default suite makes about
    80 such calls)."""
    if not (process or cwd or env):
        return cli_in_process(*args, stdin=stdin)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "dynaseq", *args], input=stdin,
                          capture_output=True, cwd=cwd or REPO, timeout=timeout, env=env)


def cli_in_process(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """``dynaseq.cli.main(ARGS)`` with stdin, stdout and stderr swapped for byte buffers (UTF-8,
    as the child's pipes; stderr with ``backslashreplace`` as Python's own). The status is
    main's return value or a ``SystemExit``'s code; an exception main lets through gives
    status 1 and its traceback on stderr, as a child's would. Run from the repository root,
    as the child is."""
    import io
    import traceback

    from dynaseq.cli import main

    out, err = io.BytesIO(), io.BytesIO()
    streams = (io.TextIOWrapper(io.BytesIO(stdin or b""), encoding="utf-8"),
               io.TextIOWrapper(out, encoding="utf-8", write_through=True),
               io.TextIOWrapper(err, encoding="utf-8", errors="backslashreplace",
                                write_through=True))
    saved, cwd = (sys.stdin, sys.stdout, sys.stderr), os.getcwd()
    sys.stdin, sys.stdout, sys.stderr = streams
    os.chdir(REPO)
    try:
        status = main(list(args))
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except Exception:  # what the child would die of
        traceback.print_exc(file=sys.stderr)
        status = 1
    finally:
        for stream in streams[1:]:
            stream.flush()
        sys.stdin, sys.stdout, sys.stderr = saved
        os.chdir(cwd)
    return subprocess.CompletedProcess(["dynaseq", *args], status, out.getvalue(),
                                       err.getvalue())


def lm_corpus(tmp_path: Path) -> None:
    """Write train/valid/test.txt of a small random word-level corpus (80 types)."""
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(80)]
    lines = [" ".join(rng.choice(words[: rng.randint(5, 80)]) for _ in range(rng.randint(3, 15)))
             for _ in range(400)]
    for name, part in (("train", lines[:320]), ("valid", lines[320:360]), ("test", lines[360:])):
        (tmp_path / f"{name}.txt").write_text("".join(f" {ln} \n" for ln in part))


def lm_config(tmp_path: Path, *extra: str):
    """A tiny LM run config (d=32, 2 layers) on :func:`lm_corpus` in ``tmp_path``."""
    lm_corpus(tmp_path)
    return load_config(None, [
        "task=lm", f"run_dir={tmp_path / 'run'}", "model.d_model=32", "model.n_layers=2",
        "model.n_heads=2", "model.ffn_dim=64", "model.context=4", "model.extended_context=12",
        "model.cutoffs=[10, 40]", f"data.train={tmp_path / 'train.txt'}",
        f"data.valid={tmp_path / 'valid.txt'}", f"data.test={tmp_path / 'test.txt'}",
        "data.batch_size=4", "train.max_steps=12", "train.warmup_steps=2", "train.lr=0.003",
        "train.valid_every=6", "train.save_every=6", "train.log_every=6", *extra])


def signal_at_step(task, step: int, signum: int):
    """Make ``task`` (a :class:`~dynaseq.tasks.protocol.Task`) send ``signum`` to this process
    right after its ``step``-th optimizer update (counted from now, so the global step of a
    fresh run), before the loop logs, validates or checkpoints that update. SIGTERM is handled
    by the loop (checkpoint at ``step``, stop); SIGKILL ends the process there, leaving only
    the checkpoints already written. Returns ``task``."""
    real = task.after_update
    done = [0]

    def after_update(out, micro) -> None:
        real(out, micro)
        done[0] += 1
        if done[0] == step:
            os.kill(os.getpid(), signum)

    task.after_update = after_update
    return task


def train_killed_at(config_path: Path, step: int, signum: int = 9,
                    timeout: float = 300) -> subprocess.CompletedProcess:
    """Train the run config at ``config_path`` in a new process that sends itself ``signum``
    after update ``step`` (:func:`signal_at_step`; ``tests/signalled_train.py``)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    script = Path(__file__).with_name("signalled_train.py")
    return subprocess.run([sys.executable, str(script), str(config_path), str(step), str(signum)],
                          capture_output=True, cwd=REPO, timeout=timeout, env=env)


def train_one_and_two_processes(single, double, timeout: float = 300) -> tuple[Path, Path]:
    """Train run config ``single`` in this process and ``double`` (the same run in another
    ``run_dir``) under ``torchrun --nproc_per_node 2`` (gloo, a free port); return their run
    directories. Raises AssertionError with torchrun's stderr if it fails."""
    from dynaseq.core.config import save_config
    from dynaseq.train.loop import train

    train(single, progress=False)
    path = Path(double.run_dir).with_suffix(".yaml")
    save_config(double, path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", free_port(), "-m", "dynaseq", "train", str(path), "--quiet"],
        cwd=REPO, capture_output=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return Path(single.run_dir), Path(double.run_dir)


#: Parameters whose gradient is zero in exact arithmetic (a key bias adds the same q·b to
#: every score of a query, which the softmax ignores): what they hold is rounding noise, which
#: Adam (dividing by sqrt(v)) turns into moves of up to lr per update in either direction, so
#: two reductions of the same gradients may leave them anywhere within steps·lr of each other.
ZERO_GRADIENT_PARAMETERS = ("k_proj.bias",)


def assert_ddp_matches_one_process(single: Path, double: Path, steps: int, lr: float,
                                   keys: tuple[str, ...] = ("loss", "nll")) -> None:
    """The two-process run ``double`` logged the one-process run ``single``'s ``keys`` at every
    one of ``steps`` updates within 1e-6 (relative; float32 sums reduced in another order
    differ by ~1e-7), and ends with the same weights within 1e-3·lr, except
    :data:`ZERO_GRADIENT_PARAMETERS` (within steps·lr; they change no output)."""
    import json

    import pytest
    from safetensors.torch import load_file

    from dynaseq.core import checkpoint as ckpt

    def train_records(run: Path) -> list[dict]:
        recs = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
        return [r for r in recs if r["event"] == "train"]

    one, two = train_records(single), train_records(double)
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, steps + 1))
    for a, b in zip(one, two, strict=True):
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=0), (a["step"], k)
    wa = load_file(str(ckpt.step_dir(single, steps) / ckpt.WEIGHTS))
    wb = load_file(str(ckpt.step_dir(double, steps) / ckpt.WEIGHTS))
    assert wa.keys() == wb.keys()
    for name in wa:
        bound = steps * lr if name.endswith(ZERO_GRADIENT_PARAMETERS) else 1e-3 * lr
        assert float((wa[name] - wb[name]).abs().max()) <= bound, name


def padded_sources(n: int = 7, seed: int = 1, eos: int = 3, vocab: int = 30,
                   width: int = 8):
    """``(n, width)`` source ids in ``[4, vocab)``, row i ending in ``eos`` and padded (0)
    over its last ``i % 5`` positions: rows of different lengths, for decoding tests."""
    import torch

    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (n, width), generator=g)
    for i in range(n):
        src[i, width - (i % 5):] = 0
        src[i, width - 1 - (i % 5)] = eos
    return src


class AtenMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` that sees the aten ops autograd's dispatch would run: a
    composite op (``linear``, ``layer_norm``: what reaches a mode under
    ``torch.inference_mode``, which the library's inference runs in) is run as its parts.
    Subclasses define :meth:`seen`, called with every other op before it runs."""

    def seen(self, func, args, kwargs) -> None:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with self:
            out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
        self.seen(func, args, kwargs)
        return func(*args, **kwargs)


def count_ops():
    """A ``TorchDispatchMode`` that lists the name of every aten op run inside it
    (``with count_ops() as ops: ...; ops.names``) and the shape of the input operand of every
    matrix product (``ops.products``: mm, addmm, bmm, baddbmm). A product with its weight
    on the left (``addmm(b[:, None], W, xᵀ)``, :class:`~dynaseq.nn.lean_step.StepLinear`;
    ``baddbmm`` alike) is known by its bias column and counts its input ``x``; one without a
    bias (``mm(W, xᵀ)``: an output layer at 2 to 8 rows) counts the weight."""
    class CountOps(AtenMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []
            self.products: list[tuple[int, ...]] = []

        def seen(self, func, args, kwargs):
            self.names.append(func.__name__)
            op = func.__name__.split(".")[0]
            if op in ("mm", "addmm", "bmm", "baddbmm"):
                biased = op in ("addmm", "baddbmm")
                if biased and args[0].dim() >= 2 and args[0].size(-1) == 1:  # W xᵀ + b
                    self.products.append(tuple(args[2].transpose(-1, -2).shape))
                else:
                    self.products.append(tuple(args[1 if biased else 0].shape))

    return CountOps()


def step_ops(lean, src, steps: int) -> list[list[str]]:
    """The aten ops of each of ``steps`` lean decoding steps (``lean``: a ``LeanDecoder``)
    from BOS over the sources ``src``, one list per step."""
    import torch

    enc = lean.encode(src)
    state = lean.init_state(capacity=64)
    tokens = torch.full((src.size(0), 1), lean.bos_id)
    counts = []
    for _ in range(steps):
        with count_ops() as ops:
            lean.decode_step(tokens, enc, state)
        counts.append(ops.names)
    return counts


def assert_same_searches(model, lean, src, beams: tuple[int, ...], max_len_b: int) -> list:
    """Greedy and beam search (each of ``beams``) through ``lean`` give ``model``'s tokens,
    with rows finishing at different steps; returns the greedy hypotheses."""
    from dynaseq.models.search import beam_search, greedy_search

    greedy = greedy_search(model, src, max_len_b=max_len_b)
    assert len({len(h) for h in greedy}) > 2, "rows finish at different steps"
    assert greedy_search(lean, src, max_len_b=max_len_b) == greedy
    for k in beams:
        assert (beam_search(lean, src, beam=k, max_len_b=max_len_b)
                == beam_search(model, src, beam=k, max_len_b=max_len_b))
    return greedy


def clock_of(costs: list[list[float]], calls: int):
    """A fake clock for :class:`~dynaseq.nn.layouts.Layouts`: ``calls`` trials run in turn
    over the ``n = len(costs)`` layouts, trial k (of layout ``k % n``, its j-th) reading
    start ``10 k`` and end ``10 k + costs[k % n][j]``."""
    n, ticks = len(costs), []
    for k in range(calls):
        i, j = k % n, k // n
        ticks += [10.0 * k, 10.0 * k + costs[i][j]]
    it = iter(ticks)
    return lambda: next(it)
