"""LLM: the Python API (vLLM's names where they fit)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Union

import torch

from kvcache import gcpolicy, hugepages, kernels
from kvcache.cache.paged import CacheStats
from kvcache.cache.config import CacheConfig, parse_kv_spec
from kvcache.engine.generate import RequestRun
from kvcache.engine.params import Delta, RequestOutput, SamplingParams
from kvcache.engine.runner import ModelRunner
from kvcache.errors import InvalidParams
from kvcache.models.config import ModelConfig
from kvcache.models.loading import model_fingerprint, model_weights, read_config, resolve_model
from kvcache.models.registry import build_model
from kvcache.models.repacked import MODES as KEPT_MODES, repack_store
from kvcache.models.tokenizer import Tokenizer
from kvcache.models.weights import check_mode, effective_mode
from kvcache.prefix.cache import PrefixStats
from kvcache.prefix.config import PrefixConfig, parse_prefix
from kvcache.press.kvzip import replay_prompt

if TYPE_CHECKING:
    from kvcache.engine.grammar import Grammars
    from kvcache.engine.scheduler import SchedulerConfig
    from kvcache.engine.session import ChatSession

Prompt = Union[str, list[int]]
Messages = list[dict[str, str]]


def default_threads() -> int:
    """Torch threads: KVCACHE_THREADS, else the number of CPUs this process may use."""
    env = os.environ.get("KVCACHE_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


class LLM:
    """A loaded model, its tokenizer and its KV cache.

    ``model`` is None (the bundled SmolLM2-135M-Instruct), a bundled name, a GGUF file, an HF
    model folder or a hub id. ``kv`` is a CacheConfig or a compact spec over four axes: capacity
    (``dynamic``, ``static,max_tokens=N``, ``none``), visibility (``window=N``, ``sinks=K``),
    encoding (``fp32`` ... ``int2``, ``rotate`` to Hadamard-rotate quantized K/V) and placement
    (``device``, ``host``, ``disk``), e.g. ``static,int4,sinks=4,window=1024`` or ``int4,rotate``;
    presets: ``offloaded``, ``quantized``, ``sink``, ...
    ``prefix``: automatic prefix caching (on by default; False turns it off; a PrefixConfig sets
    its budget, eviction policy and disk/Redis tiers). ``weights``: ``file`` (the GGUF's own
    quantized types, multiplied by int8 kernels), ``fp32``, ``q8`` or ``q4`` (quantized at load);
    see kvcache.models.weights. ``template_timeout``: seconds the chat template may take to render
    (default 1; models/templates.py); a template that cannot render a short conversation refuses
    the model at load.
    """

    def __init__(
        self,
        model: str | None = None,
        kv: str | CacheConfig | None = "dynamic",
        threads: int | None = None,
        prefix: PrefixConfig | bool | None = None,
        weights: str = "file",
        draft_model: str | None = None,
        draft_weights: str = "file",
        template_timeout: float | None = None,
    ) -> None:
        torch.set_num_threads(threads or default_threads())
        t0 = time.perf_counter()
        mode = effective_mode(check_mode(weights))
        resolved = resolve_model(model)
        self.config: ModelConfig = ModelConfig.from_hf(read_config(resolved.path))  # refuse early
        self.tokenizer = Tokenizer.from_dir(resolved.path, template_timeout)
        self.tokenizer.check_chat_template()  # a template that cannot render a short chat refuses the model
        state_dict = model_weights(resolved, mode)
        # a GGUF's repacked (or quantized anew) weights are kept beside its converted folder, one
        # file a mode, and mapped by later loads
        gguf = resolved.gguf if mode in KEPT_MODES else None
        reads = 0 if gguf is None else gguf.stat().st_size if mode == "file" else \
            sum(t.numel() * 4 for t in state_dict.values() if isinstance(t, torch.Tensor))
        with repack_store(resolved.path if gguf is not None else None, reads, mode) as store:
            if store is not None:
                store.name(state_dict)
            self.model = build_model(self.config, state_dict, mode)
        del state_dict
        self.model.replay_prompt = replay_prompt(self.tokenizer)  # press=kvzip's replay request
        self.model_path = str(resolved.source)
        self.model_name = resolved.name
        kinds = self.model.weight_kinds()
        # what the weights are in memory: "fp32", or the mode that quantized them
        self.weights = mode if set(kinds) - {"fp32"} else "fp32"
        # K/V computed with other weights never mix: the mode is part of the model's identity
        base = model_fingerprint(resolved.path)
        self.fingerprint = base if self.weights == "fp32" else f"{base}+{self.weights}"
        self.cache_config = parse_kv_spec(kv)
        self.prefix_config = parse_prefix(prefix)
        self.runner = ModelRunner(self.model, self.cache_config, self.prefix_config, self.fingerprint)
        self.draft: LLM | None = None
        if draft_model is not None:
            self.draft = self._load_draft(draft_model, draft_weights, threads)
            self.runner.draft = self.draft.runner
        hugepages.trim()  # what the load parsed and freed goes back to the kernel
        gcpolicy.settle()  # a command's deferred collection resumes, its start-up frozen (gcpolicy.py)
        self.load_s = time.perf_counter() - t0

    def _load_draft(self, model: str, weights: str, threads: int | None) -> LLM:
        """A draft model for speculative decoding: the same tokenizer (every token id the same
        text), its own dynamic cache, no prefix cache."""
        draft = LLM(model, kv="dynamic", threads=threads, prefix=False, weights=weights)
        if (draft.config.vocab_size != self.config.vocab_size
                or draft.tokenizer.backend.get_vocab() != self.tokenizer.backend.get_vocab()):
            raise InvalidParams(f"the draft model {draft.model_name!r} has another tokenizer than "
                                f"{self.model_name!r}: a draft must share the target's vocabulary")
        return draft

    # -- prompts -----------------------------------------------------------------------------
    def encode(self, prompt: Prompt | Messages, chat: bool = False) -> list[int]:
        """Token ids of a prompt: text (with the chat template when ``chat``), a messages list
        (always templated) or token ids as they are."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
            return list(prompt)
        if isinstance(prompt, list):
            return self.tokenizer.encode_chat(_check_messages(prompt))
        if not isinstance(prompt, str):
            raise InvalidParams(f"a prompt must be text, token ids or messages, got {type(prompt).__name__}")
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    # -- generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Messages | Sequence[Prompt | Messages],
        params: SamplingParams | None = None,
        chat: bool = False,
        prompt_cache: str | None = None,
        salt: str | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt (a single prompt is a list of one). With ``prompt_cache``
        (a file from save_cache) each prompt continues the cached tokens, whose K/V are loaded
        instead of computed. ``salt`` separates tenants in the prefix cache."""
        params = params or SamplingParams()
        batch = _as_batch(prompts)
        if len(batch) > 1 and prompt_cache is None:
            return self.generate_batch(batch, params, chat, salt)
        outs = []
        for prompt in batch:
            run = self.request(prompt, params, chat, prompt_cache, salt)
            for _ in run:
                pass
            outs.append(run.result)
        return outs

    def generate_batch(
        self,
        prompts: Sequence[Prompt | Messages],
        params: SamplingParams | Sequence[SamplingParams],
        chat: bool = False,
        salt: str | None = None,
        scheduler: "SchedulerConfig | None" = None,
    ) -> list[RequestOutput]:
        """Run all prompts together with continuous batching (one forward serves every running
        request; prompts prefill in chunks). ``params`` may differ per prompt."""
        from kvcache.engine.scheduler import Request, Scheduler, SchedulerConfig

        per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise InvalidParams(f"{len(per)} sampling params for {len(prompts)} prompts")
        sched = Scheduler(self.runner, self.tokenizer, scheduler or SchedulerConfig(max_running=len(prompts)))
        reqs = []
        for i, (prompt, p) in enumerate(zip(prompts, per)):
            req = Request(str(i), self.encode(prompt, chat), p, salt=salt,
                          prompt=prompt if isinstance(prompt, str) else None)
            sched.add(req)
            reqs.append(req)
        try:
            while sched.has_work:
                sched.step()
        finally:
            for req in reqs:
                sched.abort(req.request_id)  # pages of anything left behind by an error go back
            kernels.release_scratch()  # the kernels' scratch of these steps (this thread's)
        failed = [r for r in reqs if r.error]
        if failed:
            from kvcache.errors import CacheFull

            raise CacheFull(f"request {failed[0].request_id}: {failed[0].error}")
        stats = self.runner.stats()
        outs = []
        for req in reqs:
            out = req.output()
            out.kv_stats = stats
            outs.append(out)
        return outs

    def stream(
        self, prompt: Prompt | Messages, params: SamplingParams | None = None, chat: bool = False
    ) -> Iterator[Delta]:
        """Yield text pieces as they are generated (every sample's, tagged with its index)."""
        yield from self.request(prompt, params or SamplingParams(), chat)

    def request(
        self, prompt: Prompt | Messages, params: SamplingParams, chat: bool = False, prompt_cache: str | None = None,
        salt: str | None = None,
    ) -> RequestRun:
        """A request ready to run: iterate it for text pieces; ``.result`` is complete after."""
        ids = self.encode(prompt, chat)
        text = prompt if isinstance(prompt, str) else None
        if prompt_cache is None:
            return RequestRun(self.runner, self.tokenizer, ids, params, prompt=text, salt=salt)
        seq = self.runner.load(prompt_cache, self.fingerprint)
        bos = self.tokenizer.bos_token_id
        if ids and bos is not None and ids[0] == bos and not isinstance(prompt, list):
            ids = ids[1:]  # the text continues the cached tokens: no second BOS
        try:
            return RequestRun(self.runner, self.tokenizer, seq.tokens + ids, params, prompt=text, seq=seq, salt=salt)
        except Exception:
            self.runner.free(seq)  # refused before it ran: the loaded pages go back
            raise

    def save_cache(self, path: str, prompt: Prompt | Messages, chat: bool = False) -> int:
        """Compute the K/V of ``prompt`` once and save them (with its token ids) to ``path``, for
        ``generate(..., prompt_cache=path)`` here or in another process. Returns tokens saved."""
        ids = self.encode(prompt, chat)
        seq = self.runner.new_sequence()
        try:
            self.runner.step([seq], [ids])
            self.runner.save(seq, path, self.fingerprint)
        finally:
            self.runner.free(seq)
        return len(ids)

    def cache_prefix(self, prompt: Prompt | Messages, chat: bool = False, salt: str | None = None) -> int:
        """Compute the K/V of ``prompt`` once and leave them in the prefix cache, so later prompts
        that begin with its tokens start from there (under a question-agnostic press, ``knorm`` or
        ``expected``, compressed once: a shared system prompt). Returns the tokens cached."""
        if self.runner.prefix is None:
            raise InvalidParams("prefix caching is off (prefix=False): nothing would keep the prompt")
        ids = self.encode(prompt, chat)
        seq = self.runner.lookup(ids, salt, whole=True)
        try:
            if len(seq.tokens) < len(ids):
                self.runner.step([seq], [ids[len(seq.tokens):]])
        except Exception:
            self.runner.free(seq)
            raise
        self.runner.release(seq, salt)
        return len(ids)

    def chat_session(self, system: str | None = None, resume: str | None = None,
                     salt: str | None = None) -> "ChatSession":
        """A multi-turn chat; ``resume``: a file written by ``ChatSession.save``."""
        from kvcache.engine.session import ChatSession

        if resume is not None:
            if system is not None:
                raise InvalidParams("a resumed session keeps its saved system prompt; drop system=")
            return ChatSession.resume(self, resume, salt)
        return ChatSession(self, system=system, salt=salt)

    # -- inspection ----------------------------------------------------------------------------
    @property
    def grammars(self) -> Grammars:
        """This model's compiled constraints (shared by every scheduler over it)."""
        from kvcache.engine.grammar import grammars_for

        return grammars_for(self.tokenizer, self.config.vocab_size)

    def kv_stats(self) -> CacheStats | None:
        """Memory accounting of the KV cache (None for the ``none`` strategy)."""
        return self.runner.stats()

    def prefix_stats(self) -> PrefixStats | None:
        """Prefix-cache statistics: hit tokens and rate, evictions, cached pages, tier hits (None
        when prefix caching is off or there is no cache)."""
        return self.runner.prefix.stats() if self.runner.prefix is not None else None

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix held in RAM (disk and Redis tiers keep theirs)."""
        if self.runner.prefix is not None:
            self.runner.prefix.clear()

    def flush(self) -> None:
        """Wait until every page queued for the disk/Redis tiers is written."""
        if self.runner.prefix is not None:
            self.runner.prefix.flush()

    def check_integrity(self) -> None:
        """Assert the page accounting: every page free, referenced or cached (see PagedKVCache)."""
        self.runner.check_integrity()

    # -- stopping ------------------------------------------------------------------------------
    def close(self) -> None:
        """Write every page queued for the disk/Redis tiers, stop their writer thread and close
        them (a write still queued after ``CLOSE_TIMEOUT_S`` is dropped whole: an entry is on disk
        complete or not at all). Idempotent; leaving a ``with LLM(...)`` block calls it, and the
        interpreter's exit does when nobody did. Pages cached in RAM stay usable; later tier
        writes happen at once on the caller's thread."""
        if self.runner.prefix is not None:
            self.runner.prefix.close()
        if self.draft is not None:
            self.draft.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_messages(messages: list) -> Messages:
    if not messages:
        raise InvalidParams("messages must not be empty")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidParams("each message needs a string 'role' and a string 'content'")
    return messages


def _as_batch(prompts: object) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(m, dict) for m in prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts:
        return list(prompts)
    raise InvalidParams("prompts must be a string, token ids, messages, or a non-empty list of them")
