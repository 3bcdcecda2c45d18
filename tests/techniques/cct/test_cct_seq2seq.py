"""CCT sub-layers dropped into the dense encoder-decoder's layers, unchanged."""

import torch

from dynaseq.metrics import count_macs
from dynaseq.models import Decoder, Encoder, Seq2SeqTransformer, TokenEmbedding
from dynaseq.nn import AuxOutputs, DecoderLayer, EncoderLayer, SinusoidalPositions
from dynaseq.techniques.cct.layers import (
    GatedKVCache,
    budget_loss,
    budget_terms,
    conditional_attention,
    conditional_feedforward,
    force_gates,
    gate_traces,
    name_conditional_sublayers,
    realized_macs_by_layer,
)

D, V = 32, 50


def _model():
    def attn():
        return conditional_attention(D, 4, control_hidden=16)

    def ffn():
        return conditional_feedforward(D, 64, 4, control_hidden=16)

    embed = TokenEmbedding(V, D, 0)
    enc = Encoder(embed, SinusoidalPositions(D), [EncoderLayer(D, attn(), ffn())], D)
    dec = Decoder(embed, SinusoidalPositions(D), [DecoderLayer(D, attn(), attn(), ffn())
                                                 for _ in range(2)], D,
                  torch.nn.Linear(D, V, bias=False))
    model = Seq2SeqTransformer(enc, dec, 0, 2, 3)
    name_conditional_sublayers(model)
    return model


def test_cct_seq2seq_trains_decodes_and_counts():
    torch.manual_seed(0)
    model = _model().train()
    src = torch.tensor([[5, 6, 7, 3], [8, 9, 3, 0]])
    tgt = torch.tensor([[2, 10, 11], [2, 12, 0]])
    out = model(src, tgt)
    valid = {"encoder": src.ne(0), "decoder": tgt.ne(0), "decoder.memory": src.ne(0)}
    terms = budget_terms(gate_traces(out.aux), valid)
    assert {t.subnetwork for t in terms} == {0, 1}
    loss = budget_loss(terms, torch.tensor([0, 1]), torch.tensor([[0.5, 0.5], [1.0, 0.3]]))
    (out.logits.logsumexp(-1).mean() + loss.loss).backward()

    model.eval()
    with torch.no_grad():
        full = model(src, tgt).logits
        enc = model.encode(src)
        n = len(model.decoder.layers)
        state = model.init_state()
        assert all(isinstance(c, GatedKVCache) for c in state.self_caches + state.cross_caches)
        aux = AuxOutputs()
        steps = [model.decoder(tgt[:, i: i + 1], enc, state, aux=aux)[:, -1] for i in range(3)]
    torch.testing.assert_close(torch.stack(steps, 1), full)
    realized = realized_macs_by_layer(aux)
    assert set(realized) == {f"decoder.layers.{i}.{s}" for i in range(n)
                             for s in ("self_attn", "cross_attn", "ffn")}

    report = count_macs(model, 4, 3)  # the dense maximum, control nets listed separately
    assert report.encoder["ffn.control_ffn"] == 4 * (D * 16 + 16 * 4)
    with force_gates(model, 1.0), torch.no_grad():
        torch.testing.assert_close(model(src, tgt).logits, model.train()(src, tgt).logits)


def test_cct_model_decodes_with_the_generic_search():
    from dynaseq.models.search import beam_search, greedy_search

    torch.manual_seed(0)
    model = _model().eval()
    src = torch.tensor([[5, 6, 7, 3], [8, 9, 3, 0]])
    with force_gates(model, 1.0):
        assert beam_search(model, src, beam=1, max_len_b=5) == greedy_search(model, src,
                                                                               max_len_b=5)
    # hard gates, some off: finished rows are dropped from gated caches too
    assert beam_search(model, src, beam=1, max_len_b=5) == greedy_search(model, src, max_len_b=5)
    assert len(beam_search(model, src, beam=3, max_len_b=5)) == 2


def test_cct_batched_beam_search_equals_one_sentence_at_a_time():
    """Gated self- and cross-attention caches survive beam reordering and dropped rows."""
    from dynaseq.models.search import beam_search

    torch.manual_seed(3)
    model = _model().eval()
    src = torch.tensor([[5, 6, 7, 8, 3], [8, 9, 3, 0, 0], [11, 12, 13, 3, 0]])
    aux = AuxOutputs()
    with torch.no_grad():
        model.encode(src, aux=aux)
    gates = torch.cat([t.values.flatten() for t in gate_traces(aux) if t.gate != "control"])
    assert 0 < gates.mean() < 1  # a mixed gate pattern
    batched = beam_search(model, src, beam=3, max_len_a=1.0, max_len_b=4)
    for i in range(3):
        row = src[i: i + 1, : int(src[i].ne(0).sum())]
        assert beam_search(model, row, beam=3, max_len_a=1.0, max_len_b=4)[0] == batched[i]
