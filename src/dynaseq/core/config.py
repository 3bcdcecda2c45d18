"""Typed configuration: dataclasses validated in ``__post_init__``, YAML in and out.

This module holds the machinery (:func:`from_dict` / :func:`to_dict` with type checks,
``key.sub=value`` overrides, :func:`load_config` by the ``task:`` key) and the one section
every task shares, :class:`TrainConfig` (what the training loop reads). Each task defines its
run config beside its code (``tasks/translation/config.py``, ``tasks/lm/config.py``) and
each technique its section (``techniques/cct/config.py``, ...). Unknown keys and wrong value
types raise :class:`ConfigError` naming the key.

Example::

    cfg = load_config("configs/multi30k_small.yaml", ["train.max_steps=100"], RUN_CONFIGS)
    save_config(cfg, "run/config.yaml")
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import yaml

from dynaseq.core.errors import ConfigError
from dynaseq.core.files import atomic_write, read_text

#: Named model sizes shared by every task (``size:`` in a model section). ``tiny`` and
#: ``small`` are the DMB paper's on-device settings.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 128, "ffn_dim": 512, "n_heads": 4},
    "small": {"d_model": 256, "ffn_dim": 1024, "n_heads": 4},
    "base": {"d_model": 512, "ffn_dim": 2048, "n_heads": 8},
    "big": {"d_model": 1024, "ffn_dim": 4096, "n_heads": 16},  # Vaswani et al. (2017) big
}


def apply_size(cfg: Any) -> None:
    """Fill each dimension of ``cfg`` (``d_model``, ``ffn_dim``, ``n_heads``) that is None from
    its named ``size`` (:data:`MODEL_SIZES`; no size: ``tiny``), from YAML and Python alike.
    Raises :class:`ConfigError` for an unknown size."""
    if cfg.size is not None and cfg.size not in MODEL_SIZES:
        raise ConfigError(f"unknown model size {cfg.size!r}; known: {sorted(MODEL_SIZES)}")
    for name, value in MODEL_SIZES[cfg.size or "tiny"].items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)


def check_positive(obj: Any, *names: str) -> None:
    """Raise :class:`ConfigError` unless each named field of ``obj`` is > 0 (NaN fails)."""
    for name in names:
        if not getattr(obj, name) > 0:  # NaN too
            raise ConfigError(f"{name} must be > 0, got {getattr(obj, name)!r}")


def check_fraction(obj: Any, *names: str) -> None:
    """Raise :class:`ConfigError` unless each named field of ``obj`` lies in [0, 1)."""
    for name in names:
        value = getattr(obj, name)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {value!r}")


def check_task(cfg: Any, task: str, what: str) -> None:
    """Raise :class:`ConfigError` unless the run config ``cfg`` (``what``: e.g. "an MLM")
    names ``task`` in its ``task`` field: a task's run config parses only its own runs."""
    if cfg.task != task:
        raise ConfigError(f"task must be {task!r} for {what} config, got {cfg.task!r}")


#: The precisions a run trains (``train.precision``) or a predictor runs (``precision=``)
#: in: float32, or bfloat16 matrix products (:func:`dynaseq.core.distributed.pick_dtype`).
PRECISIONS = ("fp32", "bf16")


