"""CCT gate analysis (paper section 7, fig. 9-13): statistics, steered gates, the command."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dynaseq.analysis import (
    activation_rates,
    collect_gate_stats,
    compute_by_rank,
    compute_by_subword,
    compute_histogram,
    usage_by_step,
)
from dynaseq.analysis.gates import rank_buckets
from dynaseq.analysis.plots import PLOTTERS, plot_all
from dynaseq.cli import main
from dynaseq.models.seq2seq import Seq2SeqOutput
from dynaseq.nn import AuxOutputs
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.techniques.cct.config import CCTConfig
from dynaseq.techniques.cct.layers import ControlNet, GateTrace, force_gates
from dynaseq.train.loop import train

from helpers import micro_config

BUDGETS = [(1.0, 1.0), (0.5, 0.5), (1.0, 0.33)]


# -- statistics from hand-written traces ----------------------------------------------------------


class TracedStub(nn.Module):
    """Stands in for a model: returns fixed gate traces for a 3-token source, 2-token target."""

    def forward(self, src, tgt_in, control):
        aux = AuxOutputs()

        def add(layer, gate, values, cost, stream="input"):
            aux.add_trace("cct.gates", GateTrace(layer, gate, torch.tensor([values]).float(),
                                                 torch.as_tensor(cost).float(), stream))

        add("encoder.layers.0.self_attn", "q", [[1], [0], [1]], [[[10.0], [10.0], [10.0]]])
        add("encoder.layers.0.self_attn", "kv", [[1], [1], [0]], 5.0)
        add("encoder.layers.0.self_attn", "control", [[1], [1], [1]], 100.0)  # not gated work
        add("encoder.layers.0.ffn", "ffn", [[1, 0], [0, 0], [1, 1]], [3.0, 7.0])
        add("decoder.layers.0.cross_attn", "q", [[0], [1]], [[[4.0], [6.0]]])
        add("decoder.layers.0.cross_attn", "kv", [[1], [0], [0]], 9.0, "memory")
        add("decoder.layers.0.ffn", "ffn", [[1, 1], [0, 1]], [2.0, 2.0])
        return Seq2SeqOutput(torch.zeros(1, 2, 5), aux)


def test_hand_traces_give_hand_counted_statistics():
    pair = (torch.tensor([[5, 6, 3]]), torch.tensor([[2, 7]]), torch.tensor([[7, 3]]))
    stats = collect_gate_stats(TracedStub(), [pair, pair], control=0)
    assert stats.n_sentences == 2
    # encoder: sum g·cost / sum cost over SA q, SA kv, FF pieces (control left out)
    assert stats.src_fraction.tolist() == [18 / 25, 5 / 25, 20 / 25] * 2
    # decoder: CA q + FF pieces; the cross-attention kv gates act on source tokens
    assert stats.tgt_fraction.tolist() == [4 / 8, 8 / 10] * 2
    assert stats.tgt_step.tolist() == [0, 1, 0, 1] and stats.tgt_ids.tolist() == [7, 3, 7, 3]
    assert stats.total_fraction("encoder") == pytest.approx(43 / 75)
    rates = activation_rates(stats)
    assert rates == {
        "encoder.layers.0.self_attn": {"q": 2 / 3, "kv": 2 / 3},
        "encoder.layers.0.ffn": {"ffn": 0.5, "ffn_pieces": [2 / 3, 1 / 3]},
        "decoder.layers.0.cross_attn": {"q": 0.5, "kv": 1 / 3},
        "decoder.layers.0.ffn": {"ffn": 0.75, "ffn_pieces": [0.5, 1.0]},
    }
    usage = usage_by_step(stats, "cross_attn")
    assert usage.n_tokens.tolist() == [2, 2] and usage.mean.tolist() == [0.0, 1.0]
    assert list(usage.layers) == ["decoder.layers.0.cross_attn"]
    assert compute_histogram(stats.src_fraction, bins=10) == pytest.approx(
        [0, 0, 1 / 3, 0, 0, 0, 0, 1 / 3, 1 / 3, 0])


def test_subword_frequency_ranks_and_buckets():
    sub = compute_by_subword(torch.tensor([7, 5, 7, 9, 5, 7, 4, 2]),
                             torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 1.0, 0.0]))
    assert sub.ids.tolist() == [7, 5, 2, 4, 9]  # by count, ties by id
    assert sub.counts.tolist() == [3, 2, 1, 1, 1]
    assert sub.mean_fraction.tolist() == pytest.approx([1 / 3, 0.35, 0.0, 1.0, 0.4])
    assert rank_buckets(5) == [(1, 1), (2, 3), (4, 5)]
    buckets = compute_by_rank(sub)
    assert [b["ranks"] for b in buckets] == [[1, 1], [2, 3], [4, 5]]
    assert [b["n_tokens"] for b in buckets] == [3, 3, 2]
    assert [b["mean_fraction"] for b in buckets] == pytest.approx([1 / 3, 0.175, 0.7])
    assert compute_histogram(torch.tensor([0.0, 1.0, 0.5]), bins=2) == [1 / 3, 2 / 3]


# -- a real CCT model ----------------------------------------------------------------------------

D, FFN, M, FEATURE = 32, 64, 2, 0
ON = {5, 6}


def _cct_model():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=D, ffn_dim=FFN, n_heads=2, encoder_layers=2, decoder_layers=2,
                      dropout=0.0, cct=CCTConfig(ffn_pieces=M, control_hidden=8,
                                                 budgets=BUDGETS))
    return build_seq2seq(cfg, 20).eval()


PAIRS = [([5, 7, 6], [5, 8]), ([7, 8], [6, 6, 9])]


def _pairs(model):
    eos, bos = model.eos_id, model.bos_id
    return [(torch.tensor([s + [eos]]), torch.tensor([[bos] + t]), torch.tensor([t + [eos]]))
            for s, t in PAIRS]


def test_forced_gates_use_all_or_nothing():
    model = _cct_model()
    with force_gates(model, 1.0):
        on = collect_gate_stats(model, _pairs(model), control=2)
    assert bool((on.src_fraction == 1).all()) and bool((on.tgt_fraction == 1).all())
    assert on.total_fraction("encoder") == on.total_fraction("decoder") == 1.0
    rates = activation_rates(on)
    assert len(rates) == 2 * 2 + 2 * 3
    assert all(r == 1.0 for gates in rates.values() for g, r in gates.items()
               if g != "ffn_pieces")
    assert all(p == [1.0] * M for gates in rates.values() for g, p in gates.items()
               if g == "ffn_pieces")
    for kind in ("self_attn", "cross_attn"):
        assert usage_by_step(on, kind).mean.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert compute_histogram(on.src_fraction)[-1] == 1.0
    with force_gates(model, 0.0):
        off = collect_gate_stats(model, _pairs(model), control=2)
    assert bool((off.src_fraction == 0).all()) and bool((off.tgt_fraction == 0).all())


def _steer_to_feature(control: ControlNet, signs: list[float], scale: float = 100.0) -> None:
    """Gate i opens iff ``signs[i] · x[FEATURE] > 0``."""
    with torch.no_grad():
        control.w1.weight.zero_()
        control.w1.bias.zero_()
        control.w2.weight.zero_()
        control.w1.weight[0, FEATURE] = 1.0  # h0 = ReLU(x_f), h1 = ReLU(-x_f)
        control.w1.weight[1, FEATURE] = -1.0
        for i, sign in enumerate(signs):
            control.w2.weight[i, 0] = sign * scale
            control.w2.weight[i, 1] = -sign * scale


def _steered_model():
    """Every gate follows the token: q, kv and FF piece 0 open on the ON ids, piece 1 on the
    others. The embedding makes feature FEATURE +/-50 (times sqrt(d)), which dominates the
    residual stream in every layer, so the pre-LN sign of that feature is the token's."""
    model = _cct_model()
    with torch.no_grad():
        w = model.encoder.embed.weight
        w[:, FEATURE] = -50.0
        w[sorted(ON), FEATURE] = 50.0
    for m in model.modules():
        if isinstance(m, ControlNet):
            _steer_to_feature(m, [1.0] if m.n_gates == 1 else [1.0, -1.0])
    return model


