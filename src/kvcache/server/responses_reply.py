"""A chat reply as the Responses API's objects: the Response object (``response_object``), its
output items (``output_of``), its usage, and, streamed, the typed events (``Events``) that the
``openai`` package parses, from the chat chunks of the run. ``assistant_message`` turns output items
back into the chat message a next turn's prompt renders.

Pure functions and one small state machine: no model, no I/O.
"""

from __future__ import annotations

import time
from typing import Any

from kvcache.server.protocol import ApiError
from kvcache.server.responses_request import ResponsesBody, Turn, call_item, message_item, new_id, reasoning_item


def echo(body: ResponsesBody) -> dict[str, Any]:
    """The request fields a Response object repeats."""
    fmt = (body.text or {}).get("format") or {"type": "text"}
    return {"instructions": body.instructions, "tools": [t for t in body.tools or []],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "top_p": body.top_p if body.top_p is not None else 1.0, "text": {"format": fmt, "verbosity": "medium"},
            "previous_response_id": body.previous_response_id, "store": body.store is not False,
            "metadata": body.metadata or {}, "max_output_tokens": body.max_output_tokens, "user": body.user,
            "truncation": "disabled", "reasoning": {"effort": None, "summary": None}, "background": False,
            "service_tier": "default", "top_logprobs": 0, "max_tool_calls": None}


def response_object(rid: str, created: float, model: str, echoed: dict, output: list[dict], usage: dict | None,
                    status: str, error: dict | None = None) -> dict[str, Any]:
    """A Response object: ``status`` completed, incomplete (max_output_tokens), in_progress or failed."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "completed_at": time.time() if status in ("completed", "incomplete") else None, **echoed, "error": error}


def usage_of(chat_usage: dict | None) -> dict | None:
    """A chat usage as the Responses API's (what was not cached is written to the prefix cache)."""
    if not chat_usage:
        return None
    p, o = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": p - cached},
            "output_tokens": o, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + o}


def output_of(message: dict, finish: str) -> list[dict]:
    """A chat reply's message as output items: its reasoning (where it has any), its text (when it has
    any, or no calls), then its calls."""
    status = "incomplete" if finish == "length" else "completed"
    calls = message.get("tool_calls") or []
    thought = message.get("reasoning_content")
    items = [message_item("assistant", message.get("content") or "", status=status)]
    items = items if message.get("content") or not calls else []
    items = ([reasoning_item(thought, status=status)] if thought else []) + items
    return items + [call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], status)
                    for c in calls]


def assistant_message(output: list[dict]) -> dict:
    """The chat message that output items stand for (what the next turn's prompt renders)."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    thought = "".join(p["text"] for it in output if it["type"] == "reasoning" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": calls}
    if thought:
        message["reasoning_content"] = thought
    return message


class Events:
    """The typed events of one streamed response, from the chat chunks of its run. Each item is
    opened (``output_item.added``) when its first text or call arrives and closed (its ``.done``
    events) when the next one opens or the run ends; the last event is ``response.completed``
    (``response.incomplete`` when max_output_tokens cut it), or ``error`` then ``response.failed``."""

    def __init__(self, rid: str, created: float, model: str, echoed: dict, turn: Turn) -> None:
        self.rid, self.created, self.model, self.echoed, self.turn = rid, created, model, echoed, turn
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None
        self.usage: dict | None = None
        self.finish = "stop"
        self.failed = False

    def _ev(self, kind: str, **fields: Any) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _response(self, status: str, error: dict | None = None) -> dict:
        return response_object(self.rid, self.created, self.model, self.echoed, list(self.output),
                                usage_of(self.usage), status, error)

    def start(self) -> list[dict]:
        return [self._ev("response.created", response=self._response("in_progress")),
                self._ev("response.in_progress", response=self._response("in_progress"))]

    def feed(self, chunk: dict) -> list[dict]:
        if self.failed:
            return []
        if "error" in chunk:
            return self._fail(chunk["error"])
        self.usage = chunk.get("usage") or self.usage
        out: list[dict] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._thought(delta["reasoning_content"])
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if call.get("id"):
                    out += self._close("completed")
                    self.open = call_item(new_id("fc"), call["id"], fn.get("name") or "", "", "in_progress")
                    out.append(self._added())
                if fn.get("arguments") and self.open is not None and self.open["type"] == "function_call":
                    self.open["arguments"] += fn["arguments"]
                    out.append(self._ev("response.function_call_arguments.delta", item_id=self.open["id"],
                                        output_index=len(self.output), delta=fn["arguments"]))
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def end(self) -> list[dict]:
        if self.failed:
            return []
        status = "incomplete" if self.finish == "length" else "completed"
        answered = self.open is not None and self.open["type"] != "reasoning" or any(
            it["type"] != "reasoning" for it in self.output)
        out = [] if answered else self._text("")
        out += self._close(status)
        return out + [self._ev(f"response.{status}", response=self._response(status))]

    def _added(self) -> dict:
        item = dict(self.open or {})
        if item["type"] in ("message", "reasoning"):
            item["content"] = []
        return self._ev("response.output_item.added", output_index=len(self.output), item=item)

    def _thought(self, text: str) -> list[dict]:
        """A piece of reasoning: into the open reasoning item, or one opened for it."""
        out: list[dict] = []
        if self.open is not None and self.open["type"] != "reasoning":
            out += self._close("completed")
        if self.open is None:
            self.open = reasoning_item("", status="in_progress")
            out.append(self._added())
        self.open["content"][0]["text"] += text
        out.append(self._ev("response.reasoning_text.delta", item_id=self.open["id"], output_index=len(self.output),
                            content_index=0, delta=text))
        return out

    def _text(self, text: str) -> list[dict]:
        out: list[dict] = []
        if self.open is not None and self.open["type"] != "message":
            out += self._close("completed")
        if self.open is None:
            self.open = message_item("assistant", "", status="in_progress")
            out += [self._added(), self._ev("response.content_part.added", item_id=self.open["id"],
                                            output_index=len(self.output), content_index=0,
                                            part={"type": "output_text", "text": "", "annotations": []})]
        if text:
            self.open["content"][0]["text"] += text
            out.append(self._ev("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output),
                                content_index=0, delta=text, logprobs=[]))
        return out

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"], at, out = status, len(self.output), []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self._ev("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                             text=part["text"], logprobs=[]),
                    self._ev("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                             part=part)]
        elif item["type"] == "reasoning":
            out.append(self._ev("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                                text=item["content"][0]["text"]))
        else:
            out.append(self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                name=item["name"], arguments=item["arguments"]))
        self.output.append(item)
        return out + [self._ev("response.output_item.done", output_index=at, item=item)]

    def _fail(self, error: dict) -> list[dict]:
        self.failed = True
        err = self.turn.rename(ApiError(400, error.get("message") or "the response failed",
                                        error.get("type") or "server_error", error.get("param"),
                                        error.get("code"))).body["error"]
        code = "invalid_prompt" if err["type"] == "invalid_request_error" else "server_error"
        failed = self._response("failed", {"code": code, "message": err["message"]})
        return [self._ev("error", code=err.get("code") or code, message=err["message"], param=err["param"]),
                self._ev("response.failed", response=failed)]
