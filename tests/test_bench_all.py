"""``kvcache bench all --quick --out DIR``: every suite runs, and each writes JSON, a PNG and a report."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import run_kvcache
from test_bench_context import FP32_BYTES_PER_TOKEN

SUITES = ("decode", "cache-vs-none", "context", "memory", "growth", "prefix", "throughput", "serve", "hf")


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    p = run_kvcache("bench", "all", "--quick", "--out", str(d), timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    (d / "stdout.txt").write_text(p.stdout)
    return d


@pytest.mark.slow
def test_every_suite_writes_json_png_and_report(out):
    for suite in SUITES:
        data = json.loads((out / f"{suite}.json").read_text())
        assert data["meta"]["torch"] and (data.get("results") or data.get("buckets"))
        assert data["meta"]["suite"] == suite  # what `bench report` reads it by
        assert (out / f"{suite}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        report = (out / f"{suite}.md").read_text()
        assert f"# kvcache bench {suite}" in report and "| torch |" in report and "| cpu |" in report
        assert "kvcache bench all --quick" in report and f"![{suite}]({suite}.png)" in report
    index = (out / "README.md").read_text()
    assert all(f"[{s}.md]({s}.md)" in index for s in SUITES)
    from kvcache.bench import suites

    ran = [s.name for s in suites.catalogue() if s.mode is None]
    took = re.search(r"^bench all: (\d+) suites in ([\d.]+) s \((.*)\)$", (out / "stdout.txt").read_text(), re.M)
    assert took and int(took[1]) == len(ran), "bench all ends with each suite's time"
    each = dict(part.rsplit(" ", 2)[:2] for part in took[3].split(", "))
    # each figure rounded to a tenth: their sum may pass the whole's by 0.05 a suite
    assert list(each) == ran and 0 < sum(map(float, each.values())) <= float(took[2]) + 0.05 * len(ran)
    structured = json.loads((out / "structured.json").read_text())  # a table without a plot
    assert structured["results"] and "# kvcache bench structured" in (out / "structured.md").read_text()
    spec = json.loads((out / "spec.json").read_text())  # a table without a plot
    assert "# kvcache bench spec" in (out / "spec.md").read_text() and not (out / "spec.png").exists()
    ours = [r for r in spec["results"] if r["system"] == "kvcache"]
    assert ours and all(r["identical"] and r["spec_tok_s"] > 0 for r in ours)
    assert not any(r["system"] == "transformers" for r in spec["results"])  # --quick: kvcache's own rows only


@pytest.mark.slow
def test_the_report_reads_every_suites_json_back(out):
    """The JSON each suite just wrote goes through its own headline(): kvcache beside its peer,
    each ratio the file's own numbers divided."""
    import io

    from kvcache.bench.headline import collect

    notes = io.StringIO()
    (rows,) = collect([str(out)], notes=notes).values()  # one host
    assert notes.getvalue() == ""
    by_suite = {e.run.suite for e in rows}
    # decode stands beside llama.cpp and hf beside its compressed caches: neither runs under --quick
    assert {"cache-vs-none", "memory", "growth", "prefix", "throughput", "attention", "structured"} <= by_suite, by_suite
    (k,) = [r for r in _rows(out, "cache-vs-none")["results"] if r["system"] == "kvcache" and r["cache"] == "dynamic"]
    (p,) = [r for r in _rows(out, "cache-vs-none")["results"] if r["system"] == "transformers"
            and r["cache"] == "DynamicCache"]
    (e,) = [e for e in rows if e.run.suite == "cache-vs-none"]
    assert abs(e.row.ratio - (p["total_s"] / p["tokens"]) / (k["total_s"] / k["tokens"])) < 1e-9


def _rows(out, suite):
    return json.loads((out / f"{suite}.json").read_text())


