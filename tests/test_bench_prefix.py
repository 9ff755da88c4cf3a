"""``kvcache bench prefix`` through the console command, on the real default model (--quick)."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import run_kvcache


@pytest.mark.slow
def test_prefix_quick_measures_every_case(tmp_path):
    out = tmp_path / "prefix.json"
    p = run_kvcache("bench", "prefix", "--quick", "--json", str(out))
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    rows = {r["case"]: r for r in data["results"]}
    cold, warm = rows["kvcache cold (prefill all)"], rows["kvcache warm (RAM radix)"]
    disk, hf = rows["kvcache restored from disk"], rows["transformers prefill + deepcopy"]
    assert cold["reused_tokens"] == 0
    assert warm["reused_tokens"] >= 256 and disk["reused_tokens"] == warm["reused_tokens"]
    assert hf["reused_tokens"] == warm["reused_tokens"]  # the same split for transformers
    for r in (cold, warm, disk, hf):
        assert r["ttft_ms"] > 0 and r["ttft_ms_min"] <= r["ttft_ms"] <= r["ttft_ms_max"]
    redis = rows["kvcache restored from Redis"]
    if shutil.which("redis-server"):
        assert redis["reused_tokens"] == warm["reused_tokens"] and not redis["note"]
    else:
        assert "skipped" in redis["note"]
    shared, own = data["chat"]
    assert shared["turns"] == own["turns"] == 4
    assert shared["hit_rate"] > own["hit_rate"] > 0  # the system prompt is shared across sessions
    assert "warm vs cold" in p.stdout and "chat: 2 sessions x 2 turns" in p.stdout


def test_prefix_bad_options():
    p = run_kvcache("bench", "prefix", "--system-tokens", "3")
    assert p.returncode == 2 and "--system-tokens must be at least 16" in p.stderr
    p = run_kvcache("bench", "decode", "--system-tokens", "100")
    assert p.returncode == 2 and "does not apply to the decode suite" in p.stderr
