"""Classification inputs: examples -> ``[CLS] a [SEP] (b [SEP])`` ids and segments, padded
batches, targets as tensors."""

from __future__ import annotations

import torch
from torch import Tensor

from dynaseq.tasks.classify.glue import Examples, TableLayout
from dynaseq.tasks.encoder.vocab import EncoderVocab

Row = tuple[list[int], list[int]]
"""One input: token ids and segment ids, equally long."""


def encode_examples(vocab: EncoderVocab, ex: Examples, max_len: int) -> list[Row]:
    """Each example as model input (see :meth:`EncoderVocab.encode_pair`); a sentence that
    tokenizes to nothing (e.g. only unknown whitespace) keeps its [CLS]/[SEP]."""
    a = vocab.encode(ex.text_a)
    b = vocab.encode(ex.text_b) if ex.text_b is not None else [None] * len(a)
    return [vocab.encode_pair(x, y, max_len) for x, y in zip(a, b, strict=True)]


def collate_rows(rows: list[Row], pad_id: int) -> tuple[Tensor, Tensor]:
    """(tokens, segments), each (B, S) long, padded to the longest row."""
    s = max(len(ids) for ids, _ in rows)
    tokens = torch.full((len(rows), s), pad_id, dtype=torch.long)
    segments = torch.zeros((len(rows), s), dtype=torch.long)
    for i, (ids, segs) in enumerate(rows):
        tokens[i, :len(ids)] = torch.tensor(ids)
        segments[i, :len(segs)] = torch.tensor(segs)
    return tokens, segments


def target_tensor(ex: Examples, layout: TableLayout) -> Tensor:
    """(N,) label indices (long) in ``layout.labels`` order, or (N,) scores (float)."""
    if layout.regression:
        return torch.tensor(ex.scores, dtype=torch.float32)
    index = {label: i for i, label in enumerate(layout.labels)}
    return torch.tensor([index[label] for label in ex.labels], dtype=torch.long)
