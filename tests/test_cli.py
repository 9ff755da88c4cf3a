"""The console command end to end on the bundled model."""

from __future__ import annotations

import re

from conftest import run_kvcache


kvcache = run_kvcache


def test_generate_prints_text_and_summary():
    p = kvcache("generate", "The capital of France is", "-n", "8", "--stats")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout
    summary = re.search(r"prompt (\d+) tokens · new (\d+) tokens · TTFT \d+ ms · ([\d.]+) tok/s · KV ([\d.]+ \w+)",
                        p.stderr)
    assert summary, p.stderr
    assert int(summary.group(1)) == 5 and int(summary.group(2)) == 8
    assert "46,080 B/token stored" in p.stderr  # 2 x 30 layers x 3 KV heads x 64 x 4 bytes


def test_chat_reuses_the_cache_between_turns():
    p = kvcache("chat", "-n", "12", "--system", "You are terse.", stdin="Name a fruit.\nName a vegetable.\n")
    assert p.returncode == 0, p.stderr
    turns = re.findall(r"reused (\d+) tokens from the cache · prefilled (\d+)", p.stderr)
    assert len(turns) == 2
    assert int(turns[0][0]) == 0 and int(turns[1][0]) > int(turns[1][1])


def test_none_strategy_generates_the_same_text():
    # the file's weights: recomputing and caching give the same bits (test_batch_invariance.py, also
    # with fp32 weights), so the same tokens
    a = kvcache("generate", "Once upon a time", "-n", "10", "--kv", "none")
    b = kvcache("generate", "Once upon a time", "-n", "10", "--kv", "static,max_tokens=64")
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout and len(a.stdout.strip()) > 10


def test_models_lists_the_bundled_default():
    p = kvcache("models")
    assert p.returncode == 0
    assert re.search(r"smollm2 .*\[installed\]\s+\(default\)", p.stdout)
    assert "SmolLM2-135M-Instruct" in p.stdout


def test_help_and_bad_subcommand():
    assert "generate" in kvcache("--help").stdout
    bad = kvcache("frobnicate")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_the_parser_loads_no_torch():
    """The whole command line (every subcommand's options, the models `size` knows) is built
    without importing torch: --help and a mistyped option answer at once."""
    import subprocess
    import sys

    code = "import sys; from kvcache.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split() == ["False"], p.stdout + p.stderr[-2000:]