@pytest.mark.slow
def test_suites_measure_what_they_say(out):
    decode = {(r["system"], r["pair"], r["test"]): r for r in _rows(out, "decode")["results"]}
    assert decode[("kvcache", "file", "decode")]["tok_s"] > 0 and decode[("kvcache", "fp32", "decode")]["tok_s"] > 0
    assert decode[("transformers", "fp32", "decode")]["tok_s"] > 0
    assert decode[("kvcache", "file", "prefill")]["tokens"] == 128 and decode[("kvcache", "file", "depth")]["tok_s"]
    runs = {(r["system"], r["cache"]): r for r in _rows(out, "cache-vs-none")["results"]}
    assert runs[("kvcache", "dynamic")]["tokens"] == 23 and runs[("kvcache", "none")]["tokens"] >= 1
    memory = _rows(out, "memory")
    mem = {(r["system"], r["weights"], r["cache"]): r for r in memory["results"]}
    assert mem[("kvcache", "file", "int4")]["kv_used"] < 0.7 * mem[("kvcache", "file", "dynamic")]["kv_used"]
    assert mem[("transformers", "fp32", "DynamicCache")]["rss_peak"] > 0
    file, fp32 = mem[("kvcache", "file", "dynamic")], mem[("kvcache", "fp32", "dynamic")]
    assert file["weight_bytes"] < 0.25 * fp32["weight_bytes"] and set(fp32["weight_kinds"]) == {"fp32"}
    assert file["rss_loaded"] < fp32["rss_loaded"]
    assert 0 < memory["meta"]["rss_torch_alone"] < file["rss_loaded"]
    # the fixed cost beyond weights and KV: torch's own share and a bounded rest (tokenizer, kernels)
    torch_alone = memory["meta"]["rss_torch_alone"]
    assert 0.9 * torch_alone < file["overhead"] < torch_alone + (200 << 20), (file["overhead"], torch_alone)
    prefix = _rows(out, "prefix")
    cases = {r["case"]: r for r in prefix["results"]}
    cold, warm = cases["kvcache cold (prefill all)"], cases["kvcache warm (RAM radix)"]
    disk, hf = cases["kvcache restored from disk"], cases["transformers prefill + deepcopy"]
    assert cold["reused_tokens"] == 0 and warm["reused_tokens"] >= 128
    assert hf["reused_tokens"] == warm["reused_tokens"]  # the same split for transformers
    assert 0 < disk["reused_tokens"] <= warm["reused_tokens"]  # whole pages come back from disk
    redis = cases["kvcache restored from Redis"]
    if shutil.which("redis-server"):
        assert redis["reused_tokens"] == disk["reused_tokens"] and not redis["note"]
    else:
        assert "skipped" in redis["note"]
    shared, own = prefix["chat"]
    assert shared["hit_rate"] > own["hit_rate"] > 0  # sessions share the system prompt
    tp = {r["system"]: r for r in _rows(out, "throughput")["results"]}
    for weights in ("file (Q4_1)", "fp32"):  # the quantized weights beside fp32, the same requests
        assert tp[f"kvcache continuous batching, {weights} weights"]["new_tokens"] == 4 * 8
    assert {r["weights"] for r in _rows(out, "throughput")["ratios"]} == {"file", "fp32"}
    assert tp["transformers generate, padded batch"]["new_tokens"] == 4 * 8
    serve = {(r["system"], r["streams"]): r for r in _rows(out, "serve")["results"]}
    ours = serve[("kvcache", 4)]  # 4 streams, one request each, 8 tokens out, through a real `kvcache serve`
    assert ours["requests"] == 4 and ours["new_tokens"] == 4 * 8 and ours["errors"] == 0 and ours["tok_s"] > 0
    assert ours["prompt_tokens"] >= 4 * 64 and ours["ttft_p99_s"] >= ours["ttft_p50_s"] > 0
    peer = serve[("llama-server", 4)]  # measured the same way, or skipped with the reason
    assert (peer["new_tokens"] == 4 * 8 and peer["errors"] == 0) or "skipped" in peer["note"]
    hf = {(r["system"], r["cache"]): r for r in _rows(out, "hf")["results"]}
    ours, theirs = hf[("kvcache.hf", "dynamic")], hf[("transformers", "DynamicCache")]
    assert ours["tok_s"] > 0 and theirs["tok_s"] > 0
    assert ours["kv_bytes_per_token"] == theirs["kv_bytes_per_token"]  # fp32 K/V either way


