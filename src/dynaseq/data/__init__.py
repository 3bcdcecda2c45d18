"""Data pipeline: text files -> subword ids -> filtered corpus -> token-budget batches.

Example::

    from dynaseq.data import (Tokenizer, collate, make_corpus, read_parallel,
                              token_batches)

    src, tgt = read_parallel("train.en.gz", "train.de.gz")
    tok = Tokenizer.train(src + tgt, "run/spm.model", vocab_size=8000)
    corpus, stats = make_corpus(tok.encode(src), tok.encode(tgt), max_len=256)
    for idx in token_batches(corpus.src_lengths(), corpus.tgt_lengths(), 4096, seed=1, epoch=0):
        batch = collate(corpus, idx, tok.pad_id, tok.bos_id, tok.eos_id)
"""

from dynaseq.data.batching import Batch, collate, collate_source, token_batches
from dynaseq.data.dataset import FilterStats, ParallelCorpus, make_corpus
from dynaseq.data.synthetic import generate_pairs, hard_token_mask, translate, write_task
from dynaseq.data.text import read_lines, read_parallel, write_lines
from dynaseq.data.tokenizer import Tokenizer

__all__ = [
    "Batch",
    "FilterStats",
    "ParallelCorpus",
    "Tokenizer",
    "collate",
    "collate_source",
    "generate_pairs",
    "hard_token_mask",
    "make_corpus",
    "read_lines",
    "read_parallel",
    "token_batches",
    "translate",
    "write_lines",
    "write_task",
]
