"""``kvcache bench serve``: ``kvcache serve`` against llama.cpp's ``llama-server`` on the same GGUF, under load.

Workload (the shape of guidellm's fixed-concurrency runs): C streams at once, each sending its
requests one after the other (a closed loop) to the OpenAI ``/v1/completions`` endpoint, streamed;
every prompt a distinct slice of real English text of about ``PROMPT_TOKENS`` tokens (no shared
prefixes), ``new_tokens`` tokens out (EOS ignored), greedy. Measured by the client: output tokens
per second (all completion tokens / wall time of the level), TTFT (request sent -> first streamed
text) p50 and p99, and the time per output token after the first. (``--mixed LONG_TOKENS``: short
chats beside one long document instead, serving_mixed.py.)

Each server is a child process on 127.0.0.1 with the same thread count; one that fails to start
or dies is a row marked skipped, never a failed run. The servers run one after the other, so they
never share the cores. Before each level, one request warms the server up (not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from kvcache.bench.measure import english_slices
from kvcache.bench.report import cell, percentile, run_meta
from kvcache.errors import InvalidParams

PROMPT_TOKENS = 256
PEERS = ("llama-server",)
START_TIMEOUT_S = 300.0


@dataclass
class Level:
    system: str
    streams: int
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    tokens: int = 0
    requests: int = 0
    errors: int = 0
    wall_s: float = 0.0
    note: str = ""

    def summary(self) -> dict[str, object]:
        tpot = percentile(self.tpot_s, 0.5)
        return {"system": self.system, "streams": self.streams, "requests": self.requests, "errors": self.errors,
                "prompt_tokens": self.prompt_tokens, "new_tokens": self.tokens, "wall_s": self.wall_s or None,
                "tok_s": self.tokens / self.wall_s if self.wall_s and self.tokens else None,
                "ttft_p50_s": percentile(self.ttft_s, 0.5), "ttft_p99_s": percentile(self.ttft_s, 0.99),
                "tpot_p50_ms": None if tpot is None else tpot * 1000, "note": self.note}


def sse_events(url: str, body: dict, timeout: float) -> Iterator[dict]:
    """The JSON events of a streamed OpenAI response to ``body`` POSTed at ``url`` (its ``data:``
    lines up to ``[DONE]``); a failed connection or a bad status raises OSError."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def complete(url: str, prompt: str, new: int, level: Level | None, lock: threading.Lock) -> None:
    """One streamed completion; its figures go into ``level`` (None: a warm-up, not counted)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    chunks, usage, failed = 0, None, False
    try:
        for ev in sse_events(f"{url}/v1/completions", body, 900):
            failed = failed or "error" in ev
            usage = ev.get("usage") or usage
            if any(ch.get("text") for ch in ev.get("choices", [])):
                last = time.perf_counter()
                first = first or last
                chunks += 1
    except (OSError, ValueError):
        failed = True
    if level is None:
        return
    done = usage["completion_tokens"] if usage else chunks  # llama-server without usage: one token a chunk
    with lock:
        level.requests += 1
        level.errors += failed or done != new
        level.tokens += done
        level.prompt_tokens += usage["prompt_tokens"] if usage else 0
        if first is not None:
            level.ttft_s.append(first - t0)
            if last is not None and done > 1:
                level.tpot_s.append((last - first) / (done - 1))


def run_level(url: str, texts: list[str], streams: int, per_stream: int, new: int, level: Level) -> None:
    """``streams`` closed-loop clients, each sending ``per_stream`` requests in turn."""
    lock = threading.Lock()
    complete(url, texts[-1], 4, None, lock)  # warm-up

    def client(i: int) -> None:
        for k in range(per_stream):
            complete(url, texts[(i * per_stream + k) % (len(texts) - 1)], new, level, lock)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    level.wall_s = time.perf_counter() - t0


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> str | None:
    """None when ``url`` answers /health with 200; else why not (the process ended, or too slow)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            return f"exited with {proc.returncode}" + (f": {tail[0][:160]}" if tail else "")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return None
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.5)
    return f"not ready after {timeout:.0f} s"


@contextmanager
def server(cmd: list[str], port: int, label: str) -> Iterator[tuple[str | None, str]]:
    """Start ``cmd`` (a server listening on ``port``); yields (url or None, why not), and stops it."""
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-serve-") as tmp:
        log = Path(tmp) / "server.log"
        with open(log, "wb") as out:
            try:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            except OSError as e:
                yield None, f"{label} did not start: {e}"
                return
            try:
                why = _wait_ready(url, proc, log, START_TIMEOUT_S)
                yield (None, f"{label} {why}") if why else (url, "")
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def kvcache_cmd(args: argparse.Namespace, port: int, threads: int, streams: int) -> list[str]:
    cmd = [sys.executable, "-m", "kvcache", "serve", "--port", str(port), "--threads", str(threads),
           "--max-running", str(max(32, streams)), "--log-level", "warning", "--no-prefix-cache", "--served-model-name", "default"]
    if args.model:
        cmd += ["--model", args.model]
    if args.weights:
        cmd += ["--weights", args.weights]
    if args.kv:
        cmd += ["--kv", args.kv]
    if getattr(args, "max_batch_tokens", None) is not None:
        cmd += ["--max-batch-tokens", str(args.max_batch_tokens)]
    return cmd


