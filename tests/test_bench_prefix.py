"""``kvcache bench prefix`` refusals (its measurements are checked in test_bench_all)."""

from __future__ import annotations

from conftest import run_kvcache


def test_prefix_bad_options():
    p = run_kvcache("bench", "prefix", "--system-tokens", "3")
    assert p.returncode == 2 and "--system-tokens must be at least 16" in p.stderr
    p = run_kvcache("bench", "decode", "--system-tokens", "100")
    assert p.returncode == 2 and "does not apply to the decode suite" in p.stderr
