"""OpenAI response bodies and stream chunks built from finished engine requests."""

from __future__ import annotations

from typing import Any

from kvcache.engine.scheduler import Request
from kvcache.server.protocol import now, usage


def _usage(reqs: list[Request]) -> dict[str, Any]:
    prompt = sum(len(r.prompt_ids) for r in reqs)
    completion = sum(len(s.tokens) for r in reqs for s in r.samples)
    return usage(prompt, completion, sum(max(0, r.cached_tokens) for r in reqs))


def completion_response(rid: str, model: str, reqs: list[Request], echo: bool) -> dict[str, Any]:
    choices = []
    n = len(reqs[0].samples) if reqs else 1
    for i, r in enumerate(reqs):
        for s in r.samples:
            text = (r.prompt or "") + s.text.text if echo else s.text.text
            choices.append({"index": i * n + s.index, "text": text, "logprobs": None,
                            "finish_reason": s.reason or "length"})
    return {"id": rid, "object": "text_completion", "created": now(), "model": model, "choices": choices,
            "usage": _usage(reqs)}


def chat_response(rid: str, model: str, r: Request) -> dict[str, Any]:
    choices = [{"index": s.index, "message": {"role": "assistant", "content": s.text.text},
                "logprobs": None, "finish_reason": s.reason or "length"} for s in r.samples]
    return {"id": rid, "object": "chat.completion", "created": now(), "model": model, "choices": choices,
            "usage": _usage([r])}


def completion_chunk(rid: str, model: str, index: int, text: str, finish: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": now(), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(rid: str, model: str, index: int, text: str, finish: str | None, first: bool) -> dict[str, Any]:
    delta: dict[str, Any] = {"content": text}
    if first:
        delta["role"] = "assistant"
    return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, kind: str, reqs: list[Request]) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": now(), "model": model, "choices": [], "usage": _usage(reqs)}
