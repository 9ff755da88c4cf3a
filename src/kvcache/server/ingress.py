"""Ingress: the HTTP entry of kvcache's Ray Serve application.

Ray Serve's proxy hands every HTTP request to ``Ingress.__call__``. The ingress reads the body (up
to the server's limit; the replica refuses what is over), works out the request's route keys
(the prompt's token ids, by the same tokenizer and chat template the replicas use, chained under
the tenant salt of its API key) and forwards the request, untouched, to an engine replica through
the ``PrefixRouter``. The replica's app does everything else (auth, validation, generation), so
the routed endpoint answers exactly as ``kvcache serve`` does. A request the ingress cannot read
is forwarded without route keys, and the replica gives the error.

Failures: when the engine replica dies before it answered (queued, or in a non-streamed
generation), the request is sent once more to another replica; when it dies in the middle of a
stream, the stream ends with an OpenAI-style ``error`` event. With prefill replicas, a prompt of
at least ``prefill_min_tokens`` first goes to one of them, which computes its pages into the
shared tier; a failed prefill only costs the time it took (the engine computes what it lacks).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvcache.server.asgi import HttpCall
from kvcache.server.routing import KeySpace, RouteHint, route_keys

RETRIES = 1  # extra tries of a request whose engine replica died before answering


def _died(e: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError))


class Ingress:
    def __init__(self, engine: Any, prefill: Any, tokenizer_dir: str, spec: Any, prefill_min_tokens: int) -> None:
        from kvcache.models.tokenizer import Tokenizer
        from kvcache.server.auth import Auth

        self.engine, self.prefill, self.limits = engine, prefill, spec.limits
        self.prefill_min_tokens = prefill_min_tokens
        self.auth = Auth(spec.api_keys, spec.admin_keys, metrics_public=spec.metrics_public)
        self.tok = SimpleNamespace(tokenizer=Tokenizer.from_dir(tokenizer_dir))  # what server/tokens.py reads
        self.space: KeySpace | None = None
        self.model: str | None = None
        self.prefills = {"sent": 0, "failed": 0}

    async def __call__(self, http: HttpRequest) -> Response:
        call = HttpCall(http.method, http.url.path, http.url.query.encode(), tuple(http.headers.raw),
                        await self._body(http))
        ids, salt = await self._tokens(call)
        hint = RouteHint(route_keys(self.space, ids, salt), len(ids)) if ids and self.space is not None else RouteHint()
        if self.prefill is not None and len(ids) >= self.prefill_min_tokens:
            await self._prefill(call, ids, hint)
        return await self._forward(call, hint)

    async def _body(self, http: HttpRequest) -> bytes:
        """The body, cut one byte past the limit (the replica answers 413 from its size)."""
        limit = self.limits.max_request_bytes
        chunks, size = [], 0
        async for chunk in http.stream():
            if size <= limit:
                chunks.append(chunk[: limit + 1 - size])
            size += len(chunk)
        return b"".join(chunks)

    async def _tokens(self, call: HttpCall) -> tuple[list[int], str | None]:
        """The prompt's token ids (the first prompt of several) and the caller's tenant salt; no
        ids when the request is not a generation, has no valid key or cannot be read."""
        if call.method != "POST" or call.path not in ("/v1/completions", "/v1/chat/completions"):
            return [], None
        caller = self.auth.caller(call.header("authorization"))
        if caller is None or not call.body or len(call.body) > self.limits.max_request_bytes:
            return [], None
        if self.space is None:
            await self._learn_space()
        try:
            raw = json.loads(call.body)
            ids = await asyncio.to_thread(self._encode, raw, call.path.endswith("chat/completions"))
        except Exception:  # anything malformed: the replica names the problem
            return [], None
        return ids, caller.salt

    def _encode(self, raw: dict[str, Any], chat: bool) -> list[int]:
        from kvcache.server.protocol import Message
        from kvcache.server.tokens import encode_messages, encode_text

        if chat:
            msgs = [Message.model_validate(m) for m in raw["messages"]]
            return encode_messages(self.tok, [{"role": m.role, "content": m.text()} for m in msgs])  # type: ignore[arg-type]
        prompt = raw["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return encode_text(self.tok, prompt)  # type: ignore[arg-type]
        return [int(t) for t in prompt]

    async def _learn_space(self) -> None:
        """The key space and model name, from any engine replica (once)."""
        try:
            info = await self.engine.describe.remote()
        except Exception:
            return
        self.space, self.model = info["space"], info["model"]

    async def _prefill(self, call: HttpCall, ids: list[int], hint: RouteHint) -> None:
        body = json.dumps({"model": self.model, "prompt": ids, "max_tokens": 1}).encode()
        auth = call.header("authorization")
        headers = ((b"content-type", b"application/json"),) + (((b"authorization", auth.encode()),) if auth else ())
        self.prefills["sent"] += 1
        try:
            out = await self.prefill.prefill.remote(HttpCall("POST", "/v1/completions", b"", headers, body), route=hint)
            ok = out["status"] == 200
        except Exception:
            ok = False
        self.prefills["failed"] += not ok

    async def _forward(self, call: HttpCall, hint: RouteHint) -> Response:
        last: BaseException | None = None
        for _ in range(1 + RETRIES):
            gen = self.engine.options(stream=True).run_http.remote(call, route=hint)
            try:
                head = await gen.__anext__()
            except Exception as e:
                gen.cancel()
                if not _died(e):
                    return _error(500, f"the engine replica failed: {type(e).__name__}: {_first_line(e)}")
                last = e
                continue
            resp = StreamingResponse(_rest(gen, head[2]), status_code=head[1])
            resp.raw_headers = [(k, v) for k, v in head[2]]
            return resp
        return _error(503, f"no engine replica could serve the request (the replica died: {_first_line(last)})")


async def _rest(gen: Any, headers: list[tuple[bytes, bytes]]) -> AsyncIterator[bytes]:
    """The body chunks after the head; a replica dying mid-stream ends an event stream with an
    error event (other bodies just end short)."""
    sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
    done = False
    try:
        async for msg in gen:
            yield msg[1]
        done = True
    except Exception as e:
        if sse:
            err = {"error": {"message": f"the engine replica serving this stream stopped ({type(e).__name__}); "
                                        "the response is incomplete: send the request again",
                             "type": "server_error", "param": None, "code": "replica_failed"}}
            yield f"data: {json.dumps(err)}\n\n".encode()
        done = True
    finally:
        if not done:  # the client left: stop the generation on the replica
            gen.cancel()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": None}},
                        status_code=status)


def _first_line(e: BaseException | None) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300] if e is not None else ""
