"""Every combination of capacity x visibility x encoding x placement on a tiny model, with fp32
weights and with q8 weights (int8 products): runs,
forks, truncates, saves and loads; page accounting holds after each; every combination's logits
are compared with recomputation under the same visibility (full, or a window: recomputed through
dense attention with that window; sinks: the fp32 cache with those sinks, itself checked against a
direct reference in test_cache_visibility.py) within a bound per encoding; save/load gives the
same logits as the cache it was saved from."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcache import LLM
from kvcache.attention.recompute import RecomputeContext
from kvcache.cache.config import parse_kv_spec
from kvcache.engine.runner import ModelRunner

PROMPT = [5, 17, 42, 8, 99, 23, 4, 61, 77, 12, 30, 3, 9, 14]
FOLLOW = [7, 21, 33, 2, 50, 6, 18, 40]
CAPACITY = ["dynamic", "static,max_tokens=48"]
VISIBILITY = ["", "window=8", "sinks=2,window=8"]
ENCODING = ["fp32", "fp16", "bf16", "int8,group_size=8,residual=4", "int4,group_size=8,residual=4",
            "int2,group_size=8,residual=4"]
PLACEMENT = ["device", "host", "disk"]
MATRIX = [",".join(x for x in combo if x) for combo in itertools.product(CAPACITY, VISIBILITY, ENCODING, PLACEMENT)]
# largest |logit - reference| allowed per encoding (the logits here are of order 1; measured worst
# over capacities, visibilities and placements: fp32 2e-7, fp16 9e-5, bf16 8e-4, int8 6e-4,
# int4 8e-3, int2 4e-2)
BOUND = {"fp32": 1e-4, "fp16": 5e-4, "bf16": 4e-3, "int8": 4e-3, "int4": 4e-2, "int2": 2e-1}
# with q8 weights the activations are rounded to int8 per block: a K/V rounded to fp16 (or int8)
# moves an activation across a rounding boundary now and then, so the lossy encodings stray further
# (measured worst: fp32 4e-7, fp16 7e-3, bf16 6e-3, int8 6e-3, int4 1.2e-2, int2 3.9e-2; fp32 K/V can
# meet the same rounding flip when attention sums in another order)
BOUNDS = {"fp32": BOUND, "q8": {"fp32": 2e-2, "fp16": 2e-2, "bf16": 2e-2, "int8": 2e-2, "int4": 4e-2, "int2": 2e-1}}


@pytest.fixture(scope="module", params=["fp32", "q8"])
def tiny_llm(tiny_dir, request):
    """The tiny Llama with fp32 weights, and with q8 weights (int8 products, quantized at load)."""
    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv="none", weights=request.param)
    assert llm.weights == request.param
    return llm


@pytest.fixture(scope="module")
def recompute(tiny_llm):
    """Logits of recomputing from scratch after every prefix of PROMPT + FOLLOW."""
    runner = ModelRunner(tiny_llm.model, parse_kv_spec("none"))
    seq = runner.new_sequence()
    out = [runner.step([seq], [PROMPT])[0]]
    for t in FOLLOW:
        out.append(runner.step([seq], [[t]])[0])
    return out


def _windowed_recompute(model, window: int) -> list[torch.Tensor]:
    """Logits after every prefix of PROMPT + FOLLOW, recomputed in one forward through dense
    attention where each query sees its last ``window`` tokens."""
    tokens = PROMPT + FOLLOW
    ctx = RecomputeContext([len(tokens)], torch.arange(len(tokens)), [window] * model.config.num_layers)
    with torch.inference_mode():
        logits = model(torch.tensor(tokens), torch.arange(len(tokens)), ctx, logits_rows=None)  # [T, V]
    return [logits[len(PROMPT) - 1 + i] for i in range(len(FOLLOW) + 1)]


@pytest.fixture(scope="module")
def references(tiny_llm, recompute):
    """Per visibility, the logits every combination with it is compared with."""
    sinks = ModelRunner(tiny_llm.model, parse_kv_spec("dynamic,sinks=2,window=8,page_size=4"))
    seq = sinks.new_sequence()
    sink_ref = [sinks.step([seq], [PROMPT])[0]] + [sinks.step([seq], [[t]])[0] for t in FOLLOW]
    window_ref = _windowed_recompute(tiny_llm.model, 8)
    assert float((window_ref[-1] - recompute[-1]).abs().max()) > 1e-3  # the window does change them
    return {"": recompute, "window=8": window_ref, "sinks=2,window=8": sink_ref}


def _runner(llm, spec, tmp_path):
    spec = f"{spec},page_size={8 if 'int' in spec else 4}" + (f",dir={tmp_path}" if "disk" in spec else "")
    return ModelRunner(llm.model, parse_kv_spec(spec))


@pytest.mark.parametrize("spec", MATRIX)
def test_combination(tiny_llm, recompute, references, spec, tmp_path):
    runner = _runner(tiny_llm, spec, tmp_path)
    cfg = runner.cache_config
    exact = cfg.exact
    # exact strategies: recompute's logits to 1e-4 with fp32 weights; with q8 weights another
    # attention path may round an int8 activation the other way (the same bound as fp16's)
    tol = (1e-4 if tiny_llm.weights == "fp32" else BOUNDS["q8"]["fp16"]) if exact else None
    vis = "sinks=2,window=8" if cfg.sinks else "window=8" if cfg.window else ""
    seq = runner.new_sequence()
    logits = [runner.step([seq], [PROMPT])[0]]
    runner.check_integrity()
    child = runner.fork(seq)  # copy-on-write: every page shared, nothing copied yet
    assert child.kv.tables == seq.kv.tables
    assert all(runner.cache.pages.refcount(0, p) == 2 for p in seq.kv.tables[0] if p >= 0)
    copies = runner.cache.cow_copies
    runner.step([child], [[FOLLOW[1]]])  # the child writes: only a shared partial page is copied
    partial = len(PROMPT) % runner.cache.page_size and not cfg.quantized
    assert runner.cache.cow_copies - copies == (1 if partial else 0) * len(runner.cache.groups)
    runner.check_integrity()
    for t in FOLLOW:
        logits.append(runner.step([seq], [[t]])[0])
        runner.check_integrity()
    worst = max(float((got - want).abs().max()) for got, want in zip(logits, references[vis]))
    bound = BOUNDS[tiny_llm.weights][cfg.encoding]
    assert worst <= bound, f"{spec} ({tiny_llm.weights} weights): logits {worst:.2e} from the reference, bound {bound}"
    for got, want in zip(logits, recompute):
        if tol:
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # save after the prompt and three tokens, load into a fresh cache: the next step agrees
    runner.truncate(seq, len(PROMPT) + 3) if runner.reusable(seq, len(PROMPT) + 3) else None
    if len(seq.tokens) == len(PROMPT) + 3:
        path = str(tmp_path / "seq.kv")
        runner.save(seq, path, "fp")
        again = _runner(tiny_llm, spec, tmp_path)
        loaded = again.load(path, "fp")
        assert loaded.tokens == seq.tokens
        a = runner.step([seq], [[FOLLOW[3]]])[0]
        b = again.step([loaded], [[FOLLOW[3]]])[0]
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        if tol:
            torch.testing.assert_close(a, recompute[4], atol=tol, rtol=tol)
        again.free(loaded)
        again.check_integrity()
    else:  # a window dropped what a query there would need: truncation is refused, not faked
        assert cfg.window is not None
    for s in (seq, child):
        runner.free(s)
    runner.check_integrity()
    stats = runner.stats()
    assert stats.pages_used == 0 and stats.tokens_stored == 0
    assert stats.bytes_allocated > 0 and len(stats.per_layer) == 3


def test_quantized_with_residual_covering_everything_is_exact(tiny_llm, recompute):
    runner = ModelRunner(tiny_llm.model, parse_kv_spec("int2,page_size=8,group_size=8,residual=64"))
    seq = runner.new_sequence()
    torch.testing.assert_close(runner.step([seq], [PROMPT])[0], recompute[0], atol=1e-4, rtol=1e-4)
    for i, t in enumerate(FOLLOW):
        torch.testing.assert_close(runner.step([seq], [[t]])[0], recompute[i + 1], atol=1e-4, rtol=1e-4)
    assert runner.stats().pages_used == 0  # nothing left the fp32 window


@pytest.mark.parametrize("bits,bound", [(8, 0.05), (4, 0.5)])
def test_quantized_logits_stay_close(tiny_llm, recompute, bits, bound):
    runner = ModelRunner(tiny_llm.model, parse_kv_spec(f"int{bits},page_size=8,group_size=8,residual=0"))
    seq = runner.new_sequence()
    got = [runner.step([seq], [PROMPT])[0]] + [runner.step([seq], [[t]])[0] for t in FOLLOW]
    assert runner.stats().pages_used == (len(PROMPT) + len(FOLLOW)) // 8  # every full page quantized
    worst = max(float((a - b).abs().max()) for a, b in zip(got[1:], recompute[1:]))
    assert 0 < worst < bound
