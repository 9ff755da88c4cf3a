"""A Responses API request (``POST /v1/responses``) as the chat body the chat pipeline runs
(server/chat.py), and where each chat field came from.

- ``check_body``: the body's types (``ResponsesBody``), and a 400 naming each field that asks for
  what kvcache does not do: hosted tools, reasoning effort and summaries, ``include`` values,
  ``background``, ``truncation: auto``, ``conversation``, stored prompts, images and files.
- ``to_chat``: input items -> chat messages (a ``function_call`` item joins the assistant message
  before it as one of its ``tool_calls``, a ``function_call_output`` item is a tool message),
  ``instructions`` -> a system message first, ``tools`` / ``tool_choice`` -> chat's,
  ``text.format`` -> ``response_format``, ``max_output_tokens`` -> ``max_completion_tokens``; a
  stored conversation (``previous_response_id``) comes before the new items.
- ``Turn.rename``: a refusal the chat pipeline made, naming the Responses field (``input[2].content``,
  ``text.format.schema``, ``tools[0].name``, ``max_output_tokens``), never the chat one.

Pure functions over parsed JSON: no model, no I/O.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, create_model

from kvcache.server.protocol import ApiError

# kvcache's own chat fields, passed on as they are (their errors name them alike)
EXTRAS = ("seed", "top_k", "min_p", "stop", "ignore_eos", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "min_tokens", "stop_token_ids", "logit_bias", "priority", "prompt_lookup",
          "chat_template_kwargs", "reasoning_format")
# fields of what kvcache does not do -> the values that mean "not used"
OFF: dict[str, tuple[Any, ...]] = {
    "background": (None, False), "include": (None, []), "truncation": (None, "disabled"), "conversation": (None,),
    "prompt": (None,), "max_tool_calls": (None,), "top_logprobs": (None, 0), "context_management": (None,)}
WHY = {"include": "include asks for {!r}, which kvcache does not produce; send none",
       "truncation": "truncation {!r} is not done: a prompt past the context is refused; send 'disabled' or "
                     "leave it out"}
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class _Read(BaseModel):
    """The fields of a Responses body that kvcache reads (their types checked here; the rest in to_chat)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    input: Union[StrictStr, list[Any], None] = None
    instructions: Optional[StrictStr] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[StrictStr, dict[str, Any], None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    text: Optional[dict[str, Any]] = None
    max_output_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool = False
    store: Optional[StrictBool] = None
    previous_response_id: Optional[StrictStr] = None
    metadata: Optional[dict[StrictStr, StrictStr]] = Field(default=None, max_length=16)
    user: Optional[StrictStr] = None
    reasoning: Optional[dict[str, Any]] = None


# ... and the fields it knows without reading them here: refused unless off (OFF), passed on (EXTRAS),
# or a hint with nothing to do (how long OpenAI should keep its prompt cache)
ResponsesBody = create_model("ResponsesBody", __base__=_Read,
                             **{k: (Any, None) for k in (*OFF, *EXTRAS, "prompt_cache_retention")})


def bad(param: str, message: str, code: str | None = None) -> ApiError:
    """A 400 naming ``param``."""
    return ApiError(400, message, param=param, code=code)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Turn:
    """One request translated: the chat body, where each chat field came from, and what is stored."""

    def __init__(self) -> None:
        self.messages: list[dict] = []  # the chat messages, instructions first when given
        self.new: list[dict] = []  # this turn's own messages (its input items)
        self.items: list[dict] = []  # its input items, normalized, with ids
        self.names: list[tuple[str, str]] = [("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                                             ("max_tokens", "max_output_tokens"), ("response_format", "text.format"),
                                             ("response_format.json_schema", "text.format"),
                                             ("tool_choice.function", "tool_choice")]
        self.chat: dict[str, Any] = {}
        self.whole = {"instructions", "previous_response_id"}  # fields named whole, whatever part is at fault

    def add(self, message: dict, origin: str) -> None:
        self.names.append((f"messages.{len(self.messages)}", origin))
        self.messages.append(message)
        if origin.startswith("input"):
            self.new.append(message)

    def rename(self, e: ApiError) -> ApiError:
        """``e`` with its chat field named as the Responses field it came from."""
        err = e.body["error"]
        old = err.get("param")
        if not old:
            return e
        new = self.field(old)
        return ApiError(e.status, str(err["message"]).replace(old, new), err["type"], new, err.get("code"))

    def field(self, chat_param: str) -> str:
        """The Responses field a chat field came from (``messages.3.content`` -> ``input[1].content``)."""
        best, to = "", chat_param
        for prefix, name in self.names:
            if (chat_param == prefix or chat_param.startswith(prefix + ".")) and len(prefix) >= len(best):
                best, to = prefix, name
        rest = chat_param[len(best):] if best else ""
        if to in self.whole:
            return to
        return to + re.sub(r"\.(\d+)", r"[\1]", rest)


def check_body(raw: dict) -> ResponsesBody:
    """The body's types, and a 400 naming each field that asks for what kvcache does not do."""
    body = ResponsesBody.model_validate(raw)
    for name, off in OFF.items():
        value = raw.get(name)
        if not any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in off):
            raise bad(name, WHY.get(name, f"kvcache does not support {name!r}; leave it out").format(value),
                      "unsupported_parameter")
    reasoning = body.reasoning or {}
    if reasoning.get("effort") not in (None, "none"):
        raise bad("reasoning.effort", "reasoning.effort: kvcache does not set how long a model reasons; send "
                                      "'none' or leave it out", "unsupported_parameter")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) is not None:
            raise bad(f"reasoning.{key}", f"reasoning.{key}: kvcache does not summarize reasoning (a reasoning "
                                          "item holds the model's whole text)",
                      "unsupported_parameter")
    for k, v in (body.metadata or {}).items():
        if len(k) > 64 or len(v) > 512:
            raise bad("metadata", "metadata keys are at most 64 characters and values at most 512")
    return body


