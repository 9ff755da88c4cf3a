"""One HTTP request through an ASGI app in this process, its response as a stream of messages.

An engine replica receives requests as ``HttpCall`` values (method, path, query, headers, body)
and runs each through the very FastAPI app ``kvcache serve`` runs (server/app.py): same routes,
auth, limits, streaming and errors. ``run_call`` yields the app's ``http.response.start`` as
``("start", status, headers)`` and each body chunk as ``("body", bytes)``. When the consumer stops
reading (its client left, or the call was cancelled), the app is told ``http.disconnect``, which
aborts the engine request as a client leaving ``kvcache serve`` does.

Locking: none; one event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Union

Message = Union[tuple[str, int, list[tuple[bytes, bytes]]], tuple[str, bytes]]
_END = object()


@dataclass(frozen=True)
class HttpCall:
    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""

    def header(self, name: str) -> str | None:
        want = name.lower().encode()
        for k, v in self.headers:
            if k.lower() == want:
                return v.decode("latin-1")
        return None


def _scope(call: HttpCall) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
            "query_string": call.query, "root_path": "", "headers": list(call.headers),
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {}}


async def run_call(app: Any, call: HttpCall, extra_headers: tuple[tuple[bytes, bytes], ...] = ()) -> AsyncIterator[Message]:
    """Run ``call`` through ``app``; ``extra_headers`` are added to the response's."""
    queue: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    read = False
    started = False

    async def receive() -> dict[str, Any]:
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        nonlocal started
        if gone.is_set():
            raise OSError("the client is gone")
        if msg["type"] == "http.response.start":
            started = True
            queue.put_nowait(("start", msg["status"], list(msg.get("headers", ())) + list(extra_headers)))
        elif msg["type"] == "http.response.body":
            if msg.get("body"):
                queue.put_nowait(("body", bytes(msg["body"])))
            if not msg.get("more_body", False):
                queue.put_nowait(_END)

    async def drive() -> None:
        try:
            await app(_scope(call), receive, send)
        except Exception as e:  # after a 500 went out, Starlette raises again; before, answer one
            if not started and not gone.is_set():
                body = json.dumps({"error": {"message": f"internal error: {type(e).__name__}", "type": "server_error",
                                             "param": None, "code": None}}).encode()
                queue.put_nowait(("start", 500, [(b"content-type", b"application/json")] + list(extra_headers)))
                queue.put_nowait(("body", body))
        finally:
            queue.put_nowait(_END)

    task = asyncio.create_task(drive())
    try:
        while True:
            item = await queue.get()
            if item is _END:
                break
            yield item
    finally:
        gone.set()  # a consumer that stopped early is a client that left: the app aborts its work
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
