"""8-bit weight quantization for CPU inference, with real int8 kernels (torch.ao).

The DMB paper (Tan et al. 2021, section IV-E, Figure 6) stores a Transformer-DMB with 8-bit
weights: about a quarter of the disk space, the same BLEU. :func:`quantize_int8` does this
with ``torch.ao.quantization.quantize_dynamic``:

* every ``nn.Linear`` becomes a ``torch.ao.nn.quantized.dynamic.Linear``: qint8 weights,
  symmetric per output channel (``per_channel_dynamic_qconfig``), activations quantized on
  the fly per call, int8 GEMMs (fbgemm / onednn / qnnpack);
* every :class:`~dynaseq.techniques.branching.BranchedLinear` (DMB branches, MoE experts) becomes an
  :class:`Int8BranchedLinear`: after ``merge_shared_`` one dynamic quantized Linear per
  branch, run on the rows routed to it exactly as ``BranchedLinear.grouped`` does (rows
  sorted by branch, one matmul per contiguous group; no row meets another branch's weight);
* token embeddings (:class:`~dynaseq.models.seq2seq.TokenEmbedding`) become
  :class:`Int8TokenEmbedding`: the same int8 rows and per-row scales, dequantized on lookup.
  With a tied output layer the embedding *is* the int8 output matrix, stored once.

Kept in float: gates, routers and control nets (tiny, and their argmax / threshold decides
which computation runs: int8 rounding could flip a decision), LayerNorms, control-symbol
embeddings, biases. CCT pieces (``FeedForward`` inside ``FeedForwardPiece``) and CCT
attention projections are plain ``nn.Linear`` and are quantized like any other.

Activations are quantized per call with one scale for the whole input tensor, so a row's
output depends slightly on the other rows of its batch (greedy and beam outputs of a batch
can differ from one sentence at a time in rare near-ties).

Saving (:func:`save_int8`): safetensors with, per quantized matrix, ``<name>.weight.int8``
(int8), ``.scale`` (per output channel) and ``.zero_point``, the bias in float, and every
float parameter under its usual name; ``meta.json`` records ``"quantization": "int8"``.
:func:`load_int8` rebuilds the quantized modules from a float model of the same config
(quantized once for its structure) and ``set_weight_bias`` with the stored int8 tensors, so
a loaded model gives bit-identical outputs. :class:`~dynaseq.tasks.translation.predictor.Translator` loads such
a run transparently (on the CPU: the kernels are CPU kernels).

Example::

    from dynaseq.compress.int8 import quantize_int8
    qmodel = quantize_int8(translator.model)        # a quantized copy; the input is untouched
    # or from the command line:  dynaseq quantize runs/tiny --out runs/tiny_int8
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.ao.nn.quantized.dynamic as nnqd
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
from torch.ao.quantization.observer import default_per_channel_weight_observer

from dynaseq.core.errors import CheckpointError, DynaseqError
from dynaseq.techniques.branching.branched_linear import BranchedLinear, merge_shared_
from dynaseq.techniques.branching.routing import BranchGroups, Router, run_used_groups

#: The value of ``meta.json``'s ``"quantization"`` key in an int8 checkpoint.
INT8 = "int8"
WEIGHTS = "model.safetensors"
META = "meta.json"
_FORMAT = "dynaseq-int8-v1"
QCONFIG = per_channel_dynamic_qconfig


@contextlib.contextmanager
def _quiet():
    """Silence torch's deprecation notice for quantized tensors (torch.ao itself makes them)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*quantized tensor creation functions",
                                category=UserWarning)
        # torch 2.13 points eager-mode users to the separate torchao package; the
        # torch.ao eager API used here is what this torch ships and runs
        warnings.filterwarnings("ignore", message=r"torch\.ao\.quantization is deprecated",
                                category=DeprecationWarning)
        yield


