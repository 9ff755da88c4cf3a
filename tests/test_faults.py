"""Fault isolation: a failure while one request is admitted, forwarded, forked or sampled fails that
request alone; the requests beside it finish with the tokens they get without it, and every page
comes back. Faults are injected through the engine's KVCACHE_FAULTS hook (kvcache.engine.faults)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcache import LLM, SamplingParams
from kvcache.engine import faults
from kvcache.engine.scheduler import Request, Scheduler, SchedulerConfig

from conftest import run_kvcache
from test_server import Server, _model

POISON = 150  # token id "t150" of the tiny tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LLM(str(tiny_dir("llama")[0]), kv="dynamic,page_size=4")


def _healthy() -> list[list[int]]:
    return [[5 + i, 9, 11 + 2 * i, 7, 30 + i] for i in range(4)]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
    sched = Scheduler(llm.runner, llm.tokenizer, SchedulerConfig(max_running=8, max_batch_tokens=64))
    reqs = [Request(str(i), p, params) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()
    return reqs


def _arm(monkeypatch, stage: str) -> None:
    monkeypatch.setattr(faults, "TRIGGERS", {stage: POISON})
    monkeypatch.setattr(faults, "ACTIVE", True)


@pytest.mark.parametrize("stage", faults.STAGES)
def test_a_fault_in_one_request_fails_it_alone(tiny, monkeypatch, stage):
    params = SamplingParams(max_tokens=12, ignore_eos=True, n=2, temperature=0.7, seed=5)
    tiny.clear_prefix_cache()
    clean = [[s.tokens for s in r.samples] for r in _run(tiny, _healthy(), params)]
    tiny.clear_prefix_cache()
    _arm(monkeypatch, stage)
    reqs = _run(tiny, _healthy()[:2] + [[5, 9, POISON, 7]] + _healthy()[2:], params)
    bad = reqs.pop(2)
    assert bad.error and "injected fault" in bad.error and bad.error_kind == "internal"
    assert [[s.tokens for s in r.samples] for r in reqs] == clean  # the others: as if it never came
    assert all(r.error is None and all(s.reason == "length" for s in r.samples) for r in reqs)
    tiny.check_integrity()
    assert tiny.kv_stats().pages_in_use == 0


@pytest.mark.parametrize("stage", [s for s in faults.STAGES if s != "fork"])  # one sample each: no fork
def test_a_fault_beside_speculating_requests_fails_one_alone(tiny, monkeypatch, stage):
    """The same with every request speculating (prompt lookup; fewer than 8 decode at once, so
    they do): the others keep their tokens, their proposals come and go, every page comes back."""
    params = SamplingParams(max_tokens=16, ignore_eos=True, prompt_lookup=4)
    tiny.clear_prefix_cache()
    clean = [r.samples[0].tokens for r in _run(tiny, _healthy(), params)]
    assert clean == [r.samples[0].tokens for r in _run(tiny, _healthy(), SamplingParams(max_tokens=16,
                                                                                          ignore_eos=True))]
    tiny.clear_prefix_cache()
    _arm(monkeypatch, stage)
    reqs = _run(tiny, _healthy()[:2] + [[5, 9, POISON, 7]] + _healthy()[2:], params)
    bad = reqs.pop(2)
    assert bad.error and "injected fault" in bad.error
    assert [r.samples[0].tokens for r in reqs] == clean
    assert any(s.spec.forwards for r in reqs for s in r.samples)  # they did speculate
    tiny.check_integrity()
    assert tiny.kv_stats().pages_in_use == 0


def test_a_forward_fault_in_a_long_chunked_prefill_takes_nothing_with_it(tiny, monkeypatch):
    """The fault strikes a forward that carries a prompt chunk beside decodes: the decodes go on
    and the pages the failed step reserved come back."""
    _arm(monkeypatch, "forward")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    tiny.clear_prefix_cache()
    clean = [r.samples[0].tokens for r in _run(tiny, _healthy(), params)]
    tiny.clear_prefix_cache()
    long = [20 + (i % 100) for i in range(150)] + [POISON]  # several 64-token chunks; the last one fails
    reqs = _run(tiny, _healthy() + [long], params)
    assert reqs[-1].error_kind == "internal"
    assert [r.samples[0].tokens for r in reqs[:-1]] == clean
    tiny.check_integrity()
    assert tiny.kv_stats().pages_in_use == 0


def test_seeds_are_reduced_modulo_2_64_and_tiny_temperatures_are_greedy(tiny):
    ids = [5, 9, 11, 7]
    tiny.clear_prefix_cache()

    def tokens(**kw) -> list[list[int]]:
        r = tiny.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True, **kw))[0]
        return [o.token_ids for o in r.outputs]

    top = tokens(seed=2**64 - 1, n=2, temperature=0.8)  # the second sample's seed passes the top
    assert top[1] == tokens(seed=0, n=1, temperature=0.8)[0]
    assert tokens(seed=2**64 + 3, temperature=0.8) == tokens(seed=3, temperature=0.8)
    assert tokens(seed=-1, temperature=0.8) == tokens(seed=2**64 - 1, temperature=0.8)
    greedy = tokens(temperature=0.0)
    assert tokens(temperature=1e-40, seed=1) == greedy and tokens(temperature=1e-38, n=2)[1] == greedy[0]
    with pytest.raises(ValueError, match="seed must be an integer"):
        SamplingParams(seed=1.5)


def test_the_cli_takes_extreme_seeds_and_temperatures(tiny_dir):
    path = str(tiny_dir("llama")[0])
    for extra in (["--temperature", "1e-40"], ["--seed", str(2**64), "--temperature", "0.8"]):
        p = run_kvcache("generate", "t5 t6", "--model", path, "-n", "4", *extra)
        assert p.returncode == 0, p.stderr
        assert "Traceback" not in p.stderr and "finish" in p.stderr


@pytest.fixture(scope="module")
def fault_server(tiny_dir):
    s = Server(str(tiny_dir("llama")[0]), "--kv", "dynamic,page_size=4", "--max-batch-tokens", "32",
               env={"KVCACHE_FAULTS": f"sample:{POISON}"})
    yield s
    s.close()


def _stream(server: Server, i: int) -> tuple[str, str | None]:
    text, finish = [], None
    stream = server.client().completions.create(
        model=_model(server), prompt=f"t{i + 5} t{i + 6} t7", max_tokens=120, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    for chunk in stream:
        for ch in chunk.choices:
            text.append(ch.text or "")
            finish = ch.finish_reason or finish
    return "".join(text), finish


@pytest.mark.parametrize("body,status", [
    # the engine fails on this one request (500); four streams beside it finish
    ({"prompt": "t5 t150 t7", "max_tokens": 8}, 500),
    # what once failed every request in flight: a second sample's seed past 2^64, a tiny temperature
    ({"prompt": "Once upon a time", "max_tokens": 8, "seed": 2**64 - 1, "n": 2, "temperature": 0.8}, 200),
    ({"prompt": "t5 t6", "max_tokens": 8, "temperature": 1e-40}, 200),
])
def test_one_bad_request_beside_four_healthy_streams(fault_server, body, status):
    body = {"model": _model(fault_server), **body}
    with ThreadPoolExecutor(5) as pool:
        streams = [pool.submit(_stream, fault_server, i) for i in range(4)]
        code, reply = fault_server.post("/v1/completions", json.dumps(body).encode())
        results = [f.result() for f in streams]
    assert code == status, reply
    if status == 500:
        assert reply["error"]["type"] == "server_error" and "injected fault" in reply["error"]["message"]
    else:
        assert len(reply["choices"]) == body.get("n", 1)
    assert all(finish == "length" and len(text.split()) >= 60 for text, finish in results)
    stats = fault_server.stats()
    assert stats["integrity"] == "ok" and stats["kv"]["pages_in_use"] == 0
