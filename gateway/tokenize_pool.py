"""The gateway's own bounded pool for rendering chat templates and tokenising long texts: a few threads of
its kind, shared with nothing else (not asyncio's default executor, which start-up and shutdown use), with the
age of its oldest task for /health (`stalled`)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class TokenizePool:
    def __init__(self, threads: int = 2):
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._running: dict[int, float] = {}  # task id -> monotonic start

    def resize(self, threads: int) -> None:
        """Use `threads` threads from now on ([preparation] tokenize_threads)."""
        with self._lock:
            if threads != self.threads:
                old, self._pool, self.threads = self._pool, None, threads
                if old is not None:
                    old.shutdown(wait=False)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the pool, awaited."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tokenize")
            pool = self._pool
        key = object()

        def timed() -> T:
            self._running[id(key)] = time.monotonic()
            try:
                return fn(*args)
            finally:
                self._running.pop(id(key), None)
        return await asyncio.wrap_future(pool.submit(timed))

    def stalled(self, after_s: float) -> str | None:
        """Why the pool is stuck (a task older than `after_s`), or None."""
        oldest = min(self._running.values(), default=None)
        if oldest is not None and time.monotonic() - oldest > after_s:
            return f"a tokenisation task has run for {time.monotonic() - oldest:.0f} s"
        return None


POOL = TokenizePool()
