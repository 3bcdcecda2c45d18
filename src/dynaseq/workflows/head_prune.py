"""``dynaseq prune-heads`` for classification runs: a run directory -> a new run directory
whose attention keeps the most important heads (HeadPrune, Michel et al. 2019;
:mod:`dynaseq.compress.head_prune`), a baseline of adaptive depth (issue 25).

Head importance is measured on a labelled file (held-out data such as GLUE dev.tsv, or the
training file) with the task's loss; the pruned model is not fine-tuned (as in the paper's
pruning experiments). The new run's ``model.layer_heads`` records each layer's heads, so it
loads with ``dynaseq.load`` and classifies/evaluates/profiles like any run.

Example::

    rep = prune_heads_run("runs/sst2", "runs/sst2_h50", "glue/SST-2/dev.tsv", keep=0.5)
    rep["heads_after"], rep["after"]["accuracy"]
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dynaseq.compress.head_prune import (
    attention_layers,
    check_keep,
    head_importance,
    prune_heads,
    select_heads,
)
from dynaseq.core import checkpoint as ckpt
from dynaseq.core.config import save_config
from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import user_path
from dynaseq.core.rundir import check_new_run_dir, writing_new_dir
from dynaseq.metrics.profile import count_params
from dynaseq.tasks.classify.data import Row, collate_rows, encode_examples, target_tensor
from dynaseq.tasks.classify.glue import read_table
from dynaseq.tasks.classify.predictor import Classifier

#: the report written into the new run
REPORT_FILE = "head_prune_report.json"


def _batches(rows: list[Row], targets: Tensor, batch_size: int, pad_id: int,
             device: torch.device) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """(tokens, segments, targets) batches of rows of similar length."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    for i in range(0, len(order), batch_size):
        idx = order[i:i + batch_size]
        tokens, segments = collate_rows([rows[j] for j in idx], pad_id)
        yield tokens.to(device), segments.to(device), targets[idx].to(device)


def prune_heads_run(run_dir: str | Path, out_dir: str | Path, data: str | Path, keep: float,
                    checkpoint: str = "auto", batch_size: int | None = None,
                    normalize: bool = True, device: str = "auto") -> dict[str, Any]:
    """Write ``out_dir``, a copy of the classification run ``run_dir`` whose model keeps the
    fraction ``keep`` in (0, 1] of its attention heads, the most important by
    :func:`~dynaseq.compress.head_prune.head_importance` on the labelled file ``data`` (the
    task's summed loss; ``normalize``: per-layer l2 normalisation of the scores).

    ``run_dir`` is only read. ``out_dir`` gets ``config.yaml`` (``run_dir`` and
    ``model.layer_heads`` set), the vocabulary, the pruned weights in ``best/`` and
    :data:`REPORT_FILE`: the importance and kept heads per layer, heads and parameters before
    and after, and the task's metrics on ``data`` before and after pruning. Everything is
    written to a temporary sibling renamed into place at the end. Returns the report.

    Raises:
        DynaseqError: ``keep`` outside (0, 1], a missing run, an existing non-empty
            ``out_dir``, a model without dense attention (CCT), an unreadable ``data``.
    """
    keep = check_keep(keep)
    run, out = user_path(run_dir), user_path(out_dir)
    if not run.is_dir():
        raise DynaseqError(f"run directory not found: {run}")
    check_new_run_dir(run, out)
    c = Classifier.load(run, checkpoint=checkpoint, device=device)
    if c.config.model.cct is not None:
        raise DynaseqError(f"{run} is a CCT model: head pruning needs dense attention")
    layout = c.layout
    ex = read_table(data, layout)
    if not len(ex):
        raise DynaseqError(f"{data}: every row has an empty sentence")
    rows = encode_examples(c.vocab, ex, c.config.data.max_len)
    targets = target_tensor(ex, layout)
    bs = batch_size or c.config.data.batch_size

    def loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        tokens, segments, y = batch
        logits = model(tokens, segments).logits
        if layout.regression:
            return nn.functional.mse_loss(logits[:, 0], y, reduction="sum")
        return nn.functional.cross_entropy(logits, y, reduction="sum")

    importance = head_importance(c.model, _batches(rows, targets, bs, c.vocab.pad_id,
                                                   c.device), loss, normalize)
    kept = select_heads(importance, keep)
    pruned = prune_heads(c.model, kept).eval()
    cfg = copy.deepcopy(c.config)
    cfg.run_dir = str(out)
    cfg.model.layer_heads = [a.n_heads for _, a in attention_layers(pruned)]
    small = Classifier(pruned, c.vocab, cfg, c.checkpoint, c.device)
    before, after = c.evaluate(data, batch_size=bs), small.evaluate(data, batch_size=bs)
    metrics = list(layout.metrics)
    report: dict[str, Any] = {
        "source_run": str(run), "source_checkpoint": str(c.checkpoint), "data": str(data),
        "keep": keep, "normalize": normalize,
        "heads_before": sum(len(i) for i in importance), "heads_after": sum(map(len, kept)),
        "layer_heads": cfg.model.layer_heads, "kept_heads": kept,
        "importance": [i.tolist() for i in importance],
        "params_before": count_params(c.model), "params_after": count_params(pruned),
        "before": {m: before[m] for m in metrics}, "after": {m: after[m] for m in metrics}}
    meta = {k: v for k, v in ckpt.read_meta(c.checkpoint).items() if k in ("step", "valid")}
    meta.update(source_run=str(run), source_checkpoint=str(c.checkpoint), head_prune=True)
    with writing_new_dir(out) as tmp:
        save_config(cfg, tmp / "config.yaml")
        for name in Classifier.EXPORT_FILES:
            if (run / name).is_file():
                shutil.copy2(run / name, tmp / name)
        ckpt.write_checkpoint(tmp / "best", pruned, meta)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    return report
