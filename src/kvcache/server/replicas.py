"""kvcache engine replicas on Ray Serve, behind one OpenAI-compatible endpoint.

Three deployments in one Serve application:

- ``KVCacheEngine`` (``replicas`` of them): each loads the model and runs the very app of
  ``kvcache serve`` (server/app.py) in its process; requests arrive as ``HttpCall`` values and
  their responses stream back (server/asgi.py). Each publishes the short keys of the pages its
  radix index holds as Ray Serve routing statistics (server/routing.py), and answers with an
  ``x-kvcache-replica`` header naming itself.
- ``KVCachePrefill`` (``prefill_replicas``, optional): the same engine; for a long prompt it
  computes the prompt's pages into the shared Redis tier, from which the engine replica that
  generates restores them.
- ``KVCacheIngress``: Ray Serve's HTTP proxy hands it every request; it works out the route keys
  and forwards (server/ingress.py). Both engine deployments route with ``PrefixRouter``.

Every replica is configured with the same prefix tiers: with ``--redis``, a replica that misses in
RAM restores what another computed. API keys and the tier secret travel to the replicas as
deployment arguments, inside the Ray cluster.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from kvcache.cache.config import CacheConfig
from kvcache.engine.scheduler import SchedulerConfig
from kvcache.prefix.config import PrefixConfig
from kvcache.server.asgi import HttpCall, Message, run_call
from kvcache.server.intake import Limits
from kvcache.server.routing import RouteHint, index_summary, key_space

APP = "kvcache"
ENGINE, PREFILL, INGRESS = "KVCacheEngine", "KVCachePrefill", "KVCacheIngress"
REPLICA_HEADER = b"x-kvcache-replica"


@dataclass(frozen=True)
class ReplicaSpec:
    """What every engine replica loads and how it serves (the options of ``kvcache serve``)."""

    model: str | None = None
    kv: CacheConfig = field(default_factory=CacheConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    weights: str = "file"
    threads: int = 1
    model_name: str | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    metrics_public: bool = False
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True)
class Topology:
    """How many replicas of each kind, how they are routed and what each asks of Ray."""

    replicas: int = 2
    prefill_replicas: int = 0
    policy: str = "prefix"  # or round-robin
    queue_cost: int = 128  # tokens of held prefix one queued request outweighs
    replica_cpus: float = 1.0
    prefill_min_tokens: int = 512  # prompts at least this long go through a prefill replica
    stats_period_s: float = 1.0  # how often replicas publish their page summaries


class EngineReplica:
    """One engine: the model, its KV cache and prefix index, and the server app over them."""

    def __init__(self, spec: ReplicaSpec, role: str = "engine") -> None:
        from kvcache.engine.llm import LLM
        from kvcache.server.app import build_app
        from kvcache.server.auth import Auth

        self.role = role
        self.llm = LLM(spec.model, kv=spec.kv, threads=spec.threads, prefix=spec.prefix, weights=spec.weights)
        auth = Auth(spec.api_keys, spec.admin_keys, metrics_public=spec.metrics_public)
        self.app = build_app(self.llm, spec.model_name, scheduler=spec.scheduler, auth=auth, limits=spec.limits)
        self.state = self.app.state.kv
        try:
            self.name = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside a Serve replica (a plain actor, a test)
            self.name = f"{role}-{os.getpid()}"
        self.header = ((REPLICA_HEADER, self.name.encode()),)

    async def run_http(self, call: HttpCall, route: RouteHint | None = None) -> AsyncIterator[Message]:
        """The response to ``call``, streamed (``route`` is for the router only)."""
        async for msg in run_call(self.app, call, self.header):
            yield msg

    async def prefill(self, call: HttpCall, route: RouteHint | None = None) -> dict[str, Any]:
        """Run ``call`` (a one-token completion of the prompt's ids) and wait until its pages are in
        the tiers. Returns its status and the prompt tokens found cached here."""
        status, body = 0, b""
        async for msg in run_call(self.app, call):
            if msg[0] == "start":
                status = msg[1]  # type: ignore[misc]
            else:
                body += msg[1]  # type: ignore[operator]
        await asyncio.to_thread(self.llm.flush)
        return {"status": status, "replica": self.name, "body": body[:2000]}

    def describe(self) -> dict[str, Any]:
        prefix = self.llm.runner.prefix
        return {"replica": self.name, "role": self.role, "pid": os.getpid(), "model": self.state.model_name,
                "space": key_space(prefix) if prefix is not None else None}

    async def stats(self) -> dict[str, Any]:
        """This replica's prefix-cache counters (hit tokens, of which restored from a tier, ...)."""
        ps = await asyncio.to_thread(self.state.engine.call, self.llm.prefix_stats, 10)
        return {"replica": self.name, "role": self.role, "prefix": ps.as_dict() if ps is not None else None}

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve asks every ``stats_period_s``: the short keys of the pages held here."""
        prefix = self.llm.runner.prefix
        if prefix is None:
            return {"pages": b""}
        pages = await asyncio.to_thread(self.state.engine.call, lambda: index_summary(prefix), 10)
        return {"pages": pages}

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            state.engine.close()
            prefix = self.llm.runner.prefix
            if prefix is not None:
                prefix.close()


def build_application(spec: ReplicaSpec, topo: Topology, tokenizer_dir: str):
    """The Serve application: ingress, engine replicas and (optionally) prefill replicas."""
    from kvcache.server.ingress import Ingress
    from kvcache.server.router import PrefixRouter

    page_size = spec.kv.pages_of

    def engine(name: str, count: int, role: str):
        router = RequestRouterConfig(
            request_router_class=PrefixRouter,
            request_router_kwargs={"policy": topo.policy, "queue_cost": topo.queue_cost, "page_size": page_size},
            request_routing_stats_period_s=topo.stats_period_s, request_routing_stats_timeout_s=30.0)
        return serve.deployment(EngineReplica).options(
            name=name, num_replicas=count, max_ongoing_requests=max(8, 2 * spec.scheduler.max_running),
            ray_actor_options={"num_cpus": topo.replica_cpus}, request_router_config=router,
            health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=5.0,
        ).bind(spec, role)

    prefill = engine(PREFILL, topo.prefill_replicas, "prefill") if topo.prefill_replicas else None
    ingress = serve.deployment(Ingress).options(name=INGRESS, num_replicas=1, max_ongoing_requests=10000,
                                                ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine(ENGINE, topo.replicas, "engine"), prefill, tokenizer_dir, spec, topo.prefill_min_tokens)


def start(spec: ReplicaSpec, topo: Topology, host: str = "127.0.0.1", port: int = 8000,
          ray_address: str | None = None, quiet: bool = True, ray_cpus: int | None = None) -> str:
    """Start (or join) Ray, run the application and return its base URL (``http://host:port/v1``).
    Blocks until every replica is up. ``ray_cpus``: logical CPUs of a Ray started here."""
    import ray

    from kvcache.models.loading import resolve_model

    tok_dir = str(resolve_model(spec.model).path)  # converted once here, not in every replica
    if not ray.is_initialized():
        if ray_address:
            ray.init(address=ray_address, log_to_driver=not quiet)
        else:
            need = -(-(topo.replicas + topo.prefill_replicas) * topo.replica_cpus // 1)
            # logical CPUs: twice what the replicas reserve, so a redeployment's new replicas are
            # scheduled while the old ones drain
            cpus = ray_cpus or max(os.cpu_count() or 1, 2 * int(need))
            # Serve marks a proxy that is not ready within 5 s unhealthy and kills it, and on a busy
            # two-core machine a proxy's worker took longer to start (serve.start then failed with
            # ActorDiedError): the Ray started here (its processes inherit this) gives it 30 s
            os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=not quiet,
                     object_store_memory=256 << 20, configure_logging=not quiet)
    serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
    serve.run(build_application(spec, topo, tok_dir), name=APP, route_prefix="/")
    return f"http://{host}:{port}/v1"


def stop(shutdown_ray: bool = True, delete_only: bool = False) -> None:
    """Take the application down: all of Serve, or (``delete_only``, in a cluster others use) only
    this application; then leave Ray."""
    import ray

    if delete_only:
        serve.delete(APP)
    else:
        serve.shutdown()
    if shutdown_ray:
        ray.shutdown()
