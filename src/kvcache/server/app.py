"""The OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health,
Prometheus metrics and cache statistics, over the continuous-batching engine.

A request passes server/intake.py first (body size, JSON, text, unsupported parameters, limits),
then is tokenized (and templated) on a worker thread, never on the event loop, and handed to the
EngineLoop thread; its deltas come back through an asyncio queue (server/streams.py). A client that
disconnects, streaming or not, has its request aborted within ``DISCONNECT_POLL_S``. With API keys,
each key is a tenant whose prefix-cache entries are salted apart from every other tenant's (see
server/auth.py). One request's failure is reported to it alone: 400 for a request that cannot be
served as asked, 503 when the KV pool is full, 500 for an engine fault (``server_error``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request as HttpRequest, Response
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvcache.engine.llm import LLM
from kvcache.engine.request import Request
from kvcache.engine.scheduler import SchedulerConfig
from kvcache.engine.scoring import prompt_logprobs
from kvcache.errors import KVCacheError
from kvcache.server.anthropic_api import add_anthropic_routes
from kvcache.server.auth import Auth, Caller
from kvcache.server.depth import recursion_reply
from kvcache.server.intake import (ClientGone, Limits, check_limits, check_unsupported, ignored_header, read_json,
                                   unknown_fields)
from kvcache.server.logprobs import completion_logprobs
from kvcache.server.protocol import ApiError, CompletionRequest, error_body, new_id
from kvcache.server.chat import chat_chunks, chat_reply, start_chat
from kvcache.server.responses import completion_response
from kvcache.server.responses_api import add_responses
from kvcache.server.streams import DISCONNECT_POLL_S, collect, exception_reply, sse, stream_completion
from kvcache.server.tokenize_api import add_token_routes
from kvcache.server.state import ServerState
from kvcache.server.submit import check_model, check_params, new_request, no_tools, prediction
from kvcache.server.tokens import encode_text

__all__ = ["ApiError", "DISCONNECT_POLL_S", "ServerState", "build_app"]


def build_app(llm: LLM, model_name: str | None = None, api_keys: tuple[str, ...] = (),
              scheduler: SchedulerConfig | None = None, auth: Auth | None = None,
              limits: Limits | None = None) -> FastAPI:
    """The server's app. ``auth`` (or plain ``api_keys``) decides who may call it; ``limits``
    bound what one request may ask for."""
    state = ServerState(llm, model_name or llm.model_name, auth or Auth(api_keys), scheduler or SchedulerConfig(),
                        limits or Limits())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.engine.close()

    # the API's own description and its pages answer whoever may call the API: behind the key when
    # keys are set (FastAPI's defaults would serve them to anyone)
    app = FastAPI(title="kvcache", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.kv = state

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(http: HttpRequest) -> JSONResponse:
        state.caller(http)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(http: HttpRequest) -> Response:
        state.caller(http)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="kvcache")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(http: HttpRequest) -> Response:
        state.caller(http)
        return get_redoc_html(openapi_url="/openapi.json", title="kvcache")

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(ValidationError)
    async def _invalid(_: HttpRequest, e: ValidationError) -> JSONResponse:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        msg = str(err.get("msg")).removeprefix("Value error, ")
        message = f"{where}: {msg}" if where else msg
        return JSONResponse(error_body(message, param=where or None), status_code=400)

    @app.exception_handler(KVCacheError)
    async def _bad_input(_: HttpRequest, e: KVCacheError) -> JSONResponse:
        return JSONResponse(error_body(str(e)), status_code=400)

    @app.exception_handler(ClientGone)
    async def _gone(_: HttpRequest, e: ClientGone) -> Response:
        # nobody waits for an answer (or one that stalls gets a last one): close without a traceback
        return PlainTextResponse(f"{e}\n", status_code=408, headers={"Connection": "close"})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: HttpRequest, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code)

    app.add_exception_handler(RecursionError, recursion_reply)  # a 400 naming the deepest field, no traceback

    @app.exception_handler(Exception)
    async def _internal(_: HttpRequest, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine steps (or has nothing to do); 503 when it has had work and not
        finished a step for ``--stall-after`` seconds (a step, or a tier read, that hangs)."""
        stalled = state.engine.stalled_for()
        if stalled is not None and stalled > state.limits.stall_after_s:
            return JSONResponse({"status": "stalled", "engine_busy_s": round(stalled, 1)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(http: HttpRequest) -> dict[str, Any]:
        state.caller(http)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvcache"}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(http: HttpRequest, model_id: str) -> dict[str, Any]:
        state.caller(http)
        check_model(state, model_id)
        return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "kvcache"}

    @app.get("/metrics")
    async def metrics(http: HttpRequest) -> PlainTextResponse:
        if not state.auth.metrics_public:
            state.caller(http)
        gauges = await asyncio.to_thread(state.engine.call, state.gauges)
        return PlainTextResponse(state.metrics.render(gauges), media_type="text/plain; version=0.0.4")

    @app.get("/v1/cache/stats")
    async def cache_stats(http: HttpRequest, check: bool = False, flush: bool = False) -> dict[str, Any]:
        """Admins (everyone on an open server): the whole cache, and with ``?check=true`` the page
        accounting's integrity check; ``?flush=true`` first waits until every page queued for the
        disk/Redis tiers is written (what a finished request left is then readable by another
        process). Other keys: their own tenant's share of the prefix cache."""
        caller = state.caller(http)
        for asked, what in ((check, "check"), (flush, "flush")):
            if asked and not caller.admin:
                raise ApiError(403, f"?{what}=true needs an admin key", "permission_error", param=what)
        if flush:
            await asyncio.to_thread(state.llm.flush)
        report = (lambda: _cache_report(state, check)) if caller.admin else (lambda: _tenant_report(state, caller))
        return await asyncio.to_thread(state.engine.call, report)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest, response: Response) -> Any:
        caller = state.caller(http)
        raw = await read_json(http, state.limits)
        check_unsupported(raw)
        ignored = ignored_header(unknown_fields(raw, CompletionRequest, state.limits))
        response.headers.update(ignored)
        body = CompletionRequest.model_validate(raw)
        check_model(state, body.model)
        prompts = _prompts(body.prompt)
        check_limits(state.limits, len(prompts), body.n, body.stop)
        no_tools(raw)
        params = body.sampling(16, prediction=await prediction(state, body))
        await check_params(state, params, body.constraint_field())
        ids = await asyncio.to_thread(lambda: [_encode(state, p) for p in prompts])
        reqs = [new_request(state, i, body, params, caller, p if isinstance(p, str) else None, "prompt")
                for i, p in zip(ids, prompts)]
        echoes = await _echoes(state, body, reqs) if body.echo else None
        rid = new_id("cmpl")
        if body.stream:
            return sse(stream_completion(state, http, rid, body, reqs, echoes or []), ignored)
        done = await collect(state, http, reqs, "prompt")
        return completion_response(rid, state.model_name, done, echoes, state.text_of)

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest, response: Response) -> Any:
        caller = state.caller(http)
        c = await start_chat(state, await read_json(http, state.limits), caller)
        response.headers.update(c.ignored)
        if c.body.stream:
            return sse(chat_chunks(state, http, c), c.ignored)
        return await chat_reply(state, http, c)

    add_anthropic_routes(app, state)  # /v1/messages, /v1/messages/count_tokens (server/anthropic_api.py)
    add_responses(app, state)  # /v1/responses and its store (server/responses_api.py)
    add_token_routes(app, state)  # /tokenize, /detokenize (server/tokenize_api.py)
    return app