def check_precision(name: str) -> None:
    """Raise :class:`ConfigError` unless ``name`` is one of :data:`PRECISIONS`."""
    if name not in PRECISIONS:
        raise ConfigError(f"precision must be 'fp32' or 'bf16', got {name!r}")


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping. ``lr`` is the peak of the learning-rate ``schedule``:
    ``inverse_sqrt`` (Vaswani et al.) or ``cosine`` (linear warm-up, then cosine decay to
    ``min_lr_ratio`` · lr at ``max_steps``). ``tensorboard``: the train and valid scalars of
    ``log.jsonl`` also go to ``run_dir/tensorboard`` (needs the ``tensorboard`` extra).
    ``precision``: ``fp32``, or ``bf16`` for the forward pass and loss of each update under
    ``torch.autocast`` (bfloat16 matrix products; weights, gradients, optimizer state and
    validation stay float32; no loss scaling, as bfloat16 keeps float32's exponent range)."""

    seed: int = 1
    lr: float = 7e-4
    warmup_steps: int = 4000
    betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    update_freq: int = 1
    label_smoothing: float = 0.1
    max_steps: int = 100_000
    max_epochs: int = 1000
    max_minutes: float | None = None
    log_every: int = 50
    valid_every: int = 1000
    save_every: int = 1000
    keep_last: int = 5
    average_last_k: int = 0
    valid_bleu_lines: int = 500
    valid_beam: int = 1
    device: str = "auto"
    schedule: str = "inverse_sqrt"
    min_lr_ratio: float = 0.0
    tensorboard: bool = False  # also write the logged scalars to run_dir/tensorboard
    precision: str = "fp32"

    def __post_init__(self) -> None:
        check_positive(self, "lr", "update_freq", "max_steps", "max_epochs", "log_every",
                        "valid_every", "save_every", "keep_last", "valid_beam")
        if self.schedule not in ("cosine", "inverse_sqrt"):
            raise ConfigError(f"schedule must be 'cosine' or 'inverse_sqrt', got "
                              f"{self.schedule!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("min_lr_ratio must be in [0, 1]")
        if self.warmup_steps < 0 or self.average_last_k < 0 or self.valid_bleu_lines < 0:
            raise ConfigError("warmup_steps, average_last_k and valid_bleu_lines must be >= 0")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ConfigError("max_minutes must be > 0")
        if not (self.weight_decay >= 0 and self.clip_norm >= 0 and self.adam_eps > 0):
            raise ConfigError("weight_decay and clip_norm must be >= 0 and adam_eps > 0")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas must be in [0, 1), got {list(self.betas)}")
        check_fraction(self, "label_smoothing")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        check_precision(self.precision)


# --------------------------------------------------------------------------- conversion


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it in the field's type."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:  # Optional[X]: X's own, more precise error
            return _coerce(value, non_none[0], key)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return from_dict(tp, value, prefix=f"{key}.")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}")
            return tuple(_coerce(v, a, key) for v, a in zip(value, args, strict=True))
        inner = args[0] if args else Any
        items = [_coerce(v, inner, key) for v in value]
        return tuple(items) if origin is tuple else items
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if not -(2**63) <= value < 2**63:
            raise ConfigError(f"{key}: {value} is out of range (a 64-bit integer)")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {_type_name(tp)}")


T = typing.TypeVar("T")


def from_dict(cls: type[T], raw: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a plain mapping, refusing unknown keys and bad types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]!s}; "
                          f"known keys: {', '.join(sorted(names))}")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}{k}") for k, v in raw.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # a message that starts with a key reads as its path ("data.spm_model_type must be
        # ..."); another after the section's name ("model: unknown model size 'huge'")
        key = re.match(r"[A-Za-z_]\w*", str(e))
        section = prefix.rstrip(".").rsplit(".", 1)[-1]
        if str(e).startswith(f"{section}."):  # it names its own section: the path above it
            joined = f"{prefix[: -len(section) - 1]}{e}"
        elif key and key.group() in names:
            joined = f"{prefix}{e}"
        else:
            joined = f"{prefix.rstrip('.')}: {e}"
        raise ConfigError(joined if prefix else str(e)) from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain, YAML-safe mapping of a config dataclass (tuples become lists)."""

    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
    node[parts[-1]] = value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` strings (values parsed as YAML scalars) to a raw mapping."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, text = item.split("=", 1)
        try:
            value = yaml.load(text, Loader=_UniqueKeys) if text != "" else ""  # noqa: S506
        except yaml.YAMLError:
            value = text
        _set_dotted(raw, key.strip(), value)
    return raw


class _UniqueKeys(yaml.SafeLoader):
    """PyYAML's safe loader refusing a key given twice in one mapping (PyYAML keeps the last
    one silently and has no option for this, hence by hand): a config that sets
    ``train.lr`` twice is a mistake to report, not a value to guess. It also reads
    ``3e-3`` as the number YAML 1.2 and every user mean (PyYAML, YAML 1.1, wants a dot:
    ``3.0e-3``, and gave the string ``"3e-3"``, refused as "expected a number")."""


_UniqueKeys.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _mapping(loader: _UniqueKeys, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # <<: *base, expanded by PyYAML below
            continue
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, Hashable):
            continue  # construct_mapping refuses it below
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                                    key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    text = read_text(p, "config file", ConfigError)
    try:
        raw = yaml.load(text, Loader=_UniqueKeys)  # noqa: S506  (a safe loader)
    except yaml.YAMLError as e:
        msg = " ".join(str(e).split())
        raise ConfigError(f"config {p} is not valid YAML: {msg}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config {p} must be a mapping at top level")
    return raw


#: The ``task:`` of a config that names none.
DEFAULT_TASK = "seq2seq"


def config_task(raw: dict[str, Any]) -> Any:
    """What the ``task:`` key of a raw config mapping says (absent: :data:`DEFAULT_TASK`)."""
    return raw.get("task", DEFAULT_TASK)


def parse_config(raw: dict[str, Any], types: Mapping[str, type[T]]) -> T:
    """A raw config mapping as the type ``types`` maps its ``task:`` to (the tasks' table is
    :data:`dynaseq.tasks.registry.RUN_CONFIGS`; a type without a ``task`` field takes the
    key off). Raises :class:`ConfigError` for a task ``types`` does not list, an unknown key
    or a bad value."""
    task = config_task(raw)
    if not isinstance(task, str) or task not in types:
        raise ConfigError(f"unknown task {task!r}; known: {', '.join(types)}")
    cls = types[task]
    if "task" not in {f.name for f in dataclasses.fields(cls)}:
        raw = {k: v for k, v in raw.items() if k != "task"}
    return from_dict(cls, raw)


def load_config(path: str | Path | None, overrides: list[str] | None,
                types: Mapping[str, type[T]]) -> T:
    """Read a YAML config (or the defaults when ``path`` is None), apply ``key.sub=value``
    overrides and parse it (:func:`parse_config`)."""
    raw = read_yaml(path) if path is not None else {}
    return parse_config(apply_overrides(raw, list(overrides or [])), types)


def save_config(cfg: Any, path: str | Path) -> None:
    atomic_write(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