def _make_qlinear(weight: Tensor, bias: Tensor | None) -> nnqd.Linear:
    """A dynamic quantized Linear from a float ``(out, in)`` weight and optional bias."""
    lin = nn.Linear(weight.size(1), weight.size(0), bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    lin.qconfig = QCONFIG
    return nnqd.Linear.from_float(lin)


class Int8BranchedLinear(nn.Module):
    """Int8 :class:`~dynaseq.techniques.branching.BranchedLinear`: one dynamic quantized Linear per branch.

    Same interface as the float layer at inference: ``forward(x, branch)`` (x ``(..., in)``,
    branch ``(...)`` long -> ``(..., out)``), :meth:`grouped` over rows sorted by branch,
    ``n_branches``, ``in_features``, ``out_features`` and :meth:`macs`. Build it with
    :meth:`from_float` (the effective ``θ_S + θ_Pk`` of each branch is quantized).
    """

    def __init__(self, branches: Sequence[nnqd.Linear]) -> None:
        super().__init__()
        if not branches:
            raise ValueError("Int8BranchedLinear needs at least one branch")
        shapes = {(b.in_features, b.out_features) for b in branches}
        if len(shapes) != 1:
            raise ValueError(f"branches must all have one shape, got {sorted(shapes)}")
        self.branches = nn.ModuleList(branches)
        self.in_features, self.out_features = shapes.pop()

    @classmethod
    def from_float(cls, mod: BranchedLinear, use_precomputed_fake_quant: bool = False,
                   **kwargs: Any) -> Int8BranchedLinear:
        """Quantize each branch of ``mod`` (shared part included) per output channel."""
        if not isinstance(mod, BranchedLinear):
            raise TypeError(f"expected a BranchedLinear, got {type(mod).__name__}")
        with torch.no_grad():
            weight, bias = mod.branch_parameters()
            return cls([_make_qlinear(weight[k].float(), None if bias is None else bias[k].float())
                        for k in range(mod.n_branches)])

    @property
    def n_branches(self) -> int:
        return len(self.branches)

    @property
    def has_shared(self) -> bool:
        return False

    def grouped(self, xs: Tensor, groups: BranchGroups) -> Tensor:
        """``(M, in)`` rows sorted by branch as ``groups`` lays them out -> ``(M, out)``.

        One int8 matmul per non-empty group (an empty group computes nothing); a single
        group runs on ``xs`` directly (no split, no concatenation).
        """
        if len(groups.sizes) != self.n_branches:
            raise ValueError(f"got {len(groups.sizes)} group sizes for {self.n_branches} "
                             f"branches")
        return run_used_groups(xs, groups, lambda k, rows: self.branches[k](rows),
                               self.out_features)

    def forward(self, x: Tensor, branch: Tensor) -> Tensor:
        if branch.shape != x.shape[:-1]:
            raise ValueError(f"branch {tuple(branch.shape)} must match the rows of x "
                             f"{tuple(x.shape[:-1])}")
        if x.size(-1) != self.in_features:
            raise ValueError(f"x has width {x.size(-1)}, expected {self.in_features}")
        groups = BranchGroups.of(branch.reshape(-1), self.n_branches)
        flat = x.reshape(-1, self.in_features)
        out = groups.scatter(self.grouped(groups.gather(flat), groups))
        return out.view(*x.shape[:-1], self.out_features)

    def macs(self, n_tokens: int) -> int:
        """Multiply-adds of ``n_tokens`` rows (each runs one branch)."""
        return n_tokens * self.in_features * self.out_features

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"n_branches={self.n_branches}, dtype=qint8")


