"""Batch invariance with the file's quantized weights: a sequence's logits are the same bits
whatever path computed them: recomputation, a dynamic or a static cache, any prefill chunking, a
prefix hit, a batch of 1, 8 or 32 beside other sequences. (With quantized weights the activations
are rounded to int8: any path that reduced in another order would round some value the other way
and change the text, as the greedy text of the issue's prompt did before.)"""

from __future__ import annotations

import pytest
import torch

from kvcache import LLM, SamplingParams

TEXTS = ["The history of the printing press begins", "Water boils at a temperature of",
         "def fibonacci(n):\n    ", "In a distant galaxy, a small robot named", "The three primary colours are",
         "Once upon a time there was a", "A recipe for bread needs flour, water,", "The capital of Australia is"]


@pytest.fixture(scope="module")
def llms():
    made: dict[str, LLM] = {}

    def get(kv: str, prefix: bool = False) -> LLM:
        key = f"{kv}|{prefix}"
        if key not in made:
            made[key] = LLM(kv=kv, prefix=prefix)  # the bundled file, its own Q4_1/Q8_0 weights
        return made[key]

    return get


def _prompts(llm: LLM, k: int) -> list[list[int]]:
    """k prompts of different lengths (long ones cross the attention's 128-key chunks)."""
    base = [llm.encode(t) for t in TEXTS]
    out = []
    for i in range(k):
        ids = list(base[i % len(base)])
        for j in range(i // len(base)):
            ids += base[(i + j + 1) % len(base)]
        if i % 3 == 0:
            ids = ids * (1 + i % 5)  # some run past 128 and 256 tokens
        out.append(ids)
    return out


def _feed(llm: LLM, ids: list[int], chunks: list[int], steps: int = 4) -> list[torch.Tensor]:
    """Logits after the prompt (fed in ``chunks``; 0: the rest) and after ``steps`` greedy tokens."""
    r = llm.runner
    seq = r.new_sequence()
    at, out = 0, []
    for c in chunks:
        feed = ids[at : at + c] if c else ids[at:]
        at += len(feed)
        logits = r.step([seq], [feed])[0]
    assert at == len(ids)
    out.append(logits)
    for _ in range(steps):
        logits = r.step([seq], [[int(logits.argmax())]])[0]
        out.append(logits)
    r.free(seq)
    return out


def _together(llm: LLM, prompts: list[list[int]], steps: int) -> list[list[torch.Tensor]]:
    """Per prompt, the logits after it and after each of ``steps`` greedy tokens, all prompts in
    one forward, then the decodes of all sequences at once."""
    r = llm.runner
    seqs = [r.new_sequence() for _ in prompts]
    got = [[row] for row in r.step(seqs, prompts)]
    for _ in range(steps):
        for g, row in zip(got, r.step(seqs, [[int(g[-1].argmax())] for g in got])):
            g.append(row)
    for s in seqs:
        r.free(s)
    return got


def _same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}, step {i}: max difference {float((x - y).abs().max()):.3g}"


@pytest.mark.parametrize("path", ["dynamic", "static,max_tokens=1024", "dynamic|chunks 1,2,5", "dynamic|chunks 127",
                                  "dynamic|chunks 64", "dynamic|one by one"])
def test_every_cache_path_gives_recomputations_bits(llms, path):
    kv, _, how = path.partition("|")
    ref_llm, llm = llms("none"), llms(kv)
    for ids in _prompts(ref_llm, 8)[:5]:
        want = _feed(ref_llm, ids, [0], steps=3)
        if how == "one by one":
            chunks = [1] * len(ids)
        elif how:
            sizes = [int(x) for x in how.split()[1].split(",")]
            chunks, left = [], len(ids)
            while left > 0:
                c = min(sizes[len(chunks) % len(sizes)], left)
                chunks.append(c)
                left -= c
        else:
            chunks = [0]
        _same(want, _feed(llm, ids, chunks, steps=3), f"{path}, {len(ids)}-token prompt")


@pytest.mark.parametrize("batch", [8, 32])
def test_a_sequence_in_a_batch_gives_its_bits_alone(llms, batch):
    llm = llms("dynamic")
    prompts = _prompts(llm, batch)
    alone = [_feed(llm, p, [0], steps=2) for p in prompts]
    got = _together(llm, prompts, steps=2)
    for i, (a, g) in enumerate(zip(alone, got)):
        _same(a, g, f"sequence {i} of a batch of {batch}")
    llm.check_integrity()


