"""What a client library sent to `kvcache serve` and what came back.

``Wire`` hands out httpx2 transports (the transport the official ``openai`` package runs on, so
every client in the suite can be given one) that record each request body, the status, the
headers and the whole reply, streamed or not, without changing a byte. ``Wire.problems`` checks
each exchange against what the server owes any client (client_owed.py).
"""

from __future__ import annotations

import contextlib
import json
import zlib
from dataclasses import dataclass, field
from typing import Any

import httpx2 as httpx
from client_owed import owed

KEY = "sk-local-dummy"  # the suite's server runs without keys; clients insist on sending one


@dataclass
class Exchange:
    method: str
    path: str
    request: Any  # the JSON body the client sent (None for a GET)
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytearray = field(default_factory=bytearray)

    @property
    def streamed(self) -> bool:
        return "text/event-stream" in self.headers.get("content-type", "")

    @property
    def ignored(self) -> str | None:
        return self.headers.get("x-kvcache-ignored-fields")

    def body(self) -> bytes:
        data = bytes(self.raw)
        if self.headers.get("content-encoding") == "gzip":
            data = zlib.decompress(data, 16 + zlib.MAX_WBITS)
        return data

    def reply(self) -> dict | None:
        """The reply as one chat completion: a streamed one reassembled from its chunks."""
        text = self.body().decode("utf-8", "replace")
        if not self.streamed:
            try:
                return json.loads(text)
            except ValueError:
                return None
        return _assemble(text)


def _assemble(sse: str) -> dict:
    choices: dict[int, dict] = {}
    usage = None
    for line in sse.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            return chunk
        usage = chunk.get("usage") or usage
        for ch in chunk.get("choices") or []:
            c = choices.setdefault(ch["index"], {"index": ch["index"], "finish_reason": None,
                                                 "message": {"role": "assistant", "content": None}, "calls": {}})
            delta = ch.get("delta") or {}
            if delta.get("content"):
                c["message"]["content"] = (c["message"]["content"] or "") + delta["content"]
            for d in delta.get("tool_calls") or []:
                call = c["calls"].setdefault(d["index"], {"id": None, "type": "function",
                                                          "function": {"name": None, "arguments": ""}})
                call["id"] = d.get("id") or call["id"]
                fn = d.get("function") or {}
                call["function"]["name"] = fn.get("name") or call["function"]["name"]
                call["function"]["arguments"] += fn.get("arguments") or ""
            c["finish_reason"] = ch.get("finish_reason") or c["finish_reason"]
    out = []
    for _, c in sorted(choices.items()):
        if c["calls"]:
            c["message"]["tool_calls"] = [v for _, v in sorted(c.pop("calls").items())]
        else:
            c.pop("calls")
        out.append(c)
    return {"object": "chat.completion", "choices": out, "usage": usage, "streamed": True}


class _Tee(httpx.SyncByteStream):
    def __init__(self, inner: Any, sink: bytearray) -> None:
        self.inner, self.sink = inner, sink

    def __iter__(self):
        for chunk in self.inner:
            self.sink += chunk
            yield chunk

    def close(self) -> None:
        self.inner.close()


class _ATee(httpx.AsyncByteStream):
    def __init__(self, inner: Any, sink: bytearray) -> None:
        self.inner, self.sink = inner, sink

    async def __aiter__(self):
        async for chunk in self.inner:
            self.sink += chunk
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Recording(httpx.BaseTransport):
    def __init__(self, wire: "Wire") -> None:
        self.wire, self.inner = wire, httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        ex = self.wire.begin(request, request.read())
        resp = self.inner.handle_request(request)
        ex.status, ex.headers = resp.status_code, {k.lower(): v for k, v in resp.headers.items()}
        return httpx.Response(resp.status_code, headers=resp.headers, stream=_Tee(resp.stream, ex.raw),
                              extensions=resp.extensions, request=request)

    def close(self) -> None:
        self.inner.close()


class _ARecording(httpx.AsyncBaseTransport):
    def __init__(self, wire: "Wire") -> None:
        self.wire, self.inner = wire, httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        ex = self.wire.begin(request, await request.aread())
        resp = await self.inner.handle_async_request(request)
        ex.status, ex.headers = resp.status_code, {k.lower(): v for k, v in resp.headers.items()}
        return httpx.Response(resp.status_code, headers=resp.headers, stream=_ATee(resp.stream, ex.raw),
                              extensions=resp.extensions, request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Wire:
    """The exchanges of one test, recorded by the transports it hands out."""

    def __init__(self) -> None:
        self.exchanges: list[Exchange] = []

    def begin(self, request: httpx.Request, content: bytes) -> Exchange:
        try:
            body = json.loads(content) if content else None
        except ValueError:
            body = content
        ex = Exchange(request.method, request.url.path, body)
        self.exchanges.append(ex)
        return ex

    def http_client(self) -> httpx.Client:
        # trust_env=False: no proxy from the environment; the client talks to 127.0.0.1 only
        return httpx.Client(transport=_Recording(self), timeout=120, trust_env=False)

    def async_http_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=_ARecording(self), timeout=120, trust_env=False)

    def chats(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.path.endswith("/chat/completions")]

    def problems(self) -> list[str]:
        out = []
        for i, ex in enumerate(self.exchanges):
            out += [f"exchange {i} ({ex.method} {ex.path}): {p}" for p in owed(ex)]
        return out

    def assert_owed(self, min_chats: int = 1) -> None:
        """Every exchange got what the server owes; at least ``min_chats`` chat requests were made."""
        assert len(self.chats()) >= min_chats, f"{len(self.chats())} chat requests: {self.summary()}"
        problems = self.problems()
        assert not problems, "\n".join(problems) + "\n" + self.summary()

    @contextlib.contextmanager
    def explains(self):
        """A client's exception inside is reported with what the server owed and did not give."""
        try:
            yield
        except Exception as e:
            problems = self.problems()
            if problems:
                raise AssertionError(f"{type(e).__name__}: {str(e)[:500]}\nwhat the server owed:\n"
                                     + "\n".join(problems)) from e
            raise

    def summary(self, limit: int = 1500) -> str:
        lines = []
        for i, ex in enumerate(self.exchanges):
            lines.append(f"--- exchange {i}: {ex.method} {ex.path} -> {ex.status}"
                         f"{' (stream)' if ex.streamed else ''}{f' ignored={ex.ignored}' if ex.ignored else ''}")
            lines.append("  sent: " + json.dumps(ex.request)[:limit])
            lines.append("  got:  " + json.dumps(ex.reply())[:limit])
        return "\n".join(lines)