def test_steered_gates_give_hand_counted_rates_and_fractions():
    model = _steered_model()
    assert model.decoder.embed is model.encoder.embed
    stats = collect_gate_stats(model, _pairs(model), control=1)
    # sources [5 7 6 eos], [7 8 eos]: 2 of 7 tokens ON; decoder inputs [bos 5 8],
    # [bos 6 6 9]: 3 of 7 ON; cross-attention keys are the sources
    src_on, tgt_on = 2 / 7, 3 / 7
    rates = activation_rates(stats)
    for i in range(2):
        assert rates[f"encoder.layers.{i}.self_attn"] == {"q": src_on, "kv": src_on}
        assert rates[f"encoder.layers.{i}.ffn"] == {"ffn": 0.5, "ffn_pieces": [src_on,
                                                                               1 - src_on]}
        assert rates[f"decoder.layers.{i}.self_attn"] == {"q": tgt_on, "kv": tgt_on}
        assert rates[f"decoder.layers.{i}.cross_attn"] == {"q": tgt_on, "kv": src_on}
        assert rates[f"decoder.layers.{i}.ffn"] == {"ffn": 0.5, "ffn_pieces": [tgt_on,
                                                                               1 - tgt_on]}
    # by step: inputs bos | 5, 6 | 8, 6 | 9
    for kind in ("self_attn", "cross_attn"):
        usage = usage_by_step(stats, kind)
        assert usage.n_tokens.tolist() == [2, 2, 2, 1]
        assert usage.mean.tolist() == [0.0, 1.0, 0.5, 0.0]

    # per-token fractions from the layers' MAC costs: query side 2d² + 2d·keys, key/value
    # projections 2d², a FF piece 2·d·FFN/M; an ON token runs all but piece 1, others piece 1
    piece, kv = 2 * D * FFN // M, 2 * D * D

    def query(keys):
        return 2 * D * D + 2 * D * keys

    def expected(full, on):
        return [(full - piece) / full if o else piece / full for o in on]

    want_src, want_tgt = [], []
    for s, t in PAIRS:
        n_src = len(s) + 1
        want_src += expected(query(n_src) + kv + 2 * piece, [x in ON for x in s] + [False])
        tgt_in = [model.bos_id] + t
        for step, tok in enumerate(tgt_in):
            full = query(step + 1) + kv + query(n_src) + 2 * piece
            want_tgt += expected(full, [tok in ON])
    torch.testing.assert_close(stats.src_fraction, torch.tensor(want_src, dtype=torch.float64))
    torch.testing.assert_close(stats.tgt_fraction, torch.tensor(want_tgt, dtype=torch.float64))
    assert stats.tgt_ids.tolist() == [5, 8, 3, 6, 6, 9, 3]


