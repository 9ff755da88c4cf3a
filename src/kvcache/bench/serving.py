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
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvcache.bench.measure import english_slices
from kvcache.bench.report import cell, run_meta
from kvcache.bench.rows import Headline, beside_same_file, suite_parts
from kvcache.errors import InvalidParams
from kvcache.peers.llama_cpp import llama_server, llama_server_cmd
from kvcache.peers.row import percentile
from kvcache.peers.servers import server, stream

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "serve"
ORDER = 40
OPTIONS = ("new_tokens", "requests", "peers", "kv", "weights", "prefill", "streams", "llama_cpp_bin",
           "max_batch_tokens", "document_step_work")
QUICK = {"streams": "4", "requests": 1, "new_tokens": 8, "prefill": "64"}

PROMPT_TOKENS = 256
PEERS = ("llama-server",)


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


def complete(url: str, prompt: str, new: int, level: Level | None, lock: threading.Lock) -> None:
    """One streamed completion; its figures go into ``level`` (None: a warm-up, not counted)."""
    got = stream(f"{url}/v1/completions", {"prompt": prompt, "max_tokens": new})
    if level is None:
        return
    with lock:
        level.requests += 1
        level.errors += bool(got.error) or got.tokens != new
        level.tokens += got.tokens
        level.prompt_tokens += got.prompt_tokens
        if got.ttft_s is not None:
            level.ttft_s.append(got.ttft_s)
        if got.tpot_s is not None:
            level.tpot_s.append(got.tpot_s)


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
    if getattr(args, "document_step_work", None) is not None:
        cmd += ["--document-step-work", str(args.document_step_work)]
    return cmd


def run(args: argparse.Namespace) -> int:
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
    binary, missing = llama_server(args.llama_cpp_bin, gguf) if peers else (None, "")
    texts = english_slices(args.model, max(streams) * per_stream + 1, prompt, skip=0)
    results: list[dict[str, object]] = []
    for name in ["kvcache"] + peers:
        for c in streams:
            level = Level(name, c)
            print(f"bench serve: {name}, {c} streams...", file=sys.stderr, flush=True)
            with system_server(args, name, threads, c, c * (prompt + new + 64), binary, gguf, missing) as (url, why):
                if url is None:
                    level.note = why
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


@contextmanager
def system_server(args: argparse.Namespace, name: str, threads: int, slots: int, ctx: int, binary: Path | None,
                  gguf: Path | None, missing: str) -> Iterator[tuple[str | None, str]]:
    """``kvcache serve`` (``name`` kvcache) or llama-server (``binary``, ``slots`` slots sharing
    ``ctx`` tokens) on a free port: yields (its url, "") or (None, why it is skipped), and stops it."""
    from kvcache.peers.process import free_port

    if name != "kvcache" and (binary is None or gguf is None):
        yield None, missing
        return
    port = free_port()
    cmd = (kvcache_cmd(args, port, threads, slots) if name == "kvcache"
           else llama_server_cmd(binary, gguf, port, threads, slots, ctx))  # type: ignore[arg-type]
    with server(cmd, port, name) as (url, why):
        yield url, "" if url else why + ": skipped"


def check_budget(args: argparse.Namespace) -> None:
    """``--max-batch-tokens`` and ``--document-step-work`` (kvcache serve's), refused before any
    server starts when below 1 (below 0: 0 never caps a document)."""
    if getattr(args, "max_batch_tokens", None) is not None and args.max_batch_tokens < 1:
        raise InvalidParams(f"--max-batch-tokens must be at least 1, got {args.max_batch_tokens}")
    if getattr(args, "document_step_work", None) is not None and args.document_step_work < 0:
        raise InvalidParams(f"--document-step-work must be 0 (never capped) or more, got {args.document_step_work}")


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


def headline(d: dict) -> list[Headline]:
    """``bench serve``: output tok/s of ``kvcache serve`` beside llama-server on the same GGUF, at
    each level of concurrent streams."""
    meta, results, model = suite_parts(d)
    rows = []
    for k in (r for r in results if r["system"] == "kvcache"):
        p = next(x for x in results if x["system"] != "kvcache" and x["streams"] == k["streams"])
        if p.get("tok_s") is None and p.get("note"):
            continue  # the peer was skipped (its note says why): no figure to stand beside
        what = (f"{model}: serving, {k['streams']} concurrent streams, {meta['prompt_tokens']}-token prompts, "
                f"{meta['new_tokens']} out, output tok/s")
        rows.append(beside_same_file(what, k, p))
    return rows


def plot(plt, data: dict):
    """Output tok/s of each system at each level of concurrent streams."""
    from kvcache.bench.plots import bars

    rows = [r for r in data["results"] if r.get("tok_s")]
    if not rows:
        return None
    meta = data["meta"]
    return bars(plt, [f"{r['system']}, {r['streams']} streams" for r in rows], [r["tok_s"] for r in rows],
                 f"serving, {meta.get('prompt_tokens')}-token prompts, {meta.get('new_tokens')} out",
                 "output tokens per second")
