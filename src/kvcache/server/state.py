"""What the server's endpoints share: the model, the scheduler on its engine thread, who may call,
the limits, the metrics, and what is read once from the model (its tool-call format).

Every endpoint module takes a ``ServerState``; this module imports none of them, so none of them
imports the app that builds them."""

from __future__ import annotations

from fastapi import Request as HttpRequest

from kvcache.engine.llm import LLM
from kvcache.engine.loop import EngineLoop
from kvcache.engine.scheduler import Scheduler, SchedulerConfig
from kvcache.server.auth import Auth, Caller
from kvcache.server.intake import Limits
from kvcache.server.logprobs import TokenText
from kvcache.server.metrics import Metrics
from kvcache.server.protocol import ApiError
from kvcache.server.reasoning import think_format
from kvcache.server.tool_formats import tool_format


class ServerState:
    def __init__(self, llm: LLM, model_name: str, auth: Auth, scheduler: SchedulerConfig, limits: Limits) -> None:
        self.llm, self.model_name, self.auth, self.limits = llm, model_name, auth, limits
        self.sched = Scheduler(llm.runner, llm.tokenizer, scheduler, llm.grammars)
        self.engine = EngineLoop(self.sched)
        self.metrics = Metrics()
        self.text_of = TokenText(llm.tokenizer)
        self.tool_format = tool_format(llm.tokenizer.chat_template, llm.tokenizer)  # how the model writes calls
        self.think_format = think_format(llm.tokenizer.chat_template, llm.tokenizer)  # its think block, if any

    def caller(self, http: HttpRequest) -> Caller:
        """Who sent the request (its tenant salt and whether it is an admin); 401 without a valid key."""
        caller = self.auth.caller(http.headers.get("authorization"))
        if caller is None:
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                           "authentication_error", code="invalid_api_key")
        return caller

    def gauges(self) -> dict[str, float]:
        """Read on the engine thread (between steps)."""
        sched, llm = self.sched, self.llm
        out: dict[str, float] = {"requests_running": len(sched.running), "requests_waiting": len(sched.waiting),
                                 "preemptions_total": sched.preemptions, "engine_steps_total": sched.steps}
        st = llm.kv_stats()
        if st is not None:
            out.update(kv_pages=st.pages_total, kv_pages_used=st.pages_used, kv_pages_cached=st.pages_cached,
                       kv_pages_in_use=st.pages_in_use, kv_bytes_allocated=st.bytes_allocated,
                       kv_usage_ratio=st.pages_in_use / st.pages_total if st.pages_total else 0.0)
        ps = llm.prefix_stats()
        if ps is not None:
            out.update(prefix_hit_rate=ps.hit_rate, prefix_hit_tokens_total=ps.hit_tokens,
                       prefix_running_tokens_total=ps.running_tokens, prefix_evicted_pages_total=ps.evicted_pages)
        return out
