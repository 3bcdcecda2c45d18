"""Load a language-model run directory; perplexity over a text stream; sampling.

Perplexity with the neural cache (``ppl_cache``) uses the run's cache (``model.cache`` in
its config: the trained or searched θ, λ and n_cache) or, for a run without one, MicroNet's
initial values (:data:`DEFAULT_CACHE`: n_cache 2000, θ 0.016, λ 0.07). The cache memory
is carried across the windows of each stream and starts empty.

A run whose config has ``model.qat_bits`` (written by ``dynaseq quantize``) is rebuilt with
the QAT structure (:func:`apply_qat_structure`: prepare + convert) before its weights are
read.

Example::

    lm = LanguageModel.load("runs/wikitext2_tiny")
    lm.evaluate("valid")["ppl"]
    lm.evaluate("valid", with_cache=True)["ppl_cache"]
    print(lm.generate("the game", n_tokens=30, temperature=0.8, seed=1))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from dynaseq.core.arguments import check_int, check_number, check_path, check_str, int_or
from dynaseq.core.config import read_yaml
from dynaseq.core.errors import DynaseqError
from dynaseq.core.progress import progress_bar
from dynaseq.data.lm_corpus import VOCAB_FILE, StreamBatches, Vocab, read_lm_lines, tokenize
from dynaseq.models.lm import LMState, TransformerLM
from dynaseq.nn.modes import evaluating
from dynaseq.nn.neural_cache import NeuralCache
from dynaseq.tasks.lm.config import TASK, LMCacheConfig, LMRunConfig
from dynaseq.tasks.lm.model import build_lm
from dynaseq.tasks.loading import ShortRepr, load_predictor

if TYPE_CHECKING:
    from dynaseq.compress.qat import QATConfig

#: ``adjust(hidden (B, T, d), model_logp (B, T), targets (B, T)) -> logp (B, T)``: called on
#: consecutive windows of each stream, so a closure may carry memory (a neural cache).
Adjust = Callable[[Tensor, Tensor, Tensor], Tensor]

#: cache parameters for ``ppl_cache`` of a run without a cache (MicroNet's initial values)
DEFAULT_CACHE = LMCacheConfig(n_cache=2000, theta=0.016, lam=0.07, train=False)


def cache_adjust(cache: NeuralCache) -> Adjust:
    """An :data:`Adjust` mixing ``cache`` into the target log-probs, its memory carried
    from one window to the next (one per evaluation: the memory starts empty)."""
    memory = None

    def adjust(hidden: Tensor, model_logp: Tensor, targets: Tensor) -> Tensor:
        nonlocal memory
        logp, memory = cache.target_log_prob(model_logp, hidden, targets, memory)
        return logp

    return adjust


def eval_cache(model: TransformerLM) -> NeuralCache:
    """The model's cache, or one with :data:`DEFAULT_CACHE` parameters."""
    if model.cache is not None:
        return model.cache
    c = DEFAULT_CACHE
    return NeuralCache(c.n_cache, c.theta, c.lam).to(next(model.parameters()).device)


def apply_qat_structure(model: TransformerLM, bits: int | QATConfig,
                        convert: bool = True) -> None:
    """Insert the QAT structure of ``dynaseq quantize`` at ``bits`` (or a full
    :class:`~dynaseq.compress.qat.QATConfig`) (prepare; then convert, so a converted state
    dict loads). Layer choice depends on the architecture only."""
    from dynaseq.compress.qat import QATConfig, convert_qat_, prepare_qat_

    device = next(model.parameters()).device
    probe = torch.zeros(1, 2, dtype=torch.long, device=device)
    cfg = bits if isinstance(bits, QATConfig) else QATConfig(bits=bits)
    prepare_qat_(model, cfg, example_inputs=(probe,))
    if convert:
        convert_qat_(model)


def is_lm_run(run_dir: str | Path) -> bool:
    """True when ``run_dir/config.yaml`` says ``task: lm``."""
    path = Path(run_dir) / "config.yaml"
    return path.is_file() and read_yaml(path).get("task") == "lm"


@torch.inference_mode()
def evaluate_stream(model: TransformerLM, ids: Tensor, batch_size: int, window: int,
                    device: torch.device | str = "cpu", max_tokens: int | None = None,
                    adjust: Adjust | None = None, progress: bool = False) -> dict[str, float]:
    """Perplexity of ``ids`` (N,) read as ``batch_size`` streams in consecutive windows,
    carrying the per-layer state so every token sees its full context (``progress``: a bar
    of windows on a terminal). As in the usual LM evaluation, the tokens that do not fill
    the ``batch_size`` streams evenly are left out, and the streams start cold, so the
    token count and perplexity move a little with ``batch_size`` (``tokens`` says how many
    were scored; compare runs at one ``batch_size``).

    Returns ``{"loss": mean NLL (nats), "ppl": exp(loss), "tokens": n}`` and, with
    ``adjust``, also ``loss_adjusted`` / ``ppl_adjusted`` from the adjusted log-probs.
    """
    if max_tokens is not None:
        ids = ids[: max_tokens + batch_size]
    batch_size = max(1, min(batch_size, (ids.numel() - 1)))
    batches = StreamBatches(ids, batch_size, window)
    state: LMState | None = None
    nll, nll_adj, n = 0.0, 0.0, 0
    with evaluating(model), progress_bar(len(batches), "win", "evaluate", progress) as bar:
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
            bar.update(1)
    result = {"loss": nll / n, "ppl": math.exp(nll / n), "tokens": n}
    if adjust is not None:
        result.update(loss_adjusted=nll_adj / n, ppl_adjusted=math.exp(nll_adj / n))
    return result


