"""How many threads the C forward's calls take on a machine others share: the fastest of torch's thread count and
its halvings (2 -> 1 on two cores), by timing. A busy neighbour on one core makes a two-thread split wait on the
thread it preempts at every barrier (on two cores: 28 -> 77-214 ms a token, where one thread stays at 28), so
each kind of call (its rows, bucketed by powers of two) keeps a running time per count, takes the fastest, and
re-times the others now and then (every 32 calls, backing off to 256 while they keep losing). Splits are over
output columns and (sequence, head) pairs, so every count computes the same bits.

Only one thread's calls take several threads: the one that last called `claim` (the engine's step loop), or any
while none has. Every live thread that has run a multi-threaded OpenMP region keeps its own pool of workers, and
libgomp counts them all: once they outnumber the CPUs it cuts every pool's spin at a join to ~100 iterations, so
each linear of a step ends on a futex wake-up (on two cores, ~80M w8a8 decode at two threads: 325 -> 257 tok/s
once a second live thread had run one generate). A scoring thread or a start-up thread then takes one thread."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable

import torch

PROBE_EVERY, PROBE_MAX = 32, 256
_enabled = os.environ.get("TANDEM_ADAPTIVE_THREADS", "1") != "0"
_hint = 0  # the count the latest `pick` gave (0: none yet)
_owner: tuple[int, threading.Thread] | None = None  # the thread whose calls may take several threads


def claim() -> None:
    """The calling thread's kernel calls take several threads from now on (until it ends); every other thread's
    take one."""
    global _owner
    if _owner is None or _owner[0] != threading.get_ident():
        _owner = threading.get_ident(), threading.current_thread()


def owns() -> bool:
    """Whether the calling thread's kernel calls may take several threads: it claimed them, or no live thread
    has."""
    owner = _owner
    return owner is None or owner[0] == threading.get_ident() or not owner[1].is_alive()


def enable(on: bool) -> None:
    """Turn the timing on or off process-wide (off: every call takes torch's thread count). engines/core.py
    turns it off where the thread count was set explicitly, unless $TANDEM_ADAPTIVE_THREADS is "1": then an
    explicit count is the most a call takes (`forced`); "0" turns it off everywhere."""
    global _enabled
    _enabled = (bool(on) or forced()) and os.environ.get("TANDEM_ADAPTIVE_THREADS", "1") != "0"


def forced() -> bool:
    """$TANDEM_ADAPTIVE_THREADS=1: the timing stays on with an explicit thread count, as its maximum."""
    return os.environ.get("TANDEM_ADAPTIVE_THREADS") == "1"


def enabled() -> bool:
    return _enabled


def threads() -> int:
    """The count for a kernel call outside a governor (the head's GEMV, the PyTorch forward's C linears and
    attention): the latest pick, else torch's thread count."""
    if not owns():
        return 1
    n = torch.get_num_threads()
    return _hint if _enabled and 0 < _hint <= n else n


def ladder(n: int) -> list[int]:
    """The counts weighed for n threads: n, n // 2, ..., 1."""
    out = [n]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


class _Kind:
    __slots__ = ("secs", "calls", "every", "probing")

    def __init__(self) -> None:
        self.secs: dict[int, float] = {}  # running seconds per call, per thread count
        self.calls = 0
        self.every = PROBE_EVERY
        self.probing: int | None = None  # the count being re-timed, until its call is recorded


class ThreadGovernor:
    """`n = pick(key)`, run the call with n threads, `record(key, n, seconds)`; or `run(key, fn)`."""

    def __init__(self, alpha: float = 0.5, clock: Callable[[], float] = time.perf_counter,
                 max_threads: Callable[[], int] = torch.get_num_threads):
        self.alpha, self.clock, self.max_threads = alpha, clock, max_threads
        self._kinds: dict[tuple, _Kind] = {}

    def pick(self, key: Hashable) -> int:
        global _hint
        n = self._pick(key)
        if owns():  # (another thread's one says nothing of the step loop's calls)
            _hint = n
        return n

    def _pick(self, key: Hashable) -> int:
        if not owns():
            return 1
        n = self.max_threads()
        if n <= 1 or not _enabled:
            return n
        kind = self._kinds.setdefault((key, n), _Kind())
        counts = ladder(n)
        for c in counts:  # each count timed once first
            if c not in kind.secs:
                kind.probing = c
                return c
        best = min(counts, key=kind.secs.__getitem__)
        kind.calls += 1
        if kind.calls % kind.every:
            return best
        kind.probing = min((c for c in counts if c != best), key=kind.secs.__getitem__)
        return kind.probing

    def record(self, key: Hashable, n: int, seconds: float) -> None:
        kind = self._kinds.get((key, self.max_threads()))
        if kind is None or not owns():  # another thread's one-thread call says nothing of the step loop's
            return
        old = kind.secs.get(n)
        kind.secs[n] = seconds if old is None else old + self.alpha * (seconds - old)
        if kind.probing == n and len(kind.secs) == len(ladder(self.max_threads())):
            won = kind.secs[n] <= min(kind.secs.values())
            kind.every = PROBE_EVERY if won else min(PROBE_MAX, kind.every * 2)
        kind.probing = None

    def run(self, key: Hashable, fn: Callable[[int], object]) -> object:
        """fn(threads) with the count `pick` gives, timed into `record`."""
        n = self.pick(key)
        t = self.clock()
        out = fn(n)
        self.record(key, n, self.clock() - t)
        return out

    def current(self) -> dict:
        """{(key, max threads): {threads: seconds}} as timed so far (for benchmarks and logs)."""
        return {k: dict(v.secs) for k, v in self._kinds.items()}


def rows_key(kind: str, rows: int) -> tuple[str, int]:
    """A call's key: its kind and its row count bucketed by powers of two."""
    return kind, int(rows).bit_length()
