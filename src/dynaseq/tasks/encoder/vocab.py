"""The encoder's SentencePiece vocabulary and how sentences become model inputs.

Ids: pad 0, unk 1 (bos 2 and eos 3 unused), then [CLS] 4, [SEP] 5, [MASK] 6 (SentencePiece
user symbols: never split, reserved), then the subwords. A single sentence is
``[CLS] a [SEP]`` with segment 0; a pair ``[CLS] a [SEP] b [SEP]`` with segment 0 up to the
first [SEP] and 1 after it (BERT sec. 3). Over-long inputs lose tokens from the end of the
longer sentence first (the second on a tie, as BERT's
``_truncate_seq_pair``).

Example::

    vocab = EncoderVocab.train(lines, "run/spm.model", 8000)
    ids, segs = vocab.encode_pair([17, 9], [40])    # [4, 17, 9, 5, 40, 5], [0, 0, 0, 0, 1, 1]
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dynaseq.data.tokenizer import Tokenizer

CLS, SEP, MASK = "[CLS]", "[SEP]", "[MASK]"
SYMBOLS = (CLS, SEP, MASK)  # the encoder's own pieces, ids 4, 5, 6
SPM_FILE = "spm.model"


@dataclass
class EncoderVocab:
    """A SentencePiece model with the encoder's special ids."""

    tokenizer: Tokenizer

    def __post_init__(self) -> None:
        tok = self.tokenizer
        self.pad_id = tok.pad_id
        self.cls_id, self.sep_id, self.mask_id = (tok.piece_to_id(p) for p in SYMBOLS)
        #: ids that are not subwords (never masked, never a random replacement)
        self.special_ids = sorted({tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id,
                                   self.cls_id, self.sep_id, self.mask_id})
        #: the first ordinary subword id (random replacements are drawn from here up)
        self.first_word_id = max(self.special_ids) + 1

    @property
    def size(self) -> int:
        return self.tokenizer.vocab_size

    @classmethod
    def train(cls, lines: list[str], path: str | Path, vocab_size: int,
              model_type: str = "unigram", character_coverage: float = 1.0) -> EncoderVocab:
        return cls(Tokenizer.train(lines, path, vocab_size, model_type, character_coverage,
                                   user_symbols=SYMBOLS))

    @classmethod
    def load(cls, path: str | Path) -> EncoderVocab:
        return cls(Tokenizer.load(path))

    def encode(self, lines: list[str]) -> list[list[int]]:
        return self.tokenizer.encode(lines)

    def encode_pair(self, a: list[int], b: list[int] | None = None,
                    max_len: int | None = None) -> tuple[list[int], list[int]]:
        """Token ids and segment ids of ``[CLS] a [SEP] (b [SEP])``, at most ``max_len``
        long (the longer sentence is cut first)."""
        a, b = list(a), None if b is None else list(b)
        if max_len is not None:
            room = max_len - (2 if b is None else 3)
            if room < 1 + (b is not None):
                raise ValueError(f"max_len={max_len} leaves no room for the sentences")
            while len(a) + (0 if b is None else len(b)) > room:
                if b is not None and len(b) >= len(a):  # BERT's _truncate_seq_pair
                    b.pop()
                else:
                    a.pop()
        ids = [self.cls_id, *a, self.sep_id]
        segs = [0] * len(ids)
        if b is not None:
            ids += [*b, self.sep_id]
            segs += [1] * (len(b) + 1)
        return ids, segs
