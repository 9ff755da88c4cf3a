"""Tokenizing for the server, on a worker thread that does not hold up the event loop.

The tokenizer library's one-text ``encode`` keeps the GIL for most of its run (seconds for a
megabytes-long prompt), so a worker thread alone would still stall every other connection; its
batch call releases the GIL while it works. These functions give the ids ``LLM.encode`` gives
(the same tokenizer, the same special-token rules; chat: the model's template, then the text
without added special tokens) and are meant to run through ``asyncio.to_thread``.
"""

from __future__ import annotations

from kvcache.engine.llm import LLM


def encode_text(llm: LLM, text: str) -> list[int]:
    """Token ids of a plain prompt, as ``llm.encode(text)``."""
    return list(llm.tokenizer.backend.encode_batch([text], add_special_tokens=True)[0].ids)


def encode_messages(llm: LLM, messages: list[dict], extra: dict | None = None) -> list[int]:
    """Token ids of a templated conversation, as ``llm.encode(messages)``; ``extra``: more of the
    template's variables (``tools``)."""
    text = llm.tokenizer.apply_chat_template(messages, **(extra or {}))
    return list(llm.tokenizer.backend.encode_batch([text], add_special_tokens=False)[0].ids)
