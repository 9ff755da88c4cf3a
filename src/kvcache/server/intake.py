"""What a request must pass before any work is done for it: the body's size, its JSON, its text,
parameters kvcache does not implement, and the server's limits on prompts, choices and stops.

- ``read_json``: the body is read up to ``Limits.max_request_bytes`` (413 beyond it: what follows
  is read and dropped, up to ``DRAIN_MAX``, so that a client still sending gets the answer rather
  than a reset; a larger declared Content-Length is refused unread), parsed (off the event loop
  when large), and
  refused with 400 when it is not JSON: invalid UTF-8, NaN or Infinity, nesting deeper than the
  parser allows, an integer of more than 4300 digits, or text holding a lone surrogate (which
  cannot be encoded, so no tokenizer can take it); and when a field nests deeper than 64 levels
  (server/depth.py: schemas, grammars, tool parameters, content parts, any field).
- ``check_unsupported``: a parameter kvcache does not implement, set to anything but its "off"
  value, gets 400 naming it, rather than being ignored.
- ``unknown_fields``: fields no OpenAI-style server knows (``"foo": 1``). By default they are
  accepted, as vLLM does, so that clients which send their own extras keep working, but never
  silently: the server log names them (once per name) and the reply carries them in the
  ``X-KVCache-Ignored-Fields`` header. ``serve --unknown-fields reject`` answers 400
  "Unrecognized request argument supplied: foo", as OpenAI's API does.
- ``check_limits``: prompts per request, ``n`` x prompts, and the count and length of stop strings.

Every refusal is an ApiError with one line naming the limit or the parameter.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HttpRequest
from starlette.requests import ClientDisconnect

from kvcache.errors import InvalidParams
from kvcache.server.depth import check_depth, remember
from kvcache.server.protocol import ApiError

log = logging.getLogger("kvcache.server")
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
    unknown_fields: str = "warn"  # --unknown-fields: "warn" (accept, log and name them) or "reject" (400)
    body_timeout_s: float = 30.0  # --body-timeout: a body that stalls this long between chunks is dropped
    stall_after_s: float = 30.0  # --stall-after: /health answers 503 when the engine has had work and no step ended

    def __post_init__(self) -> None:
        if self.unknown_fields not in ("warn", "reject"):
            raise InvalidParams(f"--unknown-fields must be warn or reject, got {self.unknown_fields!r}")
        for flag, v in (("--body-timeout", self.body_timeout_s), ("--stall-after", self.stall_after_s)):
            if not v > 0:
                raise InvalidParams(f"{flag} must be positive, got {v}")
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
    async for chunk in _timed(http, limits.body_timeout_s):
        size += len(chunk)
        if size > DRAIN_MAX:
            raise _too_large(size, limit)
        if size <= limit:
            chunks.append(chunk)
    if size > limit:  # read to the end (dropped), so that a client still sending gets the answer
        raise _too_large(size, limit)
    raw = b"".join(chunks)
    body, deepest = await asyncio.to_thread(_checked, raw) if len(raw) > PARSE_INLINE else _checked(raw)
    remember(http, deepest)
    return body


def _checked(raw: bytes) -> tuple[Any, tuple[str, int] | None]:
    """The parsed body and its deepest field (400 for one nested too deeply)."""
    body = parse_json(raw)
    return body, check_depth(body)


class ClientGone(Exception):
    """The client left, or stalled past the body timeout, before its body was read: nobody is
    there to answer, so the app closes the exchange quietly (no traceback, no reply)."""


async def _timed(http: HttpRequest, timeout_s: float) -> AsyncIterator[bytes]:
    """The body's chunks; a client that sends nothing for ``timeout_s`` (a stalled upload, a
    slowloris) or disconnects ends it with ClientGone."""
    it = http.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(it.__anext__(), timeout_s)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise ClientGone(f"the body stalled for {timeout_s:g} s") from None
        except ClientDisconnect:
            raise ClientGone("the client disconnected while sending its body") from None
        yield chunk


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
        elif isinstance(value, list):  # (numbers need no check: a prompt of token ids can be a million)
            stack.extend((v, f"{where}.{i}") for i, v in enumerate(value) if isinstance(v, (str, dict, list)))


def _check_str(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = s[e.start]
        raise ApiError(400, f"{where or 'the body'}: the text holds a lone surrogate (\\u{ord(bad):04x}) at "
                            f"character {e.start}: it is not valid Unicode", param=where or None) from None


# parameter -> the values that mean "not used" (anything else is refused: kvcache does not do it)
# (audio and other modalities: a text model has none; functions/function_call: OpenAI's deprecated
# form of tools, which are taken; suffix: insertion, which no chat or base model here is trained for)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"), "suffix": (None, ""), "audio": (None,),
    "modalities": (None, ["text"]),
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


# fields of OpenAI's request bodies that change nothing kvcache computes: accepted without a word
QUIET = frozenset({"store", "metadata", "service_tier", "user", "stream_options", "best_of", "prompt_cache_key",
                   "safety_identifier", "reasoning_effort", "web_search_options"})
IGNORED_HEADER = "X-KVCache-Ignored-Fields"
_logged: set[str] = set()  # unknown names already written to the log (bounded: MAX_LOGGED)
MAX_LOGGED = 256


def unknown_fields(body: Any, model: type, limits: Limits) -> list[str]:
    """The body's fields that neither ``model`` (a pydantic request class) nor the lists above
    know. With ``limits.unknown_fields == "reject"``: 400 naming the first. Otherwise each new
    name is logged once, and the caller names them in the reply's IGNORED_HEADER."""
    if not isinstance(body, dict):
        return []
    known = set(model.model_fields) | set(UNSUPPORTED) | QUIET
    unknown = sorted(k for k in body if k not in known)
    if not unknown:
        return []
    if limits.unknown_fields == "reject":
        raise ApiError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                       code="unknown_parameter")
    new = [k for k in unknown if k not in _logged]
    if new and len(_logged) < MAX_LOGGED:
        _logged.update(new)
        log.warning("kvcache: ignored unknown request field(s) %s (serve --unknown-fields reject refuses them)",
                    ", ".join(repr(k[:64]) for k in new))
    return unknown


def ignored_header(names: list[str]) -> dict[str, str]:
    """The reply header naming ignored fields (ASCII, bounded), or none."""
    if not names:
        return {}
    text = ", ".join("".join(c if " " <= c <= "~" else "?" for c in n[:64]) for n in names[:16])
    return {IGNORED_HEADER: text}


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
