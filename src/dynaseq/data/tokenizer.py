"""A shared SentencePiece subword model with fixed special ids.

The special ids are the same in every model this module trains::

    pad = 0, unk = 1, bos = 2, eos = 3

:meth:`Tokenizer.encode` never adds bos/eos; the batching code adds them where the model
needs them. :meth:`Tokenizer.decode` drops pad/bos/eos ids, so model output can be decoded
as is.

Example::

    tok = Tokenizer.train(src_lines + tgt_lines, "run/spm.model", vocab_size=8000)
    ids = tok.encode(["A dog runs."])          # [[17, 402, 961, 5]]
    tok.decode(ids)                             # ['A dog runs.']
    tok = Tokenizer.load("run/spm.model")
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import sentencepiece as spm

from dynaseq.core.arguments import check_text
from dynaseq.core.errors import ConfigError, DynaseqError
from dynaseq.core.files import atomic_write, os_reason
from dynaseq.data.text import read_bytes

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3

#: Model types SentencePiece can train.
MODEL_TYPES = ("unigram", "bpe", "char", "word")

#: At most this many sentences are used for training (a random sample when there are more).
MAX_TRAIN_SENTENCES = 2_000_000

# A fixed thread count and sampling seed keep training reproducible across machines (the
# trainer splits its statistics by thread, so a machine-dependent count might change the
# floating-point sums and hence the model).
_TRAIN_THREADS = 4
_TRAIN_SEED = 1234


@dataclass
class SubwordSettings:
    """The SentencePiece model a run trains on its training text, as a config section's
    fields (:meth:`Tokenizer.train`'s options): ``vocab_size`` (an upper bound),
    ``spm_model_type`` (one of :data:`MODEL_TYPES`) and ``character_coverage`` in (0, 1].
    Every task's data section that trains a vocabulary inherits them, so one YAML key means
    the same thing, with the same default and the same check, in every task; a subclass's
    :attr:`RESERVED_IDS` is how many ids its vocabulary holds before the first word piece.
    A subclass with a ``__post_init__`` of its own calls this one."""

    RESERVED_IDS: ClassVar[int] = 4  # pad, unk, bos, eos

    vocab_size: int = 8000
    spm_model_type: str = "unigram"
    character_coverage: float = 1.0

    def __post_init__(self) -> None:
        if self.vocab_size <= self.RESERVED_IDS:
            raise ConfigError(f"vocab_size must be > {self.RESERVED_IDS} (the special ids), "
                              f"got {self.vocab_size}")
        if self.spm_model_type not in MODEL_TYPES:
            raise ConfigError(f"spm_model_type must be one of {', '.join(MODEL_TYPES)}; got "
                              f"{self.spm_model_type!r}")
        if not 0.0 < self.character_coverage <= 1.0:
            raise ConfigError("character_coverage must be in (0, 1], got "
                              f"{self.character_coverage}")


def _spm_message(e: Exception) -> str:
    """SentencePiece's error text on one line, without the status code and C++ location.

    ``"INTERNAL: src/x.cc(638) [a <= b] Vocabulary size is ..."`` -> ``"Vocabulary size is
    ..."``; a bare failed check ``"INTERNAL: src/x.cc(467) [!s.empty()]"`` -> ``"check failed:
    !s.empty()"``.
    """
    text = " ".join(str(e).split())
    match = re.fullmatch(r"(?:[A-Z_]+: )?\S+\.cc\(\d+\) \[(.*?)\](?: (.*))?", text)
    if match is None:
        return text
    check, message = match.groups()
    return message or f"check failed: {check}"


def with_subwords(ids: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """The indices of the id lists that are not empty, and those lists
    (:meth:`Tokenizer.encode_kept` of lines already encoded)."""
    keep = [i for i, x in enumerate(ids) if x]
    return keep, [ids[i] for i in keep]


class Tokenizer:
    """A loaded SentencePiece model; build one with :meth:`train` or :meth:`load`.

    Attributes:
        path: the model file this tokenizer was trained into or loaded from.
        pad_id, unk_id, bos_id, eos_id: the special ids (distinct, all defined).
    """

    def __init__(self, processor: spm.SentencePieceProcessor, path: Path) -> None:
        self._sp = processor
        self.path = path
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = (
            int(processor.pad_id()), int(processor.unk_id()), int(processor.bos_id()),
            int(processor.eos_id()))
        for name in ("pad", "unk", "bos", "eos"):
            if getattr(self, f"{name}_id") < 0:
                raise DynaseqError(f"{path}: SentencePiece model has no {name} id")
        if len({self.pad_id, self.unk_id, self.bos_id, self.eos_id}) != 4:
            raise DynaseqError(f"{path}: SentencePiece model reuses a special id")
        self._special = frozenset((self.pad_id, self.bos_id, self.eos_id))

    # ------------------------------------------------------------------ construction

    @classmethod
    def train(
        cls,
        lines: list[str],
        model_path: str | Path,
        vocab_size: int,
        model_type: str = "unigram",
        character_coverage: float = 1.0,
        seed_sentencepiece_size: int | None = None,
        user_symbols: Sequence[str] = (),
    ) -> Tokenizer:
        """Train one shared model on ``lines`` and write it to ``model_path``.

        Pass the source and target lines together for a shared vocabulary. Training reads
        the lines from memory (no temporary files), uses at most
        :data:`MAX_TRAIN_SENTENCES` of them (a seeded random sample beyond that) and is
        deterministic for the same input. ``vocab_size`` is an upper bound
        (``hard_vocab_limit=False``): a small corpus gives a smaller vocabulary instead of
        an error. ``user_symbols`` (e.g. ``["[CLS]", "[SEP]", "[MASK]"]``) get the ids right
        after the four special ones, in order, and are never split. A human-readable
        ``<model_path stem>.vocab`` (``piece<TAB>score``) is written next to the model.

        Raises:
            DynaseqError: no non-empty line, an unknown ``model_type``, a ``vocab_size``
                too small for the corpus's characters, or an unwritable ``model_path``.
        """
        model_path = Path(model_path)
        if not any(line.strip() for line in lines):
            raise DynaseqError("cannot train a SentencePiece model on no non-empty lines")
        if model_type not in MODEL_TYPES:
            raise DynaseqError(f"unknown SentencePiece model type {model_type!r}; "
                               f"known: {', '.join(MODEL_TYPES)}")
        if vocab_size <= 4:
            raise DynaseqError(f"vocab_size must be > 4 (the special ids), got {vocab_size}")
        if not 0.0 < character_coverage <= 1.0:
            raise DynaseqError(f"character_coverage must be in (0, 1], got {character_coverage}")
        options: dict[str, object] = {
            "vocab_size": vocab_size,
            "model_type": model_type,
            "character_coverage": character_coverage,
            "pad_id": PAD_ID,
            "unk_id": UNK_ID,
            "bos_id": BOS_ID,
            "eos_id": EOS_ID,
            "hard_vocab_limit": False,
            "input_sentence_size": MAX_TRAIN_SENTENCES,
            "shuffle_input_sentence": True,
            "num_threads": _TRAIN_THREADS,
            "minloglevel": 2,
        }
        if user_symbols:
            options["user_defined_symbols"] = list(user_symbols)
        if seed_sentencepiece_size is not None:
            options["seed_sentencepiece_size"] = seed_sentencepiece_size
        buffer = io.BytesIO()
        # The sampling seed lives in the C++ library; setting it to a constant each time
        # makes the sample (used only beyond MAX_TRAIN_SENTENCES lines) reproducible.
        spm.set_random_generator_seed(_TRAIN_SEED)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines), model_writer=buffer, **options
            )
        except (RuntimeError, OSError, ValueError) as e:
            raise DynaseqError(f"cannot train SentencePiece model: {_spm_message(e)}") from None
        proto = buffer.getvalue()
        assert proto, "SentencePiece returned an empty model"
        processor = spm.SentencePieceProcessor(model_proto=proto)
        vocab = "".join(f"{processor.id_to_piece(i)}\t{processor.get_score(i)}\n"
                        for i in range(processor.vocab_size()))
        try:  # the vocabulary first: a model file present is a whole, usable one
            vocab_path = model_path.with_suffix(".vocab")
            if vocab_path != model_path:
                atomic_write(vocab_path, vocab)
            atomic_write(model_path, proto)
        except OSError as e:
            raise DynaseqError(f"cannot write {model_path}: {os_reason(e)}") from None
        return cls(processor, model_path)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load a model written by :meth:`train` (or any SentencePiece model with
        pad/unk/bos/eos ids defined).

        Raises:
            DynaseqError: the file is missing, unreadable or not a SentencePiece model.
        """
        p = Path(path)
        proto = read_bytes(p)
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(proto)
        except (RuntimeError, OSError, ValueError):
            raise DynaseqError(f"{p}: not a valid SentencePiece model") from None
        if processor.vocab_size() <= 0:
            raise DynaseqError(f"{p}: not a valid SentencePiece model (empty vocabulary)")
        return cls(processor, p)

    # ------------------------------------------------------------------ ids

    @property
    def vocab_size(self) -> int:
        """Number of ids, special ids included: valid ids are ``0 .. vocab_size - 1``."""
        return int(self._sp.vocab_size())

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, lines: list[str]) -> list[list[int]]:
        """Subword ids of each line, without bos/eos.

        Example::

            tok.encode(["a dog", ""])   # [[9, 312], []]
        """
        if not lines:
            return []
        check_text(lines)
        if len(lines) < self.BATCH_LINES:  # one call per line: no thread pool to start
            return [self._sp.encode(line, out_type=int) for line in lines]
        return [list(ids) for ids in self._sp.encode(list(lines), out_type=int)]

    def encode_kept(self, lines: list[str]) -> tuple[list[int], list[list[int]]]:
        """The indices of the ``lines`` that hold at least one subword and their ids: a line
        that is empty, all whitespace or only characters the model drops (a zero-width
        space) is left out, to be answered with an empty line.

        Example::

            tok.encode_kept(["a dog", " ", "\u200b"])   # ([0], [[9, 312]])
        """
        return with_subwords(self.encode(lines))

    BATCH_LINES = 64
    """From this many lines on, :meth:`encode` makes one batched SentencePiece call. A
    batched call costs about 0.2-0.3 ms whatever its size (it starts a thread pool), one
    short line alone about 5 µs; a served request is one line, encoded on the event loop
    (measured: 0.27 ms against 4.4 µs; 1000 lines: 3.3 ms batched, 7.5 ms one by one)."""

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Text of each id sequence; pad, bos and eos ids are dropped first.

        Unknown pieces (``unk_id``) decode to SentencePiece's `` ⁇ `` mark.
        """
        vocab = self.vocab_size
        out = []
        for seq in ids:
            kept = [int(i) for i in seq if int(i) not in self._special]
            for i in kept:
                if not 0 <= i < vocab:
                    raise ValueError(f"id {i} is out of range for vocab_size={vocab}")
            out.append(self._sp.decode(kept))
        return out

    def encode_pieces(self, line: str) -> list[str]:
        """Subword pieces of one line, for debugging: ``'a dog' -> ['▁a', '▁dog']``."""
        return list(self._sp.encode(line, out_type=str))

    def piece_to_id(self, piece: str) -> int:
        """The id of a whole piece (e.g. a user symbol ``"[MASK]"``); DynaseqError if the
        model has no such piece."""
        i = int(self._sp.piece_to_id(piece))
        if i == self.unk_id and piece != self.id_to_piece(self.unk_id):
            raise DynaseqError(f"{self.path}: SentencePiece model has no piece {piece!r}")
        return i

    def id_to_piece(self, i: int) -> str:
        """The piece of id ``i`` (special ids give ``<pad>``, ``<unk>``, ``<s>``, ``</s>``)."""
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"id {i} is out of range for vocab_size={self.vocab_size}")
        return str(self._sp.id_to_piece(i))

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"
