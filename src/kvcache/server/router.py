"""PrefixRouter: a Ray Serve request router that sends each request where its prefix is hot.

Engine replicas publish, through Ray Serve's routing statistics (``record_routing_stats``, every
``request_routing_stats_period_s``), the packed short keys of the pages their radix index holds
(server/routing.py). A request's route keys come as the ``route`` keyword of the handle call
(a ``RouteHint``); requests without one (identity, statistics) are routed by load alone. Between
two summaries the router also remembers which keys it sent where (``recent``), so a burst of
requests sharing a prefix stays together before any of them has finished.

The ranking is ``routing.Policy``: the replica holding the longest prefix, less ``queue_cost``
tokens for every request queued there (Ray Serve's queue-length cache), else the less loaded of
two random replicas; ``policy="round-robin"`` turns prefixes off (the baseline). Ray Serve then
sends the request to the first replica of the ranking that accepts it (a full one passes it on).

Locking: none; Ray Serve calls the router on one event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from kvcache.server.routing import Candidate, Policy, RouteHint, held_pages, unpack

RECENT_KEYS = 1 << 16  # keys remembered per replica between summaries
RECENT_S = 30.0  # how long a key sent to a replica counts as held there without a summary saying so


class PrefixRouter(RequestRouter):
    def initialize_state(self, policy: str = "prefix", queue_cost: int = 128, page_size: int = 16,
                         **kwargs: Any) -> None:
        self.policy = Policy(policy, queue_cost)
        self.page_size = page_size
        self.summaries: dict[ReplicaID, tuple[bytes, frozenset[int]]] = {}
        self.recent: dict[ReplicaID, OrderedDict[int, float]] = {}
        self.routed = {"requests": 0, "by_prefix": 0}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        for r in replicas:
            blob = (r.routing_stats or {}).get("pages", b"")
            old = self.summaries.get(r.replica_id)
            if old is None or old[0] != blob:
                self.summaries[r.replica_id] = (blob, unpack(blob))
        live = {r.replica_id for r in replicas}
        for rid in [k for k in self.summaries if k not in live]:
            del self.summaries[rid]
            self.recent.pop(rid, None)
        super().update_replicas(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.summaries.pop(replica_id, None)
        self.recent.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: wait, do not spin
        hint = _hint(pending_request)
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        now = time.monotonic()
        cands = []
        for r in candidate_replicas:
            held = 0
            if hint.keys:
                summary = self.summaries.get(r.replica_id, (b"", frozenset()))[1]
                held = held_pages(hint.keys, summary, self._recent(r.replica_id, now))
            load = self.replica_queue_len_cache.get(r.replica_id) or 0
            cands.append(Candidate(r.replica_id.unique_id, held, load))
        ranked = self.policy.choose(cands, self.page_size)
        self.routed["requests"] += 1
        self.routed["by_prefix"] += bool(ranked and ranked[0].held)
        return [[by_name[c.name]] for c in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        hint = _hint(pending_request)
        if not hint.keys:
            return
        recent = self.recent.setdefault(replica_id, OrderedDict())
        now = time.monotonic()
        for k in hint.keys:
            recent[k] = now
            recent.move_to_end(k)
        while len(recent) > RECENT_KEYS:
            recent.popitem(last=False)

    def _recent(self, replica_id: ReplicaID, now: float) -> OrderedDict[int, float]:
        """Keys sent to the replica in the last RECENT_S seconds (older ones are dropped)."""
        recent = self.recent.setdefault(replica_id, OrderedDict())
        while recent and next(iter(recent.values())) < now - RECENT_S:
            recent.popitem(last=False)
        return recent


def _hint(pending_request: PendingRequest | None) -> RouteHint:
    if pending_request is None:
        return RouteHint()
    hint = pending_request.kwargs.get("route")
    return hint if isinstance(hint, RouteHint) else RouteHint()
