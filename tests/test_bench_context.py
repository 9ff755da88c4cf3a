"""``kvcache bench context`` and ``kvcache bench growth`` through the console command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import fresh_home, run_kvcache

from kvcache.bench.context_lengths import parse_contexts
from kvcache.bench.growth import bucket_label, buckets
from kvcache.cliargs import split_specs
from kvcache.errors import InvalidParams

FP32_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V x layers x KV heads x head_dim x fp32


kvcache = run_kvcache


def test_context_repeats_reuse_the_prompt_unless_a_window_dropped_it(tmp_path):
    out = tmp_path / "context.json"
    p = kvcache("bench", "context", "--contexts", "64", "--new-tokens", "40", "--repeats", "2",
                "--kv", "dynamic;window=32", "--weights", "file", "--json", str(out))
    assert p.returncode == 0, p.stderr
    rows = {r["spec"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["dynamic"]["full_prefills"] == 1 and rows["window=32"]["full_prefills"] == 2
    assert all(r["tok_s_min"] > 0 for r in rows.values())
    # a window holds its last 32 tokens and the pages being filled, not all 103
    assert rows["window=32"]["kv_bytes_per_token"] < FP32_BYTES_PER_TOKEN


@pytest.mark.parametrize("value, message", [
    ("512,abc", "'abc' is not an integer"),
    ("1", "1 is too short"),
    ("8190", "8190 + 64 new tokens exceeds the model's context of 8192"),
    (",", "at least one context"),
])
def test_bad_contexts_exit_2_naming_the_value(value, message):
    p = kvcache("bench", "context", "--contexts", value)
    assert p.returncode == 2
    assert p.stderr.startswith("kvcache: --contexts") and message in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, flag", [
    (("growth", "--contexts", "512"), "--contexts"),
    (("growth", "--kv", "dynamic"), "--kv"),
    (("context", "--peers", "dynamic"), "--peers"),
    (("decode", "--max-context", "64"), "--max-context"),
])
def test_options_of_another_suite_are_refused(args, flag):
    p = kvcache("bench", *args)
    assert p.returncode == 2
    assert p.stderr.startswith(f"kvcache: {flag} does not apply to the {args[0]} suite")


def test_spec_and_context_parsing():
    assert split_specs("dynamic,fp16,int8,int4,sink") == ["dynamic", "fp16", "int8", "int4", "sink"]
    assert split_specs("dynamic,int8,sinks=4,window=1024") == ["dynamic", "int8,sinks=4,window=1024"]
    assert split_specs("static,int4;dynamic") == ["static,int4", "dynamic"]
    assert split_specs("fp16,int4,rotate,int8") == ["fp16", "int4,rotate", "int8"]  # a bare flag joins its spec
    assert parse_contexts("2048, 512,512") == [512, 2048]
    with pytest.raises(InvalidParams, match="--contexts"):
        parse_contexts("0")


def test_growth_buckets():
    assert [bucket_label(a, b) for a, b in buckets(8192)] == ["0-1k", "1k-2k", "2k-4k", "4k-8k"]
    assert buckets(3000) == [(0, 1024), (1024, 2048), (2048, 3000)]
    assert buckets(100) == [(0, 100)]
    with pytest.raises(InvalidParams, match="--max-context"):
        buckets(1)


# --- bench context --long: decode and prefill at depth beside llama-bench, bytes and the wall ---

TINY_SHAPE = "hidden=128,layers=2,heads=4,kv_heads=2,ffn=256,context=2048"  # head_dim 32: int8's groups fit
TINY_KV_VALUES = 2 * 2 * 2 * 32  # K and V x layers x KV heads x head_dim


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    from kvcache.models.random_llama import parse_shape, write_f16

    _, shape = parse_shape(TINY_SHAPE)
    return str(write_f16(shape, tmp_path_factory.mktemp("tiny") / "tiny.gguf", progress=False))


def _crashing_llama_bench(folder) -> str:
    folder.mkdir()
    exe = folder / "llama-bench"
    exe.write_text("#!/bin/sh\nkill -SEGV $$\n")
    exe.chmod(0o755)
    return str(folder)


def test_long_rows_bytes_share_of_wall_memory_and_plot(tmp_path, tiny_gguf, monkeypatch):
    from kvcache.bench.longctx import REFERENCE
    from kvcache.cache.config import parse_kv_spec
    from kvcache.inspect.size import kv_size, load_model_config
    from kvcache.inspect.weight_size import parameter_groups

    monkeypatch.setenv("KVCACHE_HOME", str(fresh_home(tmp_path / "home")))
    out, new = tmp_path / "out", 4
    p = kvcache("bench", "context", "--long", "--quick", "--model", tiny_gguf, "--contexts", "128,256", "--new-tokens",
                str(new), "--repeats", "1", "--kv", "fp16;int8", "--llama-cpp-bin", _crashing_llama_bench(tmp_path / "bin"),
                "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "decode after N tokens of context" in p.stdout and "kvcache fp16: prefill 128 -> 256 tokens" in p.stderr
    data = json.loads((out / "context.json").read_text())
    meta, results, memory = data["meta"], data["results"], data["memory"]
    assert meta["mode"] == "long" and meta["contexts"] == [128, 256] and meta["read_gb_s"] > 0
    assert meta["read_gib"] == 0.25  # --quick: a quarter-GiB probe
    assert set(meta["load_avg_1min"]) == {"before", "after"} and "load average (1 min) before" in p.stdout
    rows = {(r["system"], r["kv"], r["test"], r["context"]): r for r in results}
    want = {("kvcache", s, "decode", c) for s in ("fp16", "int8") for c in (128, 256)}
    want |= {("kvcache", s, "prefill", n) for s in ("fp16", "int8") for n in (REFERENCE, 128, 256)}
    want |= {("llama.cpp", t, "decode", c) for t in ("f16", "q8_0", "q4_0") for c in (128, 256)}
    want |= {("llama.cpp", "f16", "prefill", n) for n in (REFERENCE, 128, 256)}
    assert set(rows) == want and len(results) == len(want)
    for key, r in rows.items():
        if key[0] == "llama.cpp":  # the crash is each row's reason, never the run's failure
            assert r["tok_s"] is None and r["note"] == "llama-bench crashed: SIGSEGV"
            continue
        assert r["note"] == "" and r["tok_s"] > 0
    # the bytes a decode step reads: the weights plus the KV of (context + new/2) tokens
    _, cfg = load_model_config(tiny_gguf)
    params = sum(parameter_groups(cfg)[:2])
    for c in (128, 256):
        r = rows[("kvcache", "fp16", "decode", c)]
        assert r["kv_bytes_per_token"] == TINY_KV_VALUES * 2  # fp16: two bytes a value, nothing else
        assert abs(r["weight_bytes"] - 4 * params) <= 4 * 2 * 2 * 128  # fp32 weights (the F16 file expanded)
        assert r["bytes_per_token"] == r["weight_bytes"] + TINY_KV_VALUES * 2 * (c + new / 2)
        assert r["kv_bytes_read"] == TINY_KV_VALUES * 2 * (c + new / 2)
        assert r["gb_s"] == pytest.approx(r["bytes_per_token"] * r["tok_s"] / 1e9, rel=1e-12)
        assert r["wall_share"] == pytest.approx(r["gb_s"] / meta["read_gb_s"], rel=1e-12)
        assert r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"]
    for s in ("fp16", "int8"):  # prefill: per 1k tokens, against the 512-token prompt; 256 grown from 128
        ref = rows[("kvcache", s, "prefill", REFERENCE)]
        assert ref["vs_512"] == 1.0 and ref["stages"] == 1
        for n, stages in ((128, 1), (256, 2)):
            r = rows[("kvcache", s, "prefill", n)]
            assert r["stages"] == stages and r["s_per_1k"] == pytest.approx(1000 * r["seconds"] / n)
            assert r["vs_512"] == pytest.approx((n / r["seconds"]) / (REFERENCE / ref["seconds"]))
    # memory at the largest context beside `kvcache size`'s figure for the tokens held
    assert [m["kv"] for m in memory] == ["fp16", "int8"]
    for m in memory:
        assert m["context"] == 256 and m["tokens_held"] == 256 + new - 1
        assert m["size_bytes"] == kv_size(cfg, parse_kv_spec(m["kv"]), m["tokens_held"]).bytes_total
        assert 0 < m["rss_loaded"] <= m["rss_peak"] and m["rss_after"] <= m["rss_peak"]
        assert m["kv_allocated"] >= m["kv_used"] > 0
    assert memory[0]["kv_used"] == memory[0]["size_bytes"]  # fp16 holds exactly what size counts
    assert (out / "context.png").stat().st_size > 10_000
    assert "| context | system | kv | tok/s (min-max) |" in (out / "context.md").read_text()


@pytest.mark.skipif(not (Path(sys.prefix) / "llama.cpp" / "bin" / "llama-bench").is_file(),
                    reason="llama.cpp's tools are not built (make llamacpp)")
def test_long_beside_the_real_llama_bench(tmp_path, tiny_gguf, monkeypatch):
    monkeypatch.setenv("KVCACHE_HOME", str(fresh_home(tmp_path / "home")))
    out = tmp_path / "long.json"
    p = kvcache("bench", "context", "--long", "--model", tiny_gguf, "--contexts", "128", "--new-tokens", "4",
                "--repeats", "1", "--kv", "int4", "--peers", "q8_0", "--json", str(out))
    assert p.returncode == 0, p.stderr
    rows = {(r["system"], r["kv"], r["test"], r["context"]): r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {("kvcache", "int4", "decode", 128), ("kvcache", "int4", "prefill", 512),
                         ("kvcache", "int4", "prefill", 128), ("llama.cpp", "q8_0", "decode", 128),
                         ("llama.cpp", "f16", "prefill", 512), ("llama.cpp", "f16", "prefill", 128)}
    assert all(r["tok_s"] > 0 and r["note"] == "" for r in rows.values())
    q8 = rows[("llama.cpp", "q8_0", "decode", 128)]
    assert q8["kv_bytes_per_token"] == TINY_KV_VALUES * 34 / 32  # q8_0: 34 bytes a block of 32 values
    assert q8["weight_bytes"] == Path(tiny_gguf).stat().st_size


def test_long_without_llama_bench_skips_its_rows_with_the_reason(tmp_path):
    from kvcache.peers.llama_bench import depth_rows
    from kvcache.peers.llama_cpp import find_tool

    exe, why = find_tool(str(tmp_path), "llama-bench")
    assert exe is None and why == f"no executable llama-bench in {tmp_path} (`make llamacpp` builds one)"
    rows = depth_rows(exe, why, tmp_path / "m.gguf", ["f16", "q4_0"], [4096, 16384], 8, 1, 2, 512, 512)
    assert [(r.test, r.kv, r.context) for r in rows] == [
        ("prefill", "f16", 512), ("prefill", "f16", 4096), ("prefill", "f16", 16384), ("decode", "f16", 4096),
        ("decode", "f16", 16384), ("decode", "q4_0", 4096), ("decode", "q4_0", 16384)]
    assert all(r.note == why and not r.samples for r in rows)


def test_long_table_arithmetic():
    from kvcache.bench.longctx import summarize
    from kvcache.peers.row import DepthRow

    rows = [DepthRow("kvcache", "int8", "decode", 4096, [10.0, 12.0, 11.0], kv_bytes_per_token=1000.0,
                     weight_bytes=500_000_000, new=32),
            DepthRow("kvcache", "int8", "prefill", 512, [2.0]), DepthRow("kvcache", "int8", "prefill", 4096, [32.0]),
            DepthRow("llama.cpp", "q8_0", "decode", 4096, note="llama-bench crashed: SIGSEGV")]
    dec, ref, pre, skipped = summarize(rows, read_gb_s=20.0)
    assert dec["tok_s"] == 11.0 and dec["bytes_per_token"] == 500_000_000 + 1000 * (4096 + 16)
    assert dec["gb_s"] == pytest.approx(504_112_000 * 11 / 1e9)
    assert dec["wall_share"] == pytest.approx(504_112_000 * 11 / 1e9 / 20.0)
    assert ref["vs_512"] == 1.0 and pre["tok_s"] == 128.0 and pre["s_per_1k"] == 1000 * 32 / 4096 and pre["vs_512"] == 0.5
    assert skipped["tok_s"] is None and skipped["wall_share"] is None
    assert summarize(rows[:1], read_gb_s=None)[0]["wall_share"] is None


@pytest.mark.parametrize("args, message", [
    (("--kv", "fp16,bogus"), "unknown --kv item 'bogus'"),
    (("--contexts", "9000"), "--contexts: 9000 + 8 new tokens exceeds the model's context of 8192"),
    ((), "--contexts: 16384 + 32 new tokens exceeds the model's context of 8192"),
    (("--peers", "q9_9"), "--peers: unknown llama.cpp KV type 'q9_9'"),
    (("--kv", "none"), "--kv 'none' keeps no cache"),
])
def test_long_bad_input_exits_2_with_one_line(args, message):
    quick = () if args == () else ("--quick",)
    p = kvcache("bench", "context", "--long", *quick, *args)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("kvcache: ") and message in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (("context", "--peers", "f16"), "--peers does not apply to the context suite without --long"),
    (("decode", "--long"), "--long does not apply to the decode suite"),
    (("all", "--long"), "--long does not apply to 'bench all'"),
])
def test_long_options_belong_to_the_long_context_suite(args, message):
    p = kvcache("bench", *args)
    assert p.returncode == 2 and p.stderr.strip() == f"kvcache: {message}" + (
        " (run bench context --long alone)" if args[0] == "all" else " (only to context)" if args[0] == "decode" else "")
