"""A reply's reasoning apart from its answer.

Reasoning models think before they answer, in a block their chat template knows: Qwen3, QwQ,
DeepSeek-R1 and SmolLM3 write ``<think> … </think>`` and then the answer. Left in the text, the
block reaches a client as the start of ``content``, where a JSON parser or a tool-call parser
chokes on it. kvcache returns it apart, as the message's ``reasoning_content`` (the field
llama.cpp's and vLLM's servers use; the Responses API makes it a ``reasoning`` item and the
Messages API a ``thinking`` block), and the answer after it as ``content``; tool calls are read
from the answer only.

A template thinks when it writes both markers (it renders an earlier turn's reasoning, or an empty
block for a turn that should not think). Some templates open the block in the generation prompt
(DeepSeek-R1's ``<think>\\n``, a Qwen3 template asked not to think writes the whole empty block):
a prompt that ends inside an open block starts the reply in reasoning. A reply that does not
begin with the opening marker (after whitespace), and was not started inside one, is all answer.
A request can turn thinking off where its template reads a flag for it, through
``chat_template_kwargs`` (``{"enable_thinking": false}`` for Qwen3), as with vLLM and llama.cpp.

The split is exact text surgery: the reasoning is what lies between the markers with the
whitespace at its ends removed, the content what follows the closing marker without its leading
whitespace; streamed pieces add up to the same two texts (``ReasoningStream``, ``split``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcache.server.harmony import HarmonyStream
from kvcache.server.tool_formats import TextStream
from kvcache.server.tools import ToolCall, ToolSpec, assemble, call_stream, parse_output

Event = tuple[str, str]  # ("reasoning" | "content", text)


@dataclass(frozen=True)
class ThinkFormat:
    open: str = "<think>"
    close: str = "</think>"
    ids: tuple[int, ...] = ()  # the markers that are one token of the vocabulary

    def started(self, prompt_tail: str) -> bool:
        """Whether a prompt whose text ends with ``prompt_tail`` leaves the reply inside an open block."""
        tail = prompt_tail.rstrip()
        return tail.endswith(self.open)


def think_format(template: str | None, tokenizer: Any = None) -> ThinkFormat | None:
    """The think block a chat template shows (None: the model does not reason in one)."""
    fmt = ThinkFormat()
    if not template or fmt.open not in template or fmt.close not in template:
        return None
    ids: list[int] = []
    if tokenizer is not None:
        for marker in (fmt.open, fmt.close):
            got = tokenizer.encode(marker, add_special_tokens=False)
            if len(got) == 1:
                ids.append(got[0])
    return ThinkFormat(ids=tuple(ids))


class ReasoningStream(TextStream):
    """Incremental split of a reply's text into ``("reasoning", piece)`` and ``("content", piece)``
    events. Text that may still be the start of a marker, and whitespace that may still be the end
    of the reasoning or the start of the answer, is held until the next piece or ``finish``."""

    def __init__(self, fmt: ThinkFormat, started: bool = False) -> None:
        super().__init__()
        self.open, self.close = fmt.open, fmt.close
        self._state = "reason" if started else "start"  # start | reason | after | content
        self._fresh = True  # the reasoning has given out nothing yet (its leading whitespace goes)

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self._state == "start":
                s = self._buf.lstrip()
                if s.startswith(self.open):
                    self._buf, self._state = s[len(self.open):], "reason"
                    continue
                if not final and self.open.startswith(s):  # whitespace, or the marker's beginning
                    return out
                self._state = "content"
                continue
            if self._state == "reason":
                if self._fresh:
                    self._buf = self._buf.lstrip()
                i = self._buf.find(self.close)
                if i >= 0:
                    self._give(out, "reasoning", self._buf[:i].rstrip())
                    self._buf, self._state = self._buf[i + len(self.close):], "after"
                    continue
                if final:
                    self._give(out, "reasoning", self._buf.rstrip())
                    self._buf = ""
                    return out
                held = _marker_start(self._buf, self.close)
                body = self._buf[:len(self._buf) - held]
                cut = len(body.rstrip())  # trailing whitespace may end the reasoning: held
                self._give(out, "reasoning", body[:cut])
                self._buf = self._buf[cut:]
                return out
            if self._state == "after":
                s = self._buf.lstrip()
                if not s and not final:
                    self._buf = ""
                    return out
                self._buf, self._state = s, "content"
                continue
            if self._buf:
                out.append(("content", self._buf))
                self._buf = ""
            return out

    def _give(self, out: list[Event], kind: str, text: str) -> None:
        if text:
            out.append((kind, text))
            self._fresh = False


@dataclass(frozen=True)
class Thinking:
    """A reply's think format, and whether its prompt left it inside an open block."""

    fmt: ThinkFormat
    started: bool = False

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.fmt, self.started)

    def split(self, text: str) -> tuple[str | None, str]:
        return split(text, self.fmt, self.started)


def _marker_start(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (held: it may be the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split(text: str, fmt: ThinkFormat, started: bool = False) -> tuple[str | None, str]:
    """(reasoning or None where there is none, content) of a whole reply: what ReasoningStream's
    events for it add up to."""
    stream = ReasoningStream(fmt, started)
    events = stream.feed(text) + stream.finish()
    reasoning = "".join(t for k, t in events if k == "reasoning")
    content = "".join(t for k, t in events if k == "content")
    return (reasoning or None), content


class ReplyStream:
    """A reply's text, as it streams, into the events a chat's chunks are made of: ``reasoning``,
    ``content``, and (with ``tools``) ``call`` and ``args`` as ToolStream gives them. gpt-oss's
    harmony replies (``harmony``) go through one HarmonyStream, which reads channels and calls
    together; any other reply through its Thinking's ReasoningStream (where it has one), then
    what follows the reasoning through the tools' parser."""

    def __init__(self, thinking: Thinking | None, tools: ToolSpec | None, harmony: bool = False) -> None:
        self._harmony = HarmonyStream(tools.names() if tools else None) if harmony else None
        self._split = thinking.stream() if thinking is not None and not harmony else None
        self._calls = call_stream(tools) if tools is not None and not harmony else None

    def feed(self, text: str) -> list[tuple]:
        if self._harmony is not None:
            return self._harmony.feed(text)
        return self._route(self._split.feed(text) if self._split else [("content", text)])

    def finish(self) -> list[tuple]:
        if self._harmony is not None:
            return self._harmony.finish()
        out = self._route(self._split.finish() if self._split else [])
        return out + (self._calls.finish() if self._calls is not None else [])

    def _route(self, pieces: list[Event]) -> list[tuple]:
        out: list[tuple] = []
        for kind, piece in pieces:
            if kind == "reasoning":
                out.append((kind, piece))
            elif self._calls is not None:
                out += self._calls.feed(piece)
            elif piece:
                out.append(("content", piece))
        return out


def parse_reply(text: str, thinking: Thinking | None, tools: ToolSpec | None,
                harmony: bool = False) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning or None, content, calls) of a whole reply, as its ReplyStream's events add up:
    without calls the content is the answer's text as the model wrote it (None only where calls
    were made and nothing else)."""
    if harmony:
        stream = HarmonyStream(tools.names() if tools else None)
        events = stream.feed(text) + stream.finish()
        reasoning = "".join(e[1] for e in events if e[0] == "reasoning")
        content, calls = assemble([e for e in events if e[0] != "reasoning"])
        return (reasoning or None), (content or "") if not calls else content, calls
    reasoning, answer = thinking.split(text) if thinking is not None else (None, text)
    content, calls = parse_output(answer, tools) if tools is not None else (answer, [])
    return reasoning, (content if calls else answer), calls
