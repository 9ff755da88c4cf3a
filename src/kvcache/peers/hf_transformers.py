"""transformers as a peer: its causal LM of the fp32 folder kvcache converted (the weights of
kvcache's ``fp32`` mode), or a row that says it is not installed; its decode and prefill rows for
``bench decode``, measured in a child process; and, in the calling process, what other suites time
of it: generate over a batch (``bench throughput``), greedy steps with and without a cache
(``bench cache-vs-none``), a prompt's cache deep-copied for reuse (``bench prefix``), DynamicCache
appends (``bench growth``) and the memory probe (``bench memory``, itself a child of that suite).

The child loads the fp32 folder, decodes after the same prompt token ids as kvcache (greedy, EOS
ignored, same number of new tokens, same thread count) with each of its caches, and times one
forward over each prefill prompt (a fresh DynamicCache, the last position's logits only, as
``generate`` asks). A crash or a missing transformers becomes rows with a note. The child is
``python -m kvcache.peers.hf_transformers`` with a JSON request on stdin; it prints the rows as JSON.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcache.peers.process import child_main, run_module
from kvcache.peers.row import BatchRow, Row, Tick, step_bytes

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

NO_TRANSFORMERS = "transformers not installed: skipped"


def transformers_model(model_dir: str | Path) -> Any | None:
    """transformers' causal LM of ``model_dir`` in fp32, in eval mode (kvcache's fp32 folder,
    ``models.loading.fp32_folder``: the weights of kvcache's ``fp32`` mode); None when transformers
    is not installed (its rows then say ``NO_TRANSFORMERS``)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    import torch

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


CACHES = {"none": "use_cache=False", "dynamic": "DynamicCache", "static": "StaticCache"}


def rows(model_dir: str, ids: list[int], caches: list[str], new: int, repeats: int,
         prefill: dict[int, list[int]], threads: int, tick: Tick | None = None) -> list[Row]:
    """transformers' rows, measured in a child process (or skipped with the reason)."""
    req = {"model_dir": model_dir, "ids": ids, "caches": caches, "new": new, "repeats": repeats,
           "prefill": {str(n): p for n, p in prefill.items()}, "threads": threads}
    out = run_module("kvcache.peers.hf_transformers", req, "transformers")
    expected = [Row("transformers", "fp32", CACHES[c], "fp32", tokens=len(ids)) for c in caches]
    expected += [Row("transformers", "fp32", "DynamicCache", "fp32", "prefill", n) for n in prefill]
    if tick:
        for _ in range(len(caches) * repeats + len(prefill) * repeats):
            tick()
    if not out.ok:
        for r in expected:
            r.note = out.note
        return expected
    return [Row.from_dict(d) for d in out.data]


def _measure(req: dict[str, Any]) -> list[dict[str, object]]:
    import torch

    torch.set_num_threads(int(req["threads"]))
    model = transformers_model(req["model_dir"])
    if model is None:
        return [vars(Row("transformers", "fp32", CACHES[c], "fp32", note=NO_TRANSFORMERS)) for c in req["caches"]]
    ids, new, repeats = list(req["ids"]), int(req["new"]), int(req["repeats"])
    out = [_decode(model, ids, c, new, repeats) for c in req["caches"]]
    out += [_prefill(model, int(n), p, repeats) for n, p in req["prefill"].items()]
    return [vars(r) for r in out]


