"""A synthetic translation task with easy, medium and hard target tokens.

Generated in code (no downloads), for the demo and for fast tests. Both languages are made
of pseudo-words built from 2-3 consonant-vowel syllables; the source uses the consonants
``k l m n p r s t v`` (``pene``, ``nepuki``), the target ``b d f g h j w z`` (``hofo``,
``duhobi``), so the two vocabularies share only the digits.

Source sentences are 5-25 words: a random sequence of *chunks*, each translated by one
rule. Example (source above, target below)::

    vumi   kavu pene   lome     sum 3 8 5 end   popo
    gide   hofo wuha   bahahu   = 1 6           duhobi

Rules, from easy to hard:

1. **Lexical (easy).** A fixed lexicon of 150 source words (60 nouns, 40 adjectives,
   30 verbs, 20 function words) maps 1:1 to 150 distinct target words. Nouns, verbs and
   function words translate in place.
2. **Local reordering (medium).** An adjective is always directly followed by its noun
   in the source (``ADJ NOUN``); the target swaps the pair (``NOUN' ADJ'``), as English
   to French does.
3. **Arithmetic (hard).** A span ``sum d1 .. dk end`` (k = 2..5 single digits) becomes
   ``=`` followed by the decimal digits of ``d1 + .. + dk``, one token per digit
   (``sum 3 8 5 end`` -> ``= 1 6``). The ``=`` is easy (it only marks the span); each
   result digit is *hard*: it depends on all digits of the span, not on one source word.

About 15% of the target tokens are hard (:func:`hard_token_mask` finds them). The
vocabulary is 162 source types and 161 target types, so a tiny Transformer learns the
lexical and reordering rules in a few minutes on a CPU; the sum digits take far longer,
which is what adaptive-computation models should spend extra compute on.

Example::

    src, tgt = generate_pairs(1000, seed=0)
    paths = write_task("runs/synthetic", seed=0)   # {'train.src': Path(...), ...}
"""

from __future__ import annotations

import random
from pathlib import Path
from types import MappingProxyType

from dynaseq.core.errors import DynaseqError
from dynaseq.data.text import write_lines

SUM_OPEN = "sum"
SUM_CLOSE = "end"
EQUALS = "="
DIGITS = tuple("0123456789")

#: Number of source words per class; 150 in all.
N_NOUNS, N_ADJECTIVES, N_VERBS, N_FUNCTION_WORDS = 60, 40, 30, 20

#: Digits per ``sum`` span.
MIN_SUM_TERMS, MAX_SUM_TERMS = 2, 5

#: Source sentence length in words (inclusive).
MIN_WORDS, MAX_WORDS = 5, 25

# Chunk probabilities (they sum to 1); a chunk that does not fit the words left is redrawn
# among the ones that do.
_P_SUM, _P_NOUN_PHRASE, _P_VERB = 0.16, 0.48, 0.18

_SRC_CONSONANTS, _TGT_CONSONANTS, _VOWELS = "klmnprstv", "bdfghjwz", "aeiou"

# The lexicon is the same for every seed: it is built once from this fixed seed.
_LEXICON_SEED = 20240611


def _pseudo_words(consonants: str, n: int, rng: random.Random) -> list[str]:
    """``n`` distinct words of 2 (75%) or 3 (25%) consonant-vowel syllables."""
    syllables = [c + v for c in consonants for v in _VOWELS]
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        k = 3 if rng.random() < 0.25 else 2
        word = "".join(rng.choice(syllables) for _ in range(k))
        if word not in seen and not word.startswith(SUM_OPEN):
            seen.add(word)
            words.append(word)
    return words


def _build_lexicon() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...],
                              tuple[str, ...], MappingProxyType[str, str]]:
    rng = random.Random(_LEXICON_SEED)
    n = N_NOUNS + N_ADJECTIVES + N_VERBS + N_FUNCTION_WORDS
    src = _pseudo_words(_SRC_CONSONANTS, n, rng)
    tgt = _pseudo_words(_TGT_CONSONANTS, n, rng)
    a, b, c = N_NOUNS, N_NOUNS + N_ADJECTIVES, N_NOUNS + N_ADJECTIVES + N_VERBS
    lexicon = MappingProxyType(dict(zip(src, tgt, strict=True)))
    return tuple(src[:a]), tuple(src[a:b]), tuple(src[b:c]), tuple(src[c:]), lexicon


#: Source words by class, and the 1:1 source -> target lexicon (read-only).
NOUNS, ADJECTIVES, VERBS, FUNCTION_WORDS, LEXICON = _build_lexicon()
_NOUN_SET, _ADJECTIVE_SET = frozenset(NOUNS), frozenset(ADJECTIVES)

assert len(set(LEXICON.values())) == len(LEXICON) == 150
assert not ({SUM_OPEN, SUM_CLOSE, EQUALS, *DIGITS} & (set(LEXICON) | set(LEXICON.values())))