@pytest.mark.slow
def test_decode_gives_file_q8_and_fp32_rows(out):
    """bench decode under --quick (bench all's settings): each weights mode's decode and prefill,
    the depth row, transformers beside fp32, the products' own read and the ratios."""
    data, stdout = _rows(out, "decode"), (out / "stdout.txt").read_text()
    rows = data["results"]
    ours = {(r["pair"], r["test"]): r for r in rows if r["system"] == "kvcache"}
    assert set(ours) == {(w, t) for w in ("file", "q8", "fp32") for t in ("decode", "prefill")} | {("file", "depth")}
    assert ours[("file", "decode")]["weights"] == "file (Q4_1)" and ours[("q8", "decode")]["weights"] == "q8"
    for r in ours.values():
        assert r["tok_s"] > 0 and r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"], r
    assert ours[("file", "prefill")]["tokens"] == 128 and ours[("file", "prefill")]["seconds"] > 0
    depth = ours[("file", "depth")]
    assert depth["tokens"] == 128 and depth["cache"] == "int8" and depth["gb_s"] > 0
    # the quantized weights read fewer bytes per step than fp32 (GB/s = bytes per step x tok/s)
    per_step = {w: ours[(w, "decode")]["gb_s"] / ours[(w, "decode")]["tok_s"] for w in ("file", "q8", "fp32")}
    assert per_step["file"] < per_step["q8"] < 0.3 * per_step["fp32"]
    hf = [r for r in rows if r["system"] == "transformers"]
    assert {(r["cache"], r["test"]) for r in hf} == {("DynamicCache", "decode"), ("DynamicCache", "prefill")}
    assert all(r["tok_s"] > 0 and r["pair"] == "fp32" for r in hf)
    assert all(r["gb_s"] > 0 for r in hf if r["test"] == "decode")
    assert any(x["kvcache"] == "fp32 dynamic" and x["peer"].startswith("transformers") and x["ratio"] > 0
               for x in data["ratios"])
    assert re.search(r"kvcache\s+fp32\s+dynamic\s+[\d.]+", stdout)
    assert re.search(r"transformers\s+fp32\s+DynamicCache\s+[\d.]+", stdout)
    assert "kvcache / peer" in stdout and "host: " in stdout and data["meta"]["kernel_variant"]
    # the products' own read of the weights, for the modes that have quantized weights
    assert set(data["meta"]["products_gb_s"]) == {"file", "q8"} and "the products alone" in stdout
    assert all(v > 0 for v in data["meta"]["products_gb_s"].values())


@pytest.mark.slow
def test_context_and_growth_rows(out):
    """bench context: a row per spec and context, every token but the last stored, bytes against
    the fp32 reference; bench growth: per bucket of context, kvcache's and transformers' step."""
    data, stdout = _rows(out, "context"), (out / "stdout.txt").read_text()
    assert "context 256 tokens" in stdout
    rows = {(r["spec"], r["context"]): r for r in data["results"]}
    assert set(rows) == {("dynamic", 256), ("int8", 256)}
    for r in rows.values():
        assert r["tok_s"] > 0 and r["prefill_s"] > 0 and r["gb_s"] > 0
        assert r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"]
        assert r["tokens_stored"] == 256 + 8 - 1  # the prompt and every new token but the last
    dense, int8 = rows[("dynamic", 256)], rows[("int8", 256)]
    assert dense["kv_bytes_per_token"] == FP32_BYTES_PER_TOKEN and dense["bytes_vs_ref"] == dense["tok_s_vs_ref"] == 1.0
    assert 0.2 < int8["bytes_vs_ref"] < 0.7 and int8["kv_bytes_per_token_stored"] < FP32_BYTES_PER_TOKEN / 3
    assert data["meta"]["reference"] == "dynamic" and data["meta"]["new_tokens"] == 8
    growth = _rows(out, "growth")
    assert [b["bucket"] for b in growth["buckets"]] == ["0-512"] and growth["meta"]["max_context"] == 512
    for b in growth["buckets"]:
        assert b["kvcache_us"] > 0 and b["transformers_us"] > 0 and b["ratio"] > 0
    assert growth["total"]["kvcache_s"] > 0 and growth["total"]["transformers_s"] > 0
    assert "0-512" in stdout and "total s" in stdout