def to_chat(raw: dict, body: ResponsesBody, history: list[dict]) -> Turn:
    """The chat body of a Responses request; ``history``: the stored conversation it continues."""
    turn = Turn()
    if body.instructions:
        turn.add({"role": "system", "content": body.instructions}, "instructions")
    for m in history:
        turn.add(m, "previous_response_id")
    _input(turn, body.input)
    chat: dict[str, Any] = {"model": body.model, "messages": turn.messages}
    if body.tools is not None:
        chat["tools"] = _tools(body.tools, turn)
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    fmt = _format(body.text)
    if fmt is not None:
        chat["response_format"] = fmt
    for src, dst in (("parallel_tool_calls", "parallel_tool_calls"), ("max_output_tokens", "max_completion_tokens"),
                     ("temperature", "temperature"), ("top_p", "top_p"), ("user", "user")):
        if getattr(body, src) is not None:
            chat[dst] = getattr(body, src)
    chat.update({k: raw[k] for k in EXTRAS if raw.get(k) is not None})
    if body.stream:
        chat.update(stream=True, stream_options={"include_usage": True})
    turn.chat = chat
    return turn


def _input(turn: Turn, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, str):
        turn.add({"role": "user", "content": value}, "input")
        turn.whole.add("input")
        turn.items.append(message_item("user", value))
        return
    for k, item in enumerate(value):
        where = f"input[{k}]"
        if not isinstance(item, dict):
            raise bad(where, f"{where} must be an object, got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
            text = _text(item.get("content"), f"{where}.content")
            last = turn.new[-1] if turn.new else None
            if role == "assistant" and _thought_only(last, turn):  # the answer after its reasoning item
                last["content"] = text  # type: ignore[index]
            else:
                turn.add({"role": role, "content": text}, where)
            turn.items.append(message_item(role, text, item.get("id")))
        elif kind == "reasoning":
            text = "".join(p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict))
            turn.add({"role": "assistant", "content": None, "reasoning_content": text}, where)
            turn.items.append(reasoning_item(text, item.get("id")))
        elif kind == "function_call":
            fn = {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where, "")}
            call = {"id": _string(item, "call_id", where), "type": "function", "function": fn}
            last = turn.new[-1] if turn.new else None
            if last is not None and last is turn.messages[-1] and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # calls after a text: one assistant message
            else:
                turn.add({"role": "assistant", "content": None, "tool_calls": [call]}, where)
            at = f"messages.{len(turn.messages) - 1}.tool_calls.{len(turn.messages[-1]['tool_calls']) - 1}"
            turn.names += [(f"{at}.function", where), (at, where)]
            turn.items.append(call_item(item.get("id") or new_id("fc"), call["id"], call["function"]["name"],
                                         call["function"]["arguments"], "completed"))
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            n = len(turn.messages)
            turn.add({"role": "tool", "tool_call_id": call_id, "content": text}, where)
            turn.names += [(f"messages.{n}.tool_call_id", f"{where}.call_id"),
                           (f"messages.{n}.content", f"{where}.output")]
            turn.items.append({"id": item.get("id") or new_id("fco"), "type": "function_call_output",
                               "call_id": call_id, "output": text, "status": "completed"})
        else:
            raise bad(f"{where}.type", f"{where}.type {kind!r} is not read: kvcache takes message, reasoning, "
                                       "function_call and function_call_output items")


