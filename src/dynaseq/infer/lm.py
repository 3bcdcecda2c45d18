"""Load a language-model run directory; perplexity over a text stream; sampling.

Example::

    lm = LanguageModel.load("runs/wikitext2_tiny")
    lm.evaluate("valid")["ppl"]
    print(lm.generate("the game", n_tokens=30, temperature=0.8, seed=1))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dynaseq.config import LMRunConfig, load_config, read_yaml
from dynaseq.data.lm_corpus import VOCAB_FILE, StreamBatches, Vocab, read_lm_lines, tokenize
from dynaseq.errors import CheckpointError, DynaseqError
from dynaseq.models.lm import LMState, TransformerLM, build_lm
from dynaseq.train import checkpoint as ckpt
from dynaseq.train.distributed import pick_device

#: ``adjust(hidden (B, T, d), model_logp (B, T), targets (B, T)) -> logp (B, T)``: called on
#: consecutive windows of each stream, so a closure may carry memory (a neural cache).
Adjust = Callable[[Tensor, Tensor, Tensor], Tensor]


def is_lm_run(run_dir: str | Path) -> bool:
    """True when ``run_dir/config.yaml`` says ``task: lm``."""
    path = Path(run_dir) / "config.yaml"
    return path.is_file() and read_yaml(path).get("task") == "lm"


@torch.no_grad()
def evaluate_stream(model: TransformerLM, ids: Tensor, batch_size: int, window: int,
                    device: torch.device | str = "cpu", max_tokens: int | None = None,
                    adjust: Adjust | None = None) -> dict[str, float]:
    """Perplexity of ``ids`` (N,) read as ``batch_size`` streams in consecutive windows,
    carrying the per-layer state so every token sees its full context.

    Returns ``{"loss": mean NLL (nats), "ppl": exp(loss), "tokens": n}`` and, with
    ``adjust``, also ``loss_adjusted`` / ``ppl_adjusted`` from the adjusted log-probs.
    """
    if max_tokens is not None:
        ids = ids[: max_tokens + batch_size]
    batch_size = max(1, min(batch_size, (ids.numel() - 1)))
    batches = StreamBatches(ids, batch_size, window)
    was_training = model.training
    model.eval()
    state: LMState | None = None
    nll, nll_adj, n = 0.0, 0.0, 0
    try:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            out = model(x, state)
            state = out.state
            h = out.hidden
            logp = model.softmax(h.reshape(-1, h.size(-1)), y.reshape(-1)).view(y.shape)
            nll -= float(logp.double().sum())
            if adjust is not None:
                nll_adj -= float(adjust(h, logp, y).double().sum())
            n += y.numel()
    finally:
        model.train(was_training)
    result = {"loss": nll / n, "ppl": math.exp(nll / n), "tokens": n}
    if adjust is not None:
        result.update(loss_adjusted=nll_adj / n, ppl_adjusted=math.exp(nll_adj / n))
    return result


@dataclass
class LanguageModel:
    """A trained LM: model (eval mode), vocabulary, run config and checkpoint used."""

    model: TransformerLM
    vocab: Vocab
    config: LMRunConfig
    checkpoint: Path
    device: torch.device

    @classmethod
    def load(cls, run_dir: str | Path, checkpoint: str = "auto",
             device: str = "auto") -> LanguageModel:
        run = Path(run_dir)
        if not run.is_dir():
            raise CheckpointError(f"run directory not found: {run}")
        cfg = load_config(run / "config.yaml")
        if not isinstance(cfg, LMRunConfig):
            raise DynaseqError(f"{run} is not a language-model run (no 'task: lm')")
        vocab = Vocab.load(run / VOCAB_FILE)
        path = ckpt.resolve_checkpoint(run, checkpoint)
        dev = pick_device(device)
        model = build_lm(cfg.model, len(vocab))
        ckpt.load_weights(model, path)
        return cls(model.to(dev).eval(), vocab, cfg, path, dev)

    def split_path(self, split: str) -> str:
        path = getattr(self.config.data, split, None) if split in ("train", "valid",
                                                                    "test") else None
        if path is None:
            raise DynaseqError(f"the run's config has no data.{split} file")
        return path

    def evaluate(self, split_or_path: str, batch_size: int | None = None,
                 max_tokens: int | None = None, adjust: Adjust | None = None) -> dict:
        """Perplexity of a split of the run's config (``valid``/``test``) or a text file."""
        path = (self.split_path(split_or_path)
                if split_or_path in ("train", "valid", "test") else split_or_path)
        ids = self.vocab.encode_lines(read_lm_lines(path, min_lines=1))
        result = evaluate_stream(self.model, ids,
                                 batch_size or self.config.data.eval_batch_size,
                                 self.config.model.extended_context, self.device, max_tokens,
                                 adjust)
        return {"path": str(path), **result}

    def encode_prompt(self, text: str | None) -> Tensor:
        """Words of ``text`` (unknown ones -> ``<unk>``), preceded by ``<eos>`` (a line
        start); an empty prompt is ``<eos>`` alone. -> (1, P) long."""
        words = tokenize(text or "")[:-1]
        ids = [self.vocab.eos_id, *self.vocab.encode(words)]
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    def generate(self, prompt: str | None = None, n_tokens: int = 50,
                 temperature: float = 1.0, seed: int = 0, top_k: int | None = None) -> str:
        """Sample ``n_tokens`` words after ``prompt``; ``<eos>`` is shown as a newline."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        out = self.model.generate(self.encode_prompt(prompt), n_tokens, temperature, top_k,
                                  gen)
        words = [self.vocab.itos[int(i)] for i in out[0]]
        text = " ".join(words).replace(" <eos> ", "\n").replace("<eos>", "\n")
        return (prompt + " " if prompt else "") + text
