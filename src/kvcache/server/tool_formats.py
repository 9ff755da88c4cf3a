"""Which format a model writes its tool calls in, read from its chat template and its vocabulary.

A model calls tools in the format it was trained on, which its chat template shows: the template
describes the tools, writes earlier calls back into the conversation, and says how a call looks.
kvcache reads that format from the template text and matches its markers as the tokens they are:

========  =====================================================  ==========================================
format    a call as the model writes it                          templates that show it
========  =====================================================  ==========================================
hermes    ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``  Qwen2.5, Qwen3, Hermes 2/3, GLM-4, Granite 4
llama3    ``{"name": …, "parameters": {…}}`` (the whole turn)     Llama 3.1, 3.2, 3.3
mistral   ``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]``     Mistral Nemo
mistral-args  ``[TOOL_CALLS]name[ARGS]{…}`` for each call         Mistral Small 3.2, Devstral, Ministral 3
granite   ``<|tool_call|>[{"name": …, "arguments": {…}}, …]``    Granite 3.3
tool-calls  ``<tool_calls>[{"name": …, "arguments": {…}}, …]</tool_calls>``  Apriel
harmony   ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}``  gpt-oss (server/harmony.py)
default   kvcache's own: the hermes shape, tools described in a system turn   every other template
========  =====================================================  ==========================================

A marker that is one token of the vocabulary (Qwen's ``<tool_call>`` is token 151657, Mistral's
``[TOOL_CALLS]`` a control token) is named by its id in the forcing grammar, so that the model's own
token is what the grammar takes, and it is kept in the decoded text (``keep_ids``) so that the
parser sees it even where the tokenizer counts it as special. A template that renders tools in a
format not in this table (Qwen3-Coder's XML, Kimi's sections) gets the default
format: the tools are described in a system turn, which any model can follow.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ToolFormat:
    name: str
    native: bool  # the template renders the tools and the tool turns itself
    open: str | None  # the marker that opens calls (None: a call is the whole turn, as bare JSON)
    close: str | None  # the marker that closes one call (None: a call runs to the next ``open`` or the end)
    body: str  # "object": one call object; "list": a JSON list of call objects; "named": name, ARGS, JSON
    args_key: str = "arguments"  # what the call object names its arguments
    args: str | None = None  # the marker between a function's name and its arguments ("named" bodies)
    ids: tuple[tuple[str, int], ...] = ()  # markers that are one token of the vocabulary, with their ids

    def token(self, marker: str) -> int | None:
        return dict(self.ids).get(marker)

    def lark(self, marker: str) -> str:
        """The marker in the grammar: its token (``<[id]>``) when it is one, else its text; a marker
        made of text and one-token markers (harmony's) as the sequence of them."""
        tid = self.token(marker)
        if tid is not None:
            return f"<[{tid}]>"
        known = dict(self.ids)
        inner = [m for m in sorted(known, key=len, reverse=True) if m in marker]
        if not inner:
            return json.dumps(marker)
        pieces = [p for p in re.split("(" + "|".join(map(re.escape, inner)) + ")", marker) if p]
        return " ".join(f"<[{known[p]}]>" if p in known else json.dumps(p) for p in pieces)

    def keep_ids(self) -> tuple[int, ...]:
        """Token ids to keep in decoded text even when the tokenizer calls them special."""
        return tuple(tid for _, tid in self.ids)

    def markers(self) -> tuple[str, ...]:
        if self.name == "harmony":
            return HARMONY_MARKERS
        return tuple(m for m in (self.open, self.close, self.args, PYTHON_TAG if self.name == "llama3" else None)
                     if m)


PYTHON_TAG = "<|python_tag|>"  # Llama 3.x may open a call with it; the JSON after it is the call
# gpt-oss's harmony format (server/harmony.py): the markers of its messages, special tokens of its vocabulary
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
DEFAULT = ToolFormat("default", native=False, open="<tool_call>", close="</tool_call>", body="object")
FORMATS = {
    "hermes": ToolFormat("hermes", True, "<tool_call>", "</tool_call>", "object"),
    "llama3": ToolFormat("llama3", True, None, None, "object", args_key="parameters"),
    "mistral": ToolFormat("mistral", True, "[TOOL_CALLS]", None, "list"),
    "mistral-args": ToolFormat("mistral-args", True, "[TOOL_CALLS]", None, "named", args="[ARGS]"),
    "granite": ToolFormat("granite", True, "<|tool_call|>", None, "list"),
    "tool-calls": ToolFormat("tool-calls", True, "<tool_calls>", "</tool_calls>", "list"),
    # a forced call: the commentary channel addressed to the function, then its arguments as JSON
    "harmony": ToolFormat("harmony", True, "<|channel|>commentary to=functions.", None, "named",
                          args=" <|constrain|>json<|message|>"),
}
# markers of call formats that are not JSON (XML parameters, sections): kvcache does not read them
NOT_JSON = ("<function=", "<arg_key>", "<invoke name=", "<|tool_calls_section_begin|>")
CALL_ID = "[CALL_ID]"  # Mistral's templates may write a call's id between its name and [ARGS]


def format_name(template: str | None) -> str:
    """The tool-call format a chat template shows ("default" when it shows none kvcache reads)."""
    if not template or "tools" not in template:
        return "default"
    if "<|channel|>" in template and "<|call|>" in template:
        return "harmony"
    if any(m in template for m in NOT_JSON):
        return "default"  # XML parameters, sections, channels: formats kvcache does not read
    if "[TOOL_CALLS]" in template:
        return "mistral-args" if "[ARGS]" in template else "mistral"
    if "<|tool_call|>" in template:
        return "granite"
    if "<tool_calls>" in template:
        return "tool-calls"
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters"' in template and ("ipython" in template or PYTHON_TAG in template):
        return "llama3"
    return "default"


def tool_format(template: str | None, tokenizer: Any = None) -> ToolFormat:
    """The format of a model (its template), with the markers that are one token of its vocabulary
    (``tokenizer``: kvcache's Tokenizer; None: markers as text)."""
    fmt = FORMATS.get(format_name(template), DEFAULT)
    if tokenizer is None:
        return fmt
    ids = []
    added = _added_ids(tokenizer)
    for marker in fmt.markers():
        tid = tokenizer.backend.token_to_id(marker)
        if tid is not None and tid in added:
            ids.append((marker, int(tid)))
    return replace(fmt, ids=tuple(ids))


def _added_ids(tokenizer: Any) -> set[int]:
    """Ids of the vocabulary's added tokens (the ones matched whole, before the model's BPE)."""
    try:
        return {int(i) for i in tokenizer.backend.get_added_tokens_decoder()}
    except AttributeError:  # pragma: no cover - tokenizers objects all have it
        return set()


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class TextStream:
    """The shape every incremental reply parser shares (ToolStream, ReasoningStream, HarmonyStream):
    ``feed`` text as it arrives, then ``finish`` once; each returns the events ``_drain`` gives
    (``final``: nothing more will come, so nothing may be held back)."""

    def __init__(self) -> None:
        self._buf = ""
        self._finished = False

    def feed(self, text: str) -> list[tuple]:
        if self._finished:
            raise RuntimeError(f"{type(self).__name__}.feed after finish")
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[tuple]:
        if self._finished:
            return []
        out = self._drain(final=True) + self._flush()
        self._finished = True
        return out

    def _drain(self, final: bool) -> list[tuple]:
        raise NotImplementedError

    def _flush(self) -> list[tuple]:
        """What is still held once the text has ended and been drained (nothing, unless a parser holds more)."""
        return []
