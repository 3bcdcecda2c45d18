"""Word-level LM corpus: frequency-sorted vocabulary, <eos> per line, stream batches."""

from __future__ import annotations

import pytest
import torch

from dynaseq.core.errors import DynaseqError
from dynaseq.data.lm_corpus import EOS, UNK, StreamBatches, Vocab, read_lm_lines


def test_vocab_is_frequency_sorted_with_eos_and_unk(tmp_path):
    lines = ["b a b", "", "c b a"]
    v = Vocab.build(lines)
    assert v.itos[:4] == ["b", EOS, "a", "c"]  # b:3, <eos>:3 (b seen first), a:2, c:1
    assert UNK in v.itos and v.counts[v.unk_id] == 0
    ids = v.encode_lines(["a z", ""])
    assert ids.tolist() == [v.stoi["a"], v.unk_id, v.eos_id, v.eos_id]
    v.save(tmp_path / "vocab.txt")
    again = Vocab.load(tmp_path / "vocab.txt")
    assert again.itos == v.itos and again.counts == v.counts


def test_stream_batches_continue_each_stream():
    ids = torch.arange(103)
    sb = StreamBatches(ids, batch_size=4, window=7)
    n = 102 // 4
    assert sb.stream_len == n and len(sb) == -(-n // 7) and sb.n_tokens == 4 * n
    xs, ys = zip(*sb, strict=True)
    x, y = torch.cat(xs, 1), torch.cat(ys, 1)
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    assert torch.equal(x[:, 0], torch.arange(4) * n)  # row b starts at b*n
    assert torch.equal(x[1], torch.arange(n, 2 * n))  # consecutive windows continue a row
    with pytest.raises(IndexError):
        sb[len(sb)]


@pytest.mark.parametrize("text, message", [("", "is empty"), ("one line only\n", "only 1"),
                                           ("\n  \n", "is empty")])
def test_empty_or_one_line_corpus_is_refused(tmp_path, text, message):
    (tmp_path / "c.txt").write_text(text)
    with pytest.raises(DynaseqError, match=message):
        read_lm_lines(tmp_path / "c.txt")


def test_too_few_tokens_for_the_streams():
    with pytest.raises(DynaseqError, match="cannot fill"):
        StreamBatches(torch.arange(3), batch_size=8, window=4)
