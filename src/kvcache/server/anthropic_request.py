"""Anthropic's Messages request body, checked and translated into an OpenAI chat body that
server/chat.py runs (pure functions: no server state).

``chat_body`` reads a /v1/messages body, ``chat_body(body, count=True)`` a /v1/messages/count_tokens
body. Honoured: ``model``, ``max_tokens`` (required), ``messages`` (string content, or text,
tool_use and tool_result blocks; ``system`` turns), ``system`` (a string or text blocks),
``stop_sequences``, ``temperature`` (0 to 1), ``top_p``, ``top_k``, ``stream``, client ``tools``,
``tool_choice`` (auto, any, tool, none; ``disable_parallel_tool_use``) and
``output_config.format`` (a JSON schema the answer follows). Accepted and ignored, since they change
nothing kvcache computes: ``metadata`` (a user id), ``cache_control`` (prefixes are cached without
being asked), ``output_config.effort``, ``inference_geo``, ``diagnostics``, ``user_profile_id``,
``workspace_id``. Accepted at their "off" value only: ``thinking`` (disabled), ``service_tier``
(auto, standard_only), ``speed`` (standard), ``container``, ``mcp_servers``, ``context_management``.

Anything else is refused with 400, its message naming the field (Anthropic's errors carry no
``param``): images, documents and other non-text blocks, thinking blocks, server tools, a final
assistant turn (a prefill: kvcache's chat template always opens a new assistant turn), unknown
fields.
"""

from __future__ import annotations

import json
from typing import Any

from kvcache.server.protocol import ApiError
from kvcache.server.tools import NAME_RE

HONOURED = frozenset({"model", "messages", "system", "tools", "tool_choice", "output_config"})
CREATE_ONLY = frozenset({"max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream"})
# kvcache's (vLLM's and llama.cpp's) chat fields, passed on as they are: the template's variables
PASSED = frozenset({"chat_template_kwargs"})
IGNORED = frozenset({"metadata", "cache_control", "inference_geo", "diagnostics", "user_profile_id", "workspace_id"})
OFF: dict[str, tuple[Any, ...]] = {
    "thinking": (None, {"type": "disabled"}), "service_tier": ("auto", "standard_only"), "speed": (None, "standard"),
    "container": (None,), "mcp_servers": (None, []), "context_management": (None,),
}
WHY_OFF = {"thinking": "kvcache sets no thinking budget (a model that thinks in its template returns thinking blocks)", "container": "kvcache runs no code execution container",
           "mcp_servers": "kvcache connects to no MCP server", "service_tier": "there is one tier",
           "speed": "there is one speed", "context_management": "kvcache edits no context"}
CREATE_FIELDS = HONOURED | CREATE_ONLY | IGNORED | PASSED | frozenset(OFF)
COUNT_FIELDS = HONOURED | PASSED | frozenset({"cache_control", "user_profile_id", "workspace_id", "thinking", "speed",
                                     "mcp_servers", "context_management"})
TEXT_KEYS = frozenset({"type", "text", "cache_control", "citations"})
EFFORTS = (None, "low", "medium", "high", "xhigh", "max")
NOT_TEXT = ("image", "document", "search_result", "container_upload")


def refuse(where: str, message: str) -> ApiError:
    return ApiError(400, f"{where}: {message}", param=where)