# -- the command ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_paths):
    """A CCT micro run with three budgets and a dense one (a couple of updates each)."""
    root = tmp_path_factory.mktemp("analyze")
    cct = micro_config(root / "cct", synthetic_paths, max_steps=2, log_every=1, valid_every=2,
                       save_every=2, valid_bleu_lines=2)
    cct.model.cct = CCTConfig(ffn_pieces=2, control_hidden=8, noise_ramp_steps=4,
                              budgets=BUDGETS)
    train(cct, progress=False)
    dense = micro_config(root / "dense", synthetic_paths, max_steps=1, log_every=1,
                         valid_every=1, save_every=1, valid_bleu_lines=1)
    train(dense, progress=False)
    return root / "cct", root / "dense"


def _clean_error(capsys, rc: int, *fragments: str) -> None:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("dynaseq: error:"), err
    for f in fragments:
        assert f in lines[0], lines[0]


def test_analyze_hypotheses_at_every_trained_budget(runs, synthetic_paths, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["analyze", str(runs[0]), "--src", str(synthetic_paths["test.src"]), "--out",
               str(out), "--max-lines", "6"])
    assert rc == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == sorted(["analysis.json", *PLOTTERS])
    for name in PLOTTERS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = json.loads((out / "analysis.json").read_text())
    assert res["target"] == "hypothesis" and res["beam"] == 1 and res["n_sentences"] == 6
    assert [tuple(r["budget"]) for r in res["budgets"]] == BUDGETS
    for rec in res["budgets"]:
        for part in ("encoder", "decoder"):
            side = rec[part]
            assert sum(side["histogram"]) == pytest.approx(1.0, abs=1e-5)  # rounded shares
            assert sum(b["n_tokens"] for b in side["by_rank"]) == side["n_tokens"]
            assert sum(side["by_subword"]["counts"]) == side["n_tokens"]
            assert 0.0 <= rec["gated_fraction"][part] <= 1.0
        assert sum(rec["by_step"]["n_tokens"]) == rec["decoder"]["n_tokens"]
        assert set(rec["layers"]) == {"encoder.layers.0.self_attn", "encoder.layers.0.ffn",
                                      "decoder.layers.0.self_attn",
                                      "decoder.layers.0.cross_attn", "decoder.layers.0.ffn"}
        assert set(rec["layers"]["decoder.layers.0.cross_attn"]) == {"q", "kv"}
    # the plots redraw from the JSON alone, panels wrapping for many budgets
    (tmp_path / "again").mkdir()
    paths = plot_all({**res, "budgets": res["budgets"] * 2}, tmp_path / "again")
    assert [p.name for p in paths] == list(PLOTTERS) and all(p.stat().st_size for p in paths)


