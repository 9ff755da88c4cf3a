"""OpenAI tool calling as pure functions: request checks, prompt rendering, a forcing grammar, output parsing.

- ``check_tools``: validates ``tools``, ``tool_choice`` and ``parallel_tool_calls`` into a ``ToolSpec``
  (None when no tool can be called: no tools, or ``tool_choice: "none"``).
- ``render``: the messages and template arguments for the chat template. A template that knows tools
  (it names a ``tools`` variable) gets them as ``tools=[...]`` and the messages in Hugging Face's shape;
  any other template gets the default format, described in ``tools_prompt``: a system turn listing the
  tools, calls written as ``<tool_call>`` blocks and results as ``<tool_response>`` blocks in user turns.
- ``tool_grammar``: for ``tool_choice`` "required" or a named function, a grammar in llguidance's Lark
  dialect that admits only ``<tool_call>`` blocks of the allowed functions with schema-valid arguments.
- ``ToolStream`` and ``parse_output``: model output text into content and calls, incrementally (for
  streaming) or at once; ``parse_output`` is exactly what the stream's events add up to.

Every refusal is an ``ApiError(400, ...)`` with one line naming the problem and ``param`` naming the field.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from typing import Any

from kvcache.engine.schema import closed_schema
from kvcache.server.protocol import ApiError
from kvcache.server.harmony import HarmonyStream
from kvcache.server.tool_formats import CALL_ID, DEFAULT, PYTHON_TAG, TextStream, ToolFormat, new_call_id, tool_format

MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 64 << 10  # a function's parameters schema, as JSON
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
# forced calls are written as json.dumps writes them by default (the format the prompts show)
# keywords whose value maps names to schemas, and keywords whose value is data rather than a schema
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
VALUE_KEYWORDS = ("const", "enum", "default", "examples", "required", "dependentRequired")
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# after the last call: text that cannot open another block (no "\n<" at its start), two tokens at most
TAIL = r"tail[max_tokens=2]: /(?s:[^\n].{0,31}|\n|\n[^<].{0,30})/"

Event = tuple[str, str] | tuple[str, int, str, str] | tuple[str, int, str]


@dataclass(frozen=True)
class ToolSpec:
    """The tools a request offers and how the model may use them."""

    tools: tuple[dict, ...]  # the "function" objects: {"name", "description"?, "parameters"?, "strict"?}
    choice: str  # "auto" | "required" | "named"
    name: str | None  # the forced function for choice "named"
    parallel: bool
    # "auto" beside a JSON response_format or guided_json: the schema (JSON text) a text answer follows
    answer: str | None = None
    # the text answer is JSON under a constraint: a call is only ever a <tool_call> block, and JSON
    # such as {"name": "get_time", ...} is the answer, never read as a bare call
    json_text: bool = False
    fmt: ToolFormat = DEFAULT  # the format the model writes calls in (server/tool_formats.py)

    def names(self) -> frozenset[str]:
        return frozenset(f["name"] for f in self.tools)

    @property
    def forced(self) -> bool:
        """Whether the output must be calls (``tool_grammar`` gives a grammar): "required" or named."""
        return self.choice != "auto"

    @property
    def shaped(self) -> bool:
        """Whether ``tool_grammar`` shapes the turn (forced, or "auto" with a JSON answer): after a call
        comes only another call or the grammar's tail, which the parser drops."""
        return self.forced or self.answer is not None


def bad(param: str, message: str) -> ApiError:
    """A 400 refusal: ``message`` on one line, ``param`` the field it names."""
    return ApiError(400, message, param=param)


# --- request checks -----------------------------------------------------------------------------


def check_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolSpec | None:
    """The validated tool request; None when no tool can be called (no tools, or tool_choice "none")."""
    functions = _check_tool_list(tools)
    parallel = _check_parallel(parallel_tool_calls)
    choice, name = _check_choice(tool_choice, functions)
    if not functions or choice == "none":
        return None
    return ToolSpec(tools=functions, choice=choice, name=name, parallel=parallel)


