"""Load an MLM run and score text with it: masked-token loss, perplexity and accuracy.

Example::

    import dynaseq
    m = dynaseq.load("runs/wikitext2_mlm_small")          # a MaskedLM
    m.evaluate("valid")                                    # {"loss", "ppl", "accuracy", ...}
    m.evaluate("test.txt", budget=0.5)                     # a CCT-BERT at a trained budget
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from dynaseq.core.arguments import check_path, int_or
from dynaseq.core.errors import DynaseqError
from dynaseq.core.progress import progress_bar
from dynaseq.data.text import read_lines
from dynaseq.models.encoder import EncoderModel
from dynaseq.nn.modes import evaluating
from dynaseq.tasks.encoder.budget import Budget, control_id, trained_budget
from dynaseq.tasks.encoder.model import MLM, build_encoder_model
from dynaseq.tasks.encoder.vocab import SPM_FILE, EncoderVocab
from dynaseq.tasks.loading import ShortRepr, load_predictor
from dynaseq.tasks.mlm.config import TASK, MLMRunConfig
from dynaseq.tasks.mlm.data import MaskedBatch, MaskSpec, mask_tokens, pack_blocks

#: Validation and evaluation masks come from this seed (the same positions every time).
EVAL_MASK_SEED = 20_200_707


def mask_spec(cfg: MLMRunConfig) -> MaskSpec:
    d = cfg.data
    return MaskSpec(d.mask_prob, d.mask_token_prob, d.random_token_prob)


@torch.inference_mode()
def mlm_metrics(model: EncoderModel, blocks: Tensor, vocab: EncoderVocab, spec: MaskSpec,
                batch_size: int, device: torch.device, control: int | None,
                progress: bool = False) -> dict[str, float]:
    """Masked-token loss (nats per chosen token), perplexity and accuracy over ``blocks``
    (N, L), masked from :data:`EVAL_MASK_SEED` (fixed positions, comparable across runs and
    the same at any ``batch_size``: every block is masked at once, then run in batches);
    ``progress``: a bar of blocks on a terminal."""
    masked = mask_tokens(blocks, vocab, spec, torch.Generator().manual_seed(EVAL_MASK_SEED))
    ends = masked.select.sum(1).cumsum(0).tolist()  # each block's last target, exclusive
    nll, correct, n = 0.0, 0, 0
    with evaluating(model), progress_bar(blocks.size(0), "block", "evaluate", progress) as bar:
        for i in range(0, blocks.size(0), batch_size):
            j = min(i + batch_size, blocks.size(0))
            first = ends[i - 1] if i else 0
            b = MaskedBatch(masked.inputs[i:j], masked.select[i:j],
                            masked.targets[first:ends[j - 1]]).to(device)
            logits = model(b.inputs, None, control, select=b.select).logits.float()
            nll += float(nn.functional.cross_entropy(logits, b.targets, reduction="sum"))
            correct += int((logits.argmax(-1) == b.targets).sum())
            n += b.targets.numel()
            bar.update(j - i)
    if n == 0:
        raise DynaseqError("no maskable tokens to evaluate")
    loss = nll / n
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "accuracy": correct / n,
            "n_masked": n, "n_blocks": int(blocks.size(0))}


@dataclass(repr=False)
class MaskedLM(ShortRepr):
    """A pre-trained encoder with its MLM head, vocabulary, config and checkpoint."""

    #: the run files an exported model carries besides config and weights (the vocabulary)
    EXPORT_FILES: ClassVar[tuple[str, ...]] = (SPM_FILE, "spm.vocab")

    model: EncoderModel
    vocab: EncoderVocab
    config: MLMRunConfig
    checkpoint: Path
    device: torch.device

    @classmethod
    def load(cls, run_dir: str | Path, checkpoint: str = "auto",
             device: str = "auto", precision: str = "fp32") -> MaskedLM:
        return load_predictor(
            run_dir, checkpoint, device, {TASK: MLMRunConfig}, "MLM",
            vocabulary=lambda run: EncoderVocab.load(run / SPM_FILE),
            build=lambda cfg, vocab: build_encoder_model(cfg.model, vocab.size, MLM,
                                                         vocab.pad_id),
            make=lambda r: cls(r.model, r.vocab, r.config, r.checkpoint, r.device),
            precision=precision)

    def blocks(self, split_or_path: str) -> Tensor:
        """(N, block_len) blocks of a split of the run's config (``valid``) or a text file."""
        path = self.config.data.valid if split_or_path == "valid" else split_or_path
        if path is None:
            raise DynaseqError("the run's config has no data.valid file")
        lines = read_lines(path)
        blocks = pack_blocks(self.vocab.encode(lines), self.config.data.block_len, self.vocab)
        if blocks.numel() == 0:
            raise DynaseqError(f"{path} has no text to evaluate")
        return blocks

    def evaluate(self, split_or_path: str = "valid", budget: Budget = None,
                 batch_size: int | None = None, progress: bool = False) -> dict[str, object]:
        """Masked-token loss, perplexity and accuracy of a split or file (fixed masks);
        ``budget``: a trained CCT budget (default the largest); ``progress``: a bar on a
        terminal."""
        control = control_id(self.config.model, budget)
        check_path("split_or_path", split_or_path, "a split name or a file path")
        batch = int_or("batch_size", batch_size, self.config.data.batch_size)
        result = mlm_metrics(self.model, self.blocks(split_or_path), self.vocab,
                             mask_spec(self.config), batch, self.device, control, progress)
        return {"path": split_or_path, "budget": trained_budget(self.config.model, budget),
                **result, "checkpoint": str(self.checkpoint)}
