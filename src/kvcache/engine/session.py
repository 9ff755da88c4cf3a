"""ChatSession: multi-turn chat that keeps its KV cache between turns.

Each turn renders the whole conversation with the chat template, reuses the longest cached token
prefix and prefills only the rest. With the prefix cache (the default) a finished turn's pages go
into the radix index: sessions with the same system prompt share its pages, and a session holds no
pages between turns (under memory pressure its oldest pages are evicted and recomputed when
needed). Without it, the session keeps its own sequence between turns.

A session saves to one file (its messages and its K/V) and resumes in another process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Protocol

from kvcache.engine.generate import RequestRun
from kvcache.engine.params import RequestOutput, SamplingParams
from kvcache.engine.runner import ModelRunner, Seq
from kvcache.errors import InvalidParams
from kvcache.models.tokenizer import Tokenizer
from kvcache.prefix.radix import common_prefix

class Engine(Protocol):
    """What a session needs of the LLM that opened it (kvcache.engine.llm.LLM is one)."""

    runner: ModelRunner
    tokenizer: Tokenizer
    fingerprint: str


class ChatSession:
    def __init__(self, llm: Engine, system: str | None = None, salt: str | None = None) -> None:
        self.llm = llm
        self.salt = salt
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        shared = llm.runner.prefix is not None
        self.seq: Seq | None = None if shared else llm.runner.new_sequence()
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
        return RequestRun(self.llm.runner, self.llm.tokenizer, ids, params, prompt=user, seq=self.seq,
                          keep_seq=self.seq is not None, salt=self.salt)

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
        """Tokens of the conversation whose K/V the next turn can reuse right now."""
        if self.seq is not None:
            return len(self.seq.tokens)
        runner = self.llm.runner
        if not self.messages or runner.prefix is None:
            return 0
        ids = self.llm.tokenizer.encode_chat(self.messages)
        salt = runner.prefix.config.salt if self.salt is None else self.salt
        return runner.prefix.index.match(ids, salt, touch=False).length

    def save(self, path: str) -> int:
        """Write the conversation and its K/V to ``path`` (resume with ``LLM.chat_session(resume=)``
        here or in another process); returns the bytes written."""
        from kvcache.cache.persist import save_sequence

        if self.closed:
            raise InvalidParams("this chat session is closed")
        runner, llm = self.llm.runner, self.llm
        if runner.cache is None:
            raise InvalidParams("the 'none' strategy keeps no cache to save; use dynamic or static")
        ids = llm.tokenizer.encode_chat(self.messages) if self.messages else []
        if not ids:
            raise InvalidParams("an empty chat session has nothing to save")
        seq = self.seq if self.seq is not None else runner.lookup(ids, self.salt, whole=True)
        try:
            keep = runner.reusable(seq, common_prefix(seq.tokens, ids))
            runner.truncate(seq, keep)
            if keep < len(ids):  # evicted, never computed, or the held tokens differ: compute now
                runner.step([seq], [ids[keep:]])
            assert seq.kv is not None
            return save_sequence(runner.cache, seq.kv, seq.tokens, path, llm.fingerprint,
                                 extra={"messages": json.dumps(self.messages)})
        finally:
            if seq is not self.seq:
                runner.release(seq, self.salt)

    @classmethod
    def resume(cls, llm: Engine, path: str, salt: str | None = None) -> "ChatSession":
        """A session continuing the conversation saved in ``path``; its K/V are loaded, not
        recomputed (checked against this model and cache layout)."""
        from kvcache.cache.persist import read_meta

        meta = read_meta(path)
        if "messages" not in meta:
            raise InvalidParams(f"{path} is a prompt cache, not a saved chat session")
        session = cls(llm, salt=salt)
        session.messages = json.loads(meta["messages"])
        seq = llm.runner.load(path, llm.fingerprint)
        if session.seq is not None:
            llm.runner.free(session.seq)
            session.seq = seq
        else:
            llm.runner.release(seq, salt)
        return session

    def close(self) -> None:
        """Give the session's pages back to the pool (with the prefix cache they stay cached)."""
        if not self.closed:
            if self.seq is not None:
                self.llm.runner.free(self.seq)
            self.closed = True
