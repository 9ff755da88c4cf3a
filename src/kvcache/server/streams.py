"""Running submitted requests for an HTTP request: deltas from the engine thread through an asyncio
queue, the disconnect watcher, SSE framing, the streamed bodies, and engine errors as replies.

A client that goes away (noticed within ``DISCONNECT_POLL_S``, whether or not text is flowing), or
a consumer that stops reading, aborts what is still running; its pages go back to the pool.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from kvcache.engine.request import Request, error_kind
from kvcache.server.logprobs import chat_logprobs, completion_logprobs
from kvcache.server.protocol import ApiError, ChatRequest, CompletionRequest
from kvcache.server.reasoning import ReplyStream, Thinking
from kvcache.server.responses import chat_chunk, completion_chunk, usage_chunk
from kvcache.server.tools import ToolSpec

if TYPE_CHECKING:
    from kvcache.server.state import ServerState

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
ERROR_STATUS = {"invalid": (400, "invalid_request_error", None), "capacity": (503, "server_error", "kv_cache_full"),
                "internal": (500, "server_error", None)}
_GONE = object()  # put on a request's queue when its client disconnected


def error_reply(kind: str, message: str, param: str | None = None) -> ApiError:
    """An engine-side failure as a reply: 400 (the request cannot be served as asked, naming
    ``param``), 503 (the KV pool is full: retry later) or 500 (a fault of the server)."""
    status, type_, code = ERROR_STATUS[kind]
    return ApiError(status, message, type_, param=param if kind == "invalid" else None, code=code)


def engine_error(r: Request, param: str | None = None) -> ApiError:
    if isinstance(r.exception, RecursionError):
        return exception_reply(r.exception, param)
    return error_reply(r.error_kind or "internal", r.error or "the request failed", param)


def exception_reply(e: Exception, param: str | None = None) -> ApiError:
    """An exception raised for one request on the engine thread, as a reply (a RecursionError:
    400 naming ``param``, since only a request's own structure nests that deeply)."""
    if isinstance(e, RecursionError):
        return error_reply("invalid", f"{param or 'the request'} is nested too deeply to be handled", param)
    kind = error_kind(e)
    return error_reply(kind, str(e) if kind != "internal" else f"internal error: {type(e).__name__}: {e}", param)


async def run(state: "ServerState", http: HttpRequest, reqs: list[Request]) -> AsyncIterator[tuple[int, Any]]:
    """Submit ``reqs``; yield (index, Delta) as text arrives and (index, Request) when one ends."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    for i, r in enumerate(reqs):
        r.on_delta = lambda d, i=i: loop.call_soon_threadsafe(queue.put_nowait, (i, d))
        state.engine.submit(r, lambda done, i=i: loop.call_soon_threadsafe(queue.put_nowait, (i, done)))
    watcher = asyncio.create_task(_watch(http, queue))
    left = len(reqs)
    try:
        while left:
            item = await queue.get()
            if item is _GONE:
                return
            if isinstance(item[1], Request):
                left -= 1
                _record(state, item[1])
            yield item
    finally:
        watcher.cancel()
        if left:
            for r in reqs:
                state.engine.abort(r.request_id)
            state.metrics.add("requests_aborted_total", left)


async def _watch(http: HttpRequest, queue: asyncio.Queue) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    queue.put_nowait(_GONE)


def _record(state: "ServerState", r: Request) -> None:
    if r.error:
        state.metrics.add("requests_failed_total")
        return
    gen = sum(len(s.tokens) for s in r.samples)
    ttft = r.t_first - r.t_arrival if r.t_first else None
    steps = max((len(s.tokens) for s in r.samples), default=0) - 1
    tpot = (r.t_end - r.t_first) / steps if r.t_first and steps > 0 else None
    state.metrics.finished(len(r.prompt_ids), gen, max(0, r.cached_tokens), ttft, tpot)


async def collect(state: "ServerState", http: HttpRequest, reqs: list[Request], param: str) -> list[Request]:
    """Run ``reqs`` to the end; the first failure becomes the reply."""
    done: dict[int, Request] = {}
    async for i, item in run(state, http, reqs):
        if isinstance(item, Request):
            done[i] = item
    if len(done) < len(reqs):
        raise ApiError(499, "the client closed the request")
    for r in done.values():
        if r.error:
            raise engine_error(r, param)
    return [done[i] for i in range(len(reqs))]


def _tool_chunks(rid: str, model: str, index: int, events: list[tuple], first: bool,
                 lps: dict | None) -> list[dict[str, Any]]:
    """One chunk per event: content text, reasoning text, a call's header, or a piece of its arguments."""
    out = []
    for ev in events:
        if ev[0] == "content":
            out.append(chat_chunk(rid, model, index, ev[1], None, first, lps))
        elif ev[0] == "reasoning":
            out.append(chat_chunk(rid, model, index, None, None, first, lps, reasoning=ev[1]))
        elif ev[0] == "call":
            call = {"index": ev[1], "id": ev[2], "type": "function", "function": {"name": ev[3], "arguments": ""}}
            out.append(chat_chunk(rid, model, index, None, None, first, lps, [call]))
        else:
            out.append(chat_chunk(rid, model, index, None, None, first, lps,
                                  [{"index": ev[1], "function": {"arguments": ev[2]}}]))
        first, lps = False, None
    return out


def sse(events: AsyncIterator[dict[str, Any]], headers: dict[str, str] | None = None) -> StreamingResponse:
    async def gen() -> AsyncIterator[bytes]:
        async for ev in events:
            yield f"data: {json.dumps(ev)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **(headers or {})})


async def stream_completion(state: "ServerState", http: HttpRequest, rid: str, body: CompletionRequest,
                            reqs: list[Request], echoes: list[tuple[str, dict | None]]) -> AsyncIterator[dict[str, Any]]:
    """``echoes``: per prompt, the text and log-probabilities sent first when ``echo`` is set."""
    n, model = body.n, state.model_name
    ended: list[Request] = []
    for i, (text, lps) in enumerate(echoes):
        for j in range(n):
            yield completion_chunk(rid, model, i * n + j, text, None, lps)
    async for i, item in run(state, http, reqs):
        if isinstance(item, Request):
            if item.error:
                yield engine_error(item, "prompt").body
            ended.append(item)
            continue
        lps = None
        if item.logprobs is not None:
            lps = completion_logprobs(state.text_of, item.logprobs, [e.token for e in item.logprobs])
        yield completion_chunk(rid, model, i * n + item.index, item.text, item.finish_reason, lps)
    if body.stream_options and body.stream_options.include_usage:
        yield usage_chunk(rid, model, "text_completion", ended)


async def stream_chat(state: "ServerState", http: HttpRequest, rid: str, body: ChatRequest, req: Request,
                      tools: ToolSpec | None = None, thinking: Thinking | None = None,
                      harmony: bool = False) -> AsyncIterator[dict[str, Any]]:
    """Each choice's text goes through a ReplyStream where the reply has parts to tell apart
    (``thinking``, ``tools``, gpt-oss's ``harmony`` channels): reasoning as
    ``delta.reasoning_content``, content as it comes, calls as OpenAI streams them
    (``delta.tool_calls``: index, id and name first, then argument pieces)."""
    started: set[int] = set()
    ended: list[Request] = []
    parsers: dict[int, ReplyStream] = {}
    called: set[int] = set()
    model = state.model_name
    plain = tools is None and thinking is None and not harmony
    async for _, item in run(state, http, [req]):
        if isinstance(item, Request):
            if item.error:
                yield engine_error(item, "messages").body
            ended.append(item)
            continue
        first = item.index not in started
        started.add(item.index)
        lps = chat_logprobs(state.text_of, item.logprobs) if item.logprobs is not None else None
        if plain:
            yield chat_chunk(rid, model, item.index, item.text, item.finish_reason, first, lps)
            continue
        parser = parsers.setdefault(item.index, ReplyStream(thinking, tools, harmony))
        events = parser.feed(item.text) + (parser.finish() if item.finish_reason is not None else [])
        for chunk in _tool_chunks(rid, model, item.index, events, first, lps):
            yield chunk
            first, lps = False, None
        if any(e[0] == "call" for e in events):
            called.add(item.index)
        if item.finish_reason is not None:
            reason = "tool_calls" if item.index in called and item.finish_reason == "stop" else item.finish_reason
            yield chat_chunk(rid, model, item.index, None if item.index in called else "", reason, first, lps)
        elif first or lps is not None:  # the role (and log-probabilities) go out even before text does
            yield chat_chunk(rid, model, item.index, "", None, first, lps)
    if body.stream_options and body.stream_options.include_usage:
        yield usage_chunk(rid, state.model_name, "chat.completion.chunk", ended)
