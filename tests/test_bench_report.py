"""``kvcache bench report``: the committed suite JSON read back into one table per host kind, each
ratio the file's own numbers divided; files it cannot read skipped with a note; bad input one line,
exit 2; no torch loaded."""

from __future__ import annotations

import copy
import io
import json
import re
import subprocess
import sys
from pathlib import Path

from conftest import run_kvcache
from kvcache.bench import suites
from kvcache.bench.headline import collect, load, report
from kvcache.bench.rows import model_name as _model

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
ZEN4 = "AMD EPYC · avx2 avx512f avx512_vnni · kernels avx512vnni"
FAMILY26 = "AMD EPYC · avx2 avx512f avx512_vnni avx_vnni · kernels avx512vnni"


def _raw(path: Path) -> dict:
    return json.loads(path.read_text())


def _tok_s(results: list[dict], system_prefix: str, test: str, tokens: int) -> float:
    (r,) = [r for r in results if r["system"].startswith(system_prefix) and r["test"] == test
            and r["tokens"] == tokens]
    return r["tok_s"]


def _kvcache_row(results: list[dict], test: str, tokens: int) -> float:
    (r,) = [r for r in results if r["system"] == "kvcache" and r["test"] == test and r["tokens"] == tokens]
    return r["tok_s"]


def test_committed_json_gives_one_table_per_host_kind_with_the_files_own_ratios():
    notes = io.StringIO()
    tables = collect([str(BENCH)], notes=notes)
    assert ZEN4 in tables and FAMILY26 in tables
    text = report([str(BENCH)], notes=io.StringIO())
    assert text.count(f"### {ZEN4}\n") == 1 and text.count(f"### {FAMILY26}\n") == 1

    # Zen4, 1B Q4_K_M prefill of 512 tokens: the 2026-11-28 run measured it last, after the
    # 2026-11-27 run (the K-quant order) and the 2026-11-26 layer-stack run
    src = BENCH / "scale" / "zen4" / "1b-Q4_K_M-acts-2026-11-28.json"
    res = _raw(src)["results"]
    k, p = _kvcache_row(res, "prefill", 512), _tok_s(res, "llama.cpp", "prefill", 512)
    (e,) = [e for e in tables[ZEN4] if e.row.what == "1B Q4_K_M: prefill 512 tokens, tok/s"]
    assert e.run.path.name == src.name and e.run.date == "2026-11-28"
    assert e.row.kvcache == k and e.row.peer == p
    assert abs(e.row.ratio - k / p) < 1e-12
    zen4 = text.split(f"### {ZEN4}\n", 1)[1].split("\n### ", 1)[0]  # that host's table (newest host first)
    line = next(ln for ln in zen4.splitlines() if ln.startswith("| 1B Q4_K_M: prefill 512 tokens"))
    assert f"| {k / p:.2f}x | 2026-11-28 | docs/bench/scale/zen4/1b-Q4_K_M-acts-2026-11-28.json |" in line

    # the same row on the other host kind comes from that host's own file
    fam = _raw(BENCH / "scale" / "1b-Q4_K_M.json")["results"]
    (f,) = [e for e in tables[FAMILY26] if e.row.what == "1B Q4_K_M: prefill 512 tokens, tok/s"]
    assert abs(f.row.ratio - _kvcache_row(fam, "prefill", 512) / _tok_s(fam, "llama.cpp", "prefill", 512)) < 1e-12

    # serving: kvcache serve beside llama-server at 32 streams
    serve = _raw(BENCH / "scale" / "zen4" / "serve-1b-Q4_K_M.json")["results"]
    ks = next(r["tok_s"] for r in serve if r["system"] == "kvcache" and r["streams"] == 32)
    ps = next(r["tok_s"] for r in serve if r["system"] == "llama-server" and r["streams"] == 32)
    (s,) = [e for e in tables[ZEN4] if e.run.suite == "serve" and e.row.what.startswith("1B Q4_K_M: serving, 32 ")]
    assert abs(s.row.ratio - ks / ps) < 1e-12

    # a time (lower is better): the ratio is the peer's over kvcache's
    prefix = {r["case"]: r["ttft_ms"] for r in _raw(BENCH / "prefix.json")["results"]}
    rows = [e.row for rows in tables.values() for e in rows if e.run.suite == "prefix"]
    (warm,) = [r for r in rows if r.peer_name == "kvcache prefilling it" and "RAM" in r.what]
    assert abs(warm.ratio - prefix["kvcache cold (prefill all)"] / prefix["kvcache warm (RAM radix)"]) < 1e-12

    # every suite JSON committed is read: nothing skipped
    assert notes.getvalue() == ""