def test_analyze_references_at_chosen_budgets(runs, synthetic_paths, tmp_path, capsys):
    rc = main(["analyze", str(runs[0]), "--src", str(synthetic_paths["valid.src"]), "--ref",
               str(synthetic_paths["valid.tgt"]), "--out", str(tmp_path), "--budget", "0.5",
               "--budget", "1,0.33", "--budget", "0.5,0.5", "--max-lines", "5"])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((tmp_path / "analysis.json").read_text())
    assert res["target"] == "reference" and res["ref"] == str(synthetic_paths["valid.tgt"])
    assert [r["budget"] for r in res["budgets"]] == [[0.5, 0.5], [1.0, 0.33]]
    # the references themselves, teacher forced: one decoder position per token plus eos
    from dynaseq.data import Tokenizer, read_lines

    tok = Tokenizer.load(runs[0] / "spm.model")
    refs = tok.encode(read_lines(synthetic_paths["valid.tgt"])[:5])
    assert res["budgets"][0]["decoder"]["n_tokens"] == sum(len(r) + 1 for r in refs)


def test_analyze_refuses_dense_runs_bad_paths_and_budgets(runs, synthetic_paths, tmp_path,
                                                          capsys):
    src = str(synthetic_paths["valid.src"])
    rc = main(["analyze", str(runs[1]), "--src", src, "--out", str(tmp_path / "a")])
    _clean_error(capsys, rc, "CCT model", "dense")
    assert not (tmp_path / "a").exists()
    rc = main(["analyze", str(tmp_path / "nope"), "--src", src, "--out", str(tmp_path / "b")])
    _clean_error(capsys, rc, "nope")
    rc = main(["analyze", str(runs[0]), "--src", str(tmp_path / "missing.src"), "--out",
               str(tmp_path / "c")])
    _clean_error(capsys, rc, "missing.src")
    rc = main(["analyze", str(runs[0]), "--src", src, "--out", str(tmp_path / "d"),
               "--budget", "0.2"])
    _clean_error(capsys, rc, "was not trained")
    rc = main(["analyze", str(runs[0]), "--src", src, "--ref", str(synthetic_paths["test.tgt"]),
               "--out", str(tmp_path / "e"), "--max-lines", "0"])
    _clean_error(capsys, rc, "--max-lines")
    (tmp_path / "short.tgt").write_text("a\nb\n")
    rc = main(["analyze", str(runs[0]), "--src", src, "--ref", str(tmp_path / "short.tgt"),
               "--out", str(tmp_path / "f"), "--max-lines", "2"])
    _clean_error(capsys, rc, "reference has 2")
