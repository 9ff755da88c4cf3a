"""gpt-oss's harmony format: a reply as messages on channels, read into reasoning, answer and calls.

After its generation prompt (``<|start|>assistant``) gpt-oss writes one or more messages, each a
header and a body::

    <|channel|>analysis<|message|>We need the weather in Paris.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

    <|channel|>final<|message|>It is 21 degrees in Paris.<|return|>

The ``analysis`` channel is its reasoning (the message's ``reasoning_content``), ``final`` the
answer (``content``), and a ``commentary`` message addressed ``to=functions.NAME`` a call of the
tool NAME whose body is the arguments' JSON (a commentary message to no one is content, a preamble
the model shows the user). ``<|call|>`` and ``<|return|>`` end the reply (the tokenizer counts them
as its ends; ``<|end|>`` only ends a message); ``<|end|>`` is followed by ``<|start|>`` and the next
header. The markers are special tokens of the o200k_harmony vocabulary, kept in the decoded text
for this parser (tool_formats.HARMONY_MARKERS). A reply that does not open with a header (a model that ignores the
format) is content whole.

``HarmonyStream`` gives the events ToolStream gives (``content``, ``call``, ``args``) and
``reasoning`` ones, as text arrives: a body is given out as it comes, save what may still be the
start of a marker.
"""

from __future__ import annotations

import re

from kvcache.server.tool_formats import HARMONY_MARKERS, TextStream, new_call_id

START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN = HARMONY_MARKERS
Event = tuple  # ("content" | "reasoning", text), ("call", index, id, name), ("args", index, fragment)
ENDS = (END, RETURN, CALL)
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyStream(TextStream):
    """Incremental reader of a harmony reply: ``feed`` text, then ``finish``; events as ToolStream's
    (``("content", text)``, ``("call", index, id, name)``, ``("args", index, fragment)``) and
    ``("reasoning", text)``. ``names``: the functions a call may name (None or empty: no tools, a
    commentary message to a function is content)."""

    def __init__(self, names: frozenset[str] | None = None) -> None:
        super().__init__()
        self.names = names or frozenset()
        self._state = "first"  # first | header | body | plain
        self._kind = "content"  # the open body's: reasoning | content | args
        self._calls = 0

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self._state == "first":  # a header opens the reply, or it is plain text whole
                s = self._buf.lstrip()
                if s.startswith((CHANNEL, START)) or s.startswith(" to=") or s.startswith("to="):
                    self._state = "header"
                    continue
                if not final and any(m.startswith(s) for m in (CHANNEL, START, "to=")):
                    return out
                self._state = "plain"
                continue
            if self._state == "plain":
                if self._buf:
                    out.append(("content", self._buf))
                    self._buf = ""
                return out
            if self._state == "header":
                i = self._buf.find(MESSAGE)
                if i < 0:
                    if final and self._buf.strip():  # a header cut short: nothing to show
                        self._buf = ""
                    return out
                self._open(self._buf[:i], out)
                self._buf, self._state = self._buf[i + len(MESSAGE):], "body"
                continue
            # body: up to the marker that ends the message
            at = [(self._buf.find(m), m) for m in ENDS if m in self._buf]
            if at:
                i, marker = min(at)
                self._give(out, self._buf[:i])
                self._buf, self._state = self._buf[i + len(marker):], "header"
                continue
            held = 0 if final else _marker_start(self._buf)
            self._give(out, self._buf[:len(self._buf) - held])
            self._buf = self._buf[len(self._buf) - held:]
            return out

    def _open(self, header: str, out: list[Event]) -> None:
        """The kind of the body a header opens (a call's header event given out here)."""
        channel = _CHANNEL.search(header)
        to = _RECIPIENT.search(header)
        name = to.group(1)[len("functions."):] if to and to.group(1).startswith("functions.") else None
        if name is not None and name in self.names:
            out.append(("call", self._calls, new_call_id(), name))
            self._kind = "args"
            self._calls += 1
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _give(self, out: list[Event], text: str) -> None:
        if not text:
            return
        if self._kind == "args":
            out.append(("args", self._calls - 1, text))
        else:
            out.append((self._kind, text))


def _marker_start(text: str) -> int:
    """The length of the longest end of ``text`` that may begin one of the end markers."""
    for n in range(min(len(text), max(map(len, ENDS)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in ENDS):
            return n
    return 0
