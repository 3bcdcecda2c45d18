"""The data modules end to end: text files -> tokenizer -> corpus -> batches."""

from __future__ import annotations

from pathlib import Path

from dynaseq.data import (
    Tokenizer,
    collate,
    make_corpus,
    read_parallel,
    token_batches,
    write_task,
)


def _check_pipeline(src: list[str], tgt: list[str], tok: Tokenizer, max_tokens: int) -> None:
    corpus, stats = make_corpus(tok.encode(src), tok.encode(tgt), max_len=64)
    assert stats.kept == len(corpus) and stats.empty + stats.too_long + stats.kept == len(src)
    batches = token_batches(corpus.src_lengths(), corpus.tgt_lengths(), max_tokens,
                            seed=1, epoch=0)
    seen = []
    for idx in batches:
        b = collate(corpus, idx, tok.pad_id, tok.bos_id, tok.eos_id)
        assert b.src.numel() <= max_tokens and b.tgt_out.numel() <= max_tokens
        assert tok.decode(b.tgt_out.tolist()) == tok.decode([corpus.tgt[i] for i in idx])
        assert tok.decode(b.tgt_in.tolist()) == tok.decode(b.tgt_out.tolist())
        seen += b.indices
    assert sorted(seen) == list(range(len(corpus)))


def test_synthetic_pipeline(tmp_path: Path) -> None:
    paths = write_task(tmp_path / "task", n_train=400, n_valid=10, n_test=10)
    src, tgt = read_parallel(paths["train.src"], paths["train.tgt"])
    tok = Tokenizer.train(src + tgt, tmp_path / "spm.model", vocab_size=400)
    # the small vocabulary of the task comes out as (nearly) whole words
    assert tok.vocab_size <= 400
    assert tok.decode(tok.encode(src + tgt)) == src + tgt
    _check_pipeline(src, tgt, tok, max_tokens=256)


def test_multi30k_pipeline(tmp_path: Path, multi30k_dir: Path) -> None:
    src, tgt = read_parallel(multi30k_dir / "val.en.gz", multi30k_dir / "val.de.gz")
    tok = Tokenizer.train(src + tgt, tmp_path / "spm.model", vocab_size=800)
    _check_pipeline(src, tgt, tok, max_tokens=1024)
