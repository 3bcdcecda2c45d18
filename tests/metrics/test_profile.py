from dynaseq.metrics.profile import count_params, profile_model
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq


def test_profile_fields_and_fixed_length_latency():
    m = build_seq2seq(ModelConfig(d_model=32, ffn_dim=64, n_heads=2, encoder_layers=1,
                                  decoder_layers=1), 100)
    p = profile_model(m, 30, 30, repeats=1)
    assert p["params"] == count_params(m) < sum(x.numel() for x in m.parameters()) + 1
    for key in ("macs_per_token", "macs_per_token_flop_counter"):
        assert set(p[key]) == {"encoder", "decoder", "total"}
    assert p["macs_per_token_flop_counter"] == p["macs_per_token"]
    assert p["latency_ms"]["greedy"] > 0 and p["latency_ms"]["beam4"] > 0


def test_tied_parameters_counted_once():
    m = build_seq2seq(ModelConfig(d_model=32, ffn_dim=64, n_heads=2, encoder_layers=1,
                                  decoder_layers=1), 100)
    untied = build_seq2seq(ModelConfig(d_model=32, ffn_dim=64, n_heads=2, encoder_layers=1,
                                       decoder_layers=1, share_embeddings=False,
                                       tie_output=False), 100)
    assert count_params(untied) - count_params(m) == 2 * 100 * 32
