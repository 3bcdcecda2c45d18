"""int8 quantization (dynaseq.compress.int8) and the ``dynaseq quantize`` command."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dynaseq.cli import main
from dynaseq.compress import int8
from dynaseq.compress.int8 import (
    Int8TokenEmbedding,
    is_int8,
    load_int8,
    quantize_int8,
    save_int8,
)
from dynaseq.core.errors import DynaseqError
from dynaseq.data import read_lines
from dynaseq.models.search import beam_search, greedy_search
from dynaseq.nn.int8 import Int8Linear, quantize_rows
from dynaseq.tasks.translation.config import ModelConfig
from dynaseq.tasks.translation.model import build_seq2seq
from dynaseq.tasks.translation.predictor import Translator
from dynaseq.techniques.branching import BranchedLinear
from dynaseq.techniques.branching.branched_linear import Int8BranchedLinear
from dynaseq.techniques.branching.config import DMBConfig, MoEConfig
from dynaseq.techniques.branching.routing import BranchGroups, Router
from dynaseq.workflows.quantize import quantize_run

VOCAB = 60


def micro_model(**kw) -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, ffn_dim=64, n_heads=2, encoder_layers=2, decoder_layers=2,
                      **kw)
    return build_seq2seq(cfg, VOCAB).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(4, VOCAB, (3, 9), generator=g), torch.randint(4, VOCAB, (3, 6), generator=g)


KINDS = {"dense": {}, "dmb": {"dmb": DMBConfig(n_branches=3)},
         "moe": {"moe": MoEConfig(n_experts=3, k=2)}}


def test_dense_layers_become_int8_and_input_is_untouched():
    model = micro_model()
    q = quantize_int8(model)
    assert is_int8(q) and not is_int8(model)
    assert not any(type(m) is nn.Linear for m in q.modules())
    qlin = [m for m in q.modules() if isinstance(m, Int8Linear)]
    assert len(qlin) == 2 * 6 + 2 * 10 + 1  # enc: 4 proj + 2 ffn; dec: 8 proj + 2 ffn; output
    assert all(m.weight_int8.dtype == torch.int8 and m.weight_scale.dtype == torch.float32
               for m in qlin)
    # symmetric per output channel: each row's largest |value| is 127 (row 0, the padding
    # embedding, is all zeros)
    out = q.decoder.output_proj
    assert out.weight_scale.shape == (VOCAB,)
    assert out.weight_int8.abs().amax(1)[1:].eq(127).all() and not out.weight_int8[0].any()
    assert isinstance(q.encoder.embed, Int8TokenEmbedding)
    assert q.encoder.embed is q.decoder.embed  # shared embeddings stay shared
    assert type(model.decoder.output_proj) is nn.Linear  # the input model is not modified


def test_dense_logits_close_to_fp32():
    model = micro_model()
    q = quantize_int8(model)
    src, tgt = batch()
    a, b = model(src, tgt).logits, q(src, tgt).logits
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert a.argmax(-1).eq(b.argmax(-1)).float().mean() > 0.9


def test_tied_output_layer_is_the_int8_embedding():
    q = quantize_int8(micro_model())
    out = q.decoder.output_proj
    assert q.decoder.embed.is_tied_to(out)  # the same tensors, not a copy
    assert out.weight_int8.data_ptr() == q.decoder.embed.weight_int8.data_ptr()
    tokens = torch.tensor([[5, 7]])
    expected = out.dequantized_weight()[tokens] * q.decoder.embed.scale
    assert torch.allclose(q.decoder.embed(tokens), expected)


def test_int8_linear_kernel_matches_a_float_reference_and_is_batch_independent():
    torch.manual_seed(0)
    lin = nn.Linear(48, 40)
    q = Int8Linear.from_float(lin)
    # rounding error at most half a step of each row's scale
    err = (q.dequantized_weight() - lin.weight).abs().amax(1)
    assert (err <= q.weight_scale / 2 + 1e-7).all()
    x = torch.randn(2, 7, 48)
    with torch.no_grad():
        ref, out = lin(x), q(x)
        # the int8 matmul equals float math on the same quantized values (exact int32 sums)
        flat = x.reshape(-1, 48)
        xq, xs = quantize_rows(flat)
        exact = (xq.float() @ q.weight_int8.float().t()) * xs[:, None] * q.weight_scale + lin.bias
    assert out.shape == (2, 7, 40)
    # per-token activations: error ~ 1/127 of each factor
    assert (out - ref).abs().max() < 0.02 * ref.abs().max()
    assert torch.allclose(out.reshape(-1, 40), exact, rtol=1e-5, atol=1e-5)
    # a row's output does not depend on the other rows of its batch
    assert torch.equal(q(x[:1, 3:4]), out[:1, 3:4])
    zero = q(torch.zeros(1, 48))  # an all-zero row: just the bias
    assert torch.equal(zero[0], lin.bias.detach())
    with pytest.raises(ValueError, match="width"):
        q(torch.randn(3, 47))
    with pytest.raises(TypeError):
        Int8Linear.from_float(nn.Conv1d(2, 2, 1))


@pytest.mark.parametrize("shape", [(48, 40), (512, 2048), (2048, 512), (256, 8000)])
def test_int8_linear_paths_agree_bit_for_bit(shape, monkeypatch):
    """torch._int_mm and oneDNN (prepacked weight) give the same numbers, for any row count."""
    import dynaseq.nn.int8 as nn_int8

    if nn_int8.pack_int8(torch.zeros(2, 4, dtype=torch.int8), torch.ones(2)).onednn is None:
        pytest.skip("oneDNN int8 absent or not exact on this CPU (nn.int8._probe_onednn)")
    torch.manual_seed(0)
    n_in, n_out = shape
    q = Int8Linear.from_float(nn.Linear(n_in, n_out))
    x = torch.randn(37, n_in) * torch.rand(37, 1) * 10
    x[0] = 0
    with torch.no_grad():
        outs = []
        for path in ("int_mm", "onednn"):
            monkeypatch.setattr(nn_int8, "_choose_path", lambda *a, p=path: p)
            outs.append(q(x))
        monkeypatch.undo()
        auto, rows = q(x), torch.cat([q(x[i:i + 1]) for i in range(37)])
        # the public function without a packed weight (torch._int_mm only)
        plain = nn_int8.int8_linear(x, q.weight_int8, q.weight_scale, q.bias)
    for out in (outs[1], auto, rows, plain):
        assert torch.equal(out, outs[0])


def test_int8_linear_packed_weight_follows_its_buffers():
    import copy
    import pickle

    torch.manual_seed(0)
    q = Int8Linear.from_float(nn.Linear(64, 4096))  # large enough for the oneDNN path
    x = torch.randn(8, 64)
    with torch.no_grad():
        before = q(x)
        assert torch.equal(copy.deepcopy(q)(x), before)  # the packed copy is not copied...
        assert torch.equal(pickle.loads(pickle.dumps(q))(x), before)  # ...nor pickled
        assert "_packed" not in q.state_dict() and len(q.state_dict()) == 3
        q.weight_int8.neg_()  # changed in place (as load_int8 does): repacked
        assert torch.allclose(q(x), 2 * q.bias - before, atol=1e-5)


def test_branched_linear_int8_runs_each_row_on_its_own_branch_only():
    torch.manual_seed(0)
    lin = BranchedLinear(8, 16, n_branches=3, shared=True)
    with torch.no_grad():
        lin.shared_weight.normal_()
    q = Int8BranchedLinear.from_float(lin)
    assert all(type(b) is Int8Linear and b.weight_int8.dtype == torch.int8 for b in q.branches)
    x = torch.randn(4, 5, 8)
    branch = torch.randint(0, 3, (4, 5))
    branch[0, 0] = 0
    branch[branch.eq(2)] = 1  # branch 2 gets no row: an empty group
    out = q(x, branch)
    flat_x, flat_b, flat_out = x.reshape(-1, 8), branch.reshape(-1), out.reshape(-1, 16)
    for k in range(3):
        rows = flat_b.eq(k)
        if rows.any():  # the same rows through branch k's own quantized Linear, exactly
            assert torch.equal(flat_out[rows], q.branches[k](flat_x[rows]))
    # grouped() on pre-sorted rows gives the same as forward()
    groups = BranchGroups.of(flat_b, 3)
    assert torch.equal(groups.scatter(q.grouped(groups.gather(flat_x), groups)), flat_out)
    # close to the float layer (θ_S + θ_Pk)
    ref = lin(x, branch)
    assert (ref - out).abs().max() < 0.03 * ref.abs().max()
    assert q.macs(10) == lin.macs(10)


@pytest.mark.parametrize("kind", ["dmb", "moe"])
def test_dmb_and_moe_quantize_and_translate(kind):
    model = micro_model(**KINDS[kind])
    q = quantize_int8(model)
    branched = [m for m in q.modules() if isinstance(m, Int8BranchedLinear)]
    assert branched and not any(isinstance(m, BranchedLinear) for m in q.modules())
    assert all(type(m.proj) is nn.Linear for m in q.modules() if isinstance(m, Router))
    src, tgt = batch()
    a, b = model(src, tgt).logits, q(src, tgt).logits
    # an untrained router has near-ties: int8 rounding may send a few tokens elsewhere
    assert a.argmax(-1).eq(b.argmax(-1)).float().mean() > 0.85
    assert (a - b).abs().mean() < 0.3 * a.abs().mean()
    for hyps in (greedy_search(q, src, max_len_b=5), beam_search(q, src, 2, max_len_b=5)):
        assert len(hyps) == 3 and all(isinstance(t, int) for h in hyps for t in h)


def test_cct_model_quantizes_with_float_control_nets():
    from dynaseq.techniques.cct.config import CCTConfig
    from dynaseq.techniques.cct.gating import ControlNet

    model = micro_model(cct=CCTConfig(ffn_pieces=2, control_hidden=16,
                                      budgets=[(1.0, 1.0), (0.5, 0.5)]))
    q = quantize_int8(model)
    nets = [m for m in q.modules() if isinstance(m, ControlNet)]
    assert nets and all(type(m.w1) is nn.Linear for m in nets)
    assert any(isinstance(m, Int8Linear) for m in q.modules())
    src, _ = batch()
    for control in (0, 1):
        hyps = greedy_search(q, src, max_len_b=5, control=control)
        assert len(hyps) == 3


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_save_load_roundtrip_is_bit_identical(kind, tmp_path):
    q = quantize_int8(micro_model(**KINDS[kind]))
    save_int8(q, tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "meta.json").read_text())["quantization"] == "int8"
    torch.manual_seed(123)  # a float model with other weights: only the structure is used
    cfg = ModelConfig(d_model=32, ffn_dim=64, n_heads=2, encoder_layers=2, decoder_layers=2,
                      **KINDS[kind])
    loaded = load_int8(build_seq2seq(cfg, VOCAB).eval(), tmp_path / "ckpt")
    src, tgt = batch()
    assert torch.equal(loaded(src, tgt).logits, q(src, tgt).logits)
    assert greedy_search(loaded, src) == greedy_search(q, src)


def test_quantize_errors():
    q = quantize_int8(micro_model())
    with pytest.raises(DynaseqError, match="already"):
        quantize_int8(q)
    with pytest.raises(DynaseqError, match="nothing to quantize"):
        quantize_int8(nn.Sequential(nn.LayerNorm(4)))


def test_load_rejects_a_checkpoint_of_another_model(tmp_path):
    save_int8(quantize_int8(micro_model()), tmp_path / "ckpt")
    with pytest.raises(DynaseqError, match="does not match"):
        load_int8(micro_model(**KINDS["dmb"]), tmp_path / "ckpt")


def test_a_damaged_int8_checkpoint_is_refused(tmp_path):
    from dynaseq.core.errors import CheckpointError

    ckpt = save_int8(quantize_int8(micro_model()), tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    load_int8(micro_model(), ckpt)  # as written: loads
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # a flipped byte among the weights
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="its SHA-256 does not match the one recorded"):
        load_int8(micro_model(), ckpt)


# --------------------------------------------------------------------------- run directories


def _listing(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def int8_run(trained_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("int8") / "run_int8"
    quantize_run(trained_run, out)
    return out


def test_quantized_run_loads_transparently_and_matches_in_memory(trained_run, int8_run,
                                                                  synthetic_paths):
    fp32 = Translator.load(trained_run)
    t = Translator.load(int8_run)
    assert is_int8(t.model) and t.device.type == "cpu"
    q = quantize_int8(fp32.model)
    src, tgt = batch()
    src, tgt = src % 50 + 4, tgt % 50 + 4
    assert torch.equal(t.model(src, tgt).logits, q(src, tgt).logits)
    lines = read_lines(synthetic_paths["test.src"])[:30]
    hyps = t.translate(lines, beam=1)
    assert hyps == dataclasses.replace(fp32, model=q).translate(lines, beam=1)
    # a 20-update model has flat distributions (many near-ties), still most outputs agree
    same = sum(a == b for a, b in zip(hyps, fp32.translate(lines, beam=1), strict=True))
    assert same >= 0.5 * len(lines)
    a, b = fp32.model(src, tgt).logits, t.model(src, tgt).logits
    assert a.argmax(-1).eq(b.argmax(-1)).float().mean() > 0.9
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_quantized_run_is_smaller_on_disk(trained_run, int8_run):
    src_w = Translator.load(trained_run).checkpoint / "model.safetensors"
    (ckpt,) = [p.parent for p in int8_run.rglob("model.safetensors")]
    assert ckpt.relative_to(int8_run) == src_w.parent.relative_to(trained_run)
    assert (ckpt / "model.safetensors").stat().st_size < 0.45 * src_w.stat().st_size
    assert {p.name for p in int8_run.iterdir()} >= {"config.yaml", "spm.model"}
    assert not list(int8_run.parent.glob(".tmp-*"))


def test_cli_quantize_then_evaluate_and_profile(trained_run, synthetic_paths, tmp_path, capsys):
    before = _listing(trained_run)
    out = tmp_path / "q"
    assert main(["quantize", str(trained_run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "weights" in printed and "MB ->" in printed
    assert _listing(trained_run) == before  # RUN_DIR untouched
    assert main(["evaluate", str(out), "--src", str(synthetic_paths["test.src"]), "--ref",
                 str(synthetic_paths["test.tgt"]), "--beam", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_sentences"] > 0
    profiles = []
    for run in (out, trained_run):
        assert main(["profile", str(run), "--json", "--repeats", "1", "--src-len", "5",
                     "--tgt-len", "5"]) == 0
        profiles.append(json.loads(capsys.readouterr().out))
    q, f = profiles
    assert q["params"] == f["params"]  # int8 weights counted, the tied output layer once
    assert q["macs_pair"] == f["macs_pair"]
    # the flop counter sees the int8 linears: the same count as the float model's
    assert q["macs_per_token_flop_counter"] == f["macs_per_token_flop_counter"]


def test_cli_quantize_bad_input(trained_run, tmp_path, capsys):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "file").write_text("x")
    assert main(["quantize", str(trained_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynaseq: error:") and "not empty" in err and err.count("\n") == 1
    assert main(["quantize", str(tmp_path / "missing"), "--out", str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynaseq: error:") and "not found" in err
    assert not (tmp_path / "n").exists()
    empty = tmp_path / "empty"  # an existing empty directory is fine
    empty.mkdir()
    assert main(["quantize", str(trained_run), "--out", str(empty)]) == 0
    assert (empty / "config.yaml").is_file()
    # an int8 run cannot be quantized again
    assert main(["quantize", str(empty), "--out", str(tmp_path / "again")]) == 2
    assert "already" in capsys.readouterr().err


def test_failed_quantize_leaves_no_directory(trained_run, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    from dynaseq.workflows import quantize

    monkeypatch.setattr(quantize, "save_int8", boom)
    with pytest.raises(RuntimeError):
        quantize_run(trained_run, tmp_path / "q")
    assert list(tmp_path.iterdir()) == []


def test_cli_quantize_picks_checkpoint_and_refuses_out_inside_run(trained_run, tmp_path, capsys):
    out = tmp_path / "latest"
    assert main(["quantize", str(trained_run), "--out", str(out), "--checkpoint", "latest"]) == 0
    (ckpt,) = [p.parent for p in out.rglob("model.safetensors")]
    assert ckpt.parent.name == "checkpoints" and ckpt.name.startswith("step_")
    assert Translator.load(out, checkpoint="latest").checkpoint == ckpt
    assert main(["quantize", str(trained_run), "--out", str(trained_run / "int8")]) == 2
    assert "outside" in capsys.readouterr().err
    assert not (trained_run / "int8").exists()


def test_quantize_and_run_emit_no_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.ao's deprecation notices are gone, not silenced
        q = quantize_int8(micro_model(**KINDS["dmb"]))
        src, tgt = batch()
        q(src, tgt)


def _as_v1(q: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The checkpoint the torch.ao version wrote (``dynaseq-int8-v1``) for the int8 model q."""
    tensors, meta = int8.int8_state(q)
    aliases = json.loads(meta["aliases"])
    full = {**tensors, **{k: tensors[v] for k, v in aliases.items()}}
    out, ties = {}, {}
    for name, m in q.named_modules():
        if isinstance(m, Int8Linear):
            emb = next((n for n, e in q.named_modules() if isinstance(e, Int8TokenEmbedding)
                        and e.is_tied_to(m)), None)
            if emb is not None:
                ties[name] = emb
            else:
                out[f"{name}.weight.int8"] = full[f"{name}.weight_int8"]
                out[f"{name}.weight.scale"] = full[f"{name}.weight_scale"].double()
                out[f"{name}.weight.zero_point"] = torch.zeros(m.out_features, dtype=torch.int32)
            if m.bias is not None:
                out[f"{name}.bias"] = full[f"{name}.bias"]
    lin_keys = {f"{n}.{b}" for n, m in q.named_modules() if isinstance(m, Int8Linear)
                for b in ("weight_int8", "weight_scale", "bias")}
    v1_aliases = {}
    for k, v in full.items():
        if k in lin_keys:
            continue
        if k in aliases and aliases[k] not in lin_keys:
            v1_aliases[k] = aliases[k]
        else:
            out[k] = v
    return out, {"format": "dynaseq-int8-v1", "quantization": "int8", "ties": json.dumps(ties),
                 "aliases": json.dumps(v1_aliases)}


