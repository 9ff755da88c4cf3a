"""Anthropic's Messages API on the kvcache server: ``POST /v1/messages`` (plain or streamed) and
``POST /v1/messages/count_tokens``, in Anthropic's shapes, so that the ``anthropic`` SDK works
against ``kvcache serve`` unchanged.

A body is checked and translated into an OpenAI chat body (server/anthropic_request.py), run
through the chat pipeline every conversational endpoint shares (server/chat.py), and its reply
translated back: a message with a text block and/or ``tool_use`` blocks, or Anthropic's SSE events
(``message_start``, ``ping``, ``content_block_start`` / ``_delta`` (``text_delta``,
``input_json_delta``) / ``_stop``, ``message_delta``, ``message_stop``). A tool call, a constraint
or a refusal means the same here as on /v1/chat/completions.

The key comes as ``x-api-key`` (Anthropic's clients) or ``Authorization: Bearer``; either names the
same tenant (server/auth.py). ``usage`` follows Anthropic's accounting: ``input_tokens`` are the
prompt tokens computed for this request, ``cache_read_input_tokens`` those the prefix cache gave,
so their sum is the prompt's length, which count_tokens returns.

Errors are ``{"type": "error", "error": {"type", "message"}}`` with the status the OpenAI endpoint
gives, except a full KV pool: 529 ``overloaded_error``, as Anthropic's API answers when it is
overloaded. The SDK raises ``OverloadedError`` for it and retries it with backoff (as any status of
500 or more); clients that treat overload apart (waiting longer, saying so) recognise it only by
529 and that type, which a 503 would not give them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvcache.engine.request import Request
from kvcache.errors import KVCacheError
from kvcache.server.anthropic_request import chat_body
from kvcache.server.auth import Caller
from kvcache.server.chat import Chat, chat_chunks, chat_reply, start_chat
from kvcache.server.depth import recursion_reply
from kvcache.server.intake import ClientGone, read_json
from kvcache.server.protocol import ApiError

if TYPE_CHECKING:
    from kvcache.server.state import ServerState

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


# the OpenAI field names start_chat's refusals use, as the Anthropic body names them
RENAMES = ((r"tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"), (r"tools\.(\d+)\.function", r"tools.\1"),
           (r"tool_choice\.function\.name", "tool_choice.name"),
           (r"response_format\.json_schema\.schema", "output_config.format.schema"),
           (r"\bresponse_format\b", "output_config.format"), (r"\bstop has\b", "stop_sequences has"),
           (r"\ba stop string\b", "a stop sequence"))


def anthropic_words(message: str) -> str:
    """A refusal's text with the OpenAI field names it uses put in the Messages API's words."""
    for pattern, repl in RENAMES:
        message = re.sub(pattern, repl, message)
    return message


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_reply(status: int, message: str) -> JSONResponse:
    """Anthropic's error reply for an OpenAI-endpoint status (503, a full KV pool: 529)."""
    status = 529 if status == 503 else status
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(error_body(kind, message), status_code=status)


async def refusal(http: HttpRequest, e: Exception) -> JSONResponse:
    """What the app's handlers answer for ``e``, in Anthropic's shape."""
    if isinstance(e, ApiError):
        return error_reply(e.status, anthropic_words(e.body["error"]["message"]))
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        msg = anthropic_words(str(err.get("msg")).removeprefix("Value error, "))
        return error_reply(400, f"{where}: {msg}" if where else msg)
    if isinstance(e, KVCacheError):
        return error_reply(400, anthropic_words(str(e)))
    if isinstance(e, RecursionError):
        reply = await recursion_reply(http, e)
        return error_reply(400, json.loads(bytes(reply.body))["error"]["message"])
    return error_reply(500, f"internal error: {type(e).__name__}")


