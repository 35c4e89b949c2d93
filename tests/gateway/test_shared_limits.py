"""Per-key limits shared by the replicas of a deployment (issue 33, item 6): replicas lease from one BudgetBank,
so together they never admit more than the configured limit, idle leases go back, and token reservations
settle against the same bank. In-process here (a bank behind an async hop, as the Ray actor is); the Ray
deployment's burst test is in tests/deploy/test_ray_serve.py."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.config import AuthConfig
from gateway.errors import APIError
from gateway.limits import LEASE_IDLE_S, BudgetBank, RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class AsyncBank:
    """The bank behind an awaited hop that yields a random number of times (requests interleave)."""

    def __init__(self, bank: BudgetBank, rng: random.Random):
        self.bank, self.rng, self.calls = bank, rng, 0

    async def _hop(self) -> None:
        self.calls += 1
        for _ in range(self.rng.randrange(3)):
            await asyncio.sleep(0)

    async def lease(self, key, kind, per_minute, amount):
        await self._hop()
        return self.bank.lease(key, kind, per_minute, amount)

    async def give_back(self, key, kind, per_minute, amount):
        await self._hop()
        self.bank.give_back(key, kind, per_minute, amount)


def _replicas(n: int, clock: Clock, seed: int = 0, **auth) -> tuple[list[RateLimiter], AsyncBank]:
    source = AsyncBank(BudgetBank(clock), random.Random(seed))
    cfg = AuthConfig(**auth)
    limiters = []
    for _ in range(n):
        limiter = RateLimiter(cfg.keys(), default_rpm=cfg.requests_per_minute, default_tpm=cfg.tokens_per_minute,
                              clock=clock)
        limiter.share(source)
        limiters.append(limiter)
    return limiters, source


async def _admitted(limiter: RateLimiter, key: str) -> bool:
    try:
        await limiter.admit(key)
        return True
    except APIError as exc:
        assert exc.status == 429 and exc.retry_after > 0
        return False


@pytest.mark.parametrize("replicas, seed", [(2, 0), (2, 1), (3, 2), (4, 3)])
async def test_a_burst_across_replicas_admits_no_more_than_the_limit(replicas, seed):
    clock = Clock()
    limiters, _ = _replicas(replicas, clock, seed, api_keys=["k"], requests_per_minute=100)
    rng = random.Random(seed)
    burst = [limiters[rng.randrange(replicas)] for _ in range(400)]
    results = await asyncio.gather(*(_admitted(limiter, "k") for limiter in burst))
    assert sum(results) == 100  # the whole minute's budget, exactly: every spend was leased from one bucket


async def test_counted_per_replica_the_same_burst_multiplies_the_limit():
    """What sharing fixes: unshared, each replica counts alone and N replicas admit N times the limit."""
    cfg = AuthConfig(api_keys=["k"], requests_per_minute=100)
    limiters = [RateLimiter(cfg.keys(), clock=Clock()) for _ in range(2)]
    results = await asyncio.gather(*(_admitted(limiters[i % 2], "k") for i in range(400)))
    assert sum(results) == 200


async def test_leases_save_round_trips_and_idle_ones_go_back():
    clock = Clock()
    (a, b), source = _replicas(2, clock, api_keys=["k"], requests_per_minute=1000)
    for _ in range(50):
        await a.admit("k")
    assert source.calls <= 50 // 20 + 1  # a lease is 2% of the minute: 20 requests a round trip
    spent_by_b = 0
    while await _admitted(b, "k"):
        spent_by_b += 1
    assert spent_by_b < 950  # a holds the rest of its lease: b cannot have it ...
    clock.now += LEASE_IDLE_S
    await a.flush()  # ... until a has idled and handed it back (no refill: the clock moved 1 s = 16 requests)
    extra = 0
    while await _admitted(b, "k"):
        extra += 1
    assert 50 + spent_by_b + extra == 1000 + int(1000 / 60 * LEASE_IDLE_S)


async def test_token_reservations_settle_against_the_shared_bank():
    clock = Clock()
    (a, b), _ = _replicas(2, clock, api_keys=["k"], tokens_per_minute=600)
    first = a.reservation("k")
    await first.reserve(500)  # prompt + max_tokens
    with pytest.raises(APIError) as info:
        await b.reservation("k").reserve(200)
    assert info.value.status == 429 and "600 tokens per minute" in info.value.message
    first.settle(120)  # the answer used far less: 380 go back to a, and to the bank once a flushes
    clock.now += LEASE_IDLE_S
    await a.flush()
    await b.reservation("k").reserve(200)
    overrun = b.reservation("k")
    await overrun.reserve(10)
    overrun.settle(400)  # used more than reserved: the debt is taken from the bank at the next flush
    await b.flush()
    with pytest.raises(APIError):
        await a.reservation("k").reserve(100)
