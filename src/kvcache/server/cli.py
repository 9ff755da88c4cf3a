"""``kvcache serve``: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvcache.cliargs import add_model_args, add_prefix_args, load_llm, stop_asked, stops_deferred
from kvcache.errors import InvalidParams
from kvcache.server.replicas_cli import add_replica_args
from kvcache.server.response_store import add_store_args, store_limits

SERVE_BUDGET = "50%"  # a dynamic pool's budget when --kv-budget is not given: half the RAM
# --document-step-work's default: work a document may take of a step while other requests are about
DOCUMENT_STEP_WORK = 32


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible server (completions, chat, streaming, metrics)")
    add_model_args(s)
    add_prefix_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (repeatable: one tenant per key, each with its own "
                        "prefix-cache salt); also read from KVCACHE_API_KEY. A key here shows in `ps`: "
                        "prefer --api-key-file or the environment variable")
    s.add_argument("--api-key-file", action="append", default=[], metavar="FILE",
                   help="read API keys from FILE, one per line (# comments; keep it chmod 600)")
    s.add_argument("--admin-key-file", action="append", default=[], metavar="FILE",
                   help="admin keys, one per line (also KVCACHE_ADMIN_KEY): they may send 'priority', see every "
                        "tenant's cache statistics and run the integrity check")
    s.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without a key (by default it needs one when keys are set)")
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's name)")
    s.add_argument("--max-batch-tokens", type=int, default=256,
                   help="work per forward, in prompt tokens at depth 0: decodes first, then prompt chunks "
                        "(a token deep in a long prompt counts its attention too; default 256)")
    s.add_argument("--document-step-work", type=int, default=DOCUMENT_STEP_WORK, metavar="N",
                   help="the most work a document (a prompt of more than 8 x --max-batch-tokens tokens) takes "
                        "of a step while other requests are in flight or came in the last 5 s, in tokens at depth "
                        "0: steps that carry a long document stay short, so a request that arrives meanwhile "
                        "waits less, and the document goes slower; alone, a document takes whole steps "
                        "(default 32; 0: never capped)")
    s.add_argument("--max-running", type=int, default=32, help="requests served at once (default 32)")
    s.add_argument("--prompt-lookup", type=int, default=0, metavar="K",
                   help="speculative decoding for every request that allows it: up to K tokens proposed per "
                        "forward from n-grams of its prompt and output, verified in one forward (greedy text "
                        "unchanged); off while 8 or more requests decode at once (default 0: off; a request's "
                        "'prediction' speculates either way)")
    s.add_argument("--policy", choices=("fifo", "priority"), default="fifo",
                   help="admission order (priority: the request's 'priority' field, higher first)")
    s.add_argument("--max-request-bytes", type=int, default=4 << 20, metavar="N",
                   help="largest request body (default 4 MiB); larger ones get 413")
    s.add_argument("--max-prompts", type=int, default=64, metavar="N",
                   help="prompts in one /v1/completions request (default 64)")
    s.add_argument("--max-choices", type=int, default=128, metavar="N",
                   help="n x prompts in one request (default 128)")
    s.add_argument("--unknown-fields", choices=("warn", "reject"), default="warn",
                   help="request fields kvcache does not know: warn (accept; the log and the "
                        "X-KVCache-Ignored-Fields reply header name them; the default, as vLLM) or reject "
                        "(400 'Unrecognized request argument', as OpenAI's API)")
    s.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="drop a request whose body stalls this many seconds (default 30)")
    s.add_argument("--head-timeout", type=float, default=10.0, metavar="S",
                   help="close a connection whose request line and headers take longer than this (default 10)")
    s.add_argument("--stall-after", type=float, default=30.0, metavar="S",
                   help="/health answers 503 'stalled' when the engine has had work for this many seconds "
                        "without finishing a step (default 30)")
    s.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    add_store_args(s)  # --responses-max-count, --responses-max-bytes, --responses-max-age
    add_replica_args(s)
    s.set_defaults(func=cmd_serve)


def document_work(n: int) -> int | None:
    """serve --document-step-work as SchedulerConfig takes it: 0 is None (never capped)."""
    if n < 0:
        raise InvalidParams(f"--document-step-work must be 0 (never capped) or more, got {n}")
    return n or None


def cmd_serve(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise InvalidParams(f"--port must be between 1 and 65535, got {args.port}")
    if not args.head_timeout > 0:
        raise InvalidParams(f"--head-timeout must be positive, got {args.head_timeout}")
    from kvcache.models.bundled import check_named

    check_named(args.model)  # a mistyped --model waits for no import
    with stops_deferred():  # torch, pydantic's core and uvicorn imported whole; a stop acts after them
        from kvcache.engine.scheduler import SchedulerConfig
        from kvcache.server.intake import Limits
        import uvicorn

        from kvcache.server.app import build_app

    sched = SchedulerConfig(max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                            policy=args.policy, prompt_lookup=args.prompt_lookup,
                            document_work=document_work(args.document_step_work))  # refused before the model loads
    limits = Limits(max_request_bytes=args.max_request_bytes, max_prompts=args.max_prompts,
                    max_choices=args.max_choices, unknown_fields=args.unknown_fields,
                    body_timeout_s=args.body_timeout, stall_after_s=args.stall_after)
    kept = store_limits(args)  # the stored responses' bounds, refused before the model loads
    from kvcache.server.auth import Auth, gather_keys

    # keys are checked before the model loads: an empty one is refused, never an open door
    keys = gather_keys(args.api_key, args.api_key_file, "KVCACHE_API_KEY")
    admins = gather_keys([], args.admin_key_file, "KVCACHE_ADMIN_KEY")
    auth = Auth(keys, admins, metrics_public=args.metrics_public)
    if args.replicas or args.prefill_replicas or args.ray_address:
        from kvcache.server.replicas_cli import serve_replicas

        return serve_replicas(args, sched, limits, keys, admins, SERVE_BUDGET)
    from kvcache.fmt import human_bytes

    # SIGINT or SIGTERM before serving (main() made both raise from its first line) stops with
    # nothing served or written: exit 0; once serving, both are a graceful shutdown (_signals_recorded)
    llm = None
    try:
        if stop_asked():
            raise KeyboardInterrupt
        llm = load_llm(args, SERVE_BUDGET)
        app = build_app(llm, args.served_model_name, scheduler=sched, auth=auth, limits=limits)
        app.state.responses.set_limits(kept)
        name = app.state.kv.model_name
        who = f" · {len(keys)} API key(s), {len(admins)} admin" if not auth.open else " · open (no API keys)"
        budget = llm.cache_config.budget
        kv = f"kv={llm.cache_config.spec()}" + (f" (budget {human_bytes(budget)})" if budget else "")
        print(f"kvcache serve · model {name!r} · {kv} · http://{args.host}:{args.port}/v1" + who,
              file=sys.stderr, flush=True)
        from kvcache.server.guard import GuardedH11

        GuardedH11.head_timeout_s = args.head_timeout
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                               http=GuardedH11))
        if stop_asked():  # asked on the way, and swallowed by what was running then
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        if llm is not None:
            llm.close()
        print("kvcache serve: stopped before serving; nothing was served or written", file=sys.stderr)
        return 0
    with _signals_recorded(server):
        try:
            server.run()  # returns after a graceful shutdown; the app's lifespan stops the engine
        finally:
            llm.close()  # every queued tier write done (or dropped whole) before the interpreter exits
    return 0


@contextmanager
def _signals_recorded(server: Any) -> Iterator[None]:
    """SIGINT and SIGTERM only noted while uvicorn runs. uvicorn handles both (a graceful
    shutdown), then restores the handlers it found and raises each signal again: with Python's
    defaults that is a KeyboardInterrupt (SIGINT) or the process killed where it stands
    (SIGTERM), before the prefix cache's tiers could drain. With these, the stop goes on to
    ``LLM.close`` and exits 0. A signal that comes before uvicorn has put in its own handlers asks
    the server to exit as soon as it runs (``should_exit``): none is lost in between."""
    handled = (signal.SIGINT, signal.SIGTERM)

    def note(_signum: int, _frame: object) -> None:
        server.should_exit = True

    before = {sig: signal.signal(sig, note) for sig in handled}
    if stop_asked():  # one that came just before these handlers
        server.should_exit = True
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
