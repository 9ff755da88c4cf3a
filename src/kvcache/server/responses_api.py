"""OpenAI's Responses API: ``POST /v1/responses`` (streamed or not), ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A translator over the chat pipeline (server/chat.py): the body becomes a chat body
(server/responses_request.py), runs through ``start_chat`` and ``chat_reply`` or ``chat_chunks``,
and the reply becomes a Response object or its typed events (server/responses_reply.py). A
refusal names the Responses field, never the chat field it was checked as.

With ``store`` (the default), a response keeps its conversation (server/response_store.py):
``previous_response_id`` continues it, the prompt being that conversation plus the new items. That
prompt starts with the previous turn's tokens exactly as the model saw and wrote them (``spliced``),
so the prefix cache holds every one of them and only the new items are prefilled. As OpenAI's,
``instructions`` are not carried from one turn to the next; the same ones given each turn keep the
prefix.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kvcache.server.chat import Chat, chat_chunks, chat_reply, start_chat
from kvcache.server.intake import ignored_header, read_json, unknown_fields
from kvcache.server.protocol import ApiError
from kvcache.server.response_store import RESP_ID, ResponseStore, StoredResponse, StoreLimits, tenant_of
from kvcache.server.responses_reply import Events, assistant_message, echo, output_of, response_object, usage_of
from kvcache.server.responses_request import ResponsesBody, bad, check_body, new_id, to_chat

if TYPE_CHECKING:
    from kvcache.server.state import ServerState


def add_responses(app: FastAPI, state: "ServerState") -> None:
    """The Responses routes, and the store they keep responses in (``app.state.responses``): in
    memory, and under the prefix cache's disk tier folder (``responses/``) when it has one, MAC'd
    with the tiers' secret. ``kvcache serve`` sets its bounds (``ResponseStore.set_limits``)."""
    cfg = state.llm.prefix_config
    folder = Path(cfg.disk) / "responses" if cfg.disk else None
    app.state.responses = ResponseStore(StoreLimits(), folder, cfg.mac_secret() if folder is not None else None)

    def store() -> ResponseStore:
        return app.state.responses  # type: ignore[no-any-return]

    @app.post("/v1/responses")
    async def create(http: HttpRequest) -> Any:
        return await _create(state, store(), http)

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str, http: HttpRequest) -> Any:
        return (await _stored(state, store(), http, rid)).response

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str, http: HttpRequest) -> Any:
        tenant = tenant_of(state.caller(http).salt)
        if not await asyncio.to_thread(store().delete, rid, tenant):
            raise _not_found(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}

    @app.get("/v1/responses/{rid}/input_items")
    async def input_items(rid: str, http: HttpRequest, limit: int = 20, order: str = "desc",
                          after: str | None = None) -> Any:
        items = list((await _stored(state, store(), http, rid)).input_items)
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            raise bad("order" if order not in ("asc", "desc") else "limit", "order is asc or desc; limit 1 to 100")
        items = items[::-1] if order == "desc" else items
        ids = [it["id"] for it in items]
        if after is not None:
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _not_found(rid: str) -> ApiError:
    return ApiError(404, f"Response with id '{rid[:64]}' not found.", code="response_not_found")


async def _stored(state: "ServerState", store: ResponseStore, http: HttpRequest, rid: str) -> StoredResponse:
    tenant = tenant_of(state.caller(http).salt)
    entry = await asyncio.to_thread(store.get, rid, tenant) if RESP_ID.fullmatch(rid) else None
    if entry is None:
        raise _not_found(rid)
    return entry


