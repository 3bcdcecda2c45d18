"""Checks of the plain arguments of the public API (batch sizes, token counts, seeds,
temperatures, budgets, text): each raises :class:`~dynaseq.core.errors.DynaseqError` naming
the argument, so a bad value is one clear line, not an error from deep inside torch or
SentencePiece.

Why by hand: the values come from Python calls, not from a config or the command line
(those go through the typed configs and argparse)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from pathlib import PurePath

from dynaseq.core.errors import DynaseqError


def check_int(name: str, value: object, least: int = 1, most: int | None = None) -> int:
    """``value`` as an int if it is an integer (a Python or numpy one, not a bool) in
    ``[least, most]``, else a :class:`DynaseqError`: ``check_int("batch_size", 0)`` ->
    "batch_size must be an integer >= 1, got 0"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least or (
            most is not None and value > most):
        within = f">= {least}" if most is None else f"in [{least}, {most}]"
        raise DynaseqError(f"{name} must be an integer {within}, got {value!r}")
    return int(value)


def int_or(name: str, value: object, default: int, least: int = 1) -> int:
    """``default`` for None, else ``value`` checked by :func:`check_int`."""
    return default if value is None else check_int(name, value, least)


def as_real(value: object) -> float:
    """``value`` as a float; TypeError for a bool, a string or bytes (which ``float`` would
    take: ``True`` as 1, ``"0.5"`` as 0.5) and for anything ``float`` refuses. For checks
    that word their own message."""
    if isinstance(value, bool | str | bytes):
        raise TypeError(f"not a number: {value!r}")
    return float(value)


def check_number(name: str, value: object, least: float | None = None) -> float:
    """``value`` as a float if it is a finite real number (not a bool or a string) of at
    least ``least``, else a :class:`DynaseqError`."""
    try:
        x = as_real(value)
    except (TypeError, ValueError, OverflowError):
        x = math.nan
    if not math.isfinite(x):
        raise DynaseqError(f"{name} must be a finite number, got {value!r}")
    if least is not None and x < least:
        raise DynaseqError(f"{name} must be >= {least:g}, got {value!r}")
    return x


def check_path(name: str, value: object, what: str = "a file path") -> None:
    """Refuse a ``value`` that is neither a string nor a :class:`~pathlib.Path` (``what``:
    what it should be, e.g. "a split name or a file path")."""
    if not isinstance(value, str | PurePath):
        raise DynaseqError(f"{name} must be {what}, got {type(value).__name__}")


def check_str(name: str, value: object) -> str:
    """``value`` if it is a string with a UTF-8 form (a lone surrogate such as ``"\\udfff"``
    has none, and SentencePiece needs it), else a :class:`DynaseqError` naming ``name``."""
    if not isinstance(value, str):
        raise DynaseqError(f"{name} has type {type(value).__name__}, not str")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DynaseqError(f"{name} is not valid text: {e.reason} "
                           f"({value[e.start:e.end].encode('unicode_escape').decode()})"
                           ) from None
    return value


def check_text(lines: Sequence[str]) -> None:
    """Refuse lines that are not a list (or tuple) of strings, naming the first bad line
    (1-based; :func:`check_str`)."""
    if isinstance(lines, str) or not isinstance(lines, Sequence):
        raise DynaseqError(f"lines must be a list of strings, not {type(lines).__name__}")
    for n, line in enumerate(lines, start=1):
        check_str(f"line {n}", line)
