"""8-bit weight quantization for CPU inference: a model -> model transform (no ``torch.ao``).

The DMB paper (Tan et al. 2021, section IV-E, Figure 6) stores a Transformer-DMB with 8-bit
weights: about a quarter of the disk space, the same BLEU. :func:`quantize_int8` does this
with the int8 kernel of :mod:`dynaseq.nn.int8` (``torch._int_mm``): weights int8, symmetric
per output channel; activations quantized on the fly per token (per row), so a sentence gets
the same numbers whatever else is in its batch.

How each module quantizes is looked up by its exact type in
:data:`~dynaseq.nn.int8.INT8_HANDLERS`, where every module type registers itself beside its
definition: ``nn.Linear`` -> :class:`~dynaseq.nn.int8.Int8Linear`; DMB branches and MoE
experts (``BranchedLinear``) -> ``Int8BranchedLinear`` (one int8 matmul per used branch; the
shared part is folded into every branch); gates, routers and control nets are registered as
:data:`~dynaseq.nn.int8.KEEP_FLOAT` (tiny, and their argmax / threshold decides which
computation runs: int8 rounding could flip a decision). Modules of other types are walked
into. LayerNorms, control-symbol embeddings and biases stay float. Token embeddings
(:class:`~dynaseq.models.seq2seq.TokenEmbedding`) become :class:`Int8TokenEmbedding`; with a
tied output layer the embedding *is* the int8 output matrix (the same tensors, stored once).

Saving (:func:`save_int8`): safetensors holding the int8 model's state dict (int8 weights,
float32 per-channel scales, float biases and every float parameter), tensors shared by two
modules once (metadata ``aliases``); ``meta.json`` records ``"quantization": "int8"``.
:func:`load_int8` rebuilds the int8 modules from a float model of the same config and copies
the stored tensors in, so a loaded model gives bit-identical outputs. Checkpoints of the
earlier ``torch.ao`` format (``dynaseq-int8-v1``) load too. :class:`~dynaseq.models.search.Translator`
loads such a run transparently (on the CPU: the kernels are CPU kernels).

Example::

    from dynaseq.compress.int8 import quantize_int8
    qmodel = quantize_int8(translator.model)        # a quantized copy; the input is untouched
    # or from the command line:  dynaseq quantize runs/tiny --out runs/tiny_int8
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from dynaseq.core.checkpoint import META, WEIGHTS, os_errors, verify_file, write_meta
from dynaseq.core.errors import CheckpointError, DynaseqError
from dynaseq.nn.int8 import INT8_HANDLERS, KEEP_FLOAT, Int8Linear, quantize_rows

#: The value of ``meta.json``'s ``"quantization"`` key in an int8 checkpoint.
INT8 = "int8"
_FORMAT = "dynaseq-int8-v2"
_FORMAT_V1 = "dynaseq-int8-v1"  # torch.ao packed weights: int8 + scale + zero_point per matrix


class Int8TokenEmbedding(nn.Module):
    """A token embedding with int8 rows and one float scale per row (symmetric).

    ``forward(tokens)``: ``(B, T)`` long -> ``(B, T, d)`` float, ``int8[x] · row_scale[x] ·
    scale`` (``scale`` = sqrt(d_model) as in ``TokenEmbedding``). Buffers: ``weight_int8``
    ``(V, d)`` int8 and ``row_scale`` ``(V,)`` float32; an output layer tied to the embedding
    holds the very same tensors (:meth:`output_layer`).
    """

    def __init__(self, weight_int8: Tensor, row_scale: Tensor, pad_id: int, scale: float) -> None:
        super().__init__()
        if weight_int8.dtype != torch.int8 or weight_int8.dim() != 2:
            raise ValueError("weight_int8 must be a (V, d) int8 tensor")
        if row_scale.shape != weight_int8.shape[:1]:
            raise ValueError("row_scale must hold one scale per row")
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("row_scale", row_scale)
        self.pad_id, self.scale = pad_id, scale
        self.vocab_size, self.embedding_dim = weight_int8.shape  # fixed, as nn.Embedding's

    @classmethod
    def from_float(cls, emb: nn.Module) -> Int8TokenEmbedding:
        """Quantize a ``TokenEmbedding`` (``weight``, ``pad_id``, ``scale``) per row."""
        q, row_scale = quantize_rows(emb.weight)
        return cls(q, row_scale, emb.pad_id, emb.scale)

    def output_layer(self, bias: Tensor | None = None) -> Int8Linear:
        """An ``(d -> V)`` output layer tied to this embedding: the same int8 rows and scales
        (no copy)."""
        return Int8Linear(self.weight_int8, self.row_scale, bias)

    def is_tied_to(self, lin: nn.Module) -> bool:
        """True if ``lin`` is an :class:`Int8Linear` holding this embedding's very tensors."""
        return (isinstance(lin, Int8Linear) and lin.weight_int8 is self.weight_int8
                and lin.weight_scale is self.row_scale)

    def forward(self, tokens: Tensor) -> Tensor:
        rows = self.weight_int8.index_select(0, tokens.reshape(-1)).float()
        scale = self.row_scale.index_select(0, tokens.reshape(-1)) * self.scale
        return (rows * scale[:, None]).view(*tokens.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.embedding_dim}, pad_id={self.pad_id}, dtype=int8"


