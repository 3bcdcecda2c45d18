"""The run log: one JSON object per line in ``RUN_DIR/log.jsonl`` (``event`` and ``time``
first), written by the training loop and read back by reports and benchmarks."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class RunLog:
    """JSON lines in ``run_dir/log.jsonl`` (main rank only) and the in-memory history."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled
        self.history: list[dict[str, Any]] = []
        self.sinks: list[Callable[[dict[str, Any]], None]] = []  # see add_sink

    def add_sink(self, sink: Callable[[dict[str, Any]], None]) -> None:
        """Also hand every record this log writes to ``sink`` (e.g. TensorBoard), from the
        ones written so far on."""
        self.sinks.append(sink)
        if self.enabled:
            for record in self.history:
                sink(record)

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "time": round(time.time(), 3), **fields}
        self.history.append(record)
        if self.enabled:
            self._append([record])

    def start_writing(self) -> None:
        """Write the records held so far and every later one (a log created disabled holds
        its records until the run is accepted: a refused run writes nothing)."""
        if not self.enabled:
            self.enabled = True
            self._append(self.history)

    def _append(self, records: list[dict[str, Any]]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
        for sink in self.sinks:
            for record in records:
                sink(record)


def read_log(path: str | Path, event: str | None = None) -> list[dict[str, Any]]:
    """The records of a ``log.jsonl`` (only those of ``event`` when given), in order."""
    records = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()
               if line.strip()]
    return [r for r in records if event is None or r.get("event") == event]
