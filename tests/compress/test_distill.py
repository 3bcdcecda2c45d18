"""Token-level distillation: top-k dump/reader, the (1−λ)·hard + λ·soft loss, annealing."""

from __future__ import annotations

import json

import pytest
import torch

from dynaseq.compress.distill import (
    AnnealedLambda,
    TeacherTopK,
    distill_loss,
    distill_loss_gathered,
    dump_teacher_topk,
)
from dynaseq.core.errors import DynaseqError


def _chunks(seed: int = 0, n_chunks: int = 3, b: int = 2, t: int = 5, v: int = 40):
    g = torch.Generator().manual_seed(seed)
    return [torch.log_softmax(torch.randn(b, t, v, generator=g) * 3, -1) for _ in range(n_chunks)]


def test_dump_and_read_roundtrip(tmp_path):
    chunks = _chunks()
    reader = dump_teacher_topk(iter(chunks), tmp_path / "top", k=7)
    full = torch.cat([c.reshape(-1, c.shape[-1]) for c in chunks])  # (30, 40)
    assert len(reader) == 30 and reader.k == 7
    meta = json.loads((tmp_path / "top" / "meta.json").read_text())
    assert meta["n_tokens"] == 30 and meta["k"] == 7
    assert (tmp_path / "top" / "indices.i32").stat().st_size == 30 * 7 * 4
    assert (tmp_path / "top" / "probs.f16").stat().st_size == 30 * 7 * 2
    val, idx = torch.topk(full, 7, dim=-1)
    ridx, rprob = TeacherTopK(tmp_path / "top")[0:30]
    assert ridx.dtype == torch.int64 and rprob.dtype == torch.float32
    assert torch.equal(ridx, idx)
    torch.testing.assert_close(rprob, val.exp(), atol=1e-3, rtol=1e-3)
    # a slice in the middle, an index tensor, and a single position
    ridx, _ = reader[12:17]
    assert torch.equal(ridx, idx[12:17])
    ridx, _ = reader[torch.tensor([3, 29, 0])]
    assert torch.equal(ridx, idx[[3, 29, 0]])
    assert reader[4][0].shape == (1, 7)


def test_dump_errors_leave_nothing_behind(tmp_path):
    with pytest.raises(DynaseqError, match="exceeds the vocabulary"):
        dump_teacher_topk(iter(_chunks(v=5)), tmp_path / "a", k=6)
    assert not (tmp_path / "a").exists() and not (tmp_path / "a.partial").exists()

    def broken():
        yield _chunks()[0]
        raise RuntimeError("teacher crashed")

    with pytest.raises(RuntimeError):
        dump_teacher_topk(broken(), tmp_path / "b", k=3)
    assert list(tmp_path.iterdir()) == []
    dump_teacher_topk(iter(_chunks()), tmp_path / "c", k=3)
    with pytest.raises(DynaseqError, match="already exists"):
        dump_teacher_topk(iter(_chunks()), tmp_path / "c", k=3)
    (tmp_path / "c" / "probs.f16").write_bytes(b"\0" * 10)
    with pytest.raises(DynaseqError, match="truncated"):
        TeacherTopK(tmp_path / "c")


def _setup(n: int = 6, v: int = 12, k: int = 4):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(n, v, generator=g, requires_grad=True)
    target = torch.randint(0, v, (n,), generator=g)
    teacher = torch.softmax(torch.randn(n, v, generator=g), -1)
    prob, idx = torch.topk(teacher, k, dim=-1)
    return logits, target, idx, prob


def test_loss_matches_hand_computation():
    logits, target, idx, prob = _setup()
    logp = torch.log_softmax(logits, -1)
    lam = 0.3
    out = distill_loss(logp, target, idx, prob, lam)
    hard = -logp.gather(1, target[:, None]).squeeze(1)
    p = prob / prob.sum(1, keepdim=True)
    soft = -(p * logp.gather(1, idx)).sum(1)
    torch.testing.assert_close(out.hard, hard.mean())
    torch.testing.assert_close(out.soft, soft.mean())
    torch.testing.assert_close(out.loss, ((1 - lam) * hard + lam * soft).mean())
    # the paper's un-renormalised form
    raw = distill_loss(logp, target, idx, prob, lam, renormalize=False, reduction="none")
    torch.testing.assert_close(raw.soft, -(prob * logp.gather(1, idx)).sum(1))
    # λ = 0 is plain cross-entropy
    torch.testing.assert_close(distill_loss(logp, target, idx, prob, 0.0).loss,
                               torch.nn.functional.nll_loss(logp, target))
    out.loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_callable_and_gathered_forms_agree():
    logits, target, idx, prob = _setup()
    logp = torch.log_softmax(logits, -1)
    seen = {}

    def student(ids: torch.Tensor) -> torch.Tensor:  # e.g. an adaptive softmax's cheap path
        seen["ids"] = ids
        return logp.gather(1, ids)

    a = distill_loss(logp, target, idx, prob, 0.4)
    b = distill_loss(student, target, idx, prob, 0.4)
    assert seen["ids"].shape == (6, 5) and torch.equal(seen["ids"][:, 0], target)
    c = distill_loss_gathered(logp.gather(1, target[:, None])[:, 0], logp.gather(1, idx), prob,
                              0.4)
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(a.loss, c.loss)
    # (B, T) / (B, T, k) inputs are flattened
    d = distill_loss(logp.view(2, 3, -1), target.view(2, 3), idx.view(2, 3, -1),
                     prob.view(2, 3, -1), 0.4)
    torch.testing.assert_close(a.loss, d.loss)
    with pytest.raises(DynaseqError, match="lambda"):
        distill_loss(logp, target, idx, prob, 1.5)


def test_annealed_lambda():
    sched = AnnealedLambda(0.5, 0.05, 100)
    assert sched(0) == 0.5
    assert sched(100) == pytest.approx(0.05)
    assert sched(50) == pytest.approx(0.275)
    assert sched(1000) == pytest.approx(0.05)
    with pytest.raises(DynaseqError):
        AnnealedLambda(1.5, 0.0, 10)
    with pytest.raises(DynaseqError):
        AnnealedLambda(0.5, 0.0, 0)