def stream_error(openai_error: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI error body met mid-stream as the data of Anthropic's ``error`` event."""
    err = openai_error.get("error") or {}
    kind = ("overloaded_error" if err.get("code") == "kv_cache_full"
            else "api_error" if err.get("type") == "server_error" else "invalid_request_error")
    return error_body(kind, str(err.get("message", "the request failed")))


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic writes them (``toolu_``); any id sent back is taken as it is."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its ``input``; {} for a call that ``max_tokens`` cut short."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt - cached, "output_tokens": output, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def stop_reason(finish: str | None, stop_sequence: str | None) -> str:
    if finish == "stop" or finish is None:
        return "stop_sequence" if stop_sequence is not None else "end_turn"
    return STOP_REASONS.get(finish, "end_turn")


def message_reply(reply: dict[str, Any], mid: str, stop_sequence: str | None) -> dict[str, Any]:
    """An OpenAI chat completion as Anthropic's message: a thinking block where the model reasoned,
    the text (always, when no tool was called), then one ``tool_use`` block per call."""
    choice = reply["choices"][0]
    msg, u = choice["message"], reply["usage"]
    text, calls = msg.get("content") or "", msg.get("tool_calls") or []
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text or not calls else []
    if msg.get("reasoning_content"):  # a reasoning model's thinking first, as Anthropic's models give it
        content.insert(0, {"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    content += [{"type": "tool_use", "id": tool_use_id(c["id"]), "name": c["function"]["name"],
                 "input": tool_input(c["function"]["arguments"])} for c in calls]
    reason = stop_reason(choice["finish_reason"], stop_sequence)
    return {"id": mid, "type": "message", "role": "assistant", "model": reply["model"], "content": content,
            "stop_reason": reason, "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
            "usage": usage(u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"])}


def matched_stop(req: Request, stops: list[str] | None, decode: Any) -> str | None:
    """The stop sequence that ended ``req``'s first sample (None: it ended otherwise). The engine
    cuts the text before the stop string, so the string is what the whole output's decoded text
    holds after the returned text."""
    if not stops or not req.samples or req.samples[0].reason != "stop":
        return None
    s = req.samples[0]
    rest = decode(list(s.tokens))[len(s.text.text):]
    found = [(rest.find(stop), i, stop) for i, stop in enumerate(stops) if stop in rest]
    return min(found)[2] if found else None


class EventStream:
    """OpenAI chat chunks in, Anthropic's stream events out (``feed`` per chunk, then ``end``)."""

    def __init__(self, mid: str, model: str, req: Request) -> None:
        self.mid, self.model, self.req = mid, model, req
        self.started = False
        self.blocks = 0  # content blocks opened so far
        self.texts = 0  # of them, text and tool_use blocks (not thinking)
        self.open: str | None = None  # the kind of the block open now
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if "error" in chunk:
            return [("error", stream_error(chunk))]
        out = [] if self.started else self._start()
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open != "thinking":
                    out += self._open({"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                if self.open != "text":
                    out += self._open({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if call.get("id"):
                    out += self._open({"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn.get("name"),
                                       "input": {}})
                if fn.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def end(self, stop_sequence: str | None) -> list[tuple[str, dict[str, Any]]]:
        if not self.started:  # the client left before anything came
            return []
        out = self._close()
        if not self.texts:  # as the plain reply: a text block, empty if need be
            out += self._open({"type": "text", "text": ""}) + self._close()
        reason = stop_reason(self.finish, stop_sequence)
        u = self.usage or {}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        tokens = usage(u.get("prompt_tokens", cached), u.get("completion_tokens", 0), cached)
        return out + [("message_delta", {"type": "message_delta", "usage": tokens, "delta": {
            "stop_reason": reason, "stop_sequence": stop_sequence if reason == "stop_sequence" else None}}),
                      ("message_stop", {"type": "message_stop"})]

    def _start(self) -> list[tuple[str, dict[str, Any]]]:
        self.started = True
        cached = max(0, self.req.cached_tokens)
        message = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage(len(self.req.prompt_ids), 0, cached)}
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def _open(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out = self._close()
        self.open = block["type"]
        self.blocks += 1
        self.texts += block["type"] != "thinking"
        return out + [("content_block_start", {"type": "content_block_start", "index": self.blocks - 1,
                                               "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]


async def message_events(state: "ServerState", http: HttpRequest, chat: Chat, mid: str,
                         stops: list[str] | None) -> AsyncIterator[bytes]:
    """The SSE bytes of a streamed message; an error ends the stream with an ``error`` event."""
    events = EventStream(mid, state.model_name, chat.req)
    async for chunk in chat_chunks(state, http, chat):
        for name, data in events.feed(chunk):
            yield f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
            if name == "error":
                return
    for name, data in events.end(matched_stop(chat.req, stops, state.llm.tokenizer.decode)):
        yield f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def caller(state: "ServerState", http: HttpRequest) -> Caller:
    """The caller named by ``x-api-key`` or ``Authorization: Bearer``; 401 without a valid key."""
    found = state.auth.caller(http.headers.get("authorization"), http.headers.get("x-api-key"))
    if found is None:
        raise ApiError(401, "invalid or missing API key (send x-api-key: KEY or Authorization: Bearer KEY)",
                       "authentication_error")
    return found


def add_anthropic_routes(app: FastAPI, state: "ServerState") -> None:
    """Register /v1/messages and /v1/messages/count_tokens on the server's app."""

    @app.post("/v1/messages")
    async def messages(http: HttpRequest) -> Response:
        try:
            who = caller(state, http)
            raw = await read_json(http, state.limits)
            chat = await start_chat(state, chat_body(raw), who)
            stops = chat.body.stop if isinstance(chat.body.stop, list) else None
            mid = message_id()
            if chat.body.stream:
                return StreamingResponse(message_events(state, http, chat, mid, stops), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            reply = await chat_reply(state, http, chat)
            return JSONResponse(message_reply(reply, mid, matched_stop(chat.req, stops, state.llm.tokenizer.decode)))
        except ClientGone:
            raise
        except Exception as e:
            return await refusal(http, e)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(http: HttpRequest) -> Response:
        """The prompt's length as /v1/messages would run it (template, tools), nothing run."""
        try:
            who = caller(state, http)
            chat = await start_chat(state, chat_body(await read_json(http, state.limits), count=True), who)
            return JSONResponse({"input_tokens": len(chat.req.prompt_ids)})
        except ClientGone:
            raise
        except Exception as e:
            return await refusal(http, e)