class Int8TokenEmbedding(nn.Module):
    """A token embedding with int8 rows and one float scale per row (symmetric).

    ``forward(tokens)``: ``(B, T)`` long -> ``(B, T, d)`` float, ``int8[x] · row_scale[x] ·
    scale`` (``scale`` = sqrt(d_model) as in ``TokenEmbedding``). Buffers: ``weight_int8``
    ``(V, d)`` int8 and ``row_scale`` ``(V,)`` float32.
    """

    def __init__(self, weight_int8: Tensor, row_scale: Tensor, pad_id: int, scale: float) -> None:
        super().__init__()
        if weight_int8.dtype != torch.int8 or weight_int8.dim() != 2:
            raise ValueError("weight_int8 must be a (V, d) int8 tensor")
        if row_scale.shape != weight_int8.shape[:1]:
            raise ValueError("row_scale must hold one scale per row")
        self.register_buffer("weight_int8", weight_int8.contiguous())
        self.register_buffer("row_scale", row_scale.float().contiguous())
        self.pad_id, self.scale = pad_id, scale

    @classmethod
    def from_quantized(cls, qweight: Tensor, pad_id: int, scale: float) -> Int8TokenEmbedding:
        """From a symmetric per-row (axis 0) qint8 tensor, e.g. a tied output layer's weight."""
        if (qweight.qscheme() not in (torch.per_channel_symmetric, torch.per_channel_affine)
                or qweight.q_per_channel_axis() != 0
                or bool(qweight.q_per_channel_zero_points().ne(0).any())):
            raise DynaseqError("a tied int8 output layer must be quantized symmetrically per row")
        return cls(qweight.int_repr(), qweight.q_per_channel_scales().float(), pad_id, scale)

    @classmethod
    def from_float(cls, emb: nn.Module) -> Int8TokenEmbedding:
        """Quantize a ``TokenEmbedding`` (``weight``, ``pad_id``, ``scale``) per row."""
        observer = default_per_channel_weight_observer()  # qint8, symmetric, axis 0
        w = emb.weight.detach().float()
        observer(w)
        scales, zero_points = observer.calculate_qparams()
        qweight = torch.quantize_per_channel(w, scales.double(), zero_points.long(), 0,
                                             torch.qint8)
        return cls.from_quantized(qweight, emb.pad_id, emb.scale)

    @property
    def vocab_size(self) -> int:
        return self.weight_int8.size(0)

    @property
    def embedding_dim(self) -> int:
        return self.weight_int8.size(1)

    def matches(self, qweight: Tensor) -> bool:
        """True if ``qweight`` holds exactly these int8 rows and scales (a tied output layer)."""
        return (qweight.qscheme() in (torch.per_channel_symmetric, torch.per_channel_affine)
                and qweight.q_per_channel_axis() == 0
                and qweight.shape == self.weight_int8.shape
                and bool(qweight.q_per_channel_zero_points().eq(0).all())
                and torch.equal(qweight.q_per_channel_scales(), self.row_scale.double())
                and torch.equal(qweight.int_repr(), self.weight_int8))

    def as_qweight(self) -> Tensor:
        """The embedding as a per-row qint8 tensor (for an output layer tied to it)."""
        zeros = torch.zeros(self.vocab_size, dtype=torch.long)
        return torch._make_per_channel_quantized_tensor(self.weight_int8, self.row_scale.double(),
                                                        zeros, 0)

    def forward(self, tokens: Tensor) -> Tensor:
        rows = self.weight_int8.index_select(0, tokens.reshape(-1)).float()
        scale = self.row_scale.index_select(0, tokens.reshape(-1)) * self.scale
        return (rows * scale[:, None]).view(*tokens.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.embedding_dim}, pad_id={self.pad_id}, dtype=int8"


#: Module types whose ``nn.Linear`` layers decide what runs: kept in float.
def _gate_types() -> tuple[type, ...]:
    from dynaseq.techniques.branching.moe import NoisyTopKGate
    from dynaseq.techniques.cct.gating import ControlNet

    return (Router, NoisyTopKGate, ControlNet)


_QUANTIZED = (nnqd.Linear, Int8BranchedLinear, Int8TokenEmbedding)


def is_int8(model: nn.Module) -> bool:
    """True if ``model`` holds int8 modules made by :func:`quantize_int8`."""
    return any(isinstance(m, _QUANTIZED) for m in model.modules())


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


