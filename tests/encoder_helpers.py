"""Config helpers of the encoder tests (importable as ``encoder_helpers``)."""

from __future__ import annotations

from pathlib import Path

from dynaseq.tasks.registry import load_config

from helpers import SHARED_DATA

TINY_MODEL = ["model.d_model=32", "model.ffn_dim=64", "model.n_heads=2", "model.layers=2",
              "model.max_positions=128"]


def mlm_config(run_dir: Path, corpus: dict[str, Path], *extra: str):
    return load_config(None, [
        "task=mlm", f"run_dir={run_dir}", *TINY_MODEL, f"data.train=[{corpus['train']}]",
        f"data.valid={corpus['valid']}", "data.vocab_size=400", "data.block_len=32",
        "data.batch_size=8", "data.valid_max_blocks=16", "train.max_steps=12",
        "train.warmup_steps=2", "train.lr=0.003", "train.log_every=4", "train.valid_every=6",
        "train.save_every=6", "train.seed=5", *extra])


def classify_config(run_dir: Path, data: dict[str, Path], *extra: str):
    return load_config(None, [
        "task=classify", f"run_dir={run_dir}", *TINY_MODEL, "data.glue_task=sst2",
        f"data.train={data['train']}", f"data.valid={data['dev']}", "data.vocab_size=400",
        "data.max_len=40", "data.batch_size=16", "train.max_steps=6", "train.warmup_steps=2",
        "train.lr=0.003", "train.log_every=3", "train.valid_every=3", "train.save_every=3",
        *extra])


def glue_subset(root: Path, task: str, n_train: int, n_dev: int) -> dict[str, Path]:
    """The first ``n_train`` training and ``n_dev`` dev rows of a shared GLUE task (e.g.
    ``"SST-2"``), GLUE layout, under ``root``."""
    src = SHARED_DATA / "glue" / task
    out = {}
    for name, n in (("train", n_train), ("dev", n_dev)):
        lines = (src / f"{name}.tsv").read_text().splitlines()[:n + 1]
        out[name] = root / f"{name}.tsv"
        out[name].write_text("\n".join(lines) + "\n")
    return out


def write_pair_table(path: Path, n: int) -> Path:
    """An RTE-layout table of ``n`` sentence pairs (``index``, ``sentence1``, ``sentence2``,
    ``label``: entailment on odd rows)."""
    rows = [f"{i}\tthe cat sat {i}\ta cat sat {i}\t"
            f"{'entailment' if i % 2 else 'not_entailment'}" for i in range(n)]
    path.write_text("index\tsentence1\tsentence2\tlabel\n" + "\n".join(rows) + "\n")
    return path


def read_events(run: Path) -> list[dict]:
    """The events of a run's ``log.jsonl``."""
    import json

    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def padded_tokens(lengths: list[int], vocab: int = 100, seed: int = 1):
    """(B, max(lengths)) random token ids in [5, vocab), row b right-padded with 0 after
    ``lengths[b]`` tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tok = torch.randint(5, vocab, (len(lengths), max(lengths)), generator=gen)
    for b, n in enumerate(lengths):
        tok[b, n:] = 0
    return tok
