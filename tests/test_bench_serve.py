"""``kvcache bench serve`` refusals and its server handling (its measurements are checked in test_bench_all)."""

from __future__ import annotations

import subprocess
import sys

import forkserve
import pytest

from conftest import run_kvcache

from kvcache.peers.process import free_port
from kvcache.cli import main
from kvcache.bench.serving import server


def _refused(capsys, *argv: str) -> str:
    """The one-line error of ``kvcache bench ...`` (run in this process: refused before any work)."""
    assert main(["bench", *argv]) == 2
    return capsys.readouterr().err


def test_serve_bad_options(capsys):
    assert "--streams '8,0': give whole numbers of at least 1" in _refused(capsys, "serve", "--streams", "8,0")
    assert "--streams 'eight': give whole numbers" in _refused(capsys, "serve", "--streams", "eight")
    assert "unknown serve peer 'vllm'" in _refused(capsys, "serve", "--peers", "vllm")
    assert "does not apply to the serve suite" in _refused(capsys, "serve", "--depth", "100")
    assert "does not apply to the serve suite" in _refused(capsys, "serve", "--depth", "0")  # 0 is given too
    err = _refused(capsys, "decode", "--streams", "4")
    assert "--streams does not apply to the decode suite (only to serve)" in err
    p = run_kvcache("bench", "serve", "--streams", "0")  # and as a user runs it: one line, exit 2
    assert p.returncode == 2 and p.stderr.strip() == "kvcache: --streams '0': give whole numbers of at least 1"


def test_a_server_that_dies_or_never_starts_is_a_reason_not_a_crash():
    port = free_port()
    with server([sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"], port, "peer") as (url, why):
        assert url is None and why == "peer exited with 3: no model here"
    with server(["/nonexistent/llama-server"], port, "peer") as (url, why):
        assert url is None and why.startswith("peer did not start:")


def test_a_started_server_is_stopped_afterwards():
    port = free_port()
    code = ("import http.server as h\n"
            "class H(h.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
            f"h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    with server([sys.executable, "-c", code], port, "peer") as (url, why):
        assert url == f"http://127.0.0.1:{port}" and why == ""
    gone = subprocess.run(["pgrep", "-f", f"127.0.0.1', {port}"], capture_output=True)
    assert gone.returncode == 1  # no such process left


def test_percentile_is_the_nearest_rank():
    from kvcache.peers.row import percentile

    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(100)], 0.99) == 98.0 and percentile([5.0], 0.99) == 5.0


def test_the_load_generators_read_a_real_servers_streams():
    """bench serve's completions and bench replicas' chat turns, against a real `kvcache serve`."""
    import threading

    from kvcache.bench.replicas import Case, _stream
    from kvcache.bench.serving import Level, complete

    port = free_port()
    cmd = forkserve.command("serve", "--port", str(port), "--served-model-name", "default", "--log-level", "warning",
                            "--threads", "1")
    with server(cmd, port, "kvcache") as (url, why):
        assert url is not None, why
        lock, level = threading.Lock(), Level("kvcache", 1)
        complete(url, "The capital of France is", 5, level, lock)
        assert level.requests == 1 and level.errors == 0 and level.tokens == 5 and level.prompt_tokens > 0
        assert len(level.ttft_s) == 1 and len(level.tpot_s) == 1
        case = Case("chat", "1")
        text = _stream(f"{url}/v1", [{"role": "user", "content": "Say hi."}], 4, case, lock)
        assert text and case.errors == 0 and case.tokens == 4 and case.prompt > 0 and len(case.ttft_s) == 1
        complete(f"{url}/nowhere", "x", 3, level, lock)  # a 404: counted as an error, not raised
        assert level.errors == 1


def test_mixed_refusals(capsys):
    assert "--mixed (the document's tokens) must be at least 16" in _refused(capsys, "serve", "--mixed", "4", "--peers", "")
    assert "--mixed (the document's tokens) must be at least 16" in _refused(capsys, "serve", "--mixed", "0", "--peers", "")
    assert "--mixed does not apply to the decode suite (only to serve)" in _refused(capsys, "decode", "--mixed", "100")
    assert "--max-batch-tokens must be at least 1" in _refused(capsys, "serve", "--max-batch-tokens", "0")


@pytest.mark.slow
def test_mixed_reports_short_chats_beside_a_long_document(tmp_path):
    """``bench serve --mixed``: short chats alone and beside one document, on a real `kvcache serve`
    (sizes small enough for a test; the figures are in BENCHMARKS.md)."""
    import json

    out = tmp_path / "mixed.json"
    p = run_kvcache("bench", "serve", "--mixed", "600", "--peers", "", "--streams", "1", "--requests", "2",
                    "--new-tokens", "2", "--prefill", "16", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "short TTFT alone p50/max s" in p.stdout and "doc total s" in p.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["long_tokens"] == 600 and data["meta"]["clients"] == 1
    (row,) = data["results"]
    assert row["system"] == "kvcache" and row["errors"] == 0 and row["note"] == ""
    assert row["short_alone"] == 2 and 0 < row["ttft_alone_p50_s"] <= row["ttft_alone_max_s"]
    assert 0 < row["long_ttft_s"] <= row["long_total_s"]
    if row["short_beside"]:  # sent while the document was prefilled (it may be done before the first)
        assert row["ttft_beside_p50_s"] <= row["ttft_beside_max_s"]
