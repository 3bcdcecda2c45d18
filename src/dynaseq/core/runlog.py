"""The run log: one JSON object per line in ``RUN_DIR/log.jsonl`` (``event`` and ``time``
first), written by the training loop and read back by reports and benchmarks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class RunLog:
    """JSON lines in ``run_dir/log.jsonl`` (main rank only) and the in-memory history."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled
        self.history: list[dict[str, Any]] = []

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "time": round(time.time(), 3), **fields}
        self.history.append(record)
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def read_log(path: str | Path, event: str | None = None) -> list[dict[str, Any]]:
    """The records of a ``log.jsonl`` (only those of ``event`` when given), in order."""
    records = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()
               if line.strip()]
    return [r for r in records if event is None or r.get("event") == event]