def chat_body(body: Any, count: bool = False) -> dict[str, Any]:
    """The OpenAI chat body that asks for what an Anthropic Messages body asks for (``count``: a
    count_tokens body, which has no sampling fields; the chat gets ``max_tokens`` 1)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    known = COUNT_FIELDS if count else CREATE_FIELDS
    for key in body:
        if key not in known:
            raise refuse(key, "unknown field" + (" for count_tokens" if count and key in CREATE_FIELDS else ""))
    for key, off in OFF.items():
        if key in body and body[key] not in off:
            raise refuse(key, f"{json.dumps(body[key])} is not supported ({WHY_OFF[key]}); leave it out")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise refuse("model", "a model id (string) is required")
    out: dict[str, Any] = {"model": model, "messages": _system(body.get("system")) + messages(body.get("messages"))}
    if count:
        out["max_tokens"] = 1
    else:
        out.update(_sampling(body))
    out.update(tool_fields(body.get("tools"), body.get("tool_choice")))
    out.update(_output_config(body.get("output_config")))
    out.update({k: body[k] for k in PASSED if k in body})
    return out


def _sampling(body: dict) -> dict[str, Any]:
    out: dict[str, Any] = {"max_tokens": _number(body, "max_tokens", int, 1, None, required=True)}
    for name, lo, hi in (("temperature", 0.0, 1.0), ("top_p", 0.0, 1.0)):
        if body.get(name) is not None:
            out[name] = _number(body, name, float, lo, hi)
    if out.get("top_p") == 0:
        raise refuse("top_p", "must be greater than 0")
    if body.get("top_k") is not None:
        out["top_k"] = _number(body, "top_k", int, 0, None)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise refuse("stream", f"must be a boolean, got {type(stream).__name__}")
    if stream:
        out.update(stream=True, stream_options={"include_usage": True})
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):
            raise refuse("stop_sequences", f"must be a list of strings, got {type(stops).__name__}")
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not s:
                raise refuse(f"stop_sequences.{i}", "must be a non-empty string")
        out["stop"] = list(stops)
    return out


def _number(body: dict, name: str, kind: type, lo: float, hi: float | None, required: bool = False) -> Any:
    value = body.get(name)
    if value is None and required:
        raise refuse(name, "field required")
    ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        raise refuse(name, f"must be {'an integer' if kind is int else 'a number'}, got {json.dumps(value)}")
    if value < lo or (hi is not None and value > hi):
        raise refuse(name, f"must be {f'between {lo:g} and {hi:g}' if hi is not None else f'at least {lo:g}'}, "
                           f"got {value}")
    return value


def _keys(obj: dict, allowed: frozenset[str] | set[str], where: str) -> None:
    for key in obj:
        if key not in allowed:
            raise refuse(f"{where}.{key}", "unknown or unsupported field")


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    return [{"role": "system", "content": text_content(system, "system")}]


def text_content(content: Any, where: str) -> str | list[dict]:
    """A string, or text blocks as OpenAI text parts (joined as the chat path joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise refuse(where, f"must be a string or a list of text blocks, got {type(content).__name__}")
    return [_text_block(b, f"{where}.{j}") for j, b in enumerate(content)]


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise refuse(where, "a content block must be an object with a 'type'")
    kind = block["type"]
    if kind in NOT_TEXT:
        raise refuse(f"{where}.type", f"{kind!r} blocks are not supported: kvcache serves text models; send text")
    if kind == "redacted_thinking":
        raise refuse(f"{where}.type", "'redacted_thinking' blocks are not supported: kvcache cannot read encrypted "
                                      "reasoning; send the thinking block's text")
    return kind


def _text_block(block: Any, where: str) -> dict:
    kind = _block_type(block, where)
    if kind != "text":
        raise refuse(f"{where}.type", f"must be 'text' here, got {kind!r}")
    _keys(block, TEXT_KEYS, where)
    if not isinstance(block.get("text"), str):
        raise refuse(f"{where}.text", "must be a string")
    if block.get("citations"):
        raise refuse(f"{where}.citations", "citations are not supported")
    return {"type": "text", "text": block["text"]}


def messages(msgs: Any) -> list[dict]:
    """Anthropic messages as OpenAI messages: a user turn's tool_result blocks become tool messages
    (in their place among its text), an assistant turn's tool_use blocks its tool_calls."""
    if not isinstance(msgs, list) or not msgs:
        raise refuse("messages", "must be a non-empty list")
    out: list[dict] = []
    called: set[str] = set()  # tool_use ids of the assistant turns so far
    for i, m in enumerate(msgs):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise refuse(where, f"must be an object, got {type(m).__name__}")
        _keys(m, {"role", "content"}, where)
        role, content = m.get("role"), m.get("content")
        if "content" not in m:
            raise refuse(f"{where}.content", "field required")
        if isinstance(content, list) and not content:
            raise refuse(f"{where}.content", "must not be empty")
        if role == "system":
            out.append({"role": "system", "content": text_content(content, f"{where}.content")})
        elif role == "user":
            out += _user(content, where, called)
        elif role == "assistant":
            if i == len(msgs) - 1:
                raise refuse(where, "a final assistant turn (a prefill to continue) is not supported: the "
                                    "chat template opens a new assistant turn; end with a user turn")
            out.append(_assistant(content, where, called))
        else:
            raise refuse(f"{where}.role", f"must be 'user' or 'assistant', got {role!r}")
    return out


def _user(content: Any, where: str, called: set[str]) -> list[dict]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise refuse(f"{where}.content", f"must be a string or a list of content blocks, got {type(content).__name__}")
    out: list[dict] = []
    texts: list[dict] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": texts})
                texts = []
            out.append(_tool_result(block, at, called))
        else:
            raise refuse(f"{at}.type", f"a user turn holds text and tool_result blocks, not {kind!r}")
    if texts:
        out.append({"role": "user", "content": texts})
    return out


def _tool_result(block: dict, where: str, called: set[str]) -> dict:
    _keys(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, where)
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str) or use_id not in called:
        raise refuse(f"{where}.tool_use_id", f"{use_id!r} matches no tool_use block of an earlier assistant turn")
    content = block.get("content")
    text = "" if content is None else text_content(content, f"{where}.content")
    if not isinstance(text, str):
        text = "".join(p["text"] for p in text)
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise refuse(f"{where}.is_error", "must be a boolean")
    return {"role": "tool", "tool_call_id": use_id, "content": f"Error: {text}" if is_error else text}


