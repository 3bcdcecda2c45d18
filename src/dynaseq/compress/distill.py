"""Token-level knowledge distillation with a teacher's top-k labels on disk (MicroNet §4.1).

A larger teacher is run once over the training stream; for every training token x_n its
k largest next-token probabilities S_k ⊂ {P_teacher(x | x_<n)} are written to disk
(:func:`dump_teacher_topk`, k = 30 in the paper). The student is then trained with

    L_t(x_n)   = (1 − λ_t) · L_hard(x_n) + λ_t · L_soft(P_teacher)
    L_hard     = − log P(x_n | x_<n)
    L_soft     = − Σ_{x ∈ S_k} p̃_teacher(x) · log P(x | x_<n)
    λ_t        = λ_max − (t / T) · (λ_max − λ_min)          (teacher annealing)

where p̃ are the stored top-k probabilities renormalised to sum to 1 over S_k (the paper
uses the raw top-k probabilities; renormalising makes L_soft a proper cross-entropy and
keeps its scale independent of how much mass the teacher puts outside its top k — pass
``renormalize=False`` for the paper's exact form).

The student's output layer is an adaptive softmax, whose full (N, V) log-probability is
expensive; the loss therefore only needs the student's log-probability at k + 1 vocabulary
ids per position: the target and the teacher's k indices. :func:`distill_loss` accepts
either a full (N, V) log-prob tensor, or a callable ``f(ids: (N, m) long) -> (N, m)`` that
computes the student's log-probabilities at the given ids only (e.g. the head plus only the
tail clusters those ids fall in), or, via :func:`distill_loss_gathered`, the already
gathered (N,) target and (N, k) top-k log-probs.

On-disk format (a directory written by :func:`dump_teacher_topk`)::

    meta.json      {"format": "dynaseq-teacher-topk", "version": 1, "k": k,
                    "n_tokens": N, "indices": "indices.i32", "probs": "probs.f16"}
    indices.i32    raw little-endian int32, row-major (N, k): the teacher's top-k token ids,
                   sorted by decreasing probability
    probs.f16      raw little-endian float16, row-major (N, k): their probabilities
                   (not renormalised)

Row n belongs to the n-th token position of the stream that was fed to the teacher (the
prediction of token n + 1 given tokens ≤ n, in the same order the LM loop enumerates
training targets). Files are appended chunk by chunk, so memory stays bounded by one chunk;
:class:`TeacherTopK` reads them back with ``numpy.memmap`` (no full load).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dynaseq.core.errors import DynaseqError

FORMAT = "dynaseq-teacher-topk"
VERSION = 1
_IDX_FILE = "indices.i32"
_PROB_FILE = "probs.f16"

StudentLogProb = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


def dump_teacher_topk(logp_iter: Iterable[torch.Tensor], path: str | os.PathLike, k: int = 30,
                      *, overwrite: bool = False) -> TeacherTopK:
    """Write a teacher's top-k next-token probabilities for every position, streaming.

    Args:
        logp_iter: yields chunks of teacher log-probabilities of shape (N_i, V) (or
            (B, T, V), flattened row-major to (B·T, V)), in training-stream order. Each chunk
            is reduced to its top k on the fly, so only one chunk is ever in memory.
        path: output directory (created; must not exist unless ``overwrite``). Written to a
            sibling temporary directory first and renamed at the end, so an interrupted
            dump never leaves a half-written directory at ``path``.
        k: how many labels per position (the paper: 30); must be ≤ V.

    Returns:
        a :class:`TeacherTopK` reader over the new files.

    Example::

        def chunks():
            for x, _ in train_windows:                    # (B, T) windows, stream order
                h = teacher(x).hidden.reshape(-1, d)      # (B·T, d)
                yield teacher.softmax.log_prob(h)         # (B·T, V)
        topk = dump_teacher_topk(chunks(), run / "teacher_top30", k=30)
    """
    if k < 1:
        raise DynaseqError(f"top-k size must be >= 1, got {k}")
    out = Path(path)
    if out.exists() and not overwrite:
        raise DynaseqError(f"{out} already exists (pass overwrite=True to replace it)")
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    n_tokens = 0
    try:
        with open(tmp / _IDX_FILE, "wb") as fi, open(tmp / _PROB_FILE, "wb") as fp:
            for chunk in logp_iter:
                logp = chunk.detach()
                if logp.dim() < 2:
                    raise DynaseqError(
                        f"teacher log-probs must be (N, V) or (B, T, V), got {tuple(logp.shape)}")
                logp = logp.reshape(-1, logp.shape[-1])
                if k > logp.shape[-1]:
                    raise DynaseqError(f"k={k} exceeds the vocabulary size {logp.shape[-1]}")
                val, idx = torch.topk(logp.float(), k, dim=-1)  # (N, k), sorted decreasing
                fi.write(idx.to(torch.int32).cpu().numpy().astype("<i4").tobytes())
                fp.write(val.exp().to(torch.float16).cpu().numpy().astype("<f2").tobytes())
                n_tokens += logp.shape[0]
        meta = {"format": FORMAT, "version": VERSION, "k": k, "n_tokens": n_tokens,
                "indices": _IDX_FILE, "probs": _PROB_FILE}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return TeacherTopK(out)


class TeacherTopK:
    """Memory-mapped reader of a :func:`dump_teacher_topk` directory.

    ``reader[positions]`` (an int, a slice, or a 1-D index tensor/array of token positions)
    returns ``(indices, probs)``: LongTensor (N, k) and float32 (N, k) tensors, copied out
    of the memmap (only those rows are read from disk).

    Example::

        topk = TeacherTopK(run / "teacher_top30")
        idx, prob = topk[offset : offset + B * T]         # rows for one training window
        idx, prob = idx.view(B, T, -1), prob.view(B, T, -1)
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        meta_file = self.path / "meta.json"
        if not meta_file.is_file():
            raise DynaseqError(f"{self.path} is not a teacher top-k directory (no meta.json)")
        meta = json.loads(meta_file.read_text())
        if meta.get("format") != FORMAT:
            raise DynaseqError(f"{meta_file}: unknown format {meta.get('format')!r}")
        self.k: int = int(meta["k"])
        self.n_tokens: int = int(meta["n_tokens"])
        shape = (self.n_tokens, self.k)
        for name, itemsize in ((meta["indices"], 4), (meta["probs"], 2)):
            size = (self.path / name).stat().st_size
            if size != self.n_tokens * self.k * itemsize:
                raise DynaseqError(f"{self.path / name} is truncated or corrupt "
                                   f"({size} bytes, expected {self.n_tokens * self.k * itemsize})")
        if self.n_tokens == 0:
            self._idx = np.zeros(shape, dtype="<i4")
            self._prob = np.zeros(shape, dtype="<f2")
        else:
            self._idx = np.memmap(self.path / meta["indices"], dtype="<i4", mode="r", shape=shape)
            self._prob = np.memmap(self.path / meta["probs"], dtype="<f2", mode="r", shape=shape)

    def __len__(self) -> int:
        return self.n_tokens

    def __getitem__(self, positions: int | slice | torch.Tensor | np.ndarray
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(positions, torch.Tensor):
            positions = positions.cpu().numpy()
        if isinstance(positions, int):
            positions = slice(positions, positions + 1)
        idx = np.asarray(self._idx[positions])
        prob = np.asarray(self._prob[positions])
        return torch.from_numpy(idx.astype(np.int64)), torch.from_numpy(prob.astype(np.float32))


@dataclass
class DistillLoss:
    """Result of :func:`distill_loss`: the total (to backpropagate) and its two parts."""

    loss: torch.Tensor  # (1 − λ)·hard + λ·soft, reduced
    hard: torch.Tensor  # − log P(target), reduced
    soft: torch.Tensor  # − Σ_k p̃_k log P(idx_k), reduced
    lam: float


def distill_loss(student_logp: StudentLogProb, target: torch.Tensor, topk_idx: torch.Tensor,
                 topk_prob: torch.Tensor, lam: float, *, renormalize: bool = True,
                 reduction: str = "mean") -> DistillLoss:
    """(1 − λ)·L_hard + λ·L_soft for N positions (MicroNet eq. in §4.1).

    Args:
        student_logp: either the student's full log-probabilities (N, V), or a callable
            ``f(ids: LongTensor (N, k+1)) -> (N, k+1)`` returning log P_student at the given
            ids (column 0 is the target, columns 1.. the teacher's top-k) — the cheap path
            for an adaptive softmax, which then evaluates only the clusters those ids use.
        target: (N,) gold next-token ids.
        topk_idx: (N, k) teacher top-k ids (from :class:`TeacherTopK`).
        topk_prob: (N, k) teacher probabilities for those ids; renormalised over the k ids
            when ``renormalize`` (default), used as is otherwise (the paper's form).
        lam: the soft-loss weight λ_t ∈ [0, 1] (see :class:`AnnealedLambda`).
        reduction: ``"mean"`` over positions, ``"sum"``, or ``"none"`` (per position (N,)).

    Leading batch dims are allowed: (B, T) targets with (B, T, k) top-k are flattened.
    """
    n_k = topk_idx.shape[-1]
    target = target.reshape(-1)
    topk_idx = topk_idx.reshape(-1, n_k).to(target.device)
    if topk_idx.shape[0] != target.shape[0]:
        raise DynaseqError(f"{target.shape[0]} targets but {topk_idx.shape[0]} top-k rows")
    ids = torch.cat([target.unsqueeze(1), topk_idx.long()], dim=1)  # (N, k+1)
    if isinstance(student_logp, torch.Tensor):
        full = student_logp.reshape(-1, student_logp.shape[-1])
        picked = full.gather(1, ids)
    else:
        picked = student_logp(ids)
        if picked.shape != ids.shape:
            raise DynaseqError(f"student log-prob callable returned {tuple(picked.shape)}, "
                               f"expected {tuple(ids.shape)}")
    return distill_loss_gathered(picked[:, 0], picked[:, 1:], topk_prob, lam,
                                 renormalize=renormalize, reduction=reduction)


def distill_loss_gathered(target_logp: torch.Tensor, topk_logp: torch.Tensor,
                          topk_prob: torch.Tensor, lam: float, *, renormalize: bool = True,
                          reduction: str = "mean") -> DistillLoss:
    """The same loss from pre-gathered student log-probs: target (N,) and top-k (N, k)."""
    if not 0.0 <= lam <= 1.0:
        raise DynaseqError(f"distillation weight lambda must be in [0, 1], got {lam}")
    n_k = topk_logp.shape[-1]
    target_logp = target_logp.reshape(-1)
    topk_logp = topk_logp.reshape(-1, n_k)
    p = topk_prob.reshape(-1, n_k).to(device=topk_logp.device, dtype=topk_logp.dtype)
    if renormalize:
        p = p / p.sum(dim=1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    hard = -target_logp  # (N,)
    soft = -(p * topk_logp).sum(dim=1)  # (N,)
    total = (1.0 - lam) * hard + lam * soft
    if reduction == "mean":
        total, hard, soft = total.mean(), hard.mean(), soft.mean()
    elif reduction == "sum":
        total, hard, soft = total.sum(), hard.sum(), soft.sum()
    elif reduction != "none":
        raise DynaseqError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return DistillLoss(loss=total, hard=hard, soft=soft, lam=float(lam))


@dataclass(frozen=True)
class AnnealedLambda:
    """Teacher annealing: λ_t = λ_max − (t / T)·(λ_max − λ_min), held at λ_min after T.

    The paper uses λ_max = 0.5, λ_min = 0.05 over the whole run. ``AnnealedLambda(0.5,
    0.05, 200_000)(t)`` gives λ at step t (t = 0 → λ_max, t ≥ T → λ_min).
    """

    lam_max: float
    lam_min: float
    total_steps: int

    def __post_init__(self) -> None:
        for name in ("lam_max", "lam_min"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise DynaseqError(f"{name} must be in [0, 1], got {v}")
        if self.total_steps < 1:
            raise DynaseqError(f"total_steps must be >= 1, got {self.total_steps}")

    def __call__(self, step: int) -> float:
        frac = min(max(step, 0), self.total_steps) / self.total_steps
        return self.lam_max - frac * (self.lam_max - self.lam_min)
