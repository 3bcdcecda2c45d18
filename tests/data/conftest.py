"""Shared fixtures for the data tests."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    """``<repo>/../shared/data/multi30k``; the test is skipped when it is not there."""
    path = SHARED_DATA / "multi30k"
    if not (path / "val.en.gz").is_file() or not (path / "val.de.gz").is_file():
        pytest.skip(f"real data not found under {path}")
    return path