async def _create(state: "ServerState", store: ResponseStore, http: HttpRequest) -> Any:
    caller = state.caller(http)
    raw = await read_json(http, state.limits)
    if not isinstance(raw, dict):
        raise bad("body", "the request body must be a JSON object")
    headers = ignored_header(unknown_fields(raw, ResponsesBody, state.limits))
    body = check_body(raw)
    tenant = tenant_of(caller.salt)
    history: list[dict] = []
    prev = None
    if body.previous_response_id is not None:
        prev = await asyncio.to_thread(store.get, body.previous_response_id, tenant)
        if prev is None:
            raise bad("previous_response_id", f"Previous response with id '{body.previous_response_id[:64]}' not "
                                              "found.", "previous_response_not_found")
        history = prev.conversation
    turn = to_chat(raw, body, history)
    try:
        chat = await start_chat(state, turn.chat, caller)
    except ApiError as e:
        raise turn.rename(e) from None
    except ValidationError as e:
        raise turn.rename(_validation(e)) from None
    if prev is not None and prev.tokens:
        chat.req.prompt_ids = await asyncio.to_thread(spliced, state, chat.req.prompt_ids, prev.tokens,
                                                      chat.req.params.max_tokens)
    rid, created, echoed = new_id("resp"), time.time(), echo(body)

    def keep(output: list[dict], response: dict) -> StoredResponse:
        conversation = [*history, *turn.new, assistant_message(output)]
        tokens = [*chat.req.prompt_ids, *(chat.req.samples[0].tokens if chat.req.samples else [])]
        return StoredResponse(rid, tenant, created, response, conversation, turn.items, tokens)

    if body.stream:
        return _sse(_stream(state, store, http, chat, Events(rid, created, state.model_name, echoed, turn),
                            keep if body.store is not False else None), {**chat.ignored, **headers})
    try:
        reply = await chat_reply(state, http, chat)
    except ApiError as e:
        raise turn.rename(e) from None
    choice = reply["choices"][0]
    output = output_of(choice["message"], choice["finish_reason"])
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    response = response_object(rid, created, state.model_name, echoed, output, usage_of(reply["usage"]), status)
    if body.store is not False:
        await asyncio.to_thread(store.put, keep(output, response))
    return JSONResponse(response, headers={**chat.ignored, **headers})


async def _stream(state: "ServerState", store: ResponseStore, http: HttpRequest, chat: Chat, events: Events,
                  keep: Any) -> AsyncIterator[dict]:
    for ev in events.start():
        yield ev
    async for chunk in chat_chunks(state, http, chat):
        for ev in events.feed(chunk):
            yield ev
    last = events.end()
    if last and keep is not None:  # stored before the client hears it is done: a next turn finds it
        await asyncio.to_thread(store.put, keep(events.output, last[-1]["response"]))
    for ev in last:
        yield ev


def _sse(events: AsyncIterator[dict], headers: dict[str, str]) -> StreamingResponse:
    async def gen() -> AsyncIterator[bytes]:
        async for ev in events:
            yield f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n".encode()

    return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})


def spliced(state: "ServerState", ids: list[int], before: list[int], max_tokens: int) -> list[int]:
    """The prompt ``ids`` starting with the previous turn's tokens as they were (``before``: its
    prompt and output), when these decode to the start of the prompt's text: a text the model wrote
    does not always tokenize back into the tokens it wrote, and only the tokens as they were are in
    the prefix cache. Unchanged when they do not, or when the result would not decode to the same
    text or fit the context."""
    vocab = state.llm.config.vocab_size
    if ids[:len(before)] == before or not all(0 <= t < vocab for t in before):
        return ids
    tok = state.llm.tokenizer
    head, text = tok.decode(before, skip_special_tokens=False), tok.decode(ids, skip_special_tokens=False)
    if not text.startswith(head) or "\ufffd" in head:
        return ids
    out = before + tok.encode(text[len(head):], add_special_tokens=False)
    fits = len(out) + max_tokens <= state.llm.runner.capacity
    return out if fits and tok.decode(out, skip_special_tokens=False) == text else ids


def _validation(e: ValidationError) -> ApiError:
    """A chat body's pydantic error as the app reports it (a 400 naming the field)."""
    err = e.errors()[0]
    where = ".".join(str(x) for x in err.get("loc", ()))
    msg = str(err.get("msg")).removeprefix("Value error, ")
    return ApiError(400, f"{where}: {msg}" if where else msg, param=where or None)