def _check_tool_list(tools: Any) -> tuple[dict, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise bad("tools", f"tools must be a list, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise bad("tools", f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    functions = tuple(_check_tool(i, t) for i, t in enumerate(tools))
    seen: set[str] = set()
    for i, f in enumerate(functions):
        if f["name"] in seen:
            raise bad(f"tools.{i}.function.name", f"tools.{i}.function.name {f['name']!r} is used by an earlier tool")
        seen.add(f["name"])
    return functions


def _check_tool(i: int, tool: Any) -> dict:
    where = f"tools.{i}"
    if not isinstance(tool, dict):
        raise bad(where, f"{where} must be an object, got {type(tool).__name__}")
    if tool.get("type") != "function":
        raise bad(f"{where}.type", f"{where}.type must be 'function', got {tool.get('type')!r}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function", f"{where}.function must be an object, got {type(fn).__name__}")
    return _check_function(f"{where}.function", fn)


def _check_function(where: str, fn: dict) -> dict:
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise bad(f"{where}.name", f"{where}.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}")
    out: dict[str, Any] = {"name": name}
    if fn.get("description") is not None:
        if not isinstance(fn["description"], str):
            raise bad(f"{where}.description", f"{where}.description must be a string")
        out["description"] = fn["description"]
    if fn.get("parameters") is not None:
        out["parameters"] = _check_parameters(f"{where}.parameters", fn["parameters"])
    if fn.get("strict") is not None:
        if not isinstance(fn["strict"], bool):
            raise bad(f"{where}.strict", f"{where}.strict must be a boolean")
        out["strict"] = fn["strict"]
    return out


def _check_parameters(where: str, schema: Any) -> dict:
    if not isinstance(schema, dict):
        raise bad(where, f"{where} must be a JSON Schema object, got {type(schema).__name__}")
    size = len(json.dumps(schema, ensure_ascii=False).encode())
    if size > MAX_SCHEMA_BYTES:
        raise bad(where, f"{where} is {size} bytes as JSON; at most {MAX_SCHEMA_BYTES} are allowed")
    if schema.get("type", "object") != "object":
        raise bad(where, f"{where} must describe an object (type 'object'), got type {schema.get('type')!r}")
    problem = schema_problem(schema)
    if problem:
        raise bad(where, f"{where} is not a valid JSON Schema: {problem}")
    return schema


def schema_problem(schema: dict) -> str | None:
    """Why ``jsonschema`` refuses the schema, on one line; None when it accepts it."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import Draft202012Validator, validator_for

    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        path = "/".join(str(p) for p in e.absolute_path)
        return " ".join(f"{e.message}{f' (at /{path})' if path else ''}".split())
    except RecursionError:
        return "it is nested too deeply"
    return None


def _check_parallel(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, bool):
        raise bad("parallel_tool_calls", f"parallel_tool_calls must be a boolean, got {type(value).__name__}")
    return value


def _check_choice(choice: Any, functions: tuple[dict, ...]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise bad("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}")
        if choice == "required" and not functions:
            raise bad("tool_choice", "tool_choice 'required' needs tools")
        return choice, None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise bad("tool_choice", 'tool_choice must be a string or {"type": "function", "function": {"name": ...}}')
    name = choice["function"].get("name")
    if not isinstance(name, str):
        raise bad("tool_choice.function.name", "tool_choice.function.name must be a string")
    if not functions:
        raise bad("tool_choice", f"tool_choice names function {name!r} but no tools are given")
    if name not in {f["name"] for f in functions}:
        raise bad("tool_choice.function.name", f"tool_choice.function.name {name!r} is not one of the tools")
    return "named", name


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def json_object(text: str) -> dict | None:
    """The JSON object ``text`` holds (strict JSON: no NaN or Infinity), or None."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# --- rendering ----------------------------------------------------------------------------------


def template_knows_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it names a ``tools`` variable)."""
    return bool(template) and "tools" in template


def render(messages: list[dict], spec: ToolSpec | None, template: str | None,
           fmt: ToolFormat | None = None) -> tuple[list[dict], dict]:
    """The messages to hand the chat template, and extra keyword arguments for its render.

    A template whose tool format kvcache reads (``fmt``, by default read from ``template``: see
    server/tool_formats.py) gets ``tools=[{"type": "function", "function": f}, ...]`` and messages in
    Hugging Face's shape (tool call arguments as dicts). Any other template gets messages of ``role``
    and ``content`` only, in the default format: see ``tools_prompt`` and ``calls_text``. The messages
    must have passed ``check_messages`` (server/tool_messages.py).
    """
    fmt = fmt or tool_format(template)
    if fmt.native:
        kwargs = {"tools": [{"type": "function", "function": f} for f in spec.tools]} if spec else {}
        # Mistral's templates refuse call ids that are not 9 letters or digits
        return _hf_messages(messages, _nine if fmt.name.startswith("mistral") else None), kwargs
    out = _default_messages(messages)
    return (_with_tools_prompt(out, tools_prompt(spec)) if spec else out), {}


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p["text"] for p in content)
    return content or ""


def _call_args(call: dict) -> dict:
    return json_object(call["function"]["arguments"]) or {}


def _nine(call_id: str) -> str:
    """A call id as 9 letters and digits, the same for the call and the tool message answering it."""
    return call_id if len(call_id) == 9 and call_id.isalnum() else hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _hf_messages(messages: list[dict], ids: Any = None) -> list[dict]:
    """``ids``: how call ids are written for the template (None: as they are)."""
    ids = ids or (lambda i: i)
    names: dict[str, str] = {}  # tool call id -> function name, for the tool messages that answer them
    out = []
    for m in messages:
        calls = m.get("tool_calls") or []
        msg: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"))}
        if m["role"] == "assistant" and calls:
            msg["content"] = _text(m["content"]) if m.get("content") is not None else None
            msg["tool_calls"] = [{"id": ids(c["id"]), "type": "function",
                                  "function": {"name": c["function"]["name"], "arguments": _call_args(c)}}
                                 for c in calls]
            names.update((c["id"], c["function"]["name"]) for c in calls)
        if m["role"] == "tool":
            msg["tool_call_id"] = ids(m["tool_call_id"])
            if m["tool_call_id"] in names:
                msg["name"] = names[m["tool_call_id"]]
        out.append(_with_reasoning(msg, m))
    return out


def _with_reasoning(msg: dict, m: dict) -> dict:
    """``msg`` with the reasoning of the assistant message ``m`` that it renders (where it has any)."""
    if m["role"] == "assistant" and m.get("reasoning_content") is not None:
        msg["reasoning_content"] = m["reasoning_content"]
    return msg


def _default_messages(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    last_was_tool = False
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if last_was_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            last_was_tool = True
            continue
        content = _text(m.get("content"))
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = calls_text([(c["function"]["name"], _call_args(c)) for c in m["tool_calls"]])
            content = f"{content}\n{calls}" if content else calls
        out.append(_with_reasoning({"role": m["role"], "content": content}, m))
        last_was_tool = False
    return out


def calls_text(calls: list[tuple[str, dict]]) -> str:
    """Calls in the default format: one ``<tool_call>`` block each, a newline between blocks."""
    return "\n".join(_block(name, args) for name, args in calls)


def _block(name: str, args: dict) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


def _with_tools_prompt(messages: list[dict], prompt: str) -> list[dict]:
    for i, m in enumerate(messages):
        if m["role"] in ("system", "developer"):
            merged = f"{m['content']}\n\n{prompt}" if m["content"] else prompt
            return [*messages[:i], {"role": m["role"], "content": merged}, *messages[i + 1:]]
    return [{"role": "system", "content": prompt}, *messages]


def tools_prompt(spec: ToolSpec) -> str:
    """The default system text offering the tools. Its shape, for two tools and tool_choice "auto"::

        # Tools

        You can call these functions, each given as JSON within <tools></tools> tags:
        <tools>
        {"type": "function", "function": {"name": "get_weather", "description": ..., "parameters": {...}}}
        {"type": "function", "function": {"name": "get_time", ...}}
        </tools>

        To call a function, write exactly this, with nothing else on those lines:
        <tool_call>
        {"name": "<function name>", "arguments": {<arguments as JSON>}}
        </tool_call>
        Call a function only when it helps; otherwise answer directly.
        To call several functions, write one <tool_call> block after another.
        Results come back in <tool_response></tool_response> tags.

    "required" says "You must call at least one function." (or "exactly one" without parallel calls),
    a named choice says 'You must call the function "<name>".', and without parallel calls the line
    on several calls reads "Call at most one function at a time."
    """
    listing = [json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in spec.tools]
    return "\n".join([
        "# Tools", "",
        "You can call these functions, each given as JSON within <tools></tools> tags:",
        "<tools>", *listing, "</tools>", "",
        "To call a function, write exactly this, with nothing else on those lines:",
        OPEN, '{"name": "<function name>", "arguments": {<arguments as JSON>}}', CLOSE,
        _choice_line(spec),
        "To call several functions, write one <tool_call> block after another." if spec.parallel
        else "Call at most one function at a time.",
        "Results come back in <tool_response></tool_response> tags.",
    ])


def _choice_line(spec: ToolSpec) -> str:
    if spec.choice == "named":
        return f'You must call the function "{spec.name}".'
    if spec.choice == "required":
        return "You must call at least one function." if spec.parallel else "You must call exactly one function."
    return "Call a function only when it helps; otherwise answer directly."


# --- the forcing grammar ------------------------------------------------------------------------


def tool_grammar(spec: ToolSpec) -> str | None:
    """For "required" or a named function: a Lark grammar (llguidance's dialect) admitting only calls,
    in the model's own format (``spec.fmt``; its markers as the tokens they are, where they are one).

    A call's JSON is ``{"name": <an allowed function>, "arguments": <an object its parameters admit>}``
    (``"parameters"`` in Llama 3's format), written with json.dumps's default separators. In the
    hermes and default formats the output is one ``<tool_call>`` block (one or more, a newline apart,
    when calls may be parallel); in the list formats one list of calls after the opening marker; in
    Mistral's ``[ARGS]`` format the marker, the name, ``[ARGS]`` and the arguments, once or (parallel)
    again and again; in gpt-oss's harmony format the commentary channel addressed to the function and
    the arguments (one call a turn: ``<|call|>`` ends it); in Llama 3's the call object alone (one
    call a turn). None for "auto" without a JSON answer.

    With parallel blocks, the turn may end after every complete block, and another one comes only when
    the model opens it: after ``</tool_call>`` the grammar admits the end, ``\n<tool_call>``, or ``tail``
    (any text that does not start with ``\n<``, two tokens at most, then only the end). A model that
    would go on in prose after its call (a newline first, then words) thus ends the turn. Without the
    tail its choice of a newline would leave ``<`` as the only way on, and it would write call after call
    until max_tokens. ToolStream drops the tail.
    """
    if not spec.shaped:
        return None
    fmt = spec.fmt
    allowed = [f for f in spec.tools if spec.choice != "named" or f["name"] == spec.name]
    rules: list[str] = []
    if fmt.body == "named":  # [TOOL_CALLS]name[ARGS]{...}
        names = []
        for i, f in enumerate(allowed):
            params = _rebase_refs(closed_schema(f.get("parameters") or {"type": "object"}), "#")
            params["x-guidance"] = JSON_FORMAT
            rules += [f"fn{i}: {json.dumps(f['name'])} {fmt.lark(fmt.args)} args{i}",
                      f"args{i}: %json {json.dumps(params, ensure_ascii=False)}"]
            names.append(f"fn{i}")
        rules.append("fcall: " + " | ".join(names))
        opened = f"{fmt.lark(fmt.open)} fcall"
        calls = [f"({opened})+" if spec.parallel and fmt.name != "harmony" else opened]  # harmony: a call ends the turn
    else:
        if len(allowed) == 1:
            schema = _call_schema(allowed[0], "#/properties/" + fmt.args_key, fmt.args_key)
        else:
            schema = {"anyOf": [_call_schema(f, f"#/anyOf/{i}/properties/{fmt.args_key}", fmt.args_key)
                                for i, f in enumerate(allowed)]}
        schema["x-guidance"] = JSON_FORMAT
        rules.append(f"call: %json {json.dumps(schema, ensure_ascii=False)}")
        if fmt.body == "list":
            items = 'call (", " call)*' if spec.parallel else "call"
            closing = f" {fmt.lark(fmt.close)}" if fmt.close else ""
            calls = [f'{fmt.lark(fmt.open)} "[" {items} "]"{closing}']
        elif fmt.open is None:  # Llama 3: the call object is the turn
            calls = ["call"]
        else:
            rules.append(f'block: {fmt.lark(fmt.open)} "\\n" call "\\n" {fmt.lark(fmt.close)}')
            calls = ['block ("\\n" block)* tail?', TAIL] if spec.parallel else ["block"]
    if spec.forced:
        start = [f"start: {calls[0]}", *calls[1:]]
    else:  # "auto" with a JSON answer: calls, or the answer alone
        start = ["start: calls | answer", f"calls: {calls[0]}", *calls[1:], f"answer: %json {spec.answer}"]
    return "\n".join([*start, *rules, ""])


def with_answer(spec: ToolSpec, constraint: Any, after_results: bool = False) -> ToolSpec | None:
    """``spec`` for a request that also constrains its text answer: under "auto", a JSON constraint
    (response_format json_schema or json_object, guided_json) becomes the grammar's other branch (the
    model calls tools or answers in that JSON, as OpenAI's models do), except in a turn that follows
    tool results (``after_results``: the conversation ends with them), which answers in the JSON, as
    an agent's last step does: a small model would otherwise call the same tool again and again. A
    forced turn is calls only, so its text constraint has nothing to apply to. None when the pair
    cannot be joined (a regex, a choice or a grammar beside "auto" tools)."""
    if spec.forced or constraint is None:
        return spec
    if constraint.kind in ("json_schema", "json_object"):
        spec = replace(spec, json_text=True)
        if after_results:
            return spec
    if constraint.kind == "json_schema":
        schema = json.loads(constraint.text)
    elif constraint.kind == "json_object":
        schema = {"type": "object"}
    else:
        return None
    options = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    schema = {**schema, "x-guidance": {**JSON_FORMAT, **options}}
    return replace(spec, answer=json.dumps(schema, ensure_ascii=False))


def _call_schema(fn: dict, at: str, key: str = "arguments") -> dict:
    """The schema of one call of ``fn``; its parameters (closed to their declared properties, as
    response_format's schemas are: engine/schema.py) sit under ``key`` at JSON pointer ``at``, where
    local $refs now point."""
    params = _rebase_refs(closed_schema(fn.get("parameters") or {"type": "object"}), at)
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False}


def _rebase_refs(schema: Any, at: str) -> Any:
    """A copy of a schema whose local references (``#...``) resolve from pointer ``at`` instead of the root."""
    if isinstance(schema, list):
        return [_rebase_refs(s, at) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("$ref", "$dynamicRef") and isinstance(v, str) and v.startswith("#"):
            out[k] = at + v[1:]
        elif k in SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _rebase_refs(s, at) for name, s in v.items()}
        elif k in VALUE_KEYWORDS:
            out[k] = v
        else:
            out[k] = _rebase_refs(v, at)
    return out


# --- parsing the output -------------------------------------------------------------------------


@dataclass
class ToolCall:
    id: str  # "call_" + 24 hex characters
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def read_call(value: Any, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, compact JSON arguments) of a call object naming a known function; None when it is not one.

    ``arguments`` may be an object or a JSON string holding one; ``parameters`` is its alias; a call
    with neither takes no arguments.
    """
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        args = json_object(args)
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


def _bare_calls(text: str, names: frozenset[str]) -> list[tuple[str, str]] | None:
    """The calls of an output that is, whole, one bare JSON call object or a list of them; else None."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = [read_call(v, names) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _block_calls(body: str, fmt: ToolFormat, names: frozenset[str]) -> list[tuple[str, str]] | None:
    """The calls of one block's body in ``fmt``; None when it is not (all) calls of known functions."""
    if fmt.body == "named":
        name, sep, args = body.partition(fmt.args or "")
        name = name.split(CALL_ID)[0]
        if not sep or name.strip() not in names:
            return None
        obj = json_object(args.strip())
        return None if obj is None else [(name.strip(), json.dumps(obj, ensure_ascii=False))]
    try:
        value = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) and fmt.body == "list" else [value]
    calls = [read_call(v, names) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _cut_call(body: str, fmt: ToolFormat, names: frozenset[str]) -> tuple[str, str] | None:
    """A forced call that max_tokens cut short (the grammar writes it with json.dumps's separators):
    its function's name and the arguments' JSON as far as it got, or None when the name is not out."""
    if fmt.body == "named":
        name, sep, args = body.partition(fmt.args or "")
        return (name.strip(), args) if sep and name.strip() in names else None
    head = re.compile(r'\s*\[?\s*\{"name": "([^"\\]+)", "' + fmt.args_key + '": ').match(body)
    if head is None or head.group(1) not in names:
        return None
    return head.group(1), body[head.end():]


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could begin ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolStream(TextStream):
    """Incremental parser of model output text into events, for streaming.

    Events: ``("content", text)``, then for each call ``("call", index, id, name)`` followed by one or more
    ``("args", index, fragment)`` whose fragments join into the arguments' JSON.

    Calls are read in the spec's format (``spec.fmt``, server/tool_formats.py); what follows speaks of
    the hermes format, ``<tool_call>`` blocks. Content is given out as soon as it cannot begin a
    ``<tool_call>`` tag, except that a stretch of whitespace only is held until it is known whether it
    merely separates calls (then it is dropped). A ``<tool_call>`` block is given out when it closes
    (or at the end, unclosed), as a call when its JSON names a known function and as content,
    untouched, otherwise. In the formats without a closing marker (Mistral's ``[TOOL_CALLS]``,
    Granite's ``<|tool_call|>``) a block runs to the next opening marker or the end. An output starting
    (after whitespace and Llama 3's ``<|python_tag|>``) with ``{`` or ``[`` is held to the end: it may
    be, whole, a bare JSON call or a list of calls (Llama 3's format is only that). For a forced spec,
    what follows the first call and is not a call (the grammar's ``TAIL``, or a block cut short) is
    dropped: a forced turn is calls only.
    """

    def __init__(self, spec: ToolSpec) -> None:
        super().__init__()
        self.names = spec.names()
        self.fmt = spec.fmt
        self._forced = spec.shaped
        self._bare = not spec.json_text  # whether an output opening with { or [ may be bare calls
        self._mode = "start"  # "start" | "bare" | "text" | "block"
        self._scan = 0  # in a block, where the search for its closing tag resumes
        self._ws = ""  # whitespace held at the start of the current stretch of content
        self._has_text = False  # the current stretch of content holds more than whitespace
        self._after_call = False  # the current stretch began right after a call
        self._count = 0

    def _flush(self) -> list[Event]:
        """Whitespace held at the end of the output, where it is all the stretch holds."""
        return [("content", self._ws)] if self._ws and not self._has_text and not self._after_call else []

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        if self._mode == "start":
            head = self._buf.lstrip()
            if self.fmt.name == "llama3":
                if not final and PYTHON_TAG.startswith(head) and head:
                    return events
                head = head.removeprefix(PYTHON_TAG).lstrip()
            if not head and not final:
                return events
            self._mode = "bare" if self._bare and head[:1] in ("{", "[") else "text"
        if self._mode == "bare":
            if not final:
                return events
            text = self._buf.strip()
            if self.fmt.name == "llama3":
                text = text.removeprefix(PYTHON_TAG)
            calls = _bare_calls(text, self.names)
            if calls is None and self._forced and self.fmt.open is None:
                call = _cut_call(text, self.fmt, self.names)  # Llama 3's forced call cut by max_tokens
                calls = [call] if call is not None else None
            if calls is not None:
                self._buf = ""
                for name, args in calls:
                    self._emit_call(name, args, events)
                return events
            self._mode = "text"
        while self._step(final, events):
            pass
        return events

    def _step(self, final: bool, events: list[Event]) -> bool:
        """Consume what can be decided in the buffer; whether to go on."""
        opener, closer = self.fmt.open, self.fmt.close
        if self._mode == "text":
            at = self._buf.find(opener) if opener else -1
            if at >= 0:
                self._content(self._buf[:at], events)
                self._buf, self._mode, self._scan = self._buf[at + len(opener):], "block", 0
                return True
            keep = 0 if final or not opener else _partial_tag(self._buf, opener)
            self._content(self._buf[:len(self._buf) - keep], events)
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        assert opener is not None
        ender = closer or opener  # without a closing marker a block runs to the next opening one
        end = self._buf.find(ender, self._scan)
        if end < 0 and not final:
            self._scan = max(0, len(self._buf) - len(ender) + 1)
            return False
        body = self._buf if end < 0 else self._buf[:end]
        used = end + len(closer) if closer and end >= 0 else end
        raw = opener + (self._buf if end < 0 else self._buf[:used])
        self._buf = "" if end < 0 else self._buf[used:]
        self._mode = "text" if closer or end < 0 else "block"
        self._scan = 0
        calls = _block_calls(body.strip() if self.fmt.body != "named" else body, self.fmt, self.names)
        if calls is None and end < 0 and self._forced:
            cut = _cut_call(body, self.fmt, self.names)  # max_tokens cut the forced call: OpenAI gives it as it stands
            calls = [cut] if cut is not None else None
        if calls is None:
            if not (self._forced and end < 0):  # a forced call cut before its name: no markup as text
                self._content(raw, events)
        else:
            for call in calls:
                self._emit_call(*call, events)
        if self._mode == "block":  # the next block's opening marker was found: step past it
            self._buf = self._buf[len(opener):]
        return end >= 0

    def _content(self, text: str, events: list[Event]) -> None:
        if not text or (self._forced and self._count):
            return
        if self._has_text:
            events.append(("content", text))
        elif text.strip():
            events.append(("content", self._ws + text))
            self._ws, self._has_text = "", True
        else:
            self._ws += text

    def _emit_call(self, name: str, args: str, events: list[Event]) -> None:
        index, self._count = self._count, self._count + 1
        events.append(("call", index, new_call_id(), name))
        events.append(("args", index, args))
        self._ws, self._has_text, self._after_call = "", False, True


def assemble(events: list[Event]) -> tuple[str | None, list[ToolCall]]:
    """Content and calls that a list of ToolStream events adds up to (content None when empty and calls were made)."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for e in events:
        if e[0] == "content":
            content.append(e[1])
        elif e[0] == "call":
            calls.append(ToolCall(id=e[2], name=e[3], arguments=""))
        else:
            calls[e[1]].arguments += e[2]
    text = "".join(content)
    return (None if not text and calls else text), calls


def call_stream(spec: ToolSpec) -> "ToolStream | HarmonyStream":
    """The incremental parser of the calls in a reply, in ``spec``'s format: gpt-oss's channels
    (HarmonyStream, which also gives its analysis as ``reasoning`` events) or ToolStream."""
    return HarmonyStream(spec.names()) if spec.fmt.name == "harmony" else ToolStream(spec)


def parse_output(text: str, spec: ToolSpec) -> tuple[str | None, list[ToolCall]]:
    """Content and calls of a whole model output: what its call stream's events add up to (reasoning
    left out)."""
    stream = call_stream(spec)
    return assemble([e for e in stream.feed(text) + stream.finish() if e[0] != "reasoning"])
