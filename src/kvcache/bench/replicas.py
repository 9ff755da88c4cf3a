"""``kvcache bench throughput --replicas N``: routing quality across engine replicas on Ray Serve.

Workload: multi-turn chat through the routed OpenAI endpoint. ``sessions`` conversations, each
with its own system prompt (a distinct slice of real English text, about ``SYSTEM_TOKENS``
tokens), run at once; each sends ``turns`` turns in order, every turn the whole conversation so
far plus a new question, streams ``new_tokens`` tokens (EOS ignored) and appends the answer.
Measured by the client: time to first token (request sent -> first streamed text), the hit rate
(``cached_tokens`` / ``prompt_tokens`` from the usage), output tokens per second.

Cases, same workload and model: prefix-aware routing over N replicas; round-robin over N; round-robin
over N sharing a Redis tier (when a redis-server is at hand: misses in RAM come back from Redis);
one replica with N threads (the same cores). On a machine with few cores this shows routing
quality (hit rate, TTFT), not the speed of many machines.

With ``--prefill-replicas M`` (needs Redis): long documents (``LONG_TOKENS`` tokens, one each)
sent while the chats run, first with N engine replicas alone, then with M prefill replicas that
compute the documents' pages into Redis before an engine replica restores them and generates.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from kvcache.bench.measure import english_slices
from kvcache.bench.report import cell, run_meta
from kvcache.errors import InvalidParams
from kvcache.peers.row import percentile

# the suite's declaration (bench/suites.py reads it from this source)
SUITE = "throughput"
MODE = "replicas"  # run instead of the suite's own module when --replicas is given
ORDER = 71
OPTIONS = ("requests", "new_tokens", "peers", "kv", "weights", "prefill_replicas", "redis")

SYSTEM_TOKENS = 256
LONG_TOKENS = 1500
QUESTIONS = ["Summarize the text above in one sentence.", "Which programming language is the text about?",
             "List three keywords that appear in the text.", "Is the text written for beginners or experts?",
             "What would be a good title for the text?", "Name one statement the text uses."]


@dataclass
class Case:
    name: str
    replicas: str
    ttft_s: list[float] = field(default_factory=list)
    long_ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    prompt: int = 0
    cached: int = 0
    doc_prompt: int = 0
    doc_cached: int = 0  # of the documents' prompt tokens, those found cached (restored after a prefill)
    tokens: int = 0
    wall_s: float = 0.0
    errors: int = 0
    note: str = ""

    def summary(self) -> dict[str, object]:
        return {"case": self.name, "replicas": self.replicas, "turns": len(self.ttft_s),
                "hit_rate": self.cached / self.prompt if self.prompt else None,
                "ttft_p50_s": percentile(self.ttft_s, 0.5), "ttft_p99_s": percentile(self.ttft_s, 0.99),
                "ttft_mean_s": statistics.fmean(self.ttft_s) if self.ttft_s else None,
                "long_ttft_p50_s": percentile(self.long_ttft_s, 0.5),
                "doc_hit_rate": self.doc_cached / self.doc_prompt if self.doc_prompt else None,
                "tpot_p50_ms": None if not self.tpot_s else percentile(self.tpot_s, 0.5) * 1000,  # type: ignore[operator]
                "tok_s": self.tokens / self.wall_s if self.wall_s else None, "wall_s": self.wall_s,
                "errors": self.errors, "note": self.note}


def _stream(url: str, messages: list[dict[str, str]], new: int, case: Case, lock: threading.Lock,
            long: bool = False) -> str:
    """One streamed chat turn; returns its text and records its figures in ``case``."""
    from kvcache.peers.servers import stream

    got = stream(f"{url}/chat/completions", {"messages": messages, "max_tokens": new})
    with lock:
        case.errors += bool(got.error)
        if got.ttft_s is not None:
            (case.long_ttft_s if long else case.ttft_s).append(got.ttft_s)
        if long:
            case.doc_prompt += got.prompt_tokens
            case.doc_cached += got.cached_tokens
        else:
            case.prompt += got.prompt_tokens
            case.cached += got.cached_tokens
        case.tokens += got.tokens
        if got.tpot_s is not None:
            case.tpot_s.append(got.tpot_s)
    return got.text


def run_workload(url: str, systems: list[str], turns: int, new: int, case: Case,
                 documents: list[str] = ()) -> None:
    """Every session's turns in order, the sessions (and the documents) at once."""
    lock = threading.Lock()

    def session(i: int) -> None:
        msgs = [{"role": "system", "content": systems[i]}]
        for t in range(turns):
            msgs.append({"role": "user", "content": QUESTIONS[(i + t) % len(QUESTIONS)]})
            msgs.append({"role": "assistant", "content": _stream(url, msgs, new, case, lock)})

    def document(text: str) -> None:
        _stream(url, [{"role": "user", "content": text + "\n\nSummarize this."}], new, case, lock, long=True)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(len(systems))]
    threads += [threading.Thread(target=document, args=(d,)) for d in documents]
    t0 = time.perf_counter()
    for i, t in enumerate(threads):
        t.start()
        if i >= len(systems):
            time.sleep(0.5)  # documents arrive while the chats run
    for t in threads:
        t.join()
    case.wall_s = time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    n, m = args.replicas, args.prefill_replicas or 0
    if n < 1 or m < 0:
        raise InvalidParams(f"--replicas must be at least 1 and --prefill-replicas 0 or more, got {n} and {m}")
    if args.peers is not None or (args.weights and "," in args.weights):
        raise InvalidParams("--replicas runs kvcache alone, one weights mode: drop --peers and the weights list")
    sessions = args.requests if args.requests is not None else (4 if args.quick else 8)
    new = args.new_tokens if args.new_tokens is not None else (16 if args.quick else 32)
    turns = 3 if args.quick else 4
    if sessions < 1 or new < 2:
        raise InvalidParams("--requests (sessions) must be at least 1 and --new-tokens at least 2")
    try:
        from ray import serve  # noqa: F401
    except ImportError:
        raise InvalidParams("--replicas needs Ray Serve: pip install 'kvcache[ray]'") from None
    from kvcache.peers.redis_server import local_redis
    from kvcache.cache.config import parse_kv_spec
    from kvcache.engine.scheduler import SchedulerConfig
    from kvcache.prefix.config import PrefixConfig
    from kvcache.server.replicas import ReplicaSpec, Topology, start, stop

    systems = english_slices(args.model, sessions, SYSTEM_TOKENS)
    documents = english_slices(args.model, 2 * max(1, m), LONG_TOKENS, skip=44000) if m else []
    kv = parse_kv_spec(args.kv or "dynamic")
    weights = args.weights or "file"
    sched = SchedulerConfig(max_batch_tokens=256, max_running=max(8, sessions + len(documents)))
    cases: list[Case] = []
    with ExitStack() as stack:
        redis = args.redis or stack.enter_context(local_redis())
        if m and not redis:
            raise InvalidParams("--prefill-replicas needs Redis: install redis-server or give --redis URL")
        plan = [("prefix-aware", n, "prefix", None, 1, 0, []), ("round-robin", n, "round-robin", None, 1, 0, [])]
        if redis:
            plan.append(("round-robin + Redis tier", n, "round-robin", redis, 1, 0, []))
        plan.append(("single replica", 1, "prefix", None, n, 0, []))
        if m:
            plan += [("prefix-aware + Redis, long documents", n, "prefix", redis, 1, 0, documents),
                     (f"+ {m} prefill replica(s), long documents", n, "prefix", redis, 1, m, documents)]
        port = _free_port()
        for name, count, policy, tier, threads, prefill, docs in plan:
            print(f"bench replicas: {name} ({count} x {threads} thread(s)"
                  + (f" + {prefill} prefill" if prefill else "") + ")...", file=sys.stderr, flush=True)
            spec = ReplicaSpec(model=args.model, kv=kv, weights=weights, threads=threads, model_name="default",
                               prefix=PrefixConfig(redis=tier), scheduler=sched)
            topo = Topology(replicas=count, prefill_replicas=prefill, policy=policy, replica_cpus=threads)
            if tier:
                _clear_redis(tier)
            url = start(spec, topo, port=port, ray_cpus=4 * (n + m))  # room for every case and its redeployment
            case = Case(name, f"{count} x {threads} thr" + (f" + {prefill} prefill" if prefill else ""))
            run_workload(url, systems, turns, new, case, docs)
            cases.append(case)
        stop()
    results = [c.summary() for c in cases]
    _print(results, sessions, turns, new, n)
    if args.json:
        meta = run_meta(sessions=sessions, turns=turns, new_tokens=new, replicas=n, prefill_replicas=m,
                        system_tokens=SYSTEM_TOKENS, long_tokens=LONG_TOKENS if m else None, weights=weights)
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