def test_models_are_named_shortly():
    assert _model({"model": "/c/benchmodels/1b-0-Q4_K_M.gguf"}) == "1B Q4_K_M"
    assert _model({"model": "/c/h2048-l16-a32-kv8-ff8192-d64-theta500000-ctx131072-0-Q4_0.gguf"}) == "h2048-l16 Q4_0"
    assert _model({"model": "smollm2"}, "file (Q4_1)") == "SmolLM2-135M Q4_1"
    assert _model({"model": "/m/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}) == "qwen2.5-coder-1.5b-instruct Q4_K_M"
    assert _model({"model": "/m/gemma-3-270m-it.Q8_0.gguf"}) == "gemma-3-270m-it Q8_0"
    assert _model({"model": "/m/plain.gguf"}) == "plain" and _model({}) == "model not recorded"
    # `make qwen`'s alias and its file are one model in the tables
    assert _model({"model": "qwen2.5-coder-1.5b"}, "file (Q4_K_M)") == "qwen2.5-coder-1.5b-instruct Q4_K_M"
    assert _model({"model": "other-alias"}, "file (Q4_K_M)") == "other-alias Q4_K_M"


def test_since_keeps_only_the_later_runs():
    tables = collect([str(BENCH)], since="2026-11-25", notes=io.StringIO())
    dates = {e.run.date for rows in tables.values() for e in rows}
    assert dates and min(dates) >= "2026-11-25"
    assert not any(e.run.path.name == "decode-llamacpp.json" for e in tables[ZEN4])
    everything = collect([str(BENCH)], notes=io.StringIO())
    assert any(e.run.path.name == "decode-llamacpp.json" for e in everything[ZEN4])


def test_the_newest_run_of_a_row_counts(tmp_path):
    src = _raw(BENCH / "scale" / "zen4" / "1b-Q8_0-stack-2026-11-26.json")
    old, new = copy.deepcopy(src), copy.deepcopy(src)
    old["meta"]["date"], new["meta"]["date"] = "2026-11-20T10:00:00Z", "2026-11-28T09:00:00Z"
    for r in new["results"]:
        if r["system"] == "kvcache" and r["test"] == "decode":
            r["tok_s"] = 99.0
    (tmp_path / "b-old.json").write_text(json.dumps(old))  # named so that the file order is not the answer
    (tmp_path / "a-new.json").write_text(json.dumps(new))
    tables = collect([str(tmp_path)], notes=io.StringIO())
    (decode,) = [e for e in tables[ZEN4] if e.row.what == "1B Q8_0: decode tok/s, batch 1"]
    assert decode.run.path.name == "a-new.json" and decode.run.date == "2026-11-28"
    assert decode.row.kvcache == 99.0
    assert abs(decode.row.ratio - 99.0 / _tok_s(new["results"], "llama.cpp", "decode", 46)) < 1e-12


def test_damaged_and_unknown_files_are_skipped_with_a_note(tmp_path):
    good = BENCH / "scale" / "zen4" / "serve-1b-Q4_0.json"
    (tmp_path / "serve.json").write_text(good.read_text())
    (tmp_path / "broken.json").write_text('{"meta": {')
    (tmp_path / "other.json").write_text(json.dumps({"hello": [1, 2]}))
    wrong = _raw(BENCH / "scale" / "zen4" / "1b-Q4_0-stack-2026-11-26.json")
    wrong["ratios"][0]["peer"] = "a peer that is not in the results"
    (tmp_path / "wrong-layout.json").write_text(json.dumps(wrong))
    notes = io.StringIO()
    text = report([str(tmp_path)], notes=notes)
    lines = notes.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert any("broken.json" in ln and "cannot read it as JSON" in ln for ln in lines)
    assert any("other.json" in ln and "not a kvcache bench suite's JSON" in ln for ln in lines)
    assert any("wrong-layout.json" in ln and "decode JSON of a layout" in ln for ln in lines)
    assert "Traceback" not in notes.getvalue()
    assert "serving, 8 concurrent streams" in text and "wrong-layout" not in text


def test_each_committed_file_is_told_its_suite():
    expect = {"spec/spec.json": "spec", "structured/structured.json": "structured", "throughput.json": "throughput",
              "prefix.json": "prefix", "cache-vs-none.json": "cache-vs-none", "growth.json": "growth",
              "hf.json": "hf", "memory.json": "memory", "context.json": "context", "decode.json": "decode",
              "decode-llamacpp.json": "decode", "attention/attention.json": "attention",
              "long/depth-4k/context.json": "context --long", "scale/zen4/serve-1b-Q4_0.json": "serve",
              "scale/zen4/3b-Q8_0.json": "decode"}
    for name, suite in expect.items():
        run = load(BENCH / name, notes=io.StringIO())
        assert run is not None and run.suite == suite, name


def test_a_file_without_a_known_suite_is_skipped_with_a_note(tmp_path):
    src = _raw(BENCH / "scale" / "zen4" / "serve-1b-Q4_0.json")
    for name, suite in (("none.json", None), ("unknown.json", "no-such-suite")):
        d = copy.deepcopy(src)
        if suite is None:
            del d["meta"]["suite"]
        else:
            d["meta"]["suite"] = suite
        (tmp_path / name).write_text(json.dumps(d))
        notes = io.StringIO()
        assert load(tmp_path / name, notes=notes) is None
        assert "not a kvcache bench suite's JSON" in notes.getvalue() and name in notes.getvalue()


def test_suites_declare_themselves_in_their_own_module():
    """Each suite is one module: its declarations are literals the command line reads without
    importing it, name options the parser has, and its module has the functions they promise."""
    import argparse

    from kvcache.bench.cli import add_bench_parser

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    dests = {a.dest for a in parser._subparsers._group_actions[0].choices["bench"]._actions}
    keys = [s.key for s in suites.catalogue()]
    assert len(keys) == len(set(keys)) and "decode" in keys and "context --long" in keys
    orders = [s.order for s in suites.catalogue()]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)
    for s in suites.catalogue():
        assert set(s.options) <= dests and (s.mode is None or s.mode in dests), s.key
        assert set(s.quick) <= set(s.options) and set(s.quick_llama_cpp) <= set(s.options), s.key
        assert s.mode is not None or s.quick, f"{s.key}: no settings for bench all --quick"
        module = s.load()
        assert callable(module.run), s.key
    code = ("import sys\nfrom kvcache.bench import suites\n"
            "[s.load() for s in suites.catalogue()]\nprint('torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.stdout.split() == ["False"], p.stderr  # torch and the engine load inside the suites' functions


def _kvcache(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return run_kvcache(*args, cwd=cwd, timeout=120)


def test_cli_prints_writes_and_refuses_in_one_line(tmp_path):
    out = tmp_path / "figures.md"
    p = _kvcache("bench", "report", "docs/bench", "--since", "2026-11-25", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout == out.read_text() and f"### {ZEN4}" in p.stdout
    for args, message in ((("bench", "report", "/nope"), "kvcache: /nope: no such directory"),
                          (("bench", "report", str(tmp_path / "empty")), "no kvcache bench suite JSON under"),
                          (("bench", "report", "docs/bench", "--since", "yesterday"), "give a date as YYYY-MM-DD"),
                          (("bench", "report"), "give the folders of suite JSON"),
                          (("bench", "report", "docs/bench", "--quick"), "--quick does not apply to 'bench report'")):
        (tmp_path / "empty").mkdir(exist_ok=True)
        p = _kvcache(*args)
        assert p.returncode == 2, (args, p.stderr)
        assert p.stdout == "" and len(p.stderr.strip().splitlines()) == 1 and message in p.stderr, (args, p.stderr)


def test_report_loads_no_torch():
    code = ("import contextlib, io, sys\n"
            "from kvcache.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['bench', 'report', 'docs/bench'])\n"
            "print(rc, 'torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.stdout.split() == ["0", "False"], p.stderr


def test_readme_figures_are_what_the_command_above_them_prints(monkeypatch):
    """README's Figures table is the output of the command written above it, on the committed JSON
    (the source column names files relative to the repository root, where the command is run)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Figures\n"):readme.index("## Layout\n")]
    (command,) = re.findall(r"```sh\n\.venv/bin/kvcache bench report ([^\n]*)\n```", section)
    monkeypatch.chdir(ROOT)
    assert report(command.split(), notes=io.StringIO()).strip() in section


def test_a_suites_report_gives_its_command_as_a_shell_would_take_it(tmp_path):
    """A spec list with ';' (bench context --kv "fp16;int8") is quoted in the report, so the
    command under "Run ... with:" can be pasted back."""
    from kvcache.bench.report import write_report

    argv = ["bench", "context", "--kv", "fp16;int8", "--out", str(tmp_path)]
    text = write_report(tmp_path, "context", argv, "rows", None).read_text()
    assert f"kvcache bench context --kv 'fp16;int8' --out {tmp_path}\n" in text
