"""Token-level distillation data for language models: a teacher run's top-k over the
training stream, laid out exactly as the student's training loop reads it (MicroNet §4.1).

**Order contract.** The student's loop (:class:`dynaseq.tasks.lm.task.LMTask`) cuts the training ids
into ``batch_size`` parallel streams and reads them in windows of ``extended_context``
tokens (:class:`~dynaseq.data.lm_corpus.StreamBatches`); window i has targets y_i (B, T_i).
The dump holds, row after row, the teacher's top-k for ``y_0.flatten()``, then
``y_1.flatten()``, ... (row-major, stream by stream within a window): window i starts at row
``B · i · W``. Every epoch re-reads the same rows. The teacher runs the same windows with its
per-layer state carried across them, so each row conditions on the whole preceding text.

The layout (``batch_size``, ``window``, ``n_tokens`` and a digest of the vocabulary) is
recorded in ``meta.json`` under ``"lm_stream"``; :func:`open_teacher_topk` refuses a student
whose training stream differs (another batch size, window, corpus or vocabulary).

Example::

    lm = LanguageModel.load("runs/teacher")
    dump_lm_teacher(lm, "runs/teacher_top30", k=30, batch_size=16, window=1152)
    # student config: train.distill: {topk_dir: runs/teacher_top30}
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from dynaseq.compress.distill import TeacherTopK, dump_teacher_topk
from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import user_path
from dynaseq.data.lm_corpus import StreamBatches, Vocab, read_lm_lines

LAYOUT_KEY = "lm_stream"
_ROWS = 2048  # teacher log-prob rows (x V) per chunk: bounded memory


def vocab_digest(vocab: Vocab) -> str:
    """SHA-1 of the vocabulary in id order (ids must agree between teacher and student)."""
    return hashlib.sha1("\n".join(vocab.itos).encode("utf-8")).hexdigest()


def dump_lm_teacher(lm, out_dir: str | Path, k: int = 30, batch_size: int | None = None,
                    window: int | None = None, train: str | None = None,
                    progress: bool = False) -> TeacherTopK:
    """Write the top-k of ``lm`` (a :class:`~dynaseq.tasks.lm.predictor.LanguageModel`) over the
    training text (default: its config's ``data.train``) in the stream layout of a student
    with ``batch_size`` streams and windows of ``window`` tokens (defaults: the teacher
    config's ``data.batch_size`` and ``model.extended_context``). ``out_dir`` must not
    exist; it appears complete or not at all."""
    out = Path(out_dir)
    if out.exists():
        raise DynaseqError(f"{out} already exists (choose a new --out)")
    cfg = lm.config
    batch_size = batch_size or cfg.data.batch_size
    window = window or cfg.model.extended_context
    path = train or lm.split_path("train")
    if not 1 <= k <= lm.model.vocab_size:
        raise DynaseqError(f"--k must be in 1..{lm.model.vocab_size} (the vocabulary), got {k}")
    batches = StreamBatches(lm.vocab.encode_lines(read_lm_lines(path, min_lines=2)),
                            batch_size, window)
    model = lm.model.eval()

    @torch.no_grad()
    def chunks() -> Iterator[torch.Tensor]:
        state = None
        for x, _ in tqdm(batches, disable=not progress, unit="win"):
            o = model(x.to(lm.device), state)
            state = o.state
            h = o.hidden.reshape(-1, o.hidden.size(-1))  # (B·T, d), row-major = the contract
            for start in range(0, h.size(0), _ROWS):
                yield model.softmax.log_prob(h[start:start + _ROWS])

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        dump_teacher_topk(chunks(), tmp / "topk", k)
        meta_path = tmp / "topk" / "meta.json"
        meta = json.loads(meta_path.read_text())
        meta[LAYOUT_KEY] = {"batch_size": batch_size, "window": window,
                            "n_tokens": batches.n_tokens, "vocab_size": len(lm.vocab),
                            "vocab_sha1": vocab_digest(lm.vocab), "train": str(path),
                            "teacher_run": str(lm.checkpoint)}
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / "topk").rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return TeacherTopK(out)


def open_teacher_topk(topk_dir: str | Path, train: StreamBatches, vocab: Vocab) -> TeacherTopK:
    """Open a :func:`dump_lm_teacher` directory for a student reading ``train`` with
    ``vocab``; raise DynaseqError naming the mismatch when the layouts differ."""
    path = user_path(topk_dir)
    if not (path / "meta.json").is_file():
        raise DynaseqError(f"distill.topk_dir {path} is not a teacher top-k directory (no "
                           "meta.json; write one with 'dynaseq distill-data TEACHER --out DIR')")
    reader = TeacherTopK(path)
    layout = json.loads((path / "meta.json").read_text()).get(LAYOUT_KEY)
    if not isinstance(layout, dict):
        raise DynaseqError(f"{path} has no language-model stream layout in meta.json")
    student = {"batch_size": train.batch_size, "window": train.window,
               "n_tokens": train.n_tokens, "vocab_sha1": vocab_digest(vocab)}
    for key, mine in student.items():
        if layout.get(key) != mine:
            what = {"batch_size": "data.batch_size", "window": "model.extended_context",
                    "n_tokens": "training tokens (data.train)",
                    "vocab_sha1": "vocabulary"}[key]
            raise DynaseqError(
                f"teacher top-k {path} does not match this student: {what} is "
                f"{layout.get(key)!r} for the teacher dump but {mine!r} here; re-run "
                "'dynaseq distill-data' with the student's --batch-size/--window and data")
    if reader.n_tokens != train.n_tokens:
        raise DynaseqError(f"{path} holds {reader.n_tokens} rows, the stream {train.n_tokens}")
    return reader