@pytest.mark.parametrize("kind", ["dense", "dmb"])
def test_loads_a_checkpoint_of_the_earlier_torch_ao_format(kind, tmp_path):
    from safetensors.torch import save_file

    q = quantize_int8(micro_model(**KINDS[kind]))
    tensors, meta = _as_v1(q)
    (tmp_path / "ckpt").mkdir()
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"), metadata=meta)
    torch.manual_seed(5)
    cfg = ModelConfig(d_model=32, ffn_dim=64, n_heads=2, encoder_layers=2, decoder_layers=2,
                      **KINDS[kind])
    loaded = load_int8(build_seq2seq(cfg, VOCAB).eval(), tmp_path / "ckpt")
    src, tgt = batch()
    assert torch.equal(loaded(src, tgt).logits, q(src, tgt).logits)
    assert loaded.decoder.embed.is_tied_to(loaded.decoder.output_proj)
    # a zero point that is not 0 (not written by dynaseq) is refused
    key = next(k for k in tensors if k.endswith(".weight.zero_point"))
    tensors[key] = tensors[key] + 1
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"), metadata=meta)
    with pytest.raises(DynaseqError, match="zero point"):
        load_int8(build_seq2seq(cfg, VOCAB).eval(), tmp_path / "ckpt")


def test_quantization_is_looked_up_by_exact_module_type():
    from dynaseq.nn.int8 import INT8_HANDLERS, KEEP_FLOAT, register_int8

    class Scaled(nn.Linear):  # a subclass may compute something else: not converted
        def forward(self, x):
            return 2 * super().forward(x)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), Scaled(4, 4)

    class Kept(Block):
        pass

    register_int8(Kept, KEEP_FLOAT)
    try:
        q = quantize_int8(nn.Sequential(Block(), Kept()))
        assert type(q[0].a) is Int8Linear and type(q[0].b) is Scaled
        assert type(q[1].a) is nn.Linear  # the whole subtree of a KEEP_FLOAT type stays float
    finally:
        del INT8_HANDLERS[Kept]
    with pytest.raises(TypeError):
        register_int8(nn.Linear(2, 2), KEEP_FLOAT)
    with pytest.raises(TypeError):
        register_int8(Block, "float")
