"""Per-API-key rate limits: token buckets for requests/minute and tokens/minute.

A request spends one request at the edge (`RateLimiter.admit`). Its tokens are reserved when it is admitted,
before any engine starts (`TokenReservation.reserve`: prompt + what its answer may take), and settled to the
tokens it really used when it ends (`TokenReservation.settle`: the unused part goes back). Parallel requests
therefore cannot spend more than the bucket holds, and once they have ended a key waits at most as long as
their real usage takes to refill. Over a limit: 429 with the seconds to wait. Behind Ray Serve the replicas
lease from one shared bank (`RateLimiter.share`, deploy/limits.py), so the limits hold for the deployment."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Protocol

from gateway.config import APIKeyConfig
from gateway.errors import APIError

ANONYMOUS = "anonymous"  # the one identity when auth is off: limits then apply to all traffic together


class TokenBucket:
    """`per_minute` units refilled continuously, holding at most one minute's worth."""

    def __init__(self, per_minute: int, clock: Callable[[], float]):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.clock = clock
        self.updated = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` can be spent (0 when it can be spent now). More than the bucket holds is
        spendable from a full bucket (it then goes into debt): a large request waits, it is never refused."""
        self._refill()
        need = min(amount, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, amount: float) -> None:
        """Spend `amount` (a negative amount gives back, never above the capacity)."""
        self._refill()
        self.level = min(self.capacity, self.level - amount)


class LocalBudget:
    """One key's bucket held in this process (one gateway, or each replica counting alone)."""

    def __init__(self, per_minute: int, clock: Callable[[], float], lock: threading.Lock):
        self.bucket = TokenBucket(per_minute, clock)
        self.capacity = per_minute
        self._lock = lock

    async def spend(self, amount: float) -> float:
        """Spend `amount`, or return the seconds until it could be spent (nothing spent then)."""
        with self._lock:
            wait = self.bucket.wait_for(amount)
            if wait == 0:
                self.bucket.take(amount)
            return wait

    def give(self, amount: float) -> None:
        """Give `amount` back (negative: take it, into debt), never above the capacity."""
        with self._lock:
            self.bucket.take(-amount)


class BudgetSource(Protocol):
    """Where the replicas of one deployment draw their keys' budgets from (deploy/limits.py: a Ray actor)."""

    async def lease(self, key: str, kind: str, per_minute: int, amount: float) -> float: ...

    async def give_back(self, key: str, kind: str, per_minute: int, amount: float) -> None: ...


class BudgetBank:
    """The true buckets behind a BudgetSource: `lease` spends from (key, kind)'s bucket as a local one would
    (the seconds to wait, nothing spent, when it cannot), `give_back` returns units (or takes a debt)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def _bucket(self, key: str, kind: str, per_minute: int) -> TokenBucket:
        bucket = self._buckets.get((key, kind))
        if bucket is None or bucket.capacity != per_minute:  # a new key, or its limit changed with the config
            bucket = self._buckets[(key, kind)] = TokenBucket(per_minute, self.clock)
        return bucket

    def lease(self, key: str, kind: str, per_minute: int, amount: float) -> float:
        bucket = self._bucket(key, kind, per_minute)
        wait = bucket.wait_for(amount)
        if wait == 0:
            bucket.take(amount)
        return wait

    def give_back(self, key: str, kind: str, per_minute: int, amount: float) -> None:
        self._bucket(key, kind, per_minute).take(-amount)


# A replica leases this fraction of a key's per-minute budget at a time: one round trip to the bank per lease,
# and at most this much of it idles in a replica that stops using it (until LEASE_IDLE_S returns it).
LEASE_FRACTION = 0.02
LEASE_IDLE_S = 1.0


class LeasedBudget:
    """One key's budget drawn from a shared BudgetSource in leases: spending what this process holds costs no
    round trip; a spend past it leases that much more plus one lease ahead (or, refused, exactly what is
    missing). Everything spent was leased, so N replicas together never spend more than the one bucket
    allows; what a replica holds unused goes back after LEASE_IDLE_S (`flush`)."""

    def __init__(self, source: BudgetSource, key: str, kind: str, per_minute: int, clock: Callable[[], float]):
        self.source, self.key, self.kind, self.capacity = source, key, kind, per_minute
        self.clock = clock
        self.held = 0.0  # leased and not spent; negative: a settled overrun not yet taken from the bank
        self.chunk = max(1.0, per_minute * LEASE_FRACTION)
        self.used = clock()
        self._leasing: asyncio.Lock | None = None  # made in the loop that first leases

    async def spend(self, amount: float) -> float:
        self.used = self.clock()
        if self.held >= amount:
            self.held -= amount
            return 0.0
        if self._leasing is None:
            self._leasing = asyncio.Lock()
        async with self._leasing:  # one lease in flight: concurrent requests wait for it, not each lease ahead
            if self.held >= amount:
                self.held -= amount
                return 0.0
            missing = amount - self.held
            if await self.source.lease(self.key, self.kind, self.capacity, missing + self.chunk) == 0:
                self.held += missing + self.chunk - amount
                return 0.0
            missing = amount - self.held
            wait = await self.source.lease(self.key, self.kind, self.capacity, missing)
            if wait == 0:
                self.held += missing - amount
            return wait

    def give(self, amount: float) -> None:
        self.held += amount

    async def flush(self) -> None:
        """Return what has idled past LEASE_IDLE_S, and take a settled overrun from the bank."""
        if self.held < 0 or (self.held > 0 and self.clock() - self.used >= LEASE_IDLE_S):
            amount, self.held = self.held, 0.0
            await self.source.give_back(self.key, self.kind, self.capacity, amount)


Budget = LocalBudget | LeasedBudget


def _refusal(budget: Budget, wait: float, unit: str) -> APIError:
    return APIError(429, f"Rate limit reached: {int(budget.capacity)} {unit} per minute for this API key; retry in "
                    f"{wait:.1f} s", code="rate_limit_exceeded", retry_after=wait)


class TokenReservation:
    """One request's hold on its key's tokens/minute budget: `reserve` when it is admitted (429 when the budget
    cannot hold it now), `settle` with the real usage when it ends: the unused part goes back (or the rest is
    taken); settling twice changes nothing."""

    def __init__(self, budget: Budget):
        self._budget = budget
        self.tokens = 0  # held now
        self.settled = False

    async def reserve(self, tokens: int) -> None:
        wait = await self._budget.spend(tokens)
        if wait > 0:
            raise _refusal(self._budget, wait, "tokens")
        self.tokens = tokens

    def settle(self, used: int) -> None:
        if not self.settled:
            self.settled = True
            self._budget.give(self.tokens - used)


class RateLimiter:
    """The limits of every key: counted in this process, or, once `share`d, drawn from one BudgetSource that
    every replica of a deployment shares (so N replicas allow the configured limit, not N times it)."""

    def __init__(self, keys: list[APIKeyConfig], *, default_rpm: int | None = None, default_tpm: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._clock = clock
        self._requests: dict[str, Budget] = {}
        self._tokens: dict[str, Budget] = {}
        limits = {k.key: (k.requests_per_minute, k.tokens_per_minute) for k in keys}
        if not keys:
            limits[ANONYMOUS] = (default_rpm, default_tpm)
        for key, (rpm, tpm) in limits.items():
            if rpm:
                self._requests[key] = LocalBudget(rpm, clock, self._lock)
            if tpm:
                self._tokens[key] = LocalBudget(tpm, clock, self._lock)

    @property
    def active(self) -> bool:
        return bool(self._requests or self._tokens)

    def share(self, source: BudgetSource) -> None:
        """Draw every key's budgets from `source` from now on (before serving: what was counted locally is
        dropped)."""
        for kind, budgets in (("requests", self._requests), ("tokens", self._tokens)):
            for key, budget in budgets.items():
                budgets[key] = LeasedBudget(source, key, kind, budget.capacity, self._clock)

    async def flush(self) -> None:
        """Shared budgets: hand idle leases back (a replica calls this periodically)."""
        for budget in (*self._requests.values(), *self._tokens.values()):
            if isinstance(budget, LeasedBudget):
                await budget.flush()

    async def admit(self, key: str) -> None:
        """Spend one request of `key`'s budget or raise 429 with Retry-After."""
        budget = self._requests.get(key)
        if budget is not None:
            wait = await budget.spend(1)
            if wait > 0:
                raise _refusal(budget, wait, "requests")

    def reservation(self, key: str | None) -> TokenReservation | None:
        """A reservation for one request of `key` to fill once its size is known; None when the key's tokens
        are not limited."""
        budget = self._tokens.get(key) if key is not None else None
        return TokenReservation(budget) if budget is not None else None
