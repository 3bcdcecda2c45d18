"""Word-level language-modeling corpora: a frequency-sorted vocabulary and stream batches.

The format is WikiText's (Merity et al. 2016): one paragraph per line, tokens separated by
spaces, an ``<eos>`` appended to every line (empty lines included), unknown words already
written as ``<unk>``. Ids follow frequency rank in the training file (id 0 = most frequent),
which is what the adaptive input and softmax bins need (Baevski & Auli 2018; MicroNet A.1).

Example::

    vocab = Vocab.build(read_lm_lines("wikitext-2/train.txt"))
    ids = vocab.encode_lines(read_lm_lines("wikitext-2/valid.txt"))   # (N,) long
    for x, y in StreamBatches(ids, batch_size=16, window=128):       # (16, 128) each
        ...
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from dynaseq.core.errors import DynaseqError
from dynaseq.core.files import atomic_write, read_text
from dynaseq.data.text import read_lines

EOS = "<eos>"
UNK = "<unk>"
VOCAB_FILE = "vocab.txt"


def read_lm_lines(path: str | Path, min_lines: int = 2) -> list[str]:
    """The lines of a word-level corpus (plain or gzip, UTF-8).

    Raises DynaseqError for an unreadable file and for a corpus with fewer than
    ``min_lines`` non-empty lines (an empty or one-line corpus cannot train or meaningfully
    evaluate a language model).
    """
    lines = read_lines(path)
    n = sum(1 for ln in lines if ln)
    if n < min_lines:
        what = "is empty" if n == 0 else f"has only {n} non-empty line{'s' * (n != 1)}"
        raise DynaseqError(f"corpus {path} {what}; a language model needs at least "
                           f"{min_lines} non-empty lines")
    return lines


def tokenize(line: str) -> list[str]:
    """Space-separated words plus ``<eos>``."""
    return [*line.split(), EOS]


class Vocab:
    """Words sorted by training-set frequency (ties: first occurrence), ``<eos>``/``<unk>``
    included. ``itos[i]`` is the word of id i; unknown words map to ``<unk>``."""

    def __init__(self, itos: list[str], counts: list[int] | None = None) -> None:
        if len(set(itos)) != len(itos):
            raise DynaseqError("vocabulary has duplicate words")
        for special in (EOS, UNK):
            if special not in itos:
                raise DynaseqError(f"vocabulary lacks {special}")
        self.itos = list(itos)
        self.counts = list(counts) if counts is not None else [0] * len(itos)
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        self.eos_id = self.stoi[EOS]
        self.unk_id = self.stoi[UNK]

    def __len__(self) -> int:
        return len(self.itos)

    @classmethod
    def build(cls, lines: Iterable[str]) -> Vocab:
        counts: Counter[str] = Counter()
        for line in lines:
            counts.update(tokenize(line))
        counts.setdefault(UNK, 0)  # kept even when the training text has none
        # Counter.most_common is stable: equal counts keep first-occurrence order
        ranked = counts.most_common()
        return cls([w for w, _ in ranked], [c for _, c in ranked])

    def encode(self, words: list[str]) -> list[int]:
        unk = self.unk_id
        return [self.stoi.get(w, unk) for w in words]

    def encode_lines(self, lines: Iterable[str]) -> Tensor:
        """All lines, each followed by ``<eos>``, as one ``(N,)`` long tensor."""
        ids: list[int] = []
        for line in lines:
            ids.extend(self.encode(tokenize(line)))
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(self.itos[int(i)] for i in ids)

    def save(self, path: str | Path) -> None:
        """One ``word<TAB>count`` per line, in id order."""
        text = "".join(f"{w}\t{c}\n" for w, c in zip(self.itos, self.counts, strict=True))
        atomic_write(path, text)

    @classmethod
    def load(cls, path: str | Path) -> Vocab:
        p = Path(path)
        text = read_text(p, "vocabulary")
        itos, counts = [], []
        for n, line in enumerate(text.splitlines(), 1):
            word, sep, count = line.rpartition("\t")
            if not sep or not count.isdigit():
                raise DynaseqError(f"{p}: line {n} is not 'word<TAB>count'")
            itos.append(word)
            counts.append(int(count))
        return cls(itos, counts)


class StreamBatches:
    """Consecutive windows over ``batch_size`` parallel streams of one token sequence.

    The sequence (N,) is cut into ``batch_size`` contiguous streams of ``n = (N-1) // B``
    tokens (the remainder is dropped) laid out as rows of a (B, n+1) matrix. Window i is
    ``x = rows[:, i*W : i*W + W]`` and ``y`` the same shifted by one token (the last window
    may be shorter), so window i+1 continues every row of window i: per-layer memory (and a
    neural cache) carried from one window to the next sees the true preceding text.

    ``len(self)`` is the number of windows; ``self[i]`` returns ``(x, y)``, both (B, W_i).
    """

    def __init__(self, ids: Tensor, batch_size: int, window: int) -> None:
        if batch_size < 1 or window < 1:
            raise DynaseqError("batch_size and window must be >= 1")
        n = (ids.numel() - 1) // batch_size
        if n < 1:
            raise DynaseqError(f"{ids.numel()} tokens cannot fill {batch_size} streams; "
                               "use a smaller batch size or a longer corpus")
        rows = ids[: batch_size * n + 1]
        # row b holds tokens b*n .. b*n+n (inclusive: the last is the next row's first)
        index = torch.arange(batch_size)[:, None] * n + torch.arange(n + 1)[None, :]
        self.data = rows[index]  # (B, n+1)
        self.batch_size, self.window, self.stream_len = batch_size, window, n

    def __len__(self) -> int:
        return -(-self.stream_len // self.window)

    @property
    def n_tokens(self) -> int:
        """Predicted tokens over all windows: B · n."""
        return self.batch_size * self.stream_len

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.window
        end = min(start + self.window, self.stream_len)
        return self.data[:, start:end], self.data[:, start + 1:end + 1]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for i in range(len(self)):
            yield self[i]
