"""Where ``dynaseq serve`` listens: an address in use is one error line before the model
loads (it loaded and warmed the model, logged ``ready``, then failed to bind), ``--port 0``
serves on a port the ``ready`` record names, and an empty ``--host`` is refused (it
listened on every interface)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from helpers import REPO, run_cli


def test_an_address_in_use_is_refused_before_the_model_loads(serve_run):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        r = run_cli("serve", str(serve_run), "--port", port)
    err = r.stderr.decode()
    assert r.returncode == 2
    assert err == f"dynaseq: error: cannot serve on 127.0.0.1:{port}: Address already in use\n"


def test_an_empty_host_is_refused(serve_run):
    r = run_cli("serve", str(serve_run), "--host", "", "--port", "0")
    assert r.returncode == 2
    assert r.stderr.decode() == ("dynaseq: error: --host must name an address (0.0.0.0 for "
                                 "every interface)\n")


def test_port_0_serves_on_the_port_the_ready_record_names(serve_run, tmp_path):
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO / "src")}
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "dynaseq", "serve", str(serve_run),
                                 "--port", "0", "--threads", "1", "--beam", "1"],
                                stdout=subprocess.DEVNULL,
                                stderr=err, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        ready = []
        while not ready:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
            ready = [r for r in map(json.loads, (x for x in log.read_text().splitlines()
                                                 if x.startswith("{")))
                     if r.get("event") == "ready"]
        assert ready[0]["host"] == "127.0.0.1" and ready[0]["port"] > 0
        url = f"http://127.0.0.1:{ready[0]['port']}"
        assert httpx.get(url + "/readyz", timeout=30).json()["ready"] is True
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == -signal.SIGTERM