def _sentence(rng: random.Random) -> list[str]:
    """One source sentence of MIN_WORDS..MAX_WORDS words."""
    n = rng.randint(MIN_WORDS, MAX_WORDS)
    words: list[str] = []
    while len(words) < n:
        left = n - len(words)
        r = rng.random()
        if r < _P_SUM and left >= MIN_SUM_TERMS + 2:
            k = rng.randint(MIN_SUM_TERMS, min(MAX_SUM_TERMS, left - 2))
            words += [SUM_OPEN, *(rng.choice(DIGITS) for _ in range(k)), SUM_CLOSE]
        elif r < _P_SUM + _P_NOUN_PHRASE:
            if left >= 2 and rng.random() < 0.5:
                words.append(rng.choice(ADJECTIVES))
            words.append(rng.choice(NOUNS))
        elif r < _P_SUM + _P_NOUN_PHRASE + _P_VERB:
            words.append(rng.choice(VERBS))
        else:
            words.append(rng.choice(FUNCTION_WORDS))
    assert len(words) == n
    return words


def translate(src_line: str) -> str:
    """The reference translation of a source sentence, by the rules in the module docstring.

    Example::

        >>> translate(f"{ADJECTIVES[0]} {NOUNS[0]} sum 9 9 end") == (
        ...     f"{LEXICON[NOUNS[0]]} {LEXICON[ADJECTIVES[0]]} = 1 8")
        True

    Raises:
        DynaseqError: a word outside the task's vocabulary or an unclosed ``sum`` span.
    """
    words = src_line.split()
    out: list[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        if w == SUM_OPEN:
            j = i + 1
            while j < len(words) and words[j] in DIGITS:
                j += 1
            if j == i + 1 or j == len(words) or words[j] != SUM_CLOSE:
                raise DynaseqError(f"malformed sum span at word {i + 1}: {src_line!r}")
            out += [EQUALS, *str(sum(int(d) for d in words[i + 1:j]))]
            i = j + 1
        elif w in _ADJECTIVE_SET and i + 1 < len(words) and words[i + 1] in _NOUN_SET:
            out += [LEXICON[words[i + 1]], LEXICON[w]]
            i += 2
        elif w in LEXICON:
            out.append(LEXICON[w])
            i += 1
        else:
            raise DynaseqError(f"word {w!r} is not in the synthetic vocabulary")
    return " ".join(out)


def generate_pairs(n: int, seed: int) -> tuple[list[str], list[str]]:
    """``n`` (source, target) sentence pairs, the same for the same ``(n, seed)``.

    Uses only ``random.Random(seed)``; the first ``m`` pairs do not depend on ``n``.
    """
    if n < 0:
        raise DynaseqError(f"number of pairs must be >= 0, got {n}")
    rng = random.Random(seed)
    src = [" ".join(_sentence(rng)) for _ in range(n)]
    return src, [translate(s) for s in src]


def hard_token_mask(src_line: str, tgt_line: str) -> list[bool]:
    """One flag per whitespace token of ``tgt_line``: True for the hard tokens.

    The hard tokens are the result digits of the ``sum`` spans, i.e. the run of digit
    tokens right after each ``=``. The rule reads only the target, so it also works on a
    model's output (where it flags the digits the model wrote as a sum); ``src_line`` is
    part of the signature so that rules that depend on the source can be added.

    Example::

        >>> hard_token_mask("sum 3 8 5 end", "= 1 6")
        [False, True, True]
    """
    del src_line  # the current rules need only the target
    mask: list[bool] = []
    in_result = False
    for tok in tgt_line.split():
        if tok == EQUALS:
            in_result = True
            mask.append(False)
        elif in_result and tok in DIGITS:
            mask.append(True)
        else:
            in_result = False
            mask.append(False)
    return mask


SPLITS = ("train", "valid", "test")


def write_task(
    out_dir: str | Path,
    seed: int = 0,
    n_train: int = 20000,
    n_valid: int = 500,
    n_test: int = 2000,
) -> dict[str, Path]:
    """Write ``{train,valid,test}.{src,tgt}`` under ``out_dir`` and return their paths.

    Split ``k`` (train, valid, test = 0, 1, 2) uses seed ``3 * seed + k``, so the splits
    are distinct draws and no two ``(seed, split)`` pairs share a stream.

    Example::

        >>> write_task("runs/syn", n_train=10, n_valid=2, n_test=2)["test.tgt"]  # doctest: +SKIP
        PosixPath('runs/syn/test.tgt')
    """
    out = Path(out_dir)
    paths: dict[str, Path] = {}
    for k, (split, n) in enumerate(zip(SPLITS, (n_train, n_valid, n_test), strict=True)):
        src, tgt = generate_pairs(n, 3 * seed + k)
        for side, lines in (("src", src), ("tgt", tgt)):
            path = out / f"{split}.{side}"
            write_lines(path, lines)
            paths[f"{split}.{side}"] = path
    return paths
