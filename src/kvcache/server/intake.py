"""What a request must pass before any work is done for it: the body's size, its JSON, its text,
parameters kvcache does not implement, and the server's limits on prompts, choices and stops.

- ``read_json``: the body is read up to ``Limits.max_request_bytes`` (413 beyond it: what follows
  is read and dropped, up to ``DRAIN_MAX``, so that a client still sending gets the answer rather
  than a reset; a larger declared Content-Length is refused unread), parsed (off the event loop
  when large), and
  refused with 400 when it is not JSON: invalid UTF-8, NaN or Infinity, nesting deeper than the
  parser allows, an integer of more than 4300 digits, or text holding a lone surrogate (which
  cannot be encoded, so no tokenizer can take it).
- ``check_unsupported``: a parameter kvcache does not implement, set to anything but its "off"
  value, gets 400 naming it, rather than being ignored.
- ``check_limits``: prompts per request, ``n`` x prompts, and the count and length of stop strings.

Every refusal is an ApiError with one line naming the limit or the parameter.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HttpRequest

from kvcache.errors import InvalidParams
from kvcache.server.protocol import ApiError

PARSE_INLINE = 1 << 16  # bodies larger than this are parsed on a worker thread
DRAIN_MAX = 64 << 20  # an oversized body up to this is read (and dropped) so the client gets its 413


@dataclass(frozen=True)
class Limits:
    """Server limits checked before any work (``kvcache serve`` flags of the same names)."""

    max_request_bytes: int = 4 << 20  # --max-request-bytes
    max_prompts: int = 64  # --max-prompts: prompts in one /v1/completions request
    max_choices: int = 128  # --max-choices: n x prompts in one request
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompts", "max_choices", "max_stop", "max_stop_chars"):
            if getattr(self, name) < 1:
                raise InvalidParams(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


async def read_json(http: HttpRequest, limits: Limits) -> Any:
    """The parsed JSON body (see the module docstring for what is refused)."""
    limit = limits.max_request_bytes
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max(limit, DRAIN_MAX):
        raise _too_large(int(declared), limit)  # not worth reading: the connection is closed on the client
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > DRAIN_MAX:
            raise _too_large(size, limit)
        if size <= limit:
            chunks.append(chunk)
    if size > limit:  # read to the end (dropped), so that a client still sending gets the answer
        raise _too_large(size, limit)
    raw = b"".join(chunks)
    if len(raw) > PARSE_INLINE:
        return await asyncio.to_thread(parse_json, raw)
    return parse_json(raw)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body has {size} bytes, over the limit of {limit} "
                         "(--max-request-bytes)", code="request_too_large")


def _no_constants(name: str) -> Any:
    raise ApiError(400, f"the request body is not valid JSON: {name} is not a JSON number")


def parse_json(raw: bytes) -> Any:
    """Parse a body, then check that all of its text is valid Unicode."""
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None
    except ValueError as e:  # an integer past Python's 4300-digit conversion limit
        if "digits" in str(e):
            raise ApiError(400, "the request body is not valid JSON: a number has more than 4300 digits") from None
        raise ApiError(400, "the request body is not valid JSON") from None
    check_text(body)
    return body


def check_text(body: Any) -> None:
    """400 naming the first field whose text (or key) holds a lone surrogate."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            _check_str(value, where)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_str(k, where)
                stack.append((v, f"{where}.{k}" if where else str(k)))
        elif isinstance(value, list):
            stack.extend((v, f"{where}.{i}") for i, v in enumerate(value))


def _check_str(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = s[e.start]
        raise ApiError(400, f"{where or 'the body'}: the text holds a lone surrogate (\\u{ord(bad):04x}) at "
                            f"character {e.start}: it is not valid Unicode", param=where or None) from None


# parameter -> the values that mean "not used" (anything else is refused: kvcache does not do it)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True), "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}), "suffix": (None, ""), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,),
}


def check_unsupported(body: Any) -> None:
    """400 naming each parameter that asks for something kvcache does not do."""
    if not isinstance(body, dict):
        return
    asked = [k for k, off in UNSUPPORTED.items() if k in body and not any(_same(body[k], o) for o in off)]
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1 and best_of != body.get("n", 1):
        asked.append("best_of")
    if asked:
        raise ApiError(400, f"kvcache does not support {', '.join(repr(a) for a in asked)}; leave "
                            f"{'it' if len(asked) == 1 else 'them'} out", param=asked[0], code="unsupported_parameter")


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def check_limits(limits: Limits, prompts: int, n: int, stop: str | list[str] | None) -> None:
    """Prompts per request, ``n`` x prompts, and stop strings within the server's limits."""
    if prompts > limits.max_prompts:
        raise ApiError(400, f"the request has {prompts} prompts, over the limit of {limits.max_prompts} per "
                            "request (--max-prompts)", param="prompt")
    if prompts * n > limits.max_choices:
        raise ApiError(400, f"n={n} x {prompts} prompts asks for {prompts * n} choices, over the limit of "
                            f"{limits.max_choices} per request (--max-choices)", param="n")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > limits.max_stop:
        raise ApiError(400, f"stop has {len(stops)} strings, over the limit of {limits.max_stop}", param="stop")
    long = [s for s in stops if len(s) > limits.max_stop_chars]
    if long:
        raise ApiError(400, f"a stop string has {len(long[0])} characters, over the limit of "
                            f"{limits.max_stop_chars}", param="stop")
