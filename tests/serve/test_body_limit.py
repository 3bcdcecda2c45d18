"""The server's body limits, as ASGI middleware around a small app: a chunked body is
measured as it arrives (before, only ``Content-Length`` was checked, and a 200 MiB chunked
body was read and parsed whole), and a stalled body is refused after ``timeout_s`` (before,
a client that sent half a body held a ``--max-in-flight`` slot until it hung up)."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from pydantic import BaseModel

from dynaseq.serve.app import BodyLimit


class Echo(BaseModel):
    text: str


def _app(seen: dict) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        body = await request.body()
        seen["answered"] = True
        return {"bytes": len(body)}

    @app.post("/wait")  # reads the body, then waits for the client to go (no time limit)
    async def wait(request: Request) -> dict:
        body = await request.body()
        seen["after_body"] = (await request.receive())["type"]
        return {"bytes": len(body)}

    @app.post("/parsed")  # FastAPI reads the body itself (a failed read answers 400)
    async def parsed(body: Echo) -> dict:
        seen["answered"] = True
        return {"bytes": len(body.text)}

    return app


GONE = b"<the client disconnects>"


def _call(chunks: list[bytes | None], limit: int, timeout_s: float = 5.0,
          headers: list[tuple[bytes, bytes]] = (), path: str = "/echo"
          ) -> tuple[int, dict, dict]:
    """POST ``chunks`` (None: a pause past ``timeout_s``; :data:`GONE`: a disconnect) through :class:`BodyLimit`; the
    status, the JSON answer, and what the app saw (``reads``: messages it received)."""
    seen = {"reads": 0}
    sent: list[dict] = []
    pending = list(chunks)

    async def receive() -> dict:
        seen["reads"] += 1
        if not pending:  # the body is in: the client waits for its answer
            await asyncio.sleep(3 * timeout_s)
            return {"type": "http.disconnect"}
        chunk = pending.pop(0)
        if chunk == GONE:
            return {"type": "http.disconnect"}
        if chunk is None:
            await asyncio.sleep(3 * timeout_s)
            chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": [(b"content-type", b"application/json"),
                                              *headers], "http_version": "1.1",
             "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1)}
    asyncio.run(BodyLimit(_app(seen), limit, timeout_s)(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body), seen


def test_a_chunked_body_within_the_limit_is_served():
    status, answer, _ = _call([b"a" * 60, b"b" * 40], limit=100)
    assert (status, answer) == (200, {"bytes": 100})


def test_a_chunked_body_past_the_limit_is_refused_at_the_chunk_that_passes_it():
    status, answer, seen = _call([b"a" * 60, b"b" * 60, b"c" * 60, b"d" * 60], limit=100)
    assert status == 413
    assert answer == {"error": "body of more than 100 bytes; the limit is 100"}
    assert seen["reads"] == 2 and "answered" not in seen  # the rest was never read


def test_a_body_fastapi_reads_itself_is_refused_as_well():
    status, answer, seen = _call([b'{"text": "' + b"a" * 80, b'"}'], limit=100, path="/parsed")
    assert (status, answer) == (200, {"bytes": 80})
    status, answer, seen = _call([b'{"text": "' + b"a" * 80, b"a" * 80, b'"}'], limit=100,
                                 path="/parsed")
    assert (status, answer["error"]) == (413, "body of more than 100 bytes; the limit is 100")
    assert "answered" not in seen


def test_a_content_length_past_the_limit_is_refused_before_any_read():
    status, answer, seen = _call([b"a" * 10], limit=5, headers=[(b"content-length", b"10")])
    assert (status, answer["error"]) == (413, "body of 10 bytes; the limit is 5")
    assert seen["reads"] == 0


def test_a_stalled_body_is_refused_after_the_timeout_but_a_waiting_client_is_not():
    status, answer, seen = _call([b"a" * 10, None, b"b" * 10], limit=100, timeout_s=0.05)
    assert (status, answer) == (408, {"error": "the request body stalled: no bytes for "
                                               "0.05 s"})
    assert "answered" not in seen
    # once the body is in, waiting for a disconnect (0.15 s here) has no time limit
    status, answer, seen = _call([b"a" * 10], limit=100, timeout_s=0.05, path="/wait")
    assert (status, answer, seen["after_body"]) == (200, {"bytes": 10}, "http.disconnect")


def test_a_client_gone_before_its_body_is_in_is_logged_499_not_400():
    for path in ("/echo", "/parsed"):  # read by the endpoint, or by FastAPI itself
        status, answer, seen = _call([b'{"text": "', GONE], limit=100, path=path)
        assert (status, answer) == (499, {"error": "the client closed the connection before "
                                                   "its body was in"}), path
        assert "answered" not in seen