@pytest.mark.slow
def test_structured_rows_compile_and_engines(out):
    """bench structured: constrained and free runs of the same requests at batch 4 and 1, every
    output valid; the schema cache's cold, cached and lookup times; llguidance's own row, and
    xgrammar's measured or skipped with the reason."""
    from kvcache.bench import structured as sb

    data, stdout = _rows(out, "structured"), (out / "stdout.txt").read_text()
    assert data["meta"]["torch"] and data["meta"]["schema"] == sb.SCHEMA
    rows = {r["batch"]: r for r in data["results"]}
    assert set(rows) == {4, 1} and rows[4]["requests"] == 4 and rows[1]["requests"] == 2
    for r in rows.values():
        assert r["tokens"] > 0 and r["free_tokens"] == r["constrained_tokens"] == r["tokens"]
        for key in ("free_tok_s", "constrained_tok_s", "ratio", "free_step_ms", "constrained_step_ms",
                    "mask_us_per_token", "mask_ms_per_step", "mask_share"):
            assert r[key] > 0, key
        assert r["outputs"] == 2 * r["requests"] and r["valid"] == r["outputs"]  # warm-up and timed run
        assert r["finish"] == ["stop"] and sb.valid(r["sample_output"])
    comp = data["compile"]
    assert 0 < comp["lookup_s"] <= comp["cached_s"] < comp["cold_s"]
    engines = {e["engine"]: e for e in data["engines"]}
    eng = engines["llguidance"]
    assert eng["accepted"] is True and eng["note"] == "" and eng["tokens"] > 20 and eng["version"]
    for key in ("tokenizer_s", "compile_s", "first_mask_us", "cold_mean_us", "mask_mean_us", "mask_max_us",
                "advance_us"):
        assert eng[key] > 0, key
    xg = engines["xgrammar"]
    assert (xg["accepted"] is True and xg["mask_mean_us"] > 0) or "not installed" in xg["note"]
    assert "compared: output tokens / wall time" in stdout and "llguidance" in stdout
    assert "8/8" in stdout and "4/4" in stdout  # every constrained output valid, in the table


def test_bad_bench_options(tmp_path):
    p = run_kvcache("bench", "all", "--kv", "dynamic")
    assert p.returncode == 2 and "does not apply to 'bench all'" in p.stderr
    p = run_kvcache("bench", "nothing")
    assert p.returncode == 2 and "unknown bench suite" in p.stderr
    blocker = tmp_path / "f"
    blocker.write_text("")
    p = run_kvcache("bench", "growth", "--quick", "--out", str(blocker / "x"))
    assert p.returncode == 2 and "cannot write the report" in p.stderr
    p = run_kvcache("bench", "throughput", "--peers", "vllm")
    assert p.returncode == 2 and "unknown transformers mode" in p.stderr


def test_llamacpp_peer_runs_or_is_skipped_with_a_note(tmp_path):
    """Without --llama-cpp-bin, llama.cpp is `make llamacpp`'s build or llama-cpp-python: found, it
    gives the F32 row; missing, the row and the report say how to get it, and the run succeeds."""
    from kvcache.peers.llama_bench import kind
    from kvcache.peers.llama_cpp import default_bin

    p = run_kvcache("bench", "decode", "--quick", "--kv", "dynamic", "--peers", "llama.cpp", "--weights", "fp32",
                    "--prefill", "", "--depth", "0", "--new-tokens", "2", "--repeats", "1", "--out", str(tmp_path),
                    timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [r for r in _rows(tmp_path, "decode")["results"] if r["system"] == "llama.cpp"]
    assert [(r["weights"], r["test"]) for r in rows] == [("F32", "decode")]
    if kind(default_bin()) is None:
        assert rows[0]["tok_s"] is None and "make llamacpp" in rows[0]["note"]
        assert "llama.cpp not available" in (tmp_path / "decode.md").read_text()
    else:
        assert rows[0]["tok_s"] > 0 and rows[0]["gb_s"] > 0