def _thought_only(message: dict | None, turn: Turn) -> bool:
    """Whether ``message`` is the turn's last message and an assistant's reasoning with nothing after it yet."""
    return (message is not None and message is turn.messages[-1] and message["role"] == "assistant"
            and message.get("content") is None and not message.get("tool_calls") and "reasoning_content" in message)


def _string(item: dict, key: str, where: str, empty: str | None = None) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and empty is None):
        raise bad(f"{where}.{key}", f"{where}.{key} must be a {'non-empty ' if empty is None else ''}string")
    return value


def _text(content: Any, where: str) -> str:
    """The text of a content field: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"{where} must be a string or a list of input_text parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad(f"{where}[{j}].type", f"{where}[{j}].type {kind!r} is not read: kvcache serves text models "
                                            "and takes input_text and output_text parts only")
        if not isinstance(part.get("text"), str):
            raise bad(f"{where}[{j}].text", f"{where}[{j}].text must be a string")
        out.append(part["text"])
    return "".join(out)


def _tools(tools: list, turn: Turn) -> list[dict]:
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise bad(f"tools[{i}]", f"tools[{i}] must be an object")
        if t.get("type") != "function":
            raise bad(f"tools[{i}].type", f"tools[{i}].type {t.get('type')!r} is not served: kvcache runs function "
                                          "tools only (the hosted tools run on OpenAI's side)", "unsupported_tool")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                      if t.get(k) is not None}})
        turn.names += [(f"tools.{i}", f"tools[{i}]"), (f"tools.{i}.function", f"tools[{i}]")]
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                 '{"type": "function", "name": ...}')
    return {"type": "function", "function": {"name": choice["name"]}}


def _format(text: dict | None) -> dict | None:
    text = text or {}
    if text.get("verbosity") not in (None, "medium"):
        raise bad("text.verbosity", "text.verbosity is not done; send 'medium' or leave it out",
                  "unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad("text.format.type", f"text.format.type must be text, json_object or json_schema, got {kind!r}")
    if not isinstance(fmt.get("schema"), dict):
        raise bad("text.format.schema", "text.format.schema must be a JSON Schema object")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}


def message_item(role: str, text: str, item_id: str | None = None, status: str = "completed") -> dict:
    """A message item as a Response's output or an input item listing shows it."""
    part = ({"type": "output_text", "text": text, "annotations": []} if role == "assistant"
            else {"type": "input_text", "text": text})
    return {"id": item_id or new_id("msg"), "type": "message", "role": role, "status": status, "content": [part]}


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    """A reply's reasoning as the Responses API's reasoning item (its text whole; no summary)."""
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
