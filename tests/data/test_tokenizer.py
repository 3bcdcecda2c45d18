from __future__ import annotations

from pathlib import Path

import pytest

from dynaseq.core.errors import DynaseqError
from dynaseq.data.synthetic import generate_pairs
from dynaseq.data.text import read_parallel
from dynaseq.data.tokenizer import Tokenizer

NATURAL = [
    "A man in a blue shirt is standing on a ladder.",
    "Two dogs play in the snow, one of them is brown.",
    "Ein Mann in einem blauen Hemd steht auf einer Leiter.",
    "Zwei Hunde spielen im Schnee, einer ist braun.",
    "Une femme lit un livre près de la fenêtre.",
    "Children are running (quickly!) across 3 fields; 42 birds watch.",
]


def _corpus() -> list[str]:
    src, tgt = generate_pairs(600, seed=5)
    return src + tgt + NATURAL * 20


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("spm") / "run" / "spm.model"
    return Tokenizer.train(_corpus(), path, vocab_size=400)


def test_writes_model_and_vocab(tok: Tokenizer) -> None:
    assert tok.path.is_file()
    vocab = tok.path.with_suffix(".vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab) == tok.vocab_size
    assert vocab[0].split("\t")[0] == "<pad>"


def test_special_ids(tok: Tokenizer) -> None:
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert [tok.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert 4 < tok.vocab_size <= 400
    with pytest.raises(ValueError):
        tok.id_to_piece(tok.vocab_size)


def test_round_trip(tok: Tokenizer) -> None:
    lines = NATURAL + generate_pairs(20, seed=99)[0] + ["A man reads a book near the window."]
    ids = tok.encode(lines)
    assert len(ids) == len(lines)
    assert all(isinstance(i, int) for seq in ids for i in seq)
    assert tok.decode(ids) == lines


def test_encode_adds_no_specials(tok: Tokenizer) -> None:
    ids = tok.encode(NATURAL + [""])
    assert ids[-1] == []
    assert not {tok.pad_id, tok.bos_id, tok.eos_id} & {i for seq in ids for i in seq}
    assert tok.encode([]) == []


def test_decode_ignores_pad_bos_eos(tok: Tokenizer) -> None:
    ids = tok.encode([NATURAL[0]])[0]
    framed = [tok.bos_id, *ids, tok.eos_id, tok.pad_id, tok.pad_id]
    assert tok.decode([framed, [tok.pad_id] * 3]) == [NATURAL[0], ""]


def test_unknown_character_becomes_unk(tok: Tokenizer) -> None:
    ids = tok.encode(["a ☃ b"])[0]
    assert tok.unk_id in ids


def test_encode_pieces(tok: Tokenizer) -> None:
    pieces = tok.encode_pieces(NATURAL[0])
    assert "".join(pieces).replace("▁", " ").strip() == NATURAL[0]
    assert pieces == [tok.id_to_piece(i) for i in tok.encode([NATURAL[0]])[0]]


def test_training_is_deterministic(tmp_path: Path, tok: Tokenizer) -> None:
    again = Tokenizer.train(_corpus(), tmp_path / "again.model", vocab_size=400)
    assert again.path.read_bytes() == tok.path.read_bytes()


def test_load(tok: Tokenizer) -> None:
    loaded = Tokenizer.load(tok.path)
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.encode(NATURAL) == tok.encode(NATURAL)
    assert (loaded.pad_id, loaded.unk_id, loaded.bos_id, loaded.eos_id) == (0, 1, 2, 3)


def test_load_errors(tmp_path: Path) -> None:
    missing = tmp_path / "missing.model"
    with pytest.raises(DynaseqError) as err:
        Tokenizer.load(missing)
    assert str(err.value) == f"cannot read {missing}: no such file"
    for name, data in (("garbage.model", b"\x00\x01 not a model"), ("empty.model", b"")):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(DynaseqError) as err:
            Tokenizer.load(path)
        assert str(err.value).startswith(f"{path}: not a valid SentencePiece model")


def test_train_errors(tmp_path: Path) -> None:
    with pytest.raises(DynaseqError, match="no non-empty lines"):
        Tokenizer.train([], tmp_path / "a.model", vocab_size=100)
    with pytest.raises(DynaseqError, match="no non-empty lines"):
        Tokenizer.train(["", "  "], tmp_path / "a.model", vocab_size=100)
    with pytest.raises(DynaseqError, match="unknown SentencePiece model type"):
        Tokenizer.train(NATURAL, tmp_path / "b.model", vocab_size=100, model_type="wordpiece")
    with pytest.raises(DynaseqError, match="cannot train SentencePiece model: .*vocab"):
        Tokenizer.train(NATURAL, tmp_path / "c.model", vocab_size=10)
    assert not list(tmp_path.iterdir())


def test_bpe_and_small_corpus(tmp_path: Path) -> None:
    # hard_vocab_limit=False: a vocabulary larger than the corpus supports is not an error
    bpe = Tokenizer.train(NATURAL, tmp_path / "bpe.model", vocab_size=5000, model_type="bpe")
    assert bpe.decode(bpe.encode(NATURAL)) == NATURAL
    uni = Tokenizer.train(NATURAL, tmp_path / "uni.model", vocab_size=5000,
                          seed_sentencepiece_size=1000)
    assert uni.decode(uni.encode(NATURAL)) == NATURAL


def test_multi30k_val(tmp_path: Path, multi30k_dir: Path) -> None:
    en, de = read_parallel(multi30k_dir / "val.en.gz", multi30k_dir / "val.de.gz")
    assert len(en) == len(de) == 1014
    tok = Tokenizer.train(en + de, tmp_path / "spm.model", vocab_size=1000)
    assert tok.vocab_size == 1000
    decoded = tok.decode(tok.encode(en + de))
    # NFKC normalisation may change a rare character (one line has a no-break space)
    same = sum(a == b for a, b in zip(decoded, en + de, strict=True))
    assert same >= 0.99 * len(en + de)


def test_few_lines_encode_one_by_one_as_many_encode_in_a_batch(tok: Tokenizer) -> None:
    """Below ``BATCH_LINES`` lines are encoded one call each, from it on in one batched
    call: the same ids either way, as lists of ints."""
    lines = [f"the cat {i} sat on the mat {'again ' * (i % 4)}".strip() for i in range(70)]
    assert len(lines) >= Tokenizer.BATCH_LINES
    batched = tok.encode(lines)
    one_by_one = [tok.encode([line])[0] for line in lines]
    assert batched == one_by_one
    assert all(type(ids) is list and all(type(i) is int for i in ids) for ids in one_by_one)
    assert tok.encode(lines[:3]) == batched[:3]
