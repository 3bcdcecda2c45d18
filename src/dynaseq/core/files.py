"""Reading small text files (configs, vocabularies) with one clear error for bad input."""

from __future__ import annotations

from pathlib import Path

from dynaseq.core.errors import DynaseqError


def read_text(path: str | Path, what: str, error: type[DynaseqError] = DynaseqError) -> str:
    """The UTF-8 text of ``path``; ``error("<what> not found: PATH")`` if it is missing and
    ``error("cannot read <what> PATH: ...")`` if it cannot be read or decoded."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} not found: {p}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"cannot read {what} {p}: {e}") from None