def _print(results: list[dict], sessions: int, turns: int, new: int, n: int) -> None:
    print(f"\nreplicas: {sessions} chat sessions at once, {turns} turns each, own system prompt of about "
          f"{SYSTEM_TOKENS} tokens, {new} new tokens per turn (EOS ignored); {n} replicas of 1 thread or one of {n}")
    print(f"{'case':<44} {'replicas':<18} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TTFT mean':>9} "
          f"{'doc TTFT':>9} {'doc hit':>8} {'TPOT ms':>8} {'tok/s':>6} {'errors':>6}")
    for r in results:
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        doc = "-" if r["doc_hit_rate"] is None else f"{r['doc_hit_rate']:.1%}"
        print(f"{r['case']:<44} {r['replicas']:<18} {hit:>8} {cell(r['ttft_p50_s'], '.2f'):>9} "
              f"{cell(r['ttft_p99_s'], '.2f'):>9} {cell(r['ttft_mean_s'], '.2f'):>9} "
              f"{cell(r['long_ttft_p50_s'], '.2f'):>9} {doc:>8} {cell(r['tpot_p50_ms'], '.0f'):>8} {cell(r['tok_s']):>6} "
              f"{r['errors']:>6}")


def _clear_redis(url: str) -> None:
    from kvcache.prefix.tier_redis import RedisTier

    tier = RedisTier(url)
    tier.clear()
    tier.close()


def _free_port() -> int:
    from kvcache.peers.process import free_port

    return free_port()