_QUANTIZED = (Int8Linear, Int8TokenEmbedding)


def is_int8(model: nn.Module) -> bool:
    """True if ``model`` holds int8 modules made by :func:`quantize_int8`."""
    return any(isinstance(m, _QUANTIZED) for m in model.modules())


def _quantize_children(module: nn.Module, memo: dict[int, nn.Module]) -> int:
    """Replace, below ``module``, every child whose exact type has an int8 handler (walking
    into the others). ``memo``: id(float module) -> its int8 module, so a module shared by
    two parents (or pre-set, e.g. a tied output layer) maps to one int8 module. Returns how
    many attributes were replaced."""
    n = 0
    for attr, child in list(module.named_children()):
        handler = INT8_HANDLERS.get(type(child))
        if id(child) not in memo:
            if handler == KEEP_FLOAT:
                continue
            if handler is None:
                n += _quantize_children(child, memo)
                continue
            memo[id(child)] = handler(child)
        setattr(module, attr, memo[id(child)])
        n += 1
    return n


@torch.no_grad()
def quantize_int8(model: nn.Module) -> nn.Module:
    """An int8 copy of ``model`` for CPU inference (``model`` itself is left unchanged).

    The copy is put on the CPU in eval mode; every module whose type has a handler in
    :data:`~dynaseq.nn.int8.INT8_HANDLERS` is replaced by its int8 version (``nn.Linear``,
    DMB branches, MoE experts) unless it lies inside a module kept in float (gates, routers,
    control nets), and token embeddings become :class:`Int8TokenEmbedding` (see the module
    docstring). Works for dense, CCT, DMB and MoE seq2seq models.

    Raises:
        DynaseqError: the model is already quantized, or has nothing to quantize outside
            its gates.
    """
    if is_int8(model):
        raise DynaseqError("the model is already int8-quantized")
    from dynaseq.models.seq2seq import TokenEmbedding

    qmodel = copy.deepcopy(model).cpu().eval()
    memo: dict[int, nn.Module] = {}
    embeds = {id(m): m for m in qmodel.modules() if isinstance(m, TokenEmbedding)}
    by_weight = {}
    for emb in embeds.values():
        memo[id(emb)] = Int8TokenEmbedding.from_float(emb)
        by_weight[id(emb.weight)] = memo[id(emb)]
    # output layers tied to an embedding (the same Parameter) share its int8 tensors
    for m in qmodel.modules():
        if type(m) is nn.Linear and id(m.weight) in by_weight:
            bias = None if m.bias is None else m.bias.detach().float().clone()
            memo[id(m)] = by_weight[id(m.weight)].output_layer(bias)
    n_embeds = sum(isinstance(child, TokenEmbedding) for m in qmodel.modules()
                   for child in m.children())
    if _quantize_children(qmodel, memo) <= n_embeds:
        raise DynaseqError("nothing to quantize: the model has no nn.Linear or other layer "
                           "with an int8 version outside its gates")
    return qmodel.eval()


def _int8_tensors(model: nn.Module) -> list[Tensor]:
    """The distinct int8 weights and biases held by int8 modules (shared ones once)."""
    seen: dict[int, Tensor] = {}
    for m in model.modules():
        if isinstance(m, _QUANTIZED):
            for name in ("weight_int8", "bias"):
                t = getattr(m, name, None)
                if isinstance(t, Tensor):
                    seen.setdefault(id(t), t)
    return list(seen.values())


def int8_param_count(model: nn.Module) -> int:
    """Weights held by int8 modules as buffers (not ``nn.Parameter``s): int8 matrices and
    embeddings with their float biases; an output layer tied to an embedding counted once."""
    return sum(t.numel() for t in _int8_tensors(model))


# --------------------------------------------------------------------------- saving


