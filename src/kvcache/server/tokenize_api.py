"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes: a prompt (or a conversation, through
the model's template with its tools) to token ids, and ids back to text, without running the model.

    POST /tokenize    {"prompt": "text", "add_special_tokens": true}
                      {"messages": [...], "tools": [...], "add_generation_prompt": true}
                   -> {"count": N, "max_model_len": M, "tokens": [...], "token_strs": [...] | null}
    POST /detokenize  {"tokens": [...]} -> {"prompt": "text"}

``model`` may be given (it must name the served model). The ids are those the completion and chat
endpoints would prefill for the same body.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request as HttpRequest

from kvcache.server.chat import chat_prompt
from kvcache.server.intake import read_json
from kvcache.server.protocol import ApiError, ChatRequest
from kvcache.server.submit import check_model

if TYPE_CHECKING:
    from kvcache.server.state import ServerState

TOKENIZE_KEYS = {"model", "prompt", "messages", "tools", "tool_choice", "chat_template_kwargs", "add_special_tokens",
                 "add_generation_prompt", "return_token_strs"}


def add_token_routes(app: FastAPI, state: "ServerState") -> None:
    @app.post("/tokenize")
    async def tokenize(http: HttpRequest) -> dict[str, Any]:
        state.caller(http)
        raw = await read_json(http, state.limits)
        if not isinstance(raw, dict):
            raise ApiError(400, "the body must be a JSON object")
        for key in raw:
            if key not in TOKENIZE_KEYS:
                raise ApiError(400, f"{key!r} is not a field of /tokenize (it takes {', '.join(sorted(TOKENIZE_KEYS))})",
                               param=key)
        if raw.get("model") is not None:
            check_model(state, raw["model"])
        if ("prompt" in raw) == ("messages" in raw):
            raise ApiError(400, "give one of 'prompt' (text) and 'messages' (a conversation)", param="prompt")
        flags = {k: raw.get(k, True) for k in ("add_special_tokens", "add_generation_prompt")}
        flags["return_token_strs"] = raw.get("return_token_strs", False)
        for k, v in flags.items():
            if not isinstance(v, bool):
                raise ApiError(400, f"{k} must be a boolean, got {type(v).__name__}", param=k)
        if "prompt" in raw:
            if not isinstance(raw["prompt"], str):
                raise ApiError(400, f"prompt must be a string, got {type(raw['prompt']).__name__}", param="prompt")
            tok = state.llm.tokenizer
            ids = await asyncio.to_thread(tok.encode, raw["prompt"], flags["add_special_tokens"])
        else:
            body = ChatRequest.model_validate({"model": state.model_name, "messages": raw["messages"],
                                               **{k: raw[k] for k in ("tools", "tool_choice", "chat_template_kwargs")
                                                  if k in raw}})
            ids, _ = await chat_prompt(state, body, flags["add_generation_prompt"])
        strs = [state.llm.tokenizer.decode([t], skip_special_tokens=False) for t in ids] \
            if flags["return_token_strs"] else None
        return {"count": len(ids), "max_model_len": state.llm.runner.capacity, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(http: HttpRequest) -> dict[str, Any]:
        state.caller(http)
        raw = await read_json(http, state.limits)
        if not isinstance(raw, dict) or not isinstance(raw.get("tokens"), list):
            raise ApiError(400, "the body must be an object with 'tokens': a list of token ids", param="tokens")
        for key in raw:
            if key not in ("model", "tokens"):
                raise ApiError(400, f"{key!r} is not a field of /detokenize (it takes model, tokens)", param=key)
        if raw.get("model") is not None:
            check_model(state, raw["model"])
        vocab = state.llm.config.vocab_size
        ids = raw["tokens"]
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab for t in ids):
            raise ApiError(400, f"tokens must be integers between 0 and {vocab - 1}", param="tokens")
        text = await asyncio.to_thread(state.llm.tokenizer.decode, ids)
        return {"prompt": text}