def llama_server_cmd(binary: Path, gguf: Path, port: int, threads: int, streams: int, prompt: int,
                     new: int) -> list[str]:
    """llama-server with one slot per stream and room for each slot's prompt and output."""
    ctx = streams * (prompt + new + 64)
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(streams), "-c", str(ctx), "--no-webui", "--log-disable"]


def run(args: argparse.Namespace) -> int:
    from kvcache.bench.llamabench import tool
    from kvcache.bench.llamapeer import check_bin
    from kvcache.bench.local_redis import free_port
    from kvcache.models.loading import resolve_model

    check_budget(args)
    streams = int_list(args.streams or ("4" if args.quick else "8,32"), "--streams")
    prompt = int(args.prefill) if args.prefill else (64 if args.quick else PROMPT_TOKENS)
    new = args.new_tokens if args.new_tokens is not None else (8 if args.quick else 64)
    per_stream = args.requests if args.requests is not None else (1 if args.quick else 3)
    if prompt < 8 or new < 2 or per_stream < 1:
        raise InvalidParams("--prefill (prompt tokens) must be at least 8, --new-tokens at least 2, --requests at least 1")
    peers = serve_peers(args)
    threads = args.threads or len(os.sched_getaffinity(0))
    gguf = resolve_model(args.model).gguf
    binary = None
    if peers:
        where = check_bin(args.llama_cpp_bin)
        binary = tool(where, "llama-server") if where else None
    texts = english_slices(args.model, max(streams) * per_stream + 1, prompt, skip=0)
    results: list[dict[str, object]] = []
    systems = [("kvcache", None)] + [(p, binary) for p in peers]
    for name, peer_bin in systems:
        for c in streams:
            level = Level(name, c)
            print(f"bench serve: {name}, {c} streams...", file=sys.stderr, flush=True)
            port = free_port()
            if name == "kvcache":
                cmd = kvcache_cmd(args, port, threads, c)
            elif peer_bin is None or gguf is None:
                level.note = ("no GGUF file for this model" if gguf is None else
                              "llama-server not built: `make llamacpp`, then `cmake --build .venv/llama.cpp/build "
                              "--target llama-server`: skipped")
                results.append(level.summary())
                continue
            else:
                cmd = llama_server_cmd(peer_bin, gguf, port, threads, c, prompt, new)
            with server(cmd, port, name) as (url, why):
                if url is None:
                    level.note = why + ": skipped"
                else:
                    run_level(url, texts, c, per_stream, new, level)
                    if level.errors:
                        level.note = f"{level.errors} request(s) failed or came back short"
            results.append(level.summary())
    _print(results, prompt, new, per_stream, threads)
    if args.json:
        meta = run_meta(prompt_tokens=prompt, new_tokens=new, requests_per_stream=per_stream, streams=streams,
                        threads=threads, model=str(gguf or args.model or "bundled"))
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


def check_budget(args: argparse.Namespace) -> None:
    """``--max-batch-tokens`` (kvcache serve's), refused before any server starts when below 1."""
    if getattr(args, "max_batch_tokens", None) is not None and args.max_batch_tokens < 1:
        raise InvalidParams(f"--max-batch-tokens must be at least 1, got {args.max_batch_tokens}")


def serve_peers(args: argparse.Namespace) -> list[str]:
    """The peers named by ``--peers`` (default all), each one checked."""
    peers = [p for p in (args.peers if args.peers is not None else ",".join(PEERS)).split(",") if p]
    for p in peers:
        if p not in PEERS:
            raise InvalidParams(f"unknown serve peer {p!r}; peers: {', '.join(PEERS)}")
    return peers


def int_list(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise InvalidParams(f"{flag} {text!r}: give whole numbers, comma-separated (8,32)") from None
    if not out or min(out) < 1:
        raise InvalidParams(f"{flag} {text!r}: give whole numbers of at least 1")
    return out


def _print(results: list[dict[str, object]], prompt: int, new: int, per_stream: int, threads: int) -> None:
    print(f"\nserve: C streams at once, {per_stream} request(s) each in turn, prompts of about {prompt} tokens "
          f"(distinct), {new} new tokens (EOS ignored), greedy, {threads} threads; /v1/completions, streamed")
    print(f"{'system':<14} {'streams':>7} {'tok/s':>7} {'vs peer':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT ms':>8} {'errors':>6}  note")
    ours = {r["streams"]: r["tok_s"] for r in results if r["system"] == "kvcache"}
    for r in results:
        ratio = "-"
        if r["system"] != "kvcache" and r["tok_s"] and ours.get(r["streams"]):
            ratio = f"{ours[r['streams']] / r['tok_s']:.2f}x"  # type: ignore[operator]
        print(f"{r['system']:<14} {r['streams']:>7} {cell(r['tok_s']):>7} {ratio:>8} "  # type: ignore[arg-type]
              f"{cell(r['ttft_p50_s'], '.2f'):>9} {cell(r['ttft_p99_s'], '.2f'):>9} "  # type: ignore[arg-type]
              f"{cell(r['tpot_p50_ms'], '.0f'):>8} {r['errors']:>6}  {r['note']}")  # type: ignore[arg-type]
