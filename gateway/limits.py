"""Per-API-key rate limits: token buckets for requests/minute and tokens/minute.

A request is admitted when the key has a request to spend and its token bucket is not in debt; the tokens a
request really used (prompt + completion, from `usage`) are charged when it finishes, so the bucket may go
into debt and the next request waits until it refills. Over a limit: 429 with the seconds to wait.
"""

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
        """Seconds until `amount` can be spent (0 when it can be spent now)."""
        self._refill()
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount


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
        with self._lock:
            tokens = self._tokens.get(key)
            # Only a bucket in debt blocks: a token can be spent while the level is above zero.
            wait_tokens = tokens.wait_for(1e-9) if tokens else 0.0
            requests = self._requests.get(key)
            wait_requests = requests.wait_for(1.0) if requests else 0.0
            if wait_requests > 0 or wait_tokens > 0:
                which = "requests" if wait_requests >= wait_tokens else "tokens"
                limit = (requests if which == "requests" else tokens).capacity
                raise APIError(429, f"Rate limit reached: {int(limit)} {which} per minute for this API key; "
                               f"retry in {max(wait_requests, wait_tokens):.1f} s",
                               code="rate_limit_exceeded", retry_after=max(wait_requests, wait_tokens))
            if requests:
                requests.take(1.0)

    def charge_tokens(self, key: str, amount: int) -> None:
        with self._lock:
            bucket = self._tokens.get(key)
            if bucket is not None:
                bucket.take(float(amount))
