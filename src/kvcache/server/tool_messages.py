"""The tool fields of chat messages, checked before anything is rendered (OpenAI's rules).

``tool_calls`` only on assistant messages, each call with an id, type "function", a name and arguments
that are a JSON object; ``tool_call_id`` only on tool messages, where it is required and must name a
call of an earlier assistant message. Every refusal is an ``ApiError(400, ...)`` with one line naming
the problem and ``param`` naming the field (``messages.<i>.<field>``).
"""

from __future__ import annotations

from typing import Any

from kvcache.server.tools import bad, json_object

ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(messages: list[dict]) -> None:
    """400 naming ``messages.<i>.<field>`` for a message whose role, content or tool fields are malformed,
    or a tool message whose ``tool_call_id`` answers no call made before it."""
    if not isinstance(messages, list):
        raise bad("messages", f"messages must be a list, got {type(messages).__name__}")
    called: set[str] = set()  # the ids of the calls of the assistant messages so far
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        _check_message(where, m)
        if m["role"] == "assistant":
            called.update(c["id"] for c in m.get("tool_calls") or [])
        elif m["role"] == "tool" and m["tool_call_id"] not in called:
            raise bad(f"{where}.tool_call_id", f"{where}.tool_call_id {m['tool_call_id']!r} matches no tool call "
                                               "of an earlier assistant message")


def _check_message(where: str, m: Any) -> None:
    if not isinstance(m, dict):
        raise bad(where, f"{where} must be an object, got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
    _check_content(f"{where}.content", m.get("content"))
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise bad(f"{where}.tool_calls", f"{where}.tool_calls is allowed on assistant messages only")
        _check_calls(f"{where}.tool_calls", m["tool_calls"])
    call_id = m.get("tool_call_id")
    if role == "tool" and (not isinstance(call_id, str) or not call_id):
        raise bad(f"{where}.tool_call_id", f"{where}.tool_call_id must be a non-empty string on a tool message")
    if role != "tool" and call_id is not None:
        raise bad(f"{where}.tool_call_id", f"{where}.tool_call_id is allowed on tool messages only")


def _check_content(where: str, content: Any) -> None:
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return
    raise bad(where, f"{where} must be a string, null or a list of text parts")


def _check_calls(where: str, calls: Any) -> None:
    if not isinstance(calls, list):
        raise bad(where, f"{where} must be a list, got {type(calls).__name__}")
    for j, call in enumerate(calls):
        _check_call(f"{where}.{j}", call)


def _check_call(where: str, call: Any) -> None:
    if not isinstance(call, dict):
        raise bad(where, f"{where} must be an object, got {type(call).__name__}")
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise bad(f"{where}.id", f"{where}.id must be a non-empty string")
    if call.get("type", "function") != "function":
        raise bad(f"{where}.type", f"{where}.type must be 'function', got {call.get('type')!r}")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function", f"{where}.function must be an object")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad(f"{where}.function.name", f"{where}.function.name must be a non-empty string")
    args = fn.get("arguments")
    if not isinstance(args, str):
        raise bad(f"{where}.function.arguments", f"{where}.function.arguments must be a string of JSON")
    if not isinstance(json_object(args), dict):
        raise bad(f"{where}.function.arguments", f"{where}.function.arguments is not a JSON object")
