"""The OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health,
Prometheus metrics and cache statistics, over the continuous-batching engine.

Requests are validated and tokenized on the event loop, then handed to the EngineLoop thread;
its deltas come back through an asyncio queue per HTTP request. A client that disconnects, streaming
or not, has its request aborted within ``DISCONNECT_POLL_S`` (its pages go back to the pool). With API
keys, each key is a tenant whose prefix-cache entries are salted apart from every other tenant's
(see server/auth.py). One request's failure is reported to it alone: 400 for a request that cannot
be served as asked, 503 when the KV pool is full, 500 for an engine fault.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvcache.engine.llm import LLM
from kvcache.engine.loop import EngineLoop
from kvcache.engine.scheduler import Request, Scheduler, SchedulerConfig
from kvcache.errors import KVCacheError
from kvcache.server.auth import Auth, Caller
from kvcache.server.metrics import Metrics
from kvcache.server.protocol import ChatRequest, CompletionRequest, error_body, new_id
from kvcache.server.responses import chat_chunk, chat_response, completion_chunk, completion_response, usage_chunk


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
ERROR_STATUS = {"invalid": (400, "invalid_request_error", None), "capacity": (503, "server_error", "kv_cache_full"),
                "internal": (500, "server_error", None)}


class ServerState:
    def __init__(self, llm: LLM, model_name: str, auth: Auth, scheduler: SchedulerConfig) -> None:
        self.llm, self.model_name, self.auth = llm, model_name, auth
        self.sched = Scheduler(llm.runner, llm.tokenizer, scheduler)
        self.engine = EngineLoop(self.sched)
        self.metrics = Metrics()

    def caller(self, http: HttpRequest) -> Caller:
        """Who sent the request (its tenant salt and whether it is an admin); 401 without a valid key."""
        caller = self.auth.caller(http.headers.get("authorization"))
        if caller is None:
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                           "authentication_error", code="invalid_api_key")
        return caller

    def gauges(self) -> dict[str, float]:
        """Read on the engine thread (between steps)."""
        sched, llm = self.sched, self.llm
        out: dict[str, float] = {"requests_running": len(sched.running), "requests_waiting": len(sched.waiting),
                                 "preemptions_total": sched.preemptions, "engine_steps_total": sched.steps}
        st = llm.kv_stats()
        if st is not None:
            out.update(kv_pages_total=st.pages_total, kv_pages_used=st.pages_used, kv_pages_cached=st.pages_cached,
                       kv_pages_in_use=st.pages_in_use, kv_bytes_allocated=st.bytes_allocated,
                       kv_usage_ratio=st.pages_in_use / st.pages_total if st.pages_total else 0.0)
        ps = llm.prefix_stats()
        if ps is not None:
            out.update(prefix_hit_rate=ps.hit_rate, prefix_hit_tokens_total=ps.hit_tokens,
                       prefix_evicted_pages_total=ps.evicted_pages)
        return out


def build_app(llm: LLM, model_name: str | None = None, api_keys: tuple[str, ...] = (),
              scheduler: SchedulerConfig | None = None, auth: Auth | None = None) -> FastAPI:
    """The server's app. ``auth`` (or plain ``api_keys``) decides who may call it."""
    state = ServerState(llm, model_name or llm.model_name, auth or Auth(api_keys), scheduler or SchedulerConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.engine.close()

    app = FastAPI(title="kvcache", lifespan=lifespan)
    app.state.kv = state

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(ValidationError)
    async def _invalid(_: HttpRequest, e: ValidationError) -> JSONResponse:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        message = f"{where}: {err.get('msg')}" if where else str(err.get("msg"))
        return JSONResponse(error_body(message, param=where or None), status_code=400)

    @app.exception_handler(KVCacheError)
    async def _bad_input(_: HttpRequest, e: KVCacheError) -> JSONResponse:
        return JSONResponse(error_body(str(e)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: HttpRequest, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: HttpRequest, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(http: HttpRequest) -> dict[str, Any]:
        state.caller(http)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvcache"}]}

    @app.get("/metrics")
    async def metrics(http: HttpRequest) -> PlainTextResponse:
        if not state.auth.metrics_public:
            state.caller(http)
        gauges = await asyncio.to_thread(state.engine.call, state.gauges)
        return PlainTextResponse(state.metrics.render(gauges), media_type="text/plain; version=0.0.4")

    @app.get("/v1/cache/stats")
    async def cache_stats(http: HttpRequest, check: bool = False) -> dict[str, Any]:
        """Admins (everyone on an open server): the whole cache, and with ``?check=true`` the page
        accounting's integrity check. Other keys: their own tenant's share of the prefix cache."""
        caller = state.caller(http)
        if check and not caller.admin:
            raise ApiError(403, "the integrity check needs an admin key", "permission_error", param="check")
        report = (lambda: _cache_report(state, check)) if caller.admin else (lambda: _tenant_report(state, caller))
        return await asyncio.to_thread(state.engine.call, report)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Any:
        caller = state.caller(http)
        body = CompletionRequest.model_validate(await _json(http))
        _check_model(state, body.model)
        prompts = _prompts(body.prompt)
        params = body.sampling(16)
        reqs = [_request(state, _encode(state, p), body, params, caller, p if isinstance(p, str) else None)
                for p in prompts]
        rid = new_id("cmpl")
        if body.stream:
            return _sse(_stream_completion(state, http, rid, body, reqs))
        done = await _collect(state, http, reqs)
        return completion_response(rid, state.model_name, done, body.echo)

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest) -> Any:
        caller = state.caller(http)
        body = ChatRequest.model_validate(await _json(http))
        _check_model(state, body.model)
        try:
            ids = llm.encode([{"role": m.role, "content": m.text()} for m in body.messages])
        except KVCacheError as e:
            raise ApiError(400, str(e), param="messages") from None
        room = max(1, llm.runner.capacity - len(ids))
        body.max_tokens = body.max_completion_tokens or body.max_tokens
        req = _request(state, ids, body, body.sampling(min(1024, room)), caller, None)
        rid = new_id("chatcmpl")
        if body.stream:
            return _sse(_stream_chat(state, http, rid, body, req))
        (done,) = await _collect(state, http, [req])
        return chat_response(rid, state.model_name, done)

    return app


# -- request handling ------------------------------------------------------------------------------
async def _json(http: HttpRequest) -> Any:
    try:
        return json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


def _prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    return list(prompt)


def _encode(state: ServerState, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return state.llm.encode(prompt)
    vocab = state.llm.config.vocab_size
    if not prompt or any(t < 0 or t >= vocab for t in prompt):
        raise ApiError(400, f"token ids must be between 0 and {vocab - 1}", param="prompt")
    return list(prompt)


def _request(state: ServerState, ids: list[int], body: Any, params: Any, caller: Caller,
             text: str | None) -> Request:
    if body.priority and not caller.admin:
        raise ApiError(403, "only admin keys may set 'priority' (see --admin-key-file)", "permission_error",
                       param="priority")
    cap = state.llm.runner.capacity
    if len(ids) >= cap:
        raise ApiError(400, f"the prompt has {len(ids)} tokens, more than the context of {cap} tokens "
                            "leaves room for", param="messages" if text is None else "prompt",
                       code="context_length_exceeded")
    if params.max_tokens > cap - len(ids):
        raise ApiError(400, f"max_tokens={params.max_tokens} is more than the {cap - len(ids)} tokens the "
                            f"context of {cap} leaves after the {len(ids)}-token prompt", param="max_tokens",
                       code="context_length_exceeded")
    return Request(new_id("req"), ids, params, salt=caller.salt, priority=body.priority, prompt=text)


async def _run(state: ServerState, http: HttpRequest, reqs: list[Request]) -> AsyncIterator[tuple[int, Any]]:
    """Submit ``reqs``; yield (index, Delta) as text arrives and (index, Request) when one ends.
    A client that goes away (noticed within DISCONNECT_POLL_S, whether or not text is flowing),
    or a consumer that stops, aborts what is still running."""
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


_GONE = object()  # put on a request's queue when its client disconnected


async def _watch(http: HttpRequest, queue: asyncio.Queue) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    queue.put_nowait(_GONE)


def _record(state: ServerState, r: Request) -> None:
    if r.error:
        state.metrics.add("requests_failed_total")
        return
    gen = sum(len(s.tokens) for s in r.samples)
    ttft = r.t_first - r.t_arrival if r.t_first else None
    steps = max((len(s.tokens) for s in r.samples), default=0) - 1
    tpot = (r.t_end - r.t_first) / steps if r.t_first and steps > 0 else None
    state.metrics.finished(len(r.prompt_ids), gen, max(0, r.cached_tokens), ttft, tpot)


async def _collect(state: ServerState, http: HttpRequest, reqs: list[Request]) -> list[Request]:
    done: dict[int, Request] = {}
    async for i, item in _run(state, http, reqs):
        if isinstance(item, Request):
            done[i] = item
    if len(done) < len(reqs):
        raise ApiError(499, "the client closed the request")
    for r in done.values():
        if r.error:
            raise _engine_error(r)
    return [done[i] for i in range(len(reqs))]


def _engine_error(r: Request) -> ApiError:
    status, type_, code = ERROR_STATUS[r.error_kind or "internal"]
    return ApiError(status, r.error or "the request failed", type_, code=code)


def _sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def gen() -> AsyncIterator[bytes]:
        async for ev in events:
            yield f"data: {json.dumps(ev)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _stream_completion(state: ServerState, http: HttpRequest, rid: str, body: CompletionRequest,
                             reqs: list[Request]) -> AsyncIterator[dict[str, Any]]:
    n = body.n
    ended: list[Request] = []
    async for i, item in _run(state, http, reqs):
        if isinstance(item, Request):
            if item.error:
                yield _engine_error(item).body
            ended.append(item)
            continue
        yield completion_chunk(rid, state.model_name, i * n + item.index, item.text, item.finish_reason)
    if body.stream_options and body.stream_options.include_usage:
        yield usage_chunk(rid, state.model_name, "text_completion", ended)


async def _stream_chat(state: ServerState, http: HttpRequest, rid: str, body: ChatRequest,
                       req: Request) -> AsyncIterator[dict[str, Any]]:
    started: set[int] = set()
    ended: list[Request] = []
    async for _, item in _run(state, http, [req]):
        if isinstance(item, Request):
            if item.error:
                yield _engine_error(item).body
            ended.append(item)
            continue
        first = item.index not in started
        started.add(item.index)
        yield chat_chunk(rid, state.model_name, item.index, item.text, item.finish_reason, first)
    if body.stream_options and body.stream_options.include_usage:
        yield usage_chunk(rid, state.model_name, "chat.completion.chunk", ended)


def _cache_report(state: ServerState, check: bool) -> dict[str, Any]:
    llm = state.llm
    integrity = "not checked (ask with ?check=true)"
    if check:
        try:
            llm.check_integrity()
            integrity = "ok"
        except AssertionError as e:
            integrity = f"failed: {e}"
    st, ps = llm.kv_stats(), llm.prefix_stats()
    return {"kv": st.as_dict() if st is not None else None, "prefix": ps.as_dict() if ps is not None else None,
            "scheduler": {"running": len(state.sched.running), "waiting": len(state.sched.waiting),
                          "preemptions": state.sched.preemptions, "steps": state.sched.steps},
            "integrity": integrity}


def _tenant_report(state: ServerState, caller: Caller) -> dict[str, Any]:
    prefix = state.llm.runner.prefix
    return {"tenant": prefix.tenant_stats(caller.salt) if prefix is not None else None}
