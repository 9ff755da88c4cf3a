"""Rollback in every cache strategy: a verifying step of a token and k proposals, cut back to the
token and j of them, leaves the cache a sequence that never saw the refused ones would have. After
one more token on both (a one-token decode, where a quantized press seals what it deferred), the
ledger is the same (length, pages and holes per group, slots held, fp32 tails, press slots and
evictions, the pool's pages in use and bytes); for the exact strategies the logits are the same
bits too. Lossy ones may differ in their logits (the verified tokens saw each other at full
precision), never in what they hold."""

from __future__ import annotations

import pytest
import torch

from kvcache import LLM
from kvcache.cache.sequence import HOLE

EXACT = ["dynamic", "static,max_tokens=512", "dynamic,page_size=4", "dynamic,host", "dynamic,disk",
         "dynamic,window=96,page_size=4", "offloaded_static,max_tokens=512"]
LOSSY = ["fp16", "bf16", "int8", "int4,residual=8", "int2,residual=32", "dynamic,window=96,sinks=4,page_size=4",
         "int8,window=96,page_size=32", "dynamic,press=snapkv,ratio=0.5", "dynamic,press=h2o,ratio=0.3",
         "dynamic,press=tova,ratio=0.3", "int8,press=h2o,ratio=0.3", "int4,press=snapkv,ratio=0.5",
         "dynamic,press=snapkv,ratio=0.5,window=128,page_size=4", "dynamic,press=expected,ratio=0.5"]
PROMPT = [(11 * i + 5) % 3000 + 20 for i in range(200)]  # past the 96-token windows: pages leave them
FEED = [101, 102, 103, 104, 105, 106]  # the token, then five proposals
KEEP = 3  # the token and two proposals stay
NEXT = 107


def _ledger(llm: LLM, seq) -> dict[str, object]:
    kv, cache = seq.kv, llm.runner.cache
    out: dict[str, object] = {
        "length": kv.length, "tokens": len(seq.tokens),
        "pages": [len(t) for t in kv.tables], "holes": [sum(p == HOLE for p in t) for t in kv.tables],
        "held": [kv.held(g.index) for g in cache.groups],
        "tails": [None if t is None else [x.shape for x in t] for t in kv.tails],
    }
    st = kv.press
    if st is not None:
        out["press"] = (list(st.n), list(kv.dropped), st.observing, st.since)
        if not st.press.decode:  # decode-time presses choose by the sums: counts compared, not choices
            out["slots"] = [p[:, :, : n].tolist() for p, n in zip(st.pos, st.n)]
    s = llm.kv_stats()
    out["pool"] = (s.pages_used, s.pages_in_use, s.tokens_stored, s.bytes_used)
    return out


def _run(llm: LLM, verify: bool) -> tuple[dict[str, object], torch.Tensor]:
    r = llm.runner
    seq = r.new_sequence()
    r.reserve([seq], [len(PROMPT)])
    r.step([seq], [PROMPT])
    if verify:
        r.reserve([seq], [len(FEED)], [len(FEED)])
        r.step([seq], [FEED], want=[len(FEED)])
        r.truncate(seq, len(PROMPT) + KEEP)
    else:
        for t in FEED[:KEEP]:
            r.reserve([seq], [1])
            r.step([seq], [[t]])
    r.reserve([seq], [1])
    logits = r.step([seq], [[NEXT]])[0]
    ledger = _ledger(llm, seq)
    r.free(seq)
    llm.check_integrity()
    assert llm.kv_stats().pages_in_use == 0
    return ledger, logits


@pytest.fixture(scope="module")
def made():
    cache: dict[str, LLM] = {}

    def get(kv: str, model: str | None = None) -> LLM:
        key = f"{model}|{kv}"
        if key not in cache:
            cache[key] = LLM(model, kv=kv, prefix=False)
        return cache[key]

    return get


@pytest.mark.parametrize("kv", EXACT + LOSSY)
def test_rollback_leaves_what_a_sequence_that_never_saw_the_proposals_holds(made, kv):
    llm = made(kv)
    want, want_logits = _run(llm, verify=False)
    got, logits = _run(llm, verify=True)
    assert got == want
    if kv in EXACT:
        assert torch.equal(logits, want_logits), float((logits - want_logits).abs().max())
    if "window=96" in kv:
        assert max(want["holes"]) > 0  # pages had left the window before the step


@pytest.mark.gemma
def test_rollback_on_gemma3s_sliding_layers(made):
    from conftest import gemma_installed

    if not gemma_installed():
        pytest.skip("the Gemma 3 270M package is not installed (make gemma)")
    global PROMPT
    llm = made("dynamic,page_size=16", "gemma3-270m")
    saved, PROMPT = PROMPT, [(11 * i + 5) % 3000 + 20 for i in range(600)]  # past its 512-token window
    try:
        want, want_logits = _run(llm, verify=False)
        got, logits = _run(llm, verify=True)
    finally:
        PROMPT = saved
    assert got == want and max(want["holes"]) > 0
    assert torch.equal(logits, want_logits)
