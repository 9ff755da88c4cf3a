"""The server's metrics registry on its own (the /metrics route and its key: test_server*.py)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvcache.server.metrics import Metrics


def _samples(text: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def test_two_apps_in_one_process_count_apart():
    a, b = Metrics(), Metrics()  # a second registry of the same names must not clash with the first
    a.finished(prompt_tokens=12, generated=5, cached=8, ttft=0.03, tpot=0.01)
    a.add("requests_aborted_total", 2)
    sa, sb = _samples(a.render({})), _samples(b.render({}))
    assert sa["kvcache_requests_total"] == 1 and sb["kvcache_requests_total"] == 0
    assert sa["kvcache_prompt_tokens_total"] == 12 and sa["kvcache_prefix_cached_tokens_total"] == 8
    assert sa["kvcache_generation_tokens_total"] == 5 and sa["kvcache_requests_aborted_total"] == 2
    assert sa["kvcache_time_to_first_token_seconds_count"] == 1
    assert sb["kvcache_time_to_first_token_seconds_count"] == 0


def test_engine_figures_are_exposed_as_handed():
    m = Metrics()
    text = m.render({"kv_usage_ratio": 0.25, "preemptions_total": 3})
    assert "# TYPE kvcache_kv_usage_ratio gauge" in text
    assert "# TYPE kvcache_preemptions_total counter" in text
    s = _samples(text)
    assert s["kvcache_kv_usage_ratio"] == 0.25 and s["kvcache_preemptions_total"] == 3
    assert "kvcache_kv_usage_ratio" not in m.render({})  # without a KV cache there is no such figure
    le = [line for line in text.splitlines() if line.startswith("kvcache_time_to_first_token_seconds_bucket")]
    assert le[0].startswith('kvcache_time_to_first_token_seconds_bucket{le="0.01"}') and '"+Inf"' in le[-1]