@torch.no_grad()
def quantize_int8(model: nn.Module) -> nn.Module:
    """An int8 copy of ``model`` for CPU inference (``model`` itself is left unchanged).

    The copy is put on the CPU in eval mode, DMB shared parts are merged into their branches
    (``merge_shared_``), then ``nn.Linear`` and ``BranchedLinear`` layers outside gates become
    dynamic quantized int8 modules (see the module docstring) and token embeddings
    :class:`Int8TokenEmbedding`. Works for dense, CCT, DMB and MoE seq2seq models.

    Raises:
        DynaseqError: the model is already quantized, or has no linear layer to quantize.
    """
    if is_int8(model):
        raise DynaseqError("the model is already int8-quantized")
    from dynaseq.models.seq2seq import TokenEmbedding

    qmodel = copy.deepcopy(model).cpu().eval()
    merge_shared_(qmodel)
    gates = _gate_types()
    skip: set[int] = set()
    for m in qmodel.modules():
        if isinstance(m, gates):
            skip.update(id(sub) for sub in m.modules())
    targets = {name: m for name, m in qmodel.named_modules()
               if type(m) in (nn.Linear, BranchedLinear) and id(m) not in skip}
    if not targets:
        raise DynaseqError("nothing to quantize: the model has no nn.Linear or BranchedLinear "
                           "layer outside its gates")
    embeds = {name: m for name, m in qmodel.named_modules() if isinstance(m, TokenEmbedding)}
    # output layers tied to an embedding (the same Parameter): they share the int8 matrix
    ties = {lname: ename for lname, lin in targets.items() if isinstance(lin, nn.Linear)
            for ename, emb in embeds.items() if lin.weight is emb.weight}
    with _quiet():
        quantize_dynamic(qmodel, {name: QCONFIG for name in targets},
                         mapping={nn.Linear: nnqd.Linear, BranchedLinear: Int8BranchedLinear},
                         inplace=True)
    tied_to = {e: lname for lname, e in ties.items()}
    new_embeds: dict[int, Int8TokenEmbedding] = {}
    for ename, emb in embeds.items():
        if id(emb) not in new_embeds:
            if ename in tied_to:
                qweight = qmodel.get_submodule(tied_to[ename]).weight()
                new_embeds[id(emb)] = Int8TokenEmbedding.from_quantized(qweight, emb.pad_id,
                                                                        emb.scale)
            else:
                with _quiet():
                    new_embeds[id(emb)] = Int8TokenEmbedding.from_float(emb)
    # a shared module (encoder.embed is decoder.embed) is listed once by named_modules: set
    # every attribute that points to it
    for m in list(qmodel.modules()):
        for attr, child in list(m.named_children()):
            if id(child) in new_embeds and isinstance(child, TokenEmbedding):
                setattr(m, attr, new_embeds[id(child)])
    return qmodel.eval()


def int8_param_count(model: nn.Module) -> int:
    """Weights held by int8 modules (not ``nn.Parameter``s): quantized matrices, their float
    biases and int8 embeddings; an output layer tied to an embedding counted once."""
    embeds = [m for m in {id(m): m for m in model.modules()}.values()
              if isinstance(m, Int8TokenEmbedding)]
    n = sum(e.weight_int8.numel() for e in embeds)
    for m in model.modules():
        if isinstance(m, nnqd.Linear):
            w, b = m._weight_bias()
            if not any(e.matches(w) for e in embeds):
                n += w.numel()
            n += 0 if b is None else b.numel()
    return n


# --------------------------------------------------------------------------- saving


def _quantized_linears(model: nn.Module) -> dict[str, nnqd.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nnqd.Linear)}


def _under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key.startswith(p + ".") for p in prefixes)


