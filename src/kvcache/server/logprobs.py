"""Log-probabilities in OpenAI's two shapes, from the engine's TokenLogprob entries.

- completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, parallel lists;
  with ``echo`` the prompt's tokens come first (the first has no log-probability: None);
  ``top_logprobs`` maps token text to log-probability, as evaluation harnesses read it.
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}``.

Token text is each id decoded on its own (special tokens kept); ``bytes`` are its UTF-8 bytes.
"""

from __future__ import annotations

from typing import Any

from kvcache.engine.params import TokenLogprob
from kvcache.models.tokenizer import Tokenizer


class TokenText:
    """Each token id's text, decoded once."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._memo.get(token)
        if text is None:
            text = self._memo[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text


def completion_logprobs(text_of: TokenText, entries: list[TokenLogprob | None], tokens: list[int],
                        offset: int = 0) -> dict[str, Any]:
    """The completions shape for ``tokens`` (their entries parallel; None: no log-probability),
    text offsets counted from ``offset``."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, e in zip(tokens, entries):
        text = text_of(tok)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        out["token_logprobs"].append(None if e is None else e.logprob)
        if e is None:
            out["top_logprobs"].append(None)
        else:
            top: dict[str, float] = {}
            for t, lp in e.top:
                top.setdefault(text_of(t), lp)
            out["top_logprobs"].append(top)
    return out


def chat_logprobs(text_of: TokenText, entries: list[TokenLogprob]) -> dict[str, Any]:
    """The chat shape for generated tokens' entries."""
    def item(token: int, lp: float) -> dict[str, Any]:
        text = text_of(token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}
