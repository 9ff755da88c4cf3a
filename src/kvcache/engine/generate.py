"""One request on its own: LLM.generate of one prompt, LLM.stream, chat sessions, the benchmarks.

A ``RequestRun`` is a scheduler serving that one request, so a single prompt takes the same path as
several prompts and the server's requests: prefix reuse, fork for ``n``, EOS, stop strings, the
length and context limits and the streaming hold-back are decided in ``engine/scheduler.py`` and
``Sample.take`` only. Its scheduler feeds the prompt in forwards of at most ``PREFILL_CHUNK`` tokens
(one forward for any prompt up to that): a longer prompt's activations are bounded by a chunk's, not
its length, and chunking never changes a token's bits. A cache with a press takes the whole prompt
in one forward, as the press's reference computes it.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvcache import kernels
from kvcache.engine.params import Delta, RequestOutput, SamplingParams
from kvcache.engine.request import Request, check_prompt
from kvcache.engine.runner import ModelRunner, Seq
from kvcache.engine.scheduler import Scheduler, SchedulerConfig
from kvcache.models.tokenizer import Tokenizer

__all__ = ["Delta", "RequestRun"]

# The most prompt tokens one forward of a single run takes (llama.cpp's default batch is the same).
# SmolLM2 with an 8,000-token prompt: 17.5-18.4 s either way, a peak of 0.82 GB instead of 1.26 GB
# (the model 0.41 GB, its fp32 KV 0.37 GB); Llama-3.2-1B's shape (Q4_0) with 8,192 tokens: 55.7 s
# against 55.0, a peak of 2.16 GB instead of 2.70.
PREFILL_CHUNK = 2048


class RequestRun:
    """Iterate to run the request (its Deltas, every sample's); ``result`` is complete when
    iteration ends. A failure is raised as it happened, after the request's pages went back.

    ``seq`` may already hold tokens (a chat session, a loaded prompt cache): those it shares with
    the prompt are kept (never the whole prompt: its last token is recomputed for its logits) and
    only the rest is prefilled; without one, the prefix cache gives the longest cached prefix.
    With ``keep_seq`` the first sample's sequence is left in place for the next turn; the others go
    to the prefix cache (under ``salt``) or are freed. A prompt that does not fit the context is
    refused here, before anything runs.
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        seq: Seq | None = None,
        keep_seq: bool = False,
        salt: str | None = None,
    ) -> None:
        check_prompt(prompt_ids, runner.capacity)
        pressed = runner.cache is not None and runner.cache.config.press is not None  # scores its prompt whole
        budget = len(prompt_ids) + params.n if pressed or len(prompt_ids) <= PREFILL_CHUNK else PREFILL_CHUNK
        whole_prompt = SchedulerConfig(max_batch_tokens=budget, max_running=1, count_work=False)
        self.scheduler = Scheduler(runner, tokenizer, whole_prompt)
        self.request = Request("0", list(prompt_ids), params, salt=salt, prompt=prompt, seq=seq,
                               keep_seq=keep_seq, record_stats=True)
        self.result = RequestOutput(prompt=prompt, prompt_token_ids=list(prompt_ids), outputs=[])

    def __iter__(self) -> Iterator[Delta]:
        for deltas in self.steps():
            yield from deltas

    def steps(self) -> Iterator[list[Delta]]:
        """Run the request one scheduler step at a time: after each step, the Deltas it made (often
        none: a step whose text is held back, or a prompt chunk's)."""
        req, sched = self.request, self.scheduler
        deltas: list[Delta] = []
        req.on_delta = deltas.append
        sched.add(req)
        try:
            while sched.has_work:
                sched.step()
                yield deltas
                deltas = []
                req.on_delta = deltas.append
        finally:
            sched.abort(req.request_id)  # left early (or failed): its pages go back
            kernels.release_scratch()  # the kernels' scratch of these steps (this thread's)
        if req.exception is not None:
            raise req.exception
        self.result = req.output()