def int8_state(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and safetensors metadata that :func:`load_int8_state` reads back.

    Per quantized Linear ``name``: ``name.weight.int8``, ``name.weight.scale``,
    ``name.weight.zero_point`` (per output channel, or 0-d for a per-tensor scheme) and
    ``name.bias``; an output layer tied to an :class:`Int8TokenEmbedding` is stored as a
    reference to it (metadata ``ties``). Every other parameter and persistent buffer is
    stored under its state-dict name, shared ones once (metadata ``aliases``).
    """
    qlinears = _quantized_linears(model)
    embeds = {n: m for n, m in model.named_modules() if isinstance(m, Int8TokenEmbedding)}
    tensors: dict[str, Tensor] = {}
    ties: dict[str, str] = {}
    for name, m in qlinears.items():
        w, b = m._weight_bias()
        if w.dtype != torch.qint8:
            raise DynaseqError(f"{name}: only qint8 weights can be saved, got {w.dtype}")
        tie = next((en for en, e in embeds.items() if b is None and e.matches(w)), None)
        if tie is not None:
            ties[name] = tie
        elif w.qscheme() in (torch.per_channel_symmetric, torch.per_channel_affine):
            if w.q_per_channel_axis() != 0:
                raise DynaseqError(f"{name}: per-channel scales must be along the output axis")
            tensors[f"{name}.weight.int8"] = w.int_repr()
            tensors[f"{name}.weight.scale"] = w.q_per_channel_scales().double()
            tensors[f"{name}.weight.zero_point"] = w.q_per_channel_zero_points().to(torch.int32)
        else:
            tensors[f"{name}.weight.int8"] = w.int_repr()
            tensors[f"{name}.weight.scale"] = torch.tensor(w.q_scale(), dtype=torch.float64)
            tensors[f"{name}.weight.zero_point"] = torch.tensor(w.q_zero_point(),
                                                                dtype=torch.int32)
        if b is not None:
            tensors[f"{name}.bias"] = b.detach()
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for key, t in model.state_dict().items():
        if _under(key, list(qlinears)):
            continue
        if not isinstance(t, Tensor) or t.is_quantized:
            raise DynaseqError(f"cannot save {key}: not a plain tensor")
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        tensors[key] = t.detach().contiguous()
    metadata = {"format": _FORMAT, "quantization": INT8, "ties": json.dumps(ties),
                "aliases": json.dumps(aliases)}
    return tensors, metadata


def load_int8_state(model: nn.Module, tensors: dict[str, Tensor],
                    metadata: dict[str, str]) -> None:
    """Fill an int8 ``model`` (same structure) with :func:`int8_state` output, in place.

    Raises:
        CheckpointError: a tensor is missing, left over or of the wrong shape.
    """
    if metadata.get("format") != _FORMAT:
        raise CheckpointError(f"not an int8 checkpoint (format {metadata.get('format')!r})")
    ties = json.loads(metadata.get("ties", "{}"))
    aliases = json.loads(metadata.get("aliases", "{}"))
    tensors = dict(tensors)
    for key, orig in aliases.items():
        if orig not in tensors:
            raise CheckpointError(f"int8 checkpoint: alias {key} -> missing {orig}")
        tensors[key] = tensors[orig]
    qlinears = _quantized_linears(model)
    float_state = {k: v for k, v in tensors.items() if not _under(k, list(qlinears))}
    expected = {k for k in model.state_dict() if not _under(k, list(qlinears))}
    missing, unexpected = sorted(expected - set(float_state)), sorted(set(float_state) - expected)
    if missing or unexpected:
        raise CheckpointError(f"int8 checkpoint does not match the model: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")
    # copied one by one: load_state_dict would also ask the quantized modules for their
    # (packed) state
    slots = dict(model.named_parameters(remove_duplicate=False))
    slots.update(model.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for key, value in float_state.items():
            slot = slots[key]
            if slot.shape != value.shape:
                raise CheckpointError(f"int8 checkpoint: {key} has shape {tuple(value.shape)}, "
                                      f"expected {tuple(slot.shape)}")
            slot.copy_(value)
    used = set(float_state)
    for name, m in qlinears.items():
        if name in ties:
            qweight = model.get_submodule(ties[name]).as_qweight()
        else:
            try:
                q = tensors[f"{name}.weight.int8"]
                scale = tensors[f"{name}.weight.scale"].double()
                zp = tensors[f"{name}.weight.zero_point"].long()
            except KeyError as e:
                raise CheckpointError(f"int8 checkpoint has no {e.args[0]}") from None
            used.update(f"{name}.weight.{s}" for s in ("int8", "scale", "zero_point"))
            if q.dtype != torch.int8 or q.shape != (m.out_features, m.in_features):
                raise CheckpointError(f"int8 checkpoint: {name}.weight.int8 has shape "
                                      f"{tuple(q.shape)} {q.dtype}, expected "
                                      f"{(m.out_features, m.in_features)} int8")
            if scale.dim() == 0:
                qweight = torch._make_per_tensor_quantized_tensor(q, float(scale), int(zp))
            else:
                qweight = torch._make_per_channel_quantized_tensor(q, scale, zp, 0)
        bias = tensors.get(f"{name}.bias")
        if (bias is None) != (m._weight_bias()[1] is None):
            raise CheckpointError(f"int8 checkpoint: bias of {name} does not match the model")
        if bias is not None:
            used.add(f"{name}.bias")
        m.set_weight_bias(qweight, bias)
    left = sorted(set(tensors) - used - set(aliases))
    if left:
        raise CheckpointError(f"int8 checkpoint does not match the model: unexpected {left[:3]}")


def save_int8(model: nn.Module, directory: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """Write ``model.safetensors`` (int8 format) and ``meta.json`` into ``directory``.

    The caller makes the directory appear atomically (``quantize_run`` writes a temporary run
    directory and renames it).
    """
    if not is_int8(model):
        raise DynaseqError("save_int8 needs a model made by quantize_int8")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors, metadata = int8_state(model)
    save_file(tensors, str(d / WEIGHTS), metadata=metadata)
    (d / META).write_text(json.dumps({**(meta or {}), "quantization": INT8}, indent=1),
                          encoding="utf-8")
    return d


def load_int8(float_model: nn.Module, directory: str | Path) -> nn.Module:
    """Rebuild the int8 model saved in ``directory`` from a float model of the same config.

    ``float_model`` supplies the structure (its weights do not matter): it is quantized with
    :func:`quantize_int8`, then every tensor is replaced by the stored one.
    """
    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"no checkpoint in {directory} (missing {WEIGHTS})")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"corrupt checkpoint {path}: {msg}") from None
    qmodel = quantize_int8(float_model)
    with _quiet():
        load_int8_state(qmodel, tensors, metadata)
    return qmodel.eval()


def is_int8_checkpoint(meta: dict[str, Any]) -> bool:
    """True for the ``meta.json`` of a checkpoint written by :func:`save_int8`."""
    return meta.get("quantization") == INT8


# --------------------------------------------------------------------------- run directories


def dir_size(path: str | Path) -> int:
    """Bytes of all regular files under ``path`` (or of the file ``path``)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


@dataclass
class QuantizeReport:
    """Sizes in bytes: the source checkpoint's weights and the int8 weights; whole run dirs."""

    run_dir: Path
    out_dir: Path
    checkpoint: Path
    weights_before: int
    weights_after: int
    run_before: int
    run_after: int


def check_new_run_dir(run_dir: Path, out_dir: Path) -> None:
    """Refuse an ``out_dir`` that exists and is not empty, or one inside ``run_dir``."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DynaseqError(f"{out_dir} already exists and is not empty (choose a new --out)")
    r, o = run_dir.resolve(), out_dir.resolve()
    if o == r or r in o.parents:
        raise DynaseqError(f"--out {out_dir} must lie outside the run directory {run_dir}")


def quantize_run(run_dir: str | Path, out_dir: str | Path,
                 checkpoint: str = "auto") -> QuantizeReport:
    """Write a new seq2seq run directory ``out_dir`` holding the int8 version of ``run_dir``.

    ``run_dir`` is only read. ``out_dir`` gets ``config.yaml`` (``run_dir`` set to it),
    the tokenizer files and one checkpoint at the same relative place as the source one
    (``averaged/``, ``best/`` or ``checkpoints/step_N/``, so ``--checkpoint auto`` finds it)
    whose ``meta.json`` records ``"quantization": "int8"``. Everything is written to a
    temporary sibling directory that is renamed into place at the end: a failure leaves no
    half-written run directory.

    Raises:
        DynaseqError: missing run directory, an existing non-empty ``out_dir``, an
            already-quantized run.
    """
    from dynaseq.core.checkpoint import read_meta
    from dynaseq.core.config import save_config
    from dynaseq.tasks.translation.predictor import Translator

    run, out = Path(run_dir), Path(out_dir)
    if not run.is_dir():
        raise DynaseqError(f"run directory not found: {run}")
    check_new_run_dir(run, out)
    t = Translator.load(run, checkpoint=checkpoint, device="cpu")
    if is_int8(t.model):
        raise DynaseqError(f"{run} is already int8-quantized")
    qmodel = quantize_int8(t.model)
    ckpt = t.checkpoint
    try:
        rel = ckpt.resolve().relative_to(run.resolve())
    except ValueError:
        rel = Path("best")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        cfg = copy.deepcopy(t.config)
        cfg.run_dir = str(out)
        save_config(cfg, tmp / "config.yaml")
        for name in ("spm.model", "spm.vocab"):
            if (run / name).is_file():
                shutil.copy2(run / name, tmp / name)
        meta = {k: v for k, v in read_meta(ckpt).items() if k in ("step", "averaged", "valid")}
        meta.update(source_run=str(run), source_checkpoint=str(ckpt))
        save_int8(qmodel, tmp / rel, meta)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if out.exists():  # an empty directory: rename replaces it
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return QuantizeReport(run, out, ckpt, dir_size(ckpt / WEIGHTS), dir_size(out / rel / WEIGHTS),
                          dir_size(run), dir_size(out))
