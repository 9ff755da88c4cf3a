"""``kvcache bench serve --mixed LONG_TOKENS``: short chats beside one long document.

What a user of a shared server feels when someone pastes a long document: how long a short chat
waits for its first token while the document's prompt is prefilled. Two phases on one server:

1. alone: ``requests`` short chats (``/v1/chat/completions``, each a distinct slice of English
   text of about ``short`` tokens, ``new`` tokens out, EOS ignored, greedy, streamed), one after
   the other on the idle server: each one's TTFT (request sent -> first streamed text);
2. beside: the long document (``/v1/completions``, a prompt of about LONG_TOKENS tokens, ``new``
   tokens out) is sent; after ``SETTLE_S`` (its prefill has begun), ``clients`` short-chat clients
   each send short chats one after the other until the document's first token arrives (its
   prefill is over): every short chat sent in that window counts, with its whole wait.

Reported per system: the short chats' TTFT, median and max, alone and beside the document (and
their ratio), and the document's own TTFT and total time. Servers are started as in the serve
suite (serving.py: same thread count, one after the other, one that fails is a row marked skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvcache.peers.servers import Stream, stream

from kvcache.bench.report import cell, run_meta
from kvcache.errors import InvalidParams
from kvcache.peers.llama_cpp import llama_server
from kvcache.peers.row import percentile

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "serve"
MODE = "mixed"  # run instead of the suite's own module when --mixed is given
ORDER = 41
OPTIONS = ("new_tokens", "requests", "peers", "kv", "weights", "prefill", "streams", "llama_cpp_bin",
           "max_batch_tokens", "document_step_work")

SETTLE_S = 1.0  # after the document is sent, before the first short chat goes out


@dataclass
class Mixed:
    system: str
    alone_s: list[float] = field(default_factory=list)
    beside_s: list[float] = field(default_factory=list)
    long: Stream = field(default_factory=Stream)
    errors: int = 0
    note: str = ""

    def summary(self) -> dict[str, object]:
        a, b = percentile(self.alone_s, 0.5), percentile(self.beside_s, 0.5)
        return {"system": self.system, "short_alone": len(self.alone_s), "short_beside": len(self.beside_s),
                "ttft_alone_p50_s": a, "ttft_alone_max_s": max(self.alone_s, default=None),
                "ttft_beside_p50_s": b, "ttft_beside_max_s": max(self.beside_s, default=None),
                "ratio_p50": b / a if a and b else None, "long_ttft_s": self.long.ttft_s,
                "long_total_s": self.long.total_s or None, "errors": self.errors, "note": self.note}


def _chat(url: str, text: str, new: int) -> Stream:
    return stream(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": new})


def run_mixed(url: str, long_text: str, shorts: list[str], clients: int, alone: int, new: int, level: Mixed) -> None:
    """Both phases against the server at ``url``; figures go into ``level``."""
    _chat(url, shorts[-1], 2)  # warm-up, not counted
    for text in shorts[:alone]:
        got = _chat(url, text, new)
        level.errors += bool(got.error)
        if got.ttft_s is not None:
            level.alone_s.append(got.ttft_s)
    lock = threading.Lock()
    prefilled = threading.Event()
    pool = iter(shorts[alone:-1])

    def document() -> None:
        level.long = stream(url + "/v1/completions", {"prompt": long_text, "max_tokens": new}, prefilled.set)
        prefilled.set()  # also when it failed

    def client(i: int) -> None:
        prefilled.wait(i * SETTLE_S / clients)  # staggered: the clients meet the steps at different points
        while not prefilled.is_set():  # sent while the document is prefilled: counted, however long it waits
            with lock:
                text = next(pool, None)
            if text is None:
                return
            got = _chat(url, text, new)
            with lock:
                level.errors += bool(got.error)
                if got.ttft_s is not None:
                    level.beside_s.append(got.ttft_s)

    doc = threading.Thread(target=document)
    doc.start()
    prefilled.wait(SETTLE_S)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    doc.join()
    if level.long.error:
        level.errors += 1
        level.note = f"the document failed: {level.long.error}"


def run(args: argparse.Namespace) -> int:
    from kvcache.bench.measure import english_slices
    from kvcache.bench.serving import check_budget, int_list, serve_peers, system_server
    from kvcache.models.loading import resolve_model

    check_budget(args)
    peers = serve_peers(args)
    long_tokens = int(args.mixed)
    clients = int_list(args.streams, "--streams")[0] if args.streams else 2
    short = int(args.prefill) if args.prefill else 64
    new = args.new_tokens if args.new_tokens is not None else 8
    alone = args.requests if args.requests is not None else 5
    if long_tokens < 16 or short < 8 or new < 2 or alone < 1 or clients < 1:
        raise InvalidParams("--mixed (the document's tokens) must be at least 16, --prefill (a short chat's "
                            "tokens) at least 8, --new-tokens at least 2, --requests and --streams at least 1")
    threads = args.threads or len(os.sched_getaffinity(0))
    gguf = resolve_model(args.model).gguf
    binary, missing = llama_server(args.llama_cpp_bin, gguf) if peers else (None, "")
    (long_text,) = english_slices(args.model, 1, long_tokens, skip=0)
    shorts = english_slices(args.model, alone + 200 + 1, short, skip=long_tokens + 11)
    results: list[dict[str, object]] = []
    slots = clients + 1
    for name in ["kvcache"] + peers:
        level = Mixed(name)
        print(f"bench serve --mixed: {name}...", file=sys.stderr, flush=True)
        ctx = slots * (long_tokens + 64 + new + 64)
        with system_server(args, name, threads, slots, ctx, binary, gguf, missing) as (url, why):
            if url is None:
                level.note = why
            else:
                run_mixed(url, long_text, shorts, clients, alone, new, level)
                if level.errors and not level.note:
                    level.note = f"{level.errors} request(s) failed"
        results.append(level.summary())
    budget = getattr(args, "max_batch_tokens", None) or 256
    from kvcache.server.cli import DOCUMENT_STEP_WORK

    doc_work = getattr(args, "document_step_work", None)
    doc_work = DOCUMENT_STEP_WORK if doc_work is None else doc_work  # the server's default
    _print(results, long_tokens, short, new, clients, threads, budget, doc_work)
    if args.json:
        meta = run_meta(long_tokens=long_tokens, short_tokens=short, new_tokens=new, clients=clients,
                        short_alone=alone, threads=threads, max_batch_tokens=budget, document_step_work=doc_work,
                        model=str(gguf or args.model or "bundled"))
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


def _print(results: list[dict[str, object]], long_tokens: int, short: int, new: int, clients: int,
           threads: int, budget: int, doc_work: int | None = None) -> None:
    print(f"\nserve --mixed: short chats of about {short} tokens ({new} out) alone, then from {clients} client(s) "
          f"while a {long_tokens}-token document is prefilled; greedy, streamed, {threads} threads; "
          f"kvcache --max-batch-tokens {budget} --document-step-work {doc_work}")
    print(f"{'system':<14} {'short TTFT alone p50/max s':>27} {'beside p50/max s':>17} {'n':>4} {'ratio':>6} "
          f"{'doc TTFT s':>10} {'doc total s':>11}  note")
    for r in results:
        alone = f"{cell(r['ttft_alone_p50_s'], '.2f')}/{cell(r['ttft_alone_max_s'], '.2f')}"  # type: ignore[arg-type]
        beside = f"{cell(r['ttft_beside_p50_s'], '.2f')}/{cell(r['ttft_beside_max_s'], '.2f')}"  # type: ignore[arg-type]
        print(f"{r['system']:<14} {alone:>27} {beside:>17} {r['short_beside']:>4} "
              f"{cell(r['ratio_p50'], '.1f'):>6} {cell(r['long_ttft_s'], '.1f'):>10} "  # type: ignore[arg-type]
              f"{cell(r['long_total_s'], '.1f'):>11}  {r['note']}")  # type: ignore[arg-type]