def _no_budget(budget: object) -> None:
    if budget is not None:
        raise DynaseqError("a language model has no compute-budget knob (budget must be None)")


@dataclass(repr=False)
class LanguageModel(ShortRepr):
    """A trained LM: model (eval mode), vocabulary, run config and checkpoint used."""

    #: the run files an exported model carries besides config and weights (the vocabulary)
    EXPORT_FILES: ClassVar[tuple[str, ...]] = (VOCAB_FILE,)

    model: TransformerLM
    vocab: Vocab
    config: LMRunConfig
    checkpoint: Path
    device: torch.device

    @classmethod
    def load(cls, run_dir: str | Path, checkpoint: str = "auto",
             device: str = "auto", precision: str = "fp32") -> LanguageModel:
        def build(cfg: LMRunConfig, vocab: Vocab) -> TransformerLM:
            model = build_lm(cfg.model, len(vocab))
            if cfg.model.qat_bits is not None:
                apply_qat_structure(model, cfg.model.qat_bits)
            return model

        return load_predictor(
            run_dir, checkpoint, device, {TASK: LMRunConfig}, "language-model",
            vocabulary=lambda run: Vocab.load(run / VOCAB_FILE), build=build,
            make=lambda r: cls(r.model, r.vocab, r.config, r.checkpoint, r.device),
            precision=precision)

    def split_path(self, split: str) -> str:
        path = getattr(self.config.data, split, None) if split in ("train", "valid",
                                                                    "test") else None
        if path is None:
            raise DynaseqError(f"the run's config has no data.{split} file")
        return path

    def ids(self, split_or_path: str) -> Tensor:
        """(N,) ids of a split of the run's config (``valid``/``test``) or a text file."""
        path = (self.split_path(split_or_path)
                if split_or_path in ("train", "valid", "test") else split_or_path)
        return self.vocab.encode_lines(read_lm_lines(path, min_lines=1))

    def evaluate(self, split_or_path: str, batch_size: int | None = None,
                 max_tokens: int | None = None, adjust: Adjust | None = None,
                 with_cache: bool = False, budget: None = None, progress: bool = False) -> dict:
        """Perplexity of a split of the run's config (``valid``/``test``) or a text file.

        ``budget``: the Predictor protocol's compute knob; a language model has none, so
        anything but None is refused (DynaseqError).

        ``with_cache`` adds ``ppl_cache``/``loss_cache`` (the run's cache, else
        :data:`DEFAULT_CACHE`) and ``cache`` (its n_cache, θ, λ and where they came from);
        it replaces ``adjust``. ``progress``: a bar on a terminal.
        """
        _no_budget(budget)
        check_path("split_or_path", split_or_path, "a split name or a file path")
        batch = int_or("batch_size", batch_size, self.config.data.eval_batch_size)
        if max_tokens is not None:
            max_tokens = check_int("max_tokens", max_tokens)
        path = (self.split_path(split_or_path)
                if split_or_path in ("train", "valid", "test") else split_or_path)
        cache = eval_cache(self.model) if with_cache else None
        if cache is not None:
            adjust = cache_adjust(cache)
        result = evaluate_stream(self.model, self.ids(split_or_path), batch,
                                 self.config.model.extended_context, self.device, max_tokens,
                                 adjust, progress)
        if cache is not None:
            result["loss_cache"] = result.pop("loss_adjusted")
            result["ppl_cache"] = result.pop("ppl_adjusted")
            result["cache"] = {"n_cache": cache.n_cache, "theta": float(cache.theta.detach()),
                               "lam": float(cache.lam.detach()),
                               "source": "run" if self.model.cache is not None else "default"}
        return {"path": str(path), **result}

    def encode_prompt(self, text: str | None) -> Tensor:
        """Words of ``text`` (unknown ones -> ``<unk>``), preceded by ``<eos>`` (a line
        start); an empty prompt is ``<eos>`` alone. -> (1, P) long."""
        words = tokenize(text or "")[:-1]
        ids = [self.vocab.eos_id, *self.vocab.encode(words)]
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    def generate(self, prompt: str | None = None, n_tokens: int = 50,
                 temperature: float = 1.0, seed: int = 0, top_k: int | None = None,
                 budget: None = None, stop: Callable[[], bool] | None = None) -> str:
        """Sample ``n_tokens`` words after ``prompt``; ``<eos>`` is shown as a newline.
        ``budget``: as in :meth:`evaluate` (None only). ``stop()``, asked before each word:
        True ends the text there (a server whose client went away)."""
        _no_budget(budget)
        if prompt is not None:
            check_str("prompt", prompt)
        n_tokens = check_int("n_tokens", n_tokens, least=0)
        temperature = check_number("temperature", temperature, least=0)
        seed = check_int("seed", seed, least=0, most=2**64 - 1)  # the generator takes 64 bits
        if top_k is not None:
            top_k = check_int("top_k", top_k)  # from the vocabulary's size on: no filter
        gen = torch.Generator(device=self.device).manual_seed(seed)
        out = self.model.generate(self.encode_prompt(prompt), n_tokens, temperature, top_k,
                                  gen, stop=stop)
        words = [self.vocab.itos[int(i)] for i in out[0]]
        text = " ".join(words).replace(" <eos> ", "\n").replace("<eos>", "\n")
        return " ".join(part for part in (prompt, text) if part)  # no space after nothing
