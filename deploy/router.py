"""Which replica serves a request: prefix-cache affinity balanced against load, power of two choices when no
replica holds the prefix. `AffinityTable` remembers which replica was sent which leading blocks (chained
block hashes, `deploy/prefix.py`); `rank` is the pure policy; `TandemRequestRouter` is the Ray Serve
`RequestRouter` that feeds it the replicas' queue lengths and reported stats (`record_routing_stats`:
routes, KV usage, waiting requests, SLO headroom).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica


@dataclass(frozen=True)
class ReplicaLoad:
    """What the policy knows of one replica."""

    id: Any
    queue_len: float  # requests in flight on it (Ray's queue-length cache, else its own report)
    kv_usage: float = 0.0  # 0..1 of its KV pool
    slo_headroom: float = 0.0  # lowest (attainment - target) over its routes; < 0: an SLO is being missed
    routes: frozenset[str] | None = None  # the routes it serves; None: not reported yet

    def cost(self, settings: RoutingSettings) -> float:
        """Load as one number, in requests: in flight, plus the pool's use (`kv_weight` requests when full), plus
        a penalty when the pool is nearly full or an SLO is missed."""
        return (self.queue_len + settings.kv_weight * self.kv_usage
                + (4.0 if self.kv_usage >= settings.kv_high else 0.0) + (2.0 if self.slo_headroom < 0 else 0.0))


@dataclass
class RoutingSettings:
    affinity: bool = True  # False: power of two choices only (the baseline)
    # a prefix holder is skipped when its cost exceeds the least loaded replica's by more than
    # max_imbalance + imbalance_ratio * that replica's in-flight count: tight when idle, proportional under load
    max_imbalance: float = 3.0
    imbalance_ratio: float = 0.25
    kv_weight: float = 2.0  # a full pool weighs as this many requests in flight
    kv_high: float = 0.95  # a holder whose pool is this full is skipped (unless every replica's is)
    slo_gap: float = 0.05  # a holder missing its SLO is skipped when another's attainment is this much better
    table_blocks: int = 200_000  # remembered (route, block) entries, least recently routed evicted first


@dataclass
class AffinityTable:
    """(route, block hash) -> the replicas that were sent it, each with how many requests it was sent, in
    least-recently-routed order. The count names a prefix's home: a request sent elsewhere once (its home
    was busy) does not split the prefix between two replicas for good."""

    capacity: int = 200_000
    _blocks: OrderedDict[int, dict] = field(default_factory=OrderedDict)

    def record(self, hashes: Iterable[int], replica: Any) -> None:
        for h in hashes:
            holders = self._blocks.get(h)
            if holders is None:
                holders = self._blocks[h] = {}
            else:
                self._blocks.move_to_end(h)
            holders[replica] = holders.get(replica, 0) + 1
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def sent(self, block: int, replica: Any) -> int:
        """Requests with this block sent to `replica`."""
        return (self._blocks.get(block) or {}).get(replica, 0)

    def matched_blocks(self, hashes: Sequence[int], replicas: Iterable[Any]) -> dict[Any, int]:
        """How many leading blocks of `hashes` each replica was sent (the chain: a miss ends a replica's run)."""
        alive = set(replicas)
        out = dict.fromkeys(alive, 0)
        for i, h in enumerate(hashes):
            holders = self._blocks.get(h)
            alive &= holders.keys() if holders else set()
            if not alive:
                break
            for r in alive:
                out[r] = i + 1
        return out

    def forget(self, replica: Any) -> None:
        for holders in self._blocks.values():
            holders.pop(replica, None)

    def __len__(self) -> int:
        return len(self._blocks)


def rank(replicas: Sequence[ReplicaLoad], route: str | None, hashes: Sequence[int], table: AffinityTable,
         settings: RoutingSettings, rng: random.Random) -> tuple[list[list[Any]], str]:
    """Ranked replica ids (first rank first) and why. Route-aware: only replicas reporting the route (all when
    none has reported yet). The prefix holder wins unless it is busier than the least loaded replica by more
    than the imbalance bound, its pool nearly full or its SLO missed where another replica's is met; otherwise
    power of two choices by cost. A route no replica reports goes to any (tandem's 404)."""
    serving = [r for r in replicas if r.routes is None or route is None or route in r.routes]
    if not serving:  # an unknown model: any replica answers tandem's own 404
        serving = list(replicas)
    if not serving:
        return [], "no replica"
    cost = {r.id: r.cost(settings) for r in serving}
    if settings.affinity and hashes:
        matched = table.matched_blocks(hashes, (r.id for r in serving))
        best = max(matched.values(), default=0)
        if best > 0:
            least = min(serving, key=lambda r: cost[r.id])
            bound = cost[least.id] + settings.max_imbalance + settings.imbalance_ratio * least.queue_len
            deepest = hashes[best - 1]  # home first (most requests with the prefix), then the least loaded
            holders = sorted((r for r in serving if matched[r.id] == best),
                             key=lambda r: (-table.sent(deepest, r.id), cost[r.id]))
            kv_room = any(r.kv_usage < settings.kv_high for r in serving)
            best_headroom = max(r.slo_headroom for r in serving)
            for h in holders:  # a holder is skipped for pressure that another replica does not share
                if (cost[h.id] <= bound
                        and (h.kv_usage < settings.kv_high or not kv_room)
                        and (h.slo_headroom >= 0 or h.slo_headroom >= best_headroom - settings.slo_gap)):
                    rest = sorted((r for r in serving if r.id != h.id), key=lambda r: cost[r.id])
                    return [[h.id]] + [[r.id] for r in rest], f"prefix: {best} blocks"
    pair = rng.sample(list(serving), min(2, len(serving)))
    pair.sort(key=lambda r: cost[r.id])
    rest = sorted((r for r in serving if r not in pair), key=lambda r: cost[r.id])
    return [[r.id] for r in pair] + [[r.id] for r in rest], "power of two"


def request_key(pending: PendingRequest | None) -> tuple[str | None, list[int], bool]:
    """(route, block hashes, affinity allowed) from the ingress's routing header (the first argument)."""
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return None, [], True
    key = pending.args[0].get("routing") or {}
    return key.get("route"), list(key.get("hashes") or ()), bool(key.get("affinity", True))


class TandemRequestRouter(RequestRouter):
    """Ray Serve request router for tandem replicas (`request_router_config.request_router_class`). Its
    kwargs are `RoutingSettings`' fields. Counters `decisions` say how often each reason won."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.settings = RoutingSettings(**kwargs)
        self.table = AffinityTable(self.settings.table_blocks)
        self.rng = random.Random()
        self.decisions: dict[str, int] = {}

    def _load(self, r: RunningReplica) -> ReplicaLoad:
        stats = r.routing_stats or {}
        queue = self.replica_queue_len_cache.get(r.replica_id)
        routes = stats.get("routes")
        return ReplicaLoad(id=r.replica_id, queue_len=float(queue if queue is not None else stats.get("ongoing", 0)),
                           kv_usage=float(stats.get("kv_usage", 0.0)), slo_headroom=float(stats.get("slo_headroom", 0.0)),
                           routes=frozenset(routes) if routes is not None else None)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        route, hashes, affinity = request_key(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        settings = self.settings if affinity else RoutingSettings(**{**self.settings.__dict__, "affinity": False})
        ranks, why = rank([self._load(r) for r in candidate_replicas], route, hashes, self.table, settings, self.rng)
        self.decisions[why.split(":")[0]] = self.decisions.get(why.split(":")[0], 0) + 1
        if hashes and ranks and affinity and why == "power of two" and not self.table.sent(hashes[0], ranks[0][0]):
            # a new prefix is claimed at once, not only once routed: a burst sharing it follows its first
            # request (on_request_routed records where each request really went)
            if not any(self.table.sent(hashes[0], r.replica_id) for r in candidate_replicas):
                self.table.record(hashes[:1], ranks[0][0])
        return [[by_id[i] for i in group] for group in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        route, hashes, _ = request_key(pending_request)
        if hashes:
            self.table.record(hashes, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)
