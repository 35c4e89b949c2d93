"""Per-API-key rate limits: token buckets for requests/minute and tokens/minute.

A request spends one request at the edge (`RateLimiter.admit`). Its tokens are reserved when it is admitted,
before any engine starts (`TokenReservation.reserve`: prompt + what its answer may take), and settled to the
tokens it really used when it ends (`TokenReservation.settle`: the unused part goes back). Parallel requests
therefore cannot spend more than the bucket holds, and once they have ended a key waits at most as long as
their real usage takes to refill. Over a limit: 429 with the seconds to wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

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


def _spend(lock: threading.Lock, bucket: TokenBucket, amount: int, unit: str) -> None:
    """Take `amount` from `bucket`, or raise 429 with the seconds until it can be taken."""
    with lock:
        wait = bucket.wait_for(amount)
        if wait > 0:
            raise APIError(429, f"Rate limit reached: {int(bucket.capacity)} {unit} per minute for this API key; "
                           f"retry in {wait:.1f} s", code="rate_limit_exceeded", retry_after=wait)
        bucket.take(amount)


class TokenReservation:
    """One request's hold on its key's tokens/minute bucket: `reserve` when it is admitted (429 when the bucket
    cannot hold it now), `settle` with the real usage when it ends: the unused part goes back (or the rest is
    taken); settling twice changes nothing."""

    def __init__(self, lock: threading.Lock, bucket: TokenBucket):
        self._lock, self._bucket = lock, bucket
        self.tokens = 0  # held now
        self.settled = False

    def reserve(self, tokens: int) -> None:
        _spend(self._lock, self._bucket, tokens, "tokens")
        self.tokens = tokens

    def settle(self, used: int) -> None:
        with self._lock:
            if not self.settled:
                self.settled = True
                self._bucket.take(used - self.tokens)


class RateLimiter:
    """The limits of every key; thread-safe because the benchmark and uvicorn workers may share it."""

    def __init__(self, keys: list[APIKeyConfig], *, default_rpm: int | None = None, default_tpm: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}
        limits = {k.key: (k.requests_per_minute, k.tokens_per_minute) for k in keys}
        if not keys:
            limits[ANONYMOUS] = (default_rpm, default_tpm)
        for key, (rpm, tpm) in limits.items():
            if rpm:
                self._requests[key] = TokenBucket(rpm, clock)
            if tpm:
                self._tokens[key] = TokenBucket(tpm, clock)

    @property
    def active(self) -> bool:
        return bool(self._requests or self._tokens)

    def admit(self, key: str) -> None:
        """Spend one request of `key`'s budget or raise 429 with Retry-After."""
        bucket = self._requests.get(key)
        if bucket is not None:
            _spend(self._lock, bucket, 1, "requests")

    def reservation(self, key: str | None) -> TokenReservation | None:
        """A reservation for one request of `key` to fill once its size is known; None when the key's tokens
        are not limited."""
        bucket = self._tokens.get(key) if key is not None else None
        return TokenReservation(self._lock, bucket) if bucket is not None else None
