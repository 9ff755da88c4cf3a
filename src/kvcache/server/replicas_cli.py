"""``kvcache serve --replicas N``: engine replicas on Ray Serve behind one endpoint.

Only argparse at import time; Ray is imported when replicas are asked for. Ray starts in this
process (a local cluster of this machine) unless ``--ray-address`` names one to join.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from kvcache.errors import InvalidParams

ROUTERS = ("prefix", "round-robin")


def add_replica_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("replicas (Ray Serve; needs the kvcache[ray] extra)")
    g.add_argument("--replicas", type=int, default=0, metavar="N",
                   help="run N engine replicas on Ray Serve behind this one endpoint, each request routed to the "
                        "replica holding the longest prefix of it (default 0: one process, no Ray)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (host:port of its head, or 'auto') instead of starting Ray here")
    g.add_argument("--prefill-replicas", type=int, default=0, metavar="M",
                   help="M more replicas that compute long prompts' pages into the Redis tier (needs --redis); "
                        "the engine replica that generates restores them")
    g.add_argument("--prefill-min-tokens", type=int, default=512, metavar="N",
                   help="prompts of at least N tokens go through a prefill replica (default 512)")
    g.add_argument("--router", choices=ROUTERS, default="prefix",
                   help="prefix: longest held prefix weighed against queues, else the less loaded of two random "
                        "replicas (default); round-robin: each replica in turn")
    g.add_argument("--replica-cpus", type=float, default=1.0, metavar="C",
                   help="CPUs Ray reserves for each engine replica; also its torch threads unless --threads "
                        "(default 1)")


def check_replica_args(args: argparse.Namespace) -> None:
    """Refuse impossible replica options before anything starts."""
    n, m = args.replicas, args.prefill_replicas
    if n < 0 or m < 0:
        raise InvalidParams(f"--replicas and --prefill-replicas must be 0 or more, got {n} and {m}")
    if not n and (m or args.ray_address):
        raise InvalidParams("--prefill-replicas and --ray-address need --replicas N (N >= 1)")
    if m and not args.redis:
        raise InvalidParams("--prefill-replicas needs --redis: prefill replicas hand their pages over through the "
                            "shared Redis tier")
    if m and args.no_prefix_cache:
        raise InvalidParams("--prefill-replicas needs the prefix cache (drop --no-prefix-cache)")
    if args.replica_cpus <= 0:
        raise InvalidParams(f"--replica-cpus must be positive, got {args.replica_cpus:g}")
    if args.prefill_min_tokens < 2:
        raise InvalidParams(f"--prefill-min-tokens must be at least 2, got {args.prefill_min_tokens}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve_replicas(args: argparse.Namespace, scheduler, limits, keys: list[str], admins: list[str],
                   default_budget: str) -> int:
    """Run the replicas until interrupted. ``default_budget``: one process's KV budget, shared out
    among the replicas of a local cluster."""
    check_replica_args(args)
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise InvalidParams("--replicas needs Ray Serve: pip install 'kvcache[ray]'") from None
    from kvcache.cliargs import kv_config, prefix_config
    from kvcache.server.replicas import ReplicaSpec, Topology, start, stop

    n, m = args.replicas, args.prefill_replicas
    local = args.ray_address is None
    budget = default_budget
    if local and default_budget.endswith("%"):
        budget = f"{max(1.0, float(default_budget[:-1]) / (n + m)):g}%"
    spec = ReplicaSpec(model=args.model, kv=kv_config(args, budget), prefix=prefix_config(args), weights=args.weights,
                       threads=args.threads or max(1, int(args.replica_cpus)), model_name=args.served_model_name,
                       api_keys=tuple(keys), admin_keys=tuple(admins), metrics_public=args.metrics_public,
                       scheduler=scheduler, limits=limits)
    topo = Topology(replicas=n, prefill_replicas=m, policy=args.router, replica_cpus=args.replica_cpus,
                    prefill_min_tokens=args.prefill_min_tokens)
    url = start(spec, topo, args.host, args.port, args.ray_address, quiet=args.log_level not in ("info", "debug"))
    where = f"Ray at {args.ray_address}" if not local else "a local Ray"
    tier = " · shared Redis tier" if args.redis else " · no shared tier (--redis)"
    print(f"kvcache serve · {n} engine replica(s)" + (f" + {m} prefill" if m else "") + f" on {where} · "
          f"router {args.router}{tier} · {url}", file=sys.stderr, flush=True)
    # SIGTERM (a service manager, `kill`) takes the same way out as Ctrl-C: without this the
    # process would die at once and leave the local Ray's agents running
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the shutdown short
        stop(shutdown_ray=True, delete_only=not local)
    return 0
