"""ChatSession: multi-turn chat that keeps its KV cache between turns.

Each turn renders the whole conversation with the chat template, keeps the longest common token
prefix the session's sequence already holds, and prefills only the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvcache.engine.generate import RequestRun
from kvcache.engine.params import RequestOutput, SamplingParams
from kvcache.errors import InvalidParams

if TYPE_CHECKING:
    from kvcache.engine.llm import LLM


class ChatSession:
    def __init__(self, llm: "LLM", system: str | None = None) -> None:
        self.llm = llm
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.seq = llm.runner.new_sequence()
        self.last: RequestOutput | None = None
        self.closed = False

    def _run(self, user: str, params: SamplingParams | None) -> RequestRun:
        if self.closed:
            raise InvalidParams("this chat session is closed")
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidParams("a chat session takes n=1")
        if not isinstance(user, str) or not user.strip():
            raise InvalidParams("a chat message must be non-empty text")
        ids = self.llm.tokenizer.encode_chat(self.messages + [{"role": "user", "content": user}])
        return RequestRun(self.llm.runner, self.llm.tokenizer, ids, params, prompt=user, seq=self.seq, keep_seq=True)

    def send(self, user: str, params: SamplingParams | None = None) -> RequestOutput:
        """Add a user turn, generate the reply, add it to the conversation."""
        run = self._run(user, params)
        for _ in run:
            pass
        return self._finish(user, run)

    def stream(self, user: str, params: SamplingParams | None = None) -> Iterator[str]:
        """Like send, yielding text pieces; ``last`` holds the result afterwards."""
        run = self._run(user, params)
        for delta in run:
            if delta.text:
                yield delta.text
        self._finish(user, run)

    def _finish(self, user: str, run: RequestRun) -> RequestOutput:
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": run.result.text}]
        self.last = run.result
        return run.result

    @property
    def cached_tokens(self) -> int:
        return len(self.seq.tokens)

    def close(self) -> None:
        """Give the session's pages back to the pool."""
        if not self.closed:
            self.llm.runner.free(self.seq)
            self.closed = True