def _weight_bytes(model: PreTrainedModel) -> int:
    """Bytes one step reads: every distinct parameter once but the input embedding table, plus the head."""
    head = model.get_output_embeddings().weight
    seen = {head.data_ptr()}
    total = head.numel() * head.element_size()
    for name, p in model.named_parameters():
        if p.data_ptr() in seen or any(key in name for key in ("embed", "wte", "wpe")):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def _decode(model: PreTrainedModel, ids: list[int], cache: str, new: int, repeats: int) -> Row:
    import torch

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    wbytes = _weight_bytes(model)
    kwargs: dict[str, object] = {"use_cache": cache != "none"}
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    row = Row("transformers", "fp32", CACHES[cache], "fp32", tokens=len(ids))
    gen = dict(do_sample=False, pad_token_id=cfg.eos_token_id, **kwargs)
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        model.generate(input_ids[:, :8], max_new_tokens=4, min_new_tokens=4, **gen)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.generate(input_ids, max_new_tokens=1, min_new_tokens=1, **gen)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(input_ids, max_new_tokens=new, min_new_tokens=new, **gen)
            total = time.perf_counter() - t0
            made = out.shape[1] - input_ids.shape[1]
            tok_s = (made - 1) / max(total - ttft, 1e-9)
            row.tok_s.append(tok_s)
            row.ttft_s.append(ttft)
            kv = kv_per_token if cache != "none" else 0
            row.gb_s.append(step_bytes(wbytes, kv, len(ids), new) * tok_s / 1e9)
    return row


def _prefill(model: PreTrainedModel, n: int, ids: list[int], repeats: int) -> Row:
    import torch

    row = Row("transformers", "fp32", "DynamicCache", "fp32", "prefill", n)
    x = torch.tensor([ids])
    with torch.inference_mode():
        model(x[:, :16], use_cache=True, logits_to_keep=1)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(x, use_cache=True, logits_to_keep=1)
            row.tok_s.append(n / (time.perf_counter() - t0))
    return row


# -- bench throughput: generate over a batch of requests, in this process -----------------------------