def int8_state(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and safetensors metadata that :func:`load_int8_state` reads back.

    Every parameter and persistent buffer under its state-dict name (int8 weights as int8,
    their per-channel scales as float32); a tensor shared by two modules (a tied output layer
    and its embedding, shared embeddings) is stored once and the other names recorded as
    aliases of it (metadata ``aliases``).
    """
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], str] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, Tensor) or t.is_quantized:
            raise DynaseqError(f"cannot save {key}: not a plain tensor")
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        tensors[key] = t.detach().contiguous()
    metadata = {"format": _FORMAT, "quantization": INT8, "aliases": json.dumps(aliases)}
    return tensors, metadata


def _from_v1(tensors: dict[str, Tensor], metadata: dict[str, str]) -> dict[str, Tensor]:
    """Tensors of a ``dynaseq-int8-v1`` (torch.ao) checkpoint under this format's names:
    ``X.weight.int8`` -> ``X.weight_int8``, ``X.weight.scale`` -> ``X.weight_scale`` (float32);
    a tied output layer gets its embedding's tensors.

    Raises:
        CheckpointError: a matrix with a nonzero zero point or a per-tensor scale (not
            made by dynaseq's quantize).
    """
    out = {}
    for key, t in tensors.items():
        if key.endswith(".weight.int8"):
            out[key[:-len(".weight.int8")] + ".weight_int8"] = t
        elif key.endswith(".weight.scale"):
            if t.dim() != 1:
                raise CheckpointError(f"int8 checkpoint: {key} is not a per-channel scale")
            out[key[:-len(".weight.scale")] + ".weight_scale"] = t.float()
        elif key.endswith(".weight.zero_point"):
            if bool(t.ne(0).any()):
                raise CheckpointError(f"int8 checkpoint: {key} is not symmetric (zero point 0)")
        else:
            out[key] = t
    for lin, emb in json.loads(metadata.get("ties", "{}")).items():
        for a, b in (("weight_int8", "weight_int8"), ("weight_scale", "row_scale")):
            if f"{emb}.{b}" not in out:
                raise CheckpointError(f"int8 checkpoint: {lin} is tied to missing {emb}.{b}")
            out[f"{lin}.{a}"] = out[f"{emb}.{b}"]
    return out


def load_int8_state(model: nn.Module, tensors: dict[str, Tensor],
                    metadata: dict[str, str]) -> None:
    """Fill an int8 ``model`` (same structure) with :func:`int8_state` output, in place.

    Raises:
        CheckpointError: not an int8 checkpoint, or a tensor is missing, left over or of the
            wrong shape or dtype.
    """
    fmt = metadata.get("format")
    if fmt not in (_FORMAT, _FORMAT_V1):
        raise CheckpointError(f"not an int8 checkpoint (format {fmt!r})")
    tensors = dict(tensors)
    for key, orig in json.loads(metadata.get("aliases", "{}")).items():
        if orig not in tensors:
            raise CheckpointError(f"int8 checkpoint: alias {key} -> missing {orig}")
        tensors[key] = tensors[orig]
    if fmt == _FORMAT_V1:
        tensors = _from_v1(tensors, metadata)
    slots = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(slots) - set(tensors)), sorted(set(tensors) - set(slots))
    if missing or unexpected:
        raise CheckpointError(f"int8 checkpoint does not match the model: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}")
    for key, value in tensors.items():
        slot = slots[key]
        if slot.shape != value.shape or (slot.dtype == torch.int8) != (value.dtype == torch.int8):
            raise CheckpointError(f"int8 checkpoint: {key} has shape {tuple(value.shape)} "
                                  f"{value.dtype}, expected {tuple(slot.shape)} {slot.dtype}")
    # copied one by one into the existing tensors: tensors shared by two modules stay shared
    with torch.no_grad():
        for key, value in tensors.items():
            slots[key].copy_(value)


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
    with os_errors():
        save_file(tensors, str(d / WEIGHTS), metadata=metadata)
        write_meta(d, {**(meta or {}), "quantization": INT8})  # with the weights' SHA-256
    return d


def load_int8(float_model: nn.Module, directory: str | Path) -> nn.Module:
    """Rebuild the int8 model saved in ``directory`` from a float model of the same config.

    ``float_model`` supplies the structure (its weights do not matter): it is quantized with
    :func:`quantize_int8`, then every tensor is replaced by the stored one.
    """
    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"no checkpoint in {directory} (missing {WEIGHTS})")
    if (Path(directory) / META).is_file():  # a damaged file is refused, as a float one is
        verify_file(Path(directory), WEIGHTS)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"corrupt checkpoint {path}: {msg}") from None
    qmodel = quantize_int8(float_model)
    load_int8_state(qmodel, tensors, metadata)
    return qmodel.eval()


def is_int8_checkpoint(meta: dict[str, Any]) -> bool:
    """True for the ``meta.json`` of a checkpoint written by :func:`save_int8`."""
    return meta.get("quantization") == INT8
