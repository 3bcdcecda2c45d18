from __future__ import annotations

from pathlib import Path

import pytest

from dynaseq.core.errors import DynaseqError
from dynaseq.data import synthetic
from dynaseq.data.synthetic import (
    ADJECTIVES,
    LEXICON,
    NOUNS,
    generate_pairs,
    hard_token_mask,
    translate,
    write_task,
)
from dynaseq.data.text import read_lines


@pytest.fixture(scope="module")
def pairs() -> tuple[list[str], list[str]]:
    return generate_pairs(3000, seed=11)


def _sum_results(src_line: str) -> list[list[str]]:
    """Digits of each ``sum .. end`` span's total, recomputed from the source."""
    words, out, i = src_line.split(), [], 0
    while i < len(words):
        if words[i] == "sum":
            j = words.index("end", i)
            out.append(list(str(sum(int(d) for d in words[i + 1:j]))))
            i = j
        i += 1
    return out


def test_deterministic() -> None:
    assert generate_pairs(200, seed=3) == generate_pairs(200, seed=3)
    assert generate_pairs(200, seed=3) != generate_pairs(200, seed=4)
    src, tgt = generate_pairs(200, seed=3)
    assert generate_pairs(50, seed=3) == (src[:50], tgt[:50])
    assert generate_pairs(0, seed=3) == ([], [])
    with pytest.raises(DynaseqError):
        generate_pairs(-1, seed=0)


def test_lexicon_is_fixed() -> None:
    # pins the lexicon (and the module docstring's example): changing it changes the task
    src = "vumi kavu pene lome sum 3 8 5 end popo"
    assert translate(src) == "gide hofo wuha bahahu = 1 6 duhobi"
    assert hard_token_mask(src, translate(src)) == [False] * 5 + [True, True, False]
    assert len(LEXICON) == 150 and len(set(LEXICON.values())) == 150
    assert (len(NOUNS), len(ADJECTIVES)) == (60, 40)


def test_sentence_shape_and_vocabulary(pairs: tuple[list[str], list[str]]) -> None:
    src, tgt = pairs
    lengths = [len(s.split()) for s in src]
    assert min(lengths) == synthetic.MIN_WORDS and max(lengths) == synthetic.MAX_WORDS
    src_types = {w for s in src for w in s.split()}
    tgt_types = {w for t in tgt for w in t.split()}
    assert 140 <= len(src_types) <= 170 and 140 <= len(tgt_types) <= 170
    assert src_types & tgt_types <= set("0123456789")


def test_targets_follow_the_rules(pairs: tuple[list[str], list[str]]) -> None:
    src, tgt = pairs
    adjectives, nouns = set(ADJECTIVES), set(NOUNS)
    for s, t in zip(src, tgt, strict=True):
        assert translate(s) == t
        words = s.split()
        # every adjective is directly followed by a noun
        for i, w in enumerate(words):
            if w in adjectives:
                assert words[i + 1] in nouns
        # the non-sum target words are the lexical translations, adjective-noun swapped
        expected, i = [], 0
        while i < len(words):
            if words[i] == "sum":
                i = words.index("end", i) + 1
            elif words[i] in adjectives:
                expected += [LEXICON[words[i + 1]], LEXICON[words[i]]]
                i += 2
            else:
                expected.append(LEXICON[words[i]])
                i += 1
        assert [w for w in t.split() if w in set(LEXICON.values())] == expected


def test_hard_tokens_are_the_sums(pairs: tuple[list[str], list[str]]) -> None:
    src, tgt = pairs
    for s, t in zip(src, tgt, strict=True):
        words = t.split()
        mask = hard_token_mask(s, t)
        assert len(mask) == len(words)
        # the hard tokens, grouped per "=", are exactly the recomputed sums' digits
        groups: list[list[str]] = []
        for i, (w, hard) in enumerate(zip(words, mask, strict=True)):
            if w == "=":
                assert not hard
                groups.append([])
            elif hard:
                assert words[i - 1] == "=" or mask[i - 1]
                groups[-1].append(w)
        assert groups == _sum_results(s)


def test_hard_fraction(pairs: tuple[list[str], list[str]]) -> None:
    src, tgt = pairs
    masks = [hard_token_mask(s, t) for s, t in zip(src, tgt, strict=True)]
    fraction = sum(map(sum, masks)) / sum(map(len, masks))
    assert 0.10 <= fraction <= 0.20
    assert 0.5 <= sum(any(m) for m in masks) / len(masks) <= 0.95


def test_hard_mask_on_a_hypothesis() -> None:
    # reads only the target: works on model output too
    assert hard_token_mask("", "bodu = 1 2 = 3 bodu 4") == [
        False, False, True, True, False, True, False, False]


def test_translate_rejects_foreign_input() -> None:
    with pytest.raises(DynaseqError, match="not in the synthetic vocabulary"):
        translate("hello world")
    with pytest.raises(DynaseqError, match="malformed sum span"):
        translate("sum 1 2")


def test_write_task(tmp_path: Path) -> None:
    paths = write_task(tmp_path / "task", seed=2, n_train=120, n_valid=30)
    assert set(paths) == {f"{s}.{side}" for s in ("train", "valid", "test")
                          for side in ("src", "tgt")}
    counts = {key: len(read_lines(path)) for key, path in paths.items()}
    assert counts == {"train.src": 120, "train.tgt": 120, "valid.src": 30, "valid.tgt": 30,
                      "test.src": 2000, "test.tgt": 2000}
    assert paths["test.src"] == tmp_path / "task" / "test.src"
    train, valid = read_lines(paths["train.src"]), read_lines(paths["valid.src"])
    assert train[:30] != valid
    # the same seed writes the same files; the tgt files are the translations
    again = write_task(tmp_path / "again", seed=2, n_train=120, n_valid=30)
    for key in paths:
        assert paths[key].read_bytes() == again[key].read_bytes()
    assert read_lines(paths["valid.tgt"]) == [translate(s) for s in valid]
