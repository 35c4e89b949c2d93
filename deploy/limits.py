"""Per-key limits that hold across the replicas of a deployment: one Ray actor holds the true buckets
(`gateway.limits.BudgetBank`), and each replica's RateLimiter leases from it through `RayBudgetSource` (a
round trip per lease of 2% of a key's minute, not per request; idle leases go back within a second)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from gateway.errors import APIError
from gateway.limits import LEASE_IDLE_S, BudgetBank, RateLimiter

log = logging.getLogger("tandem.deploy")

NAMESPACE = "tandem"


@ray.remote(num_cpus=0)
class BudgetBankActor:
    """The deployment's buckets, one per (key, requests | tokens); each call is a few microseconds."""

    def __init__(self) -> None:
        self.bank = BudgetBank()

    def lease(self, key: str, kind: str, per_minute: int, amount: float) -> float:
        return self.bank.lease(key, kind, per_minute, amount)

    def give_back(self, key: str, kind: str, per_minute: int, amount: float) -> None:
        self.bank.give_back(key, kind, per_minute, amount)


def bank_actor(name: str) -> Any:
    """The bank named `name`, created by the first replica that asks (detached: it outlives any one replica;
    `serve.delete` of the app leaves it, a few kilobytes, until the cluster stops)."""
    return BudgetBankActor.options(name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()


class RayBudgetSource:
    """A BudgetSource over the bank actor; a bank that cannot be reached is a 503 for the request (the limits
    are never silently dropped)."""

    def __init__(self, actor: Any):
        self.actor = actor

    async def lease(self, key: str, kind: str, per_minute: int, amount: float) -> float:
        try:
            return await self.actor.lease.remote(key, kind, per_minute, amount)
        except ray.exceptions.RayError as exc:
            log.error("rate-limit bank unreachable: %s", exc)
            raise APIError(503, "The shared rate limits cannot be checked right now; retry shortly",
                           code="rate_limits_unavailable", retry_after=1) from None

    async def give_back(self, key: str, kind: str, per_minute: int, amount: float) -> None:
        await self.actor.give_back.remote(key, kind, per_minute, amount)


async def flush_periodically(limiter: RateLimiter, period_s: float = LEASE_IDLE_S / 2) -> None:
    """Hand idle leases back (and settled overruns in) for as long as the replica runs."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await limiter.flush()
        except ray.exceptions.RayError as exc:  # the next flush retries what this one could not hand back
            log.warning("rate-limit bank unreachable while returning leases: %s", exc)
