"""Checks of the plain arguments of the public API (batch sizes, token counts, seeds,
temperatures): each raises :class:`~dynaseq.core.errors.DynaseqError` naming the argument,
so a bad value is one clear line, not an error from deep inside torch.

Why by hand: the values come from Python calls, not from a config or the command line
(those go through the typed configs and argparse)."""

from __future__ import annotations

import math

from dynaseq.core.errors import DynaseqError


def check_int(name: str, value: object, least: int = 1, most: int | None = None) -> int:
    """``value`` if it is an integer (not a bool) in ``[least, most]``, else a
    :class:`DynaseqError`: ``check_int("batch_size", 0)`` -> "batch_size must be an integer
    >= 1, got 0"."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least or (
            most is not None and value > most):
        within = f">= {least}" if most is None else f"in [{least}, {most}]"
        raise DynaseqError(f"{name} must be an integer {within}, got {value!r}")
    return value


def check_number(name: str, value: object, least: float | None = None) -> float:
    """``value`` as a float if it is a finite real number (not a bool) of at least
    ``least``, else a :class:`DynaseqError`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value):
        raise DynaseqError(f"{name} must be a finite number, got {value!r}")
    if least is not None and value < least:
        raise DynaseqError(f"{name} must be >= {least:g}, got {value!r}")
    return float(value)
