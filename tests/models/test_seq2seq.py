import torch

from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq


def model(**kw):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, ffn_dim=64, n_heads=4, encoder_layers=2, decoder_layers=2,
                      dropout=0.0, **kw)
    return build_seq2seq(cfg, vocab_size=50).eval()


def test_shapes_and_tied_weights():
    m = model()
    out = m(torch.randint(4, 50, (2, 7)), torch.randint(4, 50, (2, 5)))
    assert out.logits.shape == (2, 5, 50)
    assert m.decoder.output_proj.weight is m.encoder.embed.weight
    untied = model(share_embeddings=False, tie_output=False)
    assert untied.decoder.output_proj.weight is not untied.decoder.embed.weight
    assert untied.encoder.embed is not untied.decoder.embed


def test_incremental_decoding_equals_teacher_forcing():
    m = model()
    src = torch.randint(4, 50, (3, 9))
    src[1, 6:] = 0
    tgt = torch.randint(4, 50, (3, 8))
    full = m(src, tgt).logits
    enc, state = m.encode(src), m.init_state()
    steps = torch.stack([m.decode_step(tgt[:, i: i + 1], enc, state) for i in range(8)], 1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    assert state.step == 8


def test_source_padding_does_not_change_outputs():
    m = model()
    src = torch.randint(4, 50, (1, 6))
    tgt = torch.randint(4, 50, (1, 4))
    padded = torch.cat([src, torch.zeros(1, 5, dtype=torch.long)], 1)
    torch.testing.assert_close(m(src, tgt).logits, m(padded, tgt).logits, atol=1e-5, rtol=1e-5)


def test_future_target_tokens_do_not_leak():
    m = model()
    src = torch.randint(4, 50, (1, 6))
    a = torch.randint(4, 50, (1, 6))
    b = a.clone()
    b[0, 4:] = 7
    torch.testing.assert_close(m(src, a).logits[:, :4], m(src, b).logits[:, :4])
