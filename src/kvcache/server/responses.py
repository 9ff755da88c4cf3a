"""OpenAI response bodies and stream chunks built from finished engine requests."""

from __future__ import annotations

from typing import Any

from kvcache.engine.request import Request
from kvcache.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from kvcache.server.protocol import now, usage
from kvcache.server.reasoning import Thinking, parse_reply
from kvcache.server.tools import ToolSpec


def _usage(reqs: list[Request]) -> dict[str, Any]:
    prompt = sum(len(r.prompt_ids) for r in reqs)
    completion = sum(len(s.tokens) for r in reqs for s in r.samples)
    pred = None
    if any(r.params.prediction for r in reqs):  # OpenAI's accounting of predicted outputs
        specs = [s.spec for r in reqs for s in r.samples if s.spec is not None]
        pred = (sum(sp.pred_accepted for sp in specs), sum(sp.pred_rejected for sp in specs))
    return usage(prompt, completion, sum(max(0, r.cached_tokens) for r in reqs), pred)


def completion_response(rid: str, model: str, reqs: list[Request], echoes: list[tuple[str, dict | None]] | None,
                        text_of: TokenText) -> dict[str, Any]:
    """``echoes``: per request, its prompt's text and log-probabilities (None: no echo)."""
    choices = []
    n = len(reqs[0].samples) if reqs else 1
    for i, r in enumerate(reqs):
        prompt_text, prompt_lps = echoes[i] if echoes is not None else ("", None)
        for s in r.samples:
            lps = None
            if r.params.logprobs is not None:
                lps = completion_logprobs(text_of, s.logprobs, s.tokens, offset=len(prompt_text))
                if prompt_lps is not None:
                    lps = {k: prompt_lps[k] + lps[k] for k in lps}
            choices.append({"index": i * n + s.index, "text": prompt_text + s.text.text, "logprobs": lps,
                            "finish_reason": s.reason or "length"})
    return {"id": rid, "object": "text_completion", "created": now(), "model": model, "choices": choices,
            "usage": _usage(reqs)}


def chat_response(rid: str, model: str, r: Request, text_of: TokenText, tools: ToolSpec | None = None,
                  thinking: Thinking | None = None, harmony: bool = False) -> dict[str, Any]:
    """With ``thinking`` (or gpt-oss's ``harmony`` channels), a choice's reasoning becomes its
    ``message.reasoning_content`` and the answer its content; with ``tools``, calls in the answer
    become its ``message.tool_calls`` (finish_reason "tool_calls"); the rest of the text stays its
    content."""
    want = r.params.logprobs is not None
    choices = []
    for s in r.samples:
        reasoning, content, calls = parse_reply(s.text.text, thinking, tools, harmony)
        message: dict[str, Any] = {"role": "assistant", "content": content if content is not None else ""}
        reason = s.reason or "length"
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]}
            reason = "tool_calls" if reason == "stop" else reason
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        choices.append({"index": s.index, "message": message,
                        "logprobs": chat_logprobs(text_of, s.logprobs) if want else None, "finish_reason": reason})
    return {"id": rid, "object": "chat.completion", "created": now(), "model": model, "choices": choices,
            "usage": _usage([r])}


def completion_chunk(rid: str, model: str, index: int, text: str, finish: str | None,
                     logprobs: dict | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": now(), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_chunk(rid: str, model: str, index: int, text: str | None, finish: str | None, first: bool,
               logprobs: dict | None = None, tool_calls: list[dict[str, Any]] | None = None,
               reasoning: str | None = None) -> dict[str, Any]:
    """``reasoning``: a piece of the reply's reasoning (``delta.reasoning_content``) instead of content."""
    if reasoning is not None:
        delta: dict[str, Any] = {"reasoning_content": reasoning}
    else:
        delta = {"content": text} if text is not None or tool_calls is None else {}
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    if first:
        delta["role"] = "assistant"
    return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, kind: str, reqs: list[Request]) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": now(), "model": model, "choices": [], "usage": _usage(reqs)}