@pytest.mark.parametrize("kv", ["int4,residual=32", "int2,residual=0,rotate", "fp16"])
def test_quantized_pages_give_a_sequence_its_bits_alone_in_a_batch_and_on_any_thread_count(llms, kv):
    """Over quantized and fp16 pages (kernels/qattn.c: fixed chunks, one merge order) a sequence's logits do
    not depend on the sequences beside it or on the number of threads: prompts that seal pages,
    fed whole, then decodes."""
    llm = llms(kv)
    prompts = [(p * (200 // len(p) + 1))[: 130 + 41 * i] for i, p in enumerate(_prompts(llm, 4))]  # 130-253 tokens
    alone = [_feed(llm, p, [0], steps=2) for p in prompts]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = [_feed(llm, p, [0], steps=2) for p in prompts[:2]]
    finally:
        torch.set_num_threads(threads)
    for i, (a, b) in enumerate(zip(alone, one_thread)):
        _same(a, b, f"{kv}: sequence {i}, one thread against {threads}")
    got = _together(llm, prompts, steps=2)
    for i, (a, g) in enumerate(zip(alone, got)):
        _same(a, g, f"{kv}: sequence {i} of a batch of {len(prompts)}")
    llm.check_integrity()


def test_a_prefix_hit_gives_recomputations_bits(llms):
    llm, ref = llms("dynamic", prefix=True), llms("none")
    r = llm.runner
    for ids in _prompts(ref, 8)[:4]:
        first = ids[: max(2, 2 * len(ids) // 3)]
        seq = r.lookup(first)
        r.step([seq], [first[len(seq.tokens):]])
        r.release(seq)  # its pages go to the prefix index
        seq = r.lookup(ids)
        hit = len(seq.tokens)
        assert hit >= len(first) - llm.runner.cache.page_size  # a real hit, whole pages of it
        logits = r.step([seq], [ids[hit:]])[0]
        r.free(seq)
        _same(_feed(ref, ids, [0], steps=0), [logits], f"prefix hit of {hit} of {len(ids)} tokens")
    llm.check_integrity()


@pytest.mark.parametrize("weights", ["fp32", "q8"])
def test_other_weights_are_batch_invariant_too(weights):
    ref, llm = LLM(kv="none", weights=weights, prefix=False), LLM(kv="dynamic", weights=weights, prefix=False)
    prompts = _prompts(ref, 8)
    alone = [_feed(ref, p, [0], steps=1) for p in prompts]
    for p, a in zip(prompts[:3], alone):
        _same(a, _feed(llm, p, [5] * (len(p) // 5) + [0] * (len(p) % 5 > 0), steps=1), f"{weights}, chunks of 5")
    r = llm.runner
    seqs = [r.new_sequence() for _ in prompts]
    first = r.step(seqs, prompts)
    second = r.step(seqs, [[int(row.argmax())] for row in first])
    for s in seqs:
        r.free(s)
    for i, a in enumerate(alone):
        _same(a, [first[i], second[i]], f"{weights}, sequence {i} of a batch of 8")


def test_greedy_text_is_the_same_with_and_without_the_cache_and_beside_others(llms):
    """The tutorials' first demonstration: the cache changes the speed, not the text."""
    params = SamplingParams(max_tokens=24)
    texts = {kv: llms(kv).generate([TEXTS[0]], params)[0].text for kv in ("none", "dynamic", "static,max_tokens=1024")}
    assert len(set(texts.values())) == 1, texts
    together = llms("dynamic").generate(TEXTS, params)
    assert together[0].text == texts["none"]
    for i, t in enumerate(TEXTS[1:4], 1):
        assert llms("none").generate([t], params)[0].text == together[i].text


def test_a_served_greedy_request_does_not_depend_on_what_runs_beside_it():
    """Through `kvcache serve` (the file's weights, continuous batching with prompt chunks mixed
    into decode steps): the same greedy text alone and beside six other requests."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from test_server import Server

    s = Server("smollm2", "--max-batch-tokens", "48")
    try:
        def complete(prompt: str, n: int = 32) -> str:
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            code, reply = s.post("/v1/completions", json.dumps(body).encode())
            assert code == 200, reply
            return reply["choices"][0]["text"]

        alone = [complete(t) for t in TEXTS[:3]]
        with ThreadPoolExecutor(7) as pool:
            others = [pool.submit(complete, t * (1 + i % 3), 40) for i, t in enumerate(TEXTS[3:7])]
            together = list(pool.map(complete, TEXTS[:3]))
            [f.result() for f in others]
        assert together == alone
    finally:
        s.close()


@pytest.mark.gemma
def test_gemma3_sliding_layers_give_recomputations_bits():
    """Gemma 3's own sliding-window layers (512 tokens) go through the canonical kernel too: a
    700-token prompt, whose early pages leave the window, gives the bits of recomputation fed
    whole, in chunks, one token at a time after the window filled (60 tokens: four pages leave it
    meanwhile) and then the rest in one chunk, and in a batch."""
    from conftest import gemma_installed

    if not gemma_installed():
        pytest.skip("the Gemma 3 270M package is not installed (make gemma)")
    ref, llm = LLM("gemma3-270m", kv="none", prefix=False), LLM("gemma3-270m", kv="dynamic,page_size=16", prefix=False)
    assert 512 in ref.runner.config.layer_windows
    ids: list[int] = []
    while len(ids) < 700:
        ids += ref.encode(TEXTS[len(ids) % len(TEXTS)])
    ids = ids[:700]
    want = _feed(ref, ids, [0], steps=3)
    for chunks in ([0], [300, 250, 0], [520] + [1] * 60 + [0]):
        _same(want, _feed(llm, ids, chunks, steps=3), f"gemma3, chunks {chunks[:3]}")
    r = llm.runner
    others = [ids[:40], ids[100:650]]
    seqs = [r.new_sequence() for _ in range(3)]
    got = r.step(seqs, [others[0], ids, others[1]])
    assert torch.equal(got[1], want[0]), "gemma3, the long prompt in a batch of 3"
    for s in seqs:
        r.free(s)
    llm.check_integrity()
