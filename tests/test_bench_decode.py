"""``kvcache bench decode``: kvcache under each weights mode beside its peers, each peer in a child
process whose crash is a skipped row, never the benchmark's end."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import forkserve
import pytest

from conftest import run_kvcache

from kvcache.peers.llama_cpp import default_bin, quantize

from kvcache.peers.process import run

# what `make llamacpp` built, else a prebuilt copy
LLAMA_BIN = default_bin() or Path("/opt/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin")


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _results(path: Path) -> dict[tuple[str, str, str], dict]:
    rows = json.loads(path.read_text())["results"]
    return {(r["system"], r["pair"], r["test"]): r for r in rows}


def test_profile_splits_a_decode_step_into_the_kernels_and_the_host(tmp_path):
    """bench decode --profile: per decode step the time in the native kernels and outside them."""
    out = tmp_path / "profile.json"
    p = run_kvcache("bench", "decode", "--profile", "--new-tokens", "6", "--repeats", "1", "--json", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    prof = json.loads(out.read_text())["profile"]
    assert prof["step_ms"] > prof["kernels_ms"] > 0 and prof["calls_per_step"] >= 1
    assert prof["host_ms"] == pytest.approx(prof["step_ms"] - prof["kernels_ms"])
    assert 0 < prof["host_share"] < 1 and "outside them" in p.stdout
    bad = run_kvcache("bench", "context", "--profile")
    assert bad.returncode == 2 and "--profile" in bad.stderr and "Traceback" not in bad.stderr


def test_kernel_profile_counts_native_calls_in_process():
    code = ("from kvcache import kernels, LLM, SamplingParams\n"
            "kernels.profile()\n"
            "llm = LLM(prefix=False)\n"
            "c0, t0 = kernels.profiled()\n"
            "llm.generate(['Hello'], SamplingParams(max_tokens=3, ignore_eos=True))\n"
            "c1, t1 = kernels.profiled()\n"
            "kernels.profile(False)\n"
            "llm.generate(['Hello'], SamplingParams(max_tokens=3, ignore_eos=True))\n"
            "print(c1 - c0, t1 - t0, kernels.profiled())\n")
    p = subprocess.run(forkserve.python_command("-c", code), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    calls, seconds, after = p.stdout.split(" ", 2)
    assert int(calls) >= 3 and float(seconds) > 0 and after.strip() == "(0, 0.0)"


def test_products_alone_read_every_quantized_weight_a_step_multiplies_by():
    from kvcache import LLM
    from kvcache.bench.measure import products_bandwidth

    llm = LLM(weights="q8", prefix=False)
    ws = llm.model.quantized_weights()
    assert ws and len({id(w) for w in ws}) == len(ws)  # each once
    assert sum(w.nbytes for w in ws) == llm.model.weight_bytes() - llm.model.weight_kinds().get("fp32", 0)
    gb_s = products_bandwidth(llm.model, repeats=2)
    assert gb_s is not None and 0.1 < gb_s < 10_000
    assert products_bandwidth(LLM(weights="fp32", prefix=False).model) is None  # nothing quantized


def test_a_crashing_llama_bench_is_a_skipped_row_naming_the_signal(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    _script(fake / "llama-bench", "kill -SEGV $$")
    out = tmp_path / "decode.json"
    p = run_kvcache("bench", "decode", "--quick", "--weights", "file", "--peers", "llama.cpp", "--llama-cpp-bin",
                    str(fake), "--new-tokens", "2", "--repeats", "1", "--prefill", "32", "--depth", "64", "--rounds", "2",
                    "--json", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(out.read_text())["meta"]["rounds"] == 2 and "2 rounds of every system in turn" in p.stdout
    rows = _results(out)
    assert rows[("kvcache", "file", "decode")]["tok_s"] > 0  # kvcache's rows are all there
    assert rows[("kvcache", "file", "depth")]["tok_s"] > 0 and rows[("kvcache", "file", "depth")]["tokens"] == 64
    lcpp = [r for k, r in rows.items() if k[0] == "llama.cpp"]
    assert {r["test"] for r in lcpp} == {"decode", "prefill", "depth"}
    assert all(r["tok_s"] is None and r["note"] == "llama-bench crashed: SIGSEGV" for r in lcpp)
    assert "llama-bench crashed: SIGSEGV" in p.stdout


def test_a_crashing_llama_cpp_python_is_a_skipped_row_naming_the_signal(tmp_path):
    """The llama-cpp-python kind: its child dies of a segfault in native code when it loads the
    library (here a package named llama_cpp that dereferences NULL); the parent never loaded it."""
    pkg = tmp_path / "llama_cpp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import ctypes\nctypes.string_at(0)\n")
    out = tmp_path / "decode.json"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("KVCACHE_LLAMA_CPP_BIN", None)
    p = run_kvcache("bench", "decode", "--quick", "--weights", "file", "--peers", "llama.cpp", "--new-tokens", "2",
                    "--repeats", "1", "--prefill", "", "--depth", "0", "--json", str(out), env=env,
                    fresh=True)  # PYTHONPATH: read at start
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    if data["meta"]["llama_cpp"] == "llama-bench":
        pytest.skip("`make llamacpp`'s llama-bench is installed: it is the peer, not llama-cpp-python")
    rows = _results(out)
    assert rows[("kvcache", "file", "decode")]["tok_s"] > 0
    assert rows[("llama.cpp", "file", "decode")]["note"] == "llama-cpp-python crashed: SIGSEGV"


def test_the_weights_label_names_the_type_a_file_name_ends_with():
    """A GGUF as it ships names its type after a dot or a dash, in either case; the label and
    llama.cpp's row say it, and a name without one says nothing (never a piece of the name)."""
    from kvcache.peers.row import shipped_type

    assert shipped_type("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert shipped_type("/m/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf") == "Q4_K_M"  # not "5b-instruct-q4_k_m"
    assert shipped_type("1b-0-Q8_0.gguf") == "Q8_0" and shipped_type("gemma-3-1b-it-IQ4_XS.gguf") == "IQ4_XS"
    assert shipped_type("x.bf16.gguf") == "BF16" and shipped_type("model.gguf") is None
    assert shipped_type("qwen2.5-coder.gguf") is None


def test_rounds_pool_each_rows_samples_and_keep_a_note_only_while_nothing_ran():
    from kvcache.bench.decode import pool_rows
    from kvcache.peers.row import Row

    pooled: dict = {}
    pool_rows(pooled, [Row("kvcache", "file", "dynamic", "file", "decode", 46, tok_s=[50.0], gb_s=[30.0]),
                       Row("llama.cpp", "Q4_0", "f16", "file", "decode", 46, note="llama-bench crashed: SIGSEGV")])
    pool_rows(pooled, [Row("kvcache", "file", "dynamic", "file", "decode", 46, tok_s=[60.0, 70.0], gb_s=[36.0, 42.0]),
                       Row("kvcache", "file", "dynamic", "file", "prefill", 512, tok_s=[400.0]),
                       Row("llama.cpp", "Q4_0", "f16", "file", "decode", 46, tok_s=[55.0])])
    rows = {(r.system, r.test): r for r in pooled.values()}
    assert len(rows) == 3 and rows[("kvcache", "decode")].tok_s == [50.0, 60.0, 70.0]
    assert rows[("kvcache", "decode")].summary()["tok_s"] == 60.0 and rows[("kvcache", "decode")].gb_s == [30.0, 36.0, 42.0]
    assert rows[("llama.cpp", "decode")].tok_s == [55.0] and rows[("llama.cpp", "decode")].note == ""


def test_child_outcomes_name_what_happened(tmp_path):
    py = sys.executable
    segv = run([py, "-c", "import ctypes; ctypes.string_at(0)"], "peer")
    assert not segv.ok and segv.note == "peer crashed: SIGSEGV"
    abort = run([py, "-c", "import os; os.abort()"], "peer")
    assert abort.note == "peer crashed: SIGABRT"
    failed = run([py, "-c", "import sys; sys.exit('model file is broken')"], "peer")
    assert failed.note == "peer failed (exit 1): model file is broken"
    slow = run([py, "-c", "import time; time.sleep(30)"], "peer", timeout=1)
    assert slow.note == "peer ran past 1 s and was stopped"
    talk = run([py, "-c", "print('loading'); print('{\"tok_s\": 5}')"], "peer")
    assert talk.ok and talk.data == {"tok_s": 5}
    assert run([str(tmp_path / "missing")], "peer").note.startswith("peer could not start")


def test_a_crashing_llama_quantize_leaves_no_file(tmp_path):
    _script(tmp_path / "llama-quantize", 'echo "writing $3" >&2; : > "$3"; kill -SEGV $$')
    src = tmp_path / "model.Q4_1.gguf"
    src.write_bytes(b"GGUF")
    out = tmp_path / "model.Q8_0.gguf"
    assert quantize(tmp_path, src, "Q8_0", out) == "llama-quantize crashed: SIGSEGV"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama-quantize", "model.Q4_1.gguf"]


@pytest.mark.skipif(not (LLAMA_BIN / "llama-bench").is_file(), reason="llama.cpp's tools are not built here")
def test_real_llama_bench_beside_kvcache(tmp_path):
    out = tmp_path / "decode.json"
    p = run_kvcache("bench", "decode", "--weights", "file,q8", "--peers", "llama.cpp", "--llama-cpp-bin",
                    str(LLAMA_BIN), "--new-tokens", "4", "--repeats", "1", "--prefill", "64", "--depth", "128",
                    "--threads", "1", "--json", str(out), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["llama_cpp"] == "llama-bench"
    lcpp = {(r["pair"], r["test"]): r for r in data["results"] if r["system"] == "llama.cpp"}
    assert set(lcpp) == {("file", "decode"), ("file", "prefill"), ("file", "depth"), ("q8", "decode"),
                         ("q8", "prefill")}
    assert all(r["tok_s"] > 0 and not r["note"] for r in lcpp.values()), lcpp
    assert lcpp[("file", "decode")]["weights"] == "Q4_1 (as shipped)" and lcpp[("q8", "decode")]["weights"] == "Q8_0"
    assert lcpp[("file", "depth")]["cache"] == "q8_0" and lcpp[("file", "decode")]["ttft_ms"] > 0
    pairs = {(x["test"], x["kvcache"].split()[0], x["peer"].split()[1]) for x in data["ratios"]}
    assert {("decode", "file", "Q4_1"), ("decode", "q8", "Q8_0"), ("depth", "file", "Q4_1")} <= pairs


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_real_llama_cpp_python_beside_kvcache(tmp_path):
    out = tmp_path / "decode.json"
    env = dict(os.environ)
    env.pop("KVCACHE_LLAMA_CPP_BIN", None)
    p = subprocess.run([sys.executable, "-m", "kvcache", "bench", "decode", "--weights", "file", "--peers",
                        "llama.cpp", "--new-tokens", "4", "--repeats", "1", "--prefill", "64", "--depth", "128",
                        "--threads", "1", "--json", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    if data["meta"]["llama_cpp"] == "llama-bench":
        pytest.skip("`make llamacpp`'s llama-bench is installed: it is the peer, not llama-cpp-python")
    lcpp = {r["test"]: r for r in data["results"] if r["system"] == "llama.cpp"}
    assert set(lcpp) == {"decode", "prefill", "depth"} and all(r["tok_s"] > 0 for r in lcpp.values()), lcpp


BAD = [
    (("--weights", "q9"), "--weights: unknown mode 'q9'"),
    (("--prefill", "abc"), "--prefill: 'abc' is not a number"),
    (("--prefill", "9000"), "--prefill: 9000 tokens is outside 2..8192"),
    (("--depth", "8191"), "--depth must be 0"),
    (("--llama-cpp-bin", "/nonexistent/llama"), "--llama-cpp-bin /nonexistent/llama: not a folder"),
    (("--peers", "vllm"), "unknown peer 'vllm'"),
    (("--rounds", "0"), "--rounds must be >= 1"),
]


def test_bad_decode_options_exit_2_in_one_line(tmp_path, capsys):
    from kvcache.cli import main

    p = run_kvcache("bench", "decode", *BAD[0][0])  # as a user runs it: status 2, one line, nothing on stdout
    assert p.returncode == 2 and p.stdout == "" and p.stderr == f"kvcache: {BAD[0][1]}; choose from file, fp32, q8, q4\n"
    for args, message in [*BAD[1:], (("--llama-cpp-bin", str(tmp_path)), "no executable llama-bench there")]:
        assert main(["bench", "decode", *args]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("kvcache: ") and message in err and len(err.strip().splitlines()) == 1
    assert main(["bench", "growth", "--llama-cpp-bin", str(tmp_path)]) == 2
    assert "--llama-cpp-bin does not apply to the growth suite" in capsys.readouterr().err