def _prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    return list(prompt)


def _encode(state: ServerState, prompt: Any) -> list[int]:
    """Token ids of one prompt (run on a worker thread: tokenizing a long text takes seconds)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return encode_text(state.llm, prompt)
    vocab = state.llm.config.vocab_size
    if not prompt or any(t < 0 or t >= vocab for t in prompt):
        raise ApiError(400, f"token ids must be between 0 and {vocab - 1}", param="prompt")
    return list(prompt)


async def _echoes(state: ServerState, body: CompletionRequest, reqs: list[Request]) -> list[tuple[str, dict | None]]:
    """Per request, the prompt's text and, when ``logprobs`` is set, its tokens' log-probabilities
    (computed on the engine thread between steps; the prompt's pages stay in the prefix cache)."""
    llm, k = state.llm, body.logprobs
    texts = [r.prompt if r.prompt is not None else llm.tokenizer.decode(r.prompt_ids) for r in reqs]
    if k is None:
        return [(t, None) for t in texts]

    def score() -> list[list]:
        return [prompt_logprobs(llm.runner, r.prompt_ids, k, r.salt) for r in reqs]

    try:
        entries = await asyncio.to_thread(state.engine.call, score, None)
    except Exception as e:
        raise exception_reply(e, "prompt") from None
    return [(t, completion_logprobs(state.text_of, e, r.prompt_ids)) for t, e, r in zip(texts, entries, reqs)]


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
