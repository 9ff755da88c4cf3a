"""The chat pipeline every conversational endpoint shares: an OpenAI chat body in, its engine
request out (template, tools, the forcing grammar, sampling, budget), and the reply as OpenAI's
chat completion or its stream of chunks.

/v1/chat/completions serves these as they are; the other APIs (Anthropic's Messages, the
Responses API) translate their bodies into a chat body, run it here, and translate the reply back,
so that a tool call, a constraint or a refusal means the same on every endpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fastapi import Request as HttpRequest

from kvcache.engine.grammar import Constraint
from kvcache.engine.request import Request
from kvcache.errors import KVCacheError
from kvcache.server.auth import Caller
from kvcache.server.intake import check_limits, check_unsupported, ignored_header, unknown_fields
from kvcache.server.protocol import ApiError, ChatRequest, new_id
from kvcache.server.reasoning import Thinking
from kvcache.server.responses import chat_response
from kvcache.server.streams import collect, stream_chat
from kvcache.server.submit import check_model, check_params, new_request, prediction
from kvcache.server.tokens import encode_messages
from kvcache.server.tool_messages import check_messages
from kvcache.server.tool_formats import ToolFormat
from kvcache.server.tools import ToolSpec, check_tools, render, tool_grammar, with_answer

if TYPE_CHECKING:
    from kvcache.server.state import ServerState


@dataclass
class Chat:
    """A chat request checked and ready to run."""

    body: ChatRequest
    req: Request
    spec: ToolSpec | None  # the tools the model may call (None: none)
    ignored: dict[str, str]  # the header naming body fields kvcache does not read (empty when none)
    thinking: Thinking | None = None  # how the reply's reasoning is told from its answer (None: it is not)
    harmony: bool = False  # gpt-oss's channels: analysis as reasoning, final as the answer, calls to functions


async def start_chat(state: "ServerState", raw: Any, caller: Caller) -> Chat:
    """Check an OpenAI chat body (``raw``, parsed JSON) and build its engine request; nothing is
    queued yet. Every refusal is an ``ApiError`` naming the field."""
    llm = state.llm
    check_unsupported(raw)
    ignored = ignored_header(unknown_fields(raw, ChatRequest, state.limits))
    body = ChatRequest.model_validate(raw)
    check_model(state, body.model)
    check_limits(state.limits, 1, body.n, body.stop)
    ids, spec = await chat_prompt(state, body)
    fmt = model_tool_format(state)
    source = body.constraint_field()
    if spec is not None:  # tools beside a text constraint: one grammar for the turn, or a 400
        joined = with_answer(spec, body.constraint(), after_results=body.messages[-1].role == "tool")
        if joined is None:
            raise ApiError(400, f"{source} cannot be combined with tools under tool_choice 'auto' (a JSON "
                                "response_format or guided_json can: the model calls tools or answers in it)",
                           param=source)
        spec = joined
    forced = tool_grammar(spec) if spec is not None else None
    room = max(1, llm.runner.capacity - len(ids))
    body.max_tokens = body.max_completion_tokens or body.max_tokens
    params = body.sampling(min(1024, room), Constraint("lark", forced) if forced is not None else None,
                           await prediction(state, body))
    harmony = fmt.name == "harmony" and body.reasoning_format != "none"  # gpt-oss: channels, always read
    thinking = None if harmony else reply_thinking(state, body, ids, params.constraint is not None)
    keep = (fmt.keep_ids() if spec is not None or fmt.name == "harmony" else ()) + (thinking.fmt.ids if thinking else ())
    if keep:  # the call, channel and think markers reach the parsers even where the tokenizer counts them special
        params = replace(params, keep_special=tuple(dict.fromkeys(keep)))
    await check_params(state, params, "tool_choice" if spec is not None and spec.forced else source)
    req = new_request(state, ids, body, params, caller, None, "messages")
    return Chat(body, req, spec, ignored, thinking, harmony)


def reply_thinking(state: "ServerState", body: ChatRequest, ids: list[int], constrained: bool) -> Thinking | None:
    """How a chat's reply is split into reasoning and answer: None where the model does not think in
    a block, the request asks for the raw text (reasoning_format "none"), or a grammar shapes the
    whole reply (a forced call, a JSON answer: there is no room for a think block)."""
    fmt = state.think_format
    if fmt is None or body.reasoning_format == "none" or constrained:
        return None
    tail = state.llm.tokenizer.decode(ids[-8:], keep=frozenset(fmt.ids))  # the marker, even in pieces
    return Thinking(fmt, fmt.started(tail))


async def chat_prompt(state: "ServerState", body: ChatRequest,
                      add_generation_prompt: bool = True) -> tuple[list[int], ToolSpec | None]:
    """The prompt's token ids of a checked chat body (its messages and tools through the model's
    template, off the event loop) and the tools the model may call (None: none)."""
    llm = state.llm
    spec = check_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    fmt = model_tool_format(state)
    if spec is not None:
        spec = replace(spec, fmt=fmt)
    messages = [m.as_dict() for m in body.messages]
    check_messages(messages)
    messages, extra = render(messages, spec, llm.tokenizer.chat_template, fmt)
    if body.chat_template_kwargs:
        extra = {**body.chat_template_kwargs, **extra}
    if not add_generation_prompt:
        extra = {**extra, "add_generation_prompt": False}
    try:
        ids = await asyncio.to_thread(encode_messages, llm, messages, extra)
    except KVCacheError as e:
        raise ApiError(400, str(e), param="messages") from None
    return ids, spec


def model_tool_format(state: "ServerState") -> ToolFormat:
    """The served model's tool-call format (read once, when the server state is built)."""
    return state.tool_format


async def chat_reply(state: "ServerState", http: HttpRequest, chat: Chat) -> dict[str, Any]:
    """Run a chat to the end: OpenAI's chat completion body (a failure raises its ``ApiError``)."""
    (done,) = await collect(state, http, [chat.req], "messages")
    return chat_response(new_id("chatcmpl"), state.model_name, done, state.text_of, chat.spec, chat.thinking,
                         chat.harmony)


def chat_chunks(state: "ServerState", http: HttpRequest, chat: Chat, rid: str | None = None) -> AsyncIterator[dict]:
    """Run a chat, streamed: OpenAI's ``chat.completion.chunk`` bodies (a failure after the first
    chunk is one error body in the stream)."""
    return stream_chat(state, http, rid or new_id("chatcmpl"), chat.body, chat.req, chat.spec, chat.thinking,
                       chat.harmony)