def _assistant(content: Any, where: str, called: set[str]) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise refuse(f"{where}.content", f"must be a string or a list of content blocks, got {type(content).__name__}")
    texts: list[dict] = []
    calls: list[dict] = []
    thoughts: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use":
            calls.append(_tool_use(block, at, called))
        elif kind == "thinking":  # a reasoning model's earlier reasoning, given back to its template
            _keys(block, {"type", "thinking", "signature"}, at)
            if not isinstance(block.get("thinking"), str):
                raise refuse(f"{at}.thinking", "must be a string")
            thoughts.append(block["thinking"])
        else:
            raise refuse(f"{at}.type", f"an assistant turn holds text, thinking and tool_use blocks, not {kind!r}")
    msg: dict[str, Any] = {"role": "assistant", "content": texts or ("" if not calls else None)}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning_content"] = "\n".join(thoughts)
    return msg


def _tool_use(block: dict, where: str, called: set[str]) -> dict:
    _keys(block, {"type", "id", "name", "input", "cache_control"}, where)
    use_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(use_id, str) or not use_id:
        raise refuse(f"{where}.id", "must be a non-empty string")
    if not isinstance(name, str) or not name:
        raise refuse(f"{where}.name", "must be a non-empty string")
    if not isinstance(args, dict):
        raise refuse(f"{where}.input", "must be an object")
    called.add(use_id)
    return {"id": use_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def tool_fields(tools: Any, choice: Any) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as OpenAI's tools, tool_choice and parallel_tool_calls."""
    out: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise refuse("tools", f"must be a list, got {type(tools).__name__}")
        out["tools"] = [_tool(t, f"tools.{i}") for i, t in enumerate(tools)]
    if choice is None:
        return out
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise refuse("tool_choice", 'must be {"type": "auto" | "any" | "tool" | "none"}')
    kind = choice["type"]
    _keys(choice, {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set()), "tool_choice")
    if kind in ("any", "tool") and not tools:
        raise refuse("tool_choice", f"type {kind!r} needs tools")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise refuse("tool_choice.name", "must name one of the tools")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    no_parallel = choice.get("disable_parallel_tool_use")
    if no_parallel is not None:
        if not isinstance(no_parallel, bool):
            raise refuse("tool_choice.disable_parallel_tool_use", "must be a boolean")
        out["parallel_tool_calls"] = not no_parallel
    return out


def _tool(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict):
        raise refuse(where, f"must be an object, got {type(tool).__name__}")
    if tool.get("type") not in (None, "custom"):
        raise refuse(f"{where}.type", f"{tool['type']!r} is a server tool, which kvcache does not run; give client "
                                      "tools (name, description, input_schema)")
    _keys(tool, {"type", "name", "description", "input_schema", "cache_control", "strict", "eager_input_streaming"},
          where)
    name = tool.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise refuse(f"{where}.name", f"must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}")
    if not isinstance(tool.get("input_schema"), dict):
        raise refuse(f"{where}.input_schema", "a JSON Schema object is required")
    fn: dict[str, Any] = {"name": name, "parameters": tool["input_schema"]}
    for key in ("description", "strict"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def _output_config(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise refuse("output_config", f"must be an object, got {type(config).__name__}")
    _keys(config, {"format", "effort"}, "output_config")
    if config.get("effort") not in EFFORTS:
        raise refuse("output_config.effort", f"must be one of low, medium, high, xhigh, max; got {config['effort']!r}")
    fmt = config.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise refuse("output_config.format", 'must be {"type": "json_schema", "schema": {...}}')
    _keys(fmt, {"type", "schema"}, "output_config.format")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}
