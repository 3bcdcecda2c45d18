import pytest
import torch

from dynaseq.config import ModelConfig
from dynaseq.metrics import count_macs, flop_counter_macs
from dynaseq.models import build_seq2seq


def test_hand_count_for_a_small_model():
    d, f, v, s, t = 16, 32, 40, 5, 4
    cfg = ModelConfig(d_model=d, ffn_dim=f, n_heads=2, encoder_layers=1, decoder_layers=1)
    rep = count_macs(build_seq2seq(cfg, v), s, t)
    enc = 4 * s * d * d + 2 * s * s * d + 2 * s * d * f
    dec_self = 4 * t * d * d + 2 * t * t * d
    dec_cross = 2 * t * d * d + 2 * s * d * d + 2 * t * s * d
    dec = dec_self + dec_cross + 2 * t * d * f + t * d * v
    assert rep.encoder_total == enc
    assert rep.decoder_total == dec
    assert rep.decoder["output_proj"] == t * d * v
    assert rep.encoder["embedding"] == 0 and rep.decoder["embedding"] == 0
    assert rep.per_token() == {"encoder": enc / s, "decoder": dec / t, "total": enc / s + dec / t}


@pytest.mark.parametrize("size, s, t", [("tiny", 30, 30), ("small", 12, 21)])
def test_analytic_count_matches_flop_counter(size, s, t):
    torch.manual_seed(0)
    cfg = ModelConfig(size=size, encoder_layers=2, decoder_layers=2)
    m = build_seq2seq(cfg, 1000)
    rep = count_macs(m, s, t).per_token()
    measured = flop_counter_macs(m, torch.randint(4, 1000, (1, s)), torch.randint(4, 1000, (1, t)))
    for part in ("encoder", "decoder", "total"):
        assert measured[part] == pytest.approx(rep[part], rel=0.02)
    # the fused CPU attention kernel is counted, not silently dropped
    assert any("attention" in op for op in measured["ops"]["encoder"])
