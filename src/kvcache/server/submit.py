"""What every endpoint does with a request before it runs: the model named, the constraint
compiled, the token budget checked against the context, the engine request built.

Each refusal is an ``ApiError`` (400, 403 or 404) naming the field at fault; nothing is queued
until all checks have passed."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from kvcache.engine.grammar import Constraint
from kvcache.engine.params import SamplingParams
from kvcache.engine.request import Request
from kvcache.errors import KVCacheError
from kvcache.server.auth import Caller
from kvcache.server.protocol import ApiError, new_id

if TYPE_CHECKING:
    from kvcache.server.state import ServerState


def check_model(state: "ServerState", model: str) -> None:
    if model != state.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


async def prediction(state: "ServerState", body: Any) -> list[int] | None:
    """The token ids of the request's ``prediction`` (tokenized off the event loop), or None."""
    text = body.prediction_text()
    if not text:
        return None
    return await asyncio.to_thread(lambda: state.llm.tokenizer.encode(text, add_special_tokens=False))


def no_tools(raw: Any) -> None:
    """Tools are called from a conversation: /v1/completions refuses them by name."""
    for name, off in (("tools", (None, [])), ("tool_choice", (None, "none")), ("parallel_tool_calls", (None,))):
        if isinstance(raw, dict) and raw.get(name, None) not in off:
            raise ApiError(400, f"'{name}' works with /v1/chat/completions only: a completion has no conversation "
                                "to call tools from", param=name)


async def check_params(state: "ServerState", params: SamplingParams, source: str | None = None) -> None:
    """Token ids within the vocabulary and the constraint compiled (once per schema or grammar,
    on a worker thread) before any work is queued: a bad one gets 400 naming it."""
    try:
        params.check_vocab(state.llm.config.vocab_size)
    except KVCacheError as e:
        raise ApiError(400, str(e), param=str(e).split(":", 1)[0]) from None
    if params.constraint is None:
        return
    try:
        await asyncio.to_thread(state.llm.grammars.compile, params.constraint)
    except KVCacheError as e:
        raise ApiError(400, str(e), param=source or constraint_field(params.constraint)) from None


def constraint_field(c: Constraint) -> str:
    return {"json_schema": "response_format", "json_object": "response_format", "regex": "guided_regex",
            "choice": "guided_choice"}.get(c.kind, "guided_grammar")


def new_request(state: "ServerState", ids: list[int], body: Any, params: Any, caller: Caller,
             text: str | None, param: str) -> Request:
    """An engine request for ``ids``; ``param`` names the body field they came from in errors."""
    if body.priority and not caller.admin:
        raise ApiError(403, "only admin keys may set 'priority' (see --admin-key-file)", "permission_error",
                       param="priority")
    cap = state.llm.runner.capacity
    if len(ids) >= cap:
        raise ApiError(400, f"the prompt has {len(ids)} tokens, more than the {context_bound(state)} leaves room for",
                       param=param, code="context_length_exceeded")
    if params.max_tokens > cap - len(ids):
        raise ApiError(400, f"max_tokens={params.max_tokens} is more than the {cap - len(ids)} tokens the "
                            f"{context_bound(state)} leaves after the {len(ids)}-token prompt", param="max_tokens",
                       code="context_length_exceeded")
    return Request(new_id("req"), ids, params, salt=caller.salt, priority=body.priority, prompt=text)


def context_bound(state: "ServerState") -> str:
    """What bounds a sequence: the model's context, or a static cache or the KV budget when smaller."""
    runner = state.llm.runner
    cache, cap = runner.cache, runner.capacity
    bound = cache.capacity_per_sequence() if cache is not None else None
    why = cache.capacity_reason() if cache is not None and bound == cap else None
    return f"context of {cap} tokens" + (f" ({why})" if why else "")