class _Clock:
    """A transformers streamer that records when each generation step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.calls = 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls > 1:  # the first call carries the prompt
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate_sequential(model, prompts: list[list[int]], new: int, tick: Callable[[], None]) -> BatchRow:
    import torch

    res = BatchRow("transformers generate, one at a time")
    pad = model.config.eos_token_id
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            clock = _Clock()
            out = model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=pad, streamer=clock)
            made = out.shape[1] - len(p)
            res.new_tokens += made
            res.ttft_s.append(clock.times[0] - t0)
            if made > 1:
                res.tpot_s.append((clock.times[-1] - clock.times[0]) / (made - 1))
            tick()
    res.wall_s = time.perf_counter() - t0
    return res


def generate_padded(model, prompts: list[list[int]], new: int, tick: Callable[[], None]) -> BatchRow:
    import torch

    res = BatchRow("transformers generate, padded batch")
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=pad, streamer=clock)
    res.wall_s = time.perf_counter() - t0
    made = out.shape[1] - width
    res.new_tokens = made * len(prompts)
    res.ttft_s = [clock.times[0] - t0] * len(prompts)
    if made > 1:
        res.tpot_s = [(clock.times[-1] - clock.times[0]) / (made - 1)] * len(prompts)
    tick()
    return res


def generate_batch(model, prompts: list[list[int]], new: int, tick: Callable[[], None]) -> BatchRow:
    res = BatchRow("transformers generate_batch")
    if not hasattr(model, "generate_batch"):
        res.note = "this transformers has no generate_batch: skipped"
        return res
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    try:
        model.generate_batch([p[:8] for p in prompts[:2]], generation_config=cfg, progress_bar=False)  # warm-up
        t0 = time.perf_counter()
        outs = model.generate_batch(prompts, generation_config=cfg, progress_bar=False, record_timestamps=True)
        res.wall_s = time.perf_counter() - t0
    except Exception as e:  # it is young and CUDA-first: report, do not crash the suite
        res.note = f"failed here: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return res
    for o in outs.values():
        toks = list(o.generated_tokens)
        res.new_tokens += len(toks)
        stamps = list(o.timestamps or [])
        if stamps:
            res.ttft_s.append(stamps[0] - o.created_time)  # from the request's creation
            if len(stamps) > 1:
                res.tpot_s.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    tick()
    return res


# -- in this process: bench cache-vs-none's steps, bench prefix's reuse, bench growth's appends -------


def greedy_stepper(model: PreTrainedModel, ids: list[int], use_cache: bool) -> tuple[int, Callable[[int], int]]:
    """The greedy token after the prompt ``ids``, and a step: the next greedy token after a given one,
    with a DynamicCache or (``use_cache`` False) recomputing the whole sequence each step."""
    import torch
    from transformers import DynamicCache

    seq = list(ids)
    cache = DynamicCache(config=model.config) if use_cache else None
    with torch.inference_mode():
        first = int(model(torch.tensor([seq]), past_key_values=cache, use_cache=use_cache).logits[0, -1].argmax())

    def step(tok: int) -> int:
        seq.append(tok)
        with torch.inference_mode():
            inp = torch.tensor([[tok]]) if use_cache else torch.tensor([seq])
            return int(model(inp, past_key_values=cache, use_cache=use_cache).logits[0, -1].argmax())

    return first, step


def deepcopy_ttft(model_dir: str, prompts: list[list[int]], shared: int,
                  progress: Callable[[], None] | None = None) -> tuple[list[float], str]:
    """Seconds to the first token of each prompt when its first ``shared`` tokens' DynamicCache,
    prefilled once, is deep-copied and the rest read into the copy (the documented way to reuse a
    prompt's cache in transformers); and a note ([] and why when transformers is missing)."""
    import copy
    import inspect

    import torch

    model = transformers_model(model_dir)
    if model is None:
        return [], NO_TRANSFORMERS
    from transformers import DynamicCache

    # generate() asks for the last position's logits only; a forward does too when it can
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out: list[float] = []
    with torch.inference_mode():
        prompt_cache = DynamicCache(config=model.config)
        model(torch.tensor([prompts[0][:shared]]), past_key_values=prompt_cache, use_cache=True)
        for ids in prompts:
            t0 = time.perf_counter()
            cache = copy.deepcopy(prompt_cache)
            logits = model(torch.tensor([ids[shared:]]), past_key_values=cache, use_cache=True, **keep).logits
            int(logits[0, -1].argmax())
            out.append(time.perf_counter() - t0)
            if progress:
                progress()
    return out, ""


def dynamic_cache_appends(layers: int, kv_heads: int, head_dim: int, max_context: int,
                          progress: Callable[[int], None] | None = None) -> list[float] | None:
    """Seconds of each DynamicCache append (one token's K and V updated into every layer) from 0 to
    ``max_context`` tokens; None without transformers."""
    import torch

    try:
        from transformers import DynamicCache
    except ImportError:
        return None
    cache = DynamicCache()
    torch.manual_seed(0)
    ks = [torch.randn(1, kv_heads, 1, head_dim) for _ in range(layers)]
    vs = [torch.randn(1, kv_heads, 1, head_dim) for _ in range(layers)]
    times = [0.0] * max_context
    clock = time.perf_counter
    with torch.inference_mode():
        for pos in range(max_context):
            t0 = clock()
            for layer in range(layers):
                cache.update(ks[layer], vs[layer], layer)
            times[pos] = clock() - t0
            if progress and pos % 256 == 255:
                progress(256)
    return times


def memory_probe(model_dir: str | Path, ids: list[int], cache: str, new: int) -> dict[str, object]:
    """``bench memory``'s probe of transformers in this process: resident bytes once loaded and at
    the peak of a greedy generate of ``new`` tokens after ``ids`` with its DynamicCache or
    StaticCache, and the bytes of the K and V tensors it held."""
    import torch

    from kvcache.peers.process import PeakRss, rss_bytes

    hf = transformers_model(model_dir)
    kwargs: dict[str, object] = {"cache_implementation": "static"} if cache == "StaticCache" else {}
    loaded = rss_bytes()
    with PeakRss() as peak, torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=hf.config.eos_token_id, return_dict_in_generate=True, **kwargs)
    kv = 0
    for layer in getattr(out.past_key_values, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                kv += t.numel() * t.element_size()
    return {"rss_loaded": loaded, "rss_peak": peak.peak, "kv_used": kv, "kv_allocated": kv,
            "tokens": out.sequences.shape[1], "weights_label": "fp32",
            "weight_bytes": sum(p.numel() * p.element_size() for p in hf.parameters())}


if __name__ == "__main__":
    raise SystemExit(child_main(_measure))
