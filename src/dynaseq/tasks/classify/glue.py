"""GLUE tables as the GLUE download writes them, and any TSV by a column spec.

Each task's :class:`TableLayout` names its sentence and label columns (by header name, or by
index for CoLA, whose files have no header), its label set (None: a regression score), its
official metrics (the first is the one ``best/`` keeps) and F1's positive label. Reading
(:func:`read_table`) splits lines on tabs only (no quoting: GLUE's MRPC/QQP text holds
quotes), checks the header of a GLUE file, and raises a one-line
:class:`~dynaseq.core.errors.DynaseqError` naming the file and line for a missing column, a
label outside the set, a score that is not a number, or an empty file. Rows with an empty
sentence are counted and skipped.

Example::

    ex = read_table("glue/SST-2/dev.tsv", GLUE_TASKS["sst2"])
    ex.text_a[0], ex.labels[0], ex.skipped            # "it 's a charming ...", "1", 0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from dynaseq.core.errors import DynaseqError
from dynaseq.data.text import read_lines

Column = str | int
"""A header name, or a 0-based index (files without a header)."""


@dataclass(frozen=True)
class TableLayout:
    """Where a table's fields are and how it is scored (see the module doc).

    name: the GLUE task (or ``"columns"``); text_a/text_b/label: columns (text_b None: a
    single-sentence task); header: the first line names the columns; labels: the label set,
    in the classifier's output order (None: a regression score); metrics: official metrics;
    positive: F1's positive label; n_columns: the column count of a headerless GLUE file.
    """

    name: str
    text_a: Column
    text_b: Column | None
    label: Column
    header: bool
    labels: tuple[str, ...] | None
    regression: bool
    metrics: tuple[str, ...]
    positive: str | None = None
    n_columns: int | None = None

    @property
    def is_pair(self) -> bool:
        return self.text_b is not None

    @property
    def n_outputs(self) -> int:
        return 1 if self.regression else len(self.labels or ())


def _glue(name, a, b, label, labels, metrics, positive=None, header=True, n_columns=None):
    return TableLayout(name, a, b, label, header, labels, labels is None, metrics, positive,
                       n_columns)


BINARY = ("0", "1")
ENTAIL = ("entailment", "not_entailment")

#: ``data.glue_task`` -> its layout (GLUE's train.tsv / dev*.tsv).
GLUE_TASKS: dict[str, TableLayout] = {
    "cola": _glue("cola", 3, None, 1, BINARY, ("mcc", "accuracy"), header=False, n_columns=4),
    "sst2": _glue("sst2", "sentence", None, "label", BINARY, ("accuracy",)),
    "mrpc": _glue("mrpc", "#1 String", "#2 String", "Quality", BINARY, ("f1", "accuracy"), "1"),
    "qqp": _glue("qqp", "question1", "question2", "is_duplicate", BINARY, ("f1", "accuracy"),
                 "1"),
    "stsb": _glue("stsb", "sentence1", "sentence2", "score", None, ("pearson", "spearman")),
    "mnli": _glue("mnli", "sentence1", "sentence2", "gold_label",
                  ("contradiction", "entailment", "neutral"), ("accuracy",)),
    "qnli": _glue("qnli", "question", "sentence", "label", ENTAIL, ("accuracy",)),
    "rte": _glue("rte", "sentence1", "sentence2", "label", ENTAIL, ("accuracy",)),
    "wnli": _glue("wnli", "sentence1", "sentence2", "label", BINARY, ("accuracy",)),
}


@dataclass
class Examples:
    """The kept rows of a table: sentences, gold labels (str) or scores (float), or None
    (unlabelled); ``skipped``: rows dropped for an empty sentence; ``line_numbers``: the
    1-based file line of each kept row."""

    text_a: list[str]
    text_b: list[str] | None
    labels: list[str] | None = None
    scores: list[float] | None = None
    skipped: int = 0
    line_numbers: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.text_a)

    def targets(self) -> list[str] | list[float] | None:
        return self.scores if self.scores is not None else self.labels


def _index(layout: TableLayout, header: list[str] | None, col: Column, path: Path,
           what: str) -> int:
    if isinstance(col, int):
        return col
    assert header is not None
    if col not in header:
        raise DynaseqError(f"{path}: the header has no column {col!r} ({what}) for "
                           f"{layout.name}; it has: {', '.join(header)}")
    return header.index(col)


def read_table(path: str | Path, layout: TableLayout, labelled: bool = True) -> Examples:
    """The rows of a TSV in ``layout`` (see the module doc); ``labelled=False`` reads a
    file without labels (e.g. GLUE's test.tsv). A label column is required when
    ``labelled``; without ``layout.labels`` (a column spec to learn them) any label is
    taken."""
    p = Path(path)
    lines = read_lines(p, strip=False)  # an empty first or last field keeps its tab
    while lines and not lines[-1].strip():
        lines.pop()  # a trailing blank line is no row
    if not lines or (layout.header and len(lines) == 1):
        raise DynaseqError(f"{p} is empty (no rows)")
    header = lines[0].split("\t") if layout.header else None
    if header is not None:
        header = [h.strip() for h in header]
    ia = _index(layout, header, layout.text_a, p, "first sentence")
    ib = None if layout.text_b is None else _index(layout, header, layout.text_b, p,
                                                     "second sentence")
    il = _index(layout, header, layout.label, p, "label") if labelled else None
    needed = 1 + max(i for i in (ia, ib, il) if i is not None)
    first = 2 if layout.header else 1
    ex = Examples([], [] if ib is not None else None,
                  [] if labelled and not layout.regression else None,
                  [] if labelled and layout.regression else None)
    for n, line in enumerate(lines[first - 1:], start=first):
        cols = line.split("\t")
        while layout.n_columns is not None and len(cols) > layout.n_columns and not (
                cols[-1].strip()):
            cols.pop()  # a stray tab (or "\r") at the end of the row
        if layout.n_columns is not None and len(cols) != layout.n_columns:
            raise DynaseqError(f"{p} line {n}: {len(cols)} columns, {layout.name} files have "
                               f"{layout.n_columns}")
        if len(cols) < needed:
            raise DynaseqError(f"{p} line {n}: {len(cols)} columns, {layout.name} needs at "
                               f"least {needed}")
        a = cols[ia].strip()
        b = None if ib is None else cols[ib].strip()
        if il is not None:
            raw = cols[il].strip()
            if layout.regression:
                try:
                    score = float(raw)
                except ValueError:
                    score = math.nan
                if not math.isfinite(score):
                    raise DynaseqError(f"{p} line {n}: score {raw!r} is not a number")
            elif layout.labels is not None and raw not in layout.labels:
                raise DynaseqError(f"{p} line {n}: label {raw!r} is not one of "
                                   f"{', '.join(layout.labels)} ({layout.name})")
        if not a or (ib is not None and not b):
            ex.skipped += 1
            continue
        ex.text_a.append(a)
        if ex.text_b is not None:
            ex.text_b.append(b)
        if il is not None:
            if layout.regression:
                ex.scores.append(score)
            else:
                ex.labels.append(raw)
        ex.line_numbers.append(n)
    return ex
