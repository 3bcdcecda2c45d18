"""The server tests' helpers (importable as ``serve_helpers``): the budgets of the micro
CCT they serve, a real ``dynaseq serve`` process, and an app on uvicorn in a thread."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from dynaseq.serve.app import build_app

from helpers import REPO, free_port

BUDGETS = [(1.0, 1.0), (0.5, 0.5), (1.0, 0.33)]


class Server:
    """A ``dynaseq serve`` child process on 127.0.0.1 and a client for it."""

    def __init__(self, run: Path, *args: str, log: Path | None = None) -> None:
        self.port = int(free_port())
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO / "src")}
        self.log = log
        self.stderr = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynaseq", "serve", str(run), "--port", str(self.port),
             "--threads", "1", *args], stdout=subprocess.DEVNULL, stderr=self.stderr,
            env=env, cwd=REPO)
        self.client = httpx.Client(base_url=self.url, timeout=60)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynaseq serve exited {self.proc.returncode}: "
                                   f"{self.log_text()}")
            with contextlib.suppress(httpx.TransportError):
                if self.client.get("/readyz").status_code == 200:
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("dynaseq serve did not get ready in 120 s")
            time.sleep(0.1)

    def log_text(self) -> str:
        return self.log.read_text() if self.log is not None and self.log.exists() else ""

    def post(self, path: str, **kw) -> httpx.Response:
        return self.client.post(path, **kw)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of ``/metrics`` (0 when absent)."""
        want = {k: str(v) for k, v in labels.items()}
        for line in self.client.get("/metrics").text.splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            base, _, rest = key.partition("{")
            got = dict(re.findall(r'(\w+)="([^"]*)"', rest))
            if base == name and got == want:
                return float(value)
        return 0.0

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.client.close()
            if self.stderr is not subprocess.DEVNULL:
                self.stderr.close()


class InProcess:
    """The app of ``state`` on uvicorn in a thread (to reach into the batch function)."""

    def __init__(self, state) -> None:
        self.port = int(free_port())
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
