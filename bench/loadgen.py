"""Open-loop load for the gateway benchmarks: Poisson arrivals at a rate, each request sent at its scheduled time
on a keep-alive connection to 127.0.0.1, latency from that time to the response's last byte. The sending and
reading is bench/loadgen.c (built at first use, called through ctypes with the GIL released), so the client
costs the 2-core machine a few microseconds a request instead of the ~0.15 ms of CPU an asyncio client took,
which on this machine was as much as the server it measured and came out of the same cores.
"""

from __future__ import annotations

import ctypes
import random
from pathlib import Path

import numpy as np

from kernels.cbuild import build_library

_SRC = Path(__file__).with_name("loadgen.c")
_lib: ctypes.CDLL | None = None
OK, TIMEOUT, CLOSED, BAD = 0, 1, 2, 3
STATUS_NAMES = {TIMEOUT: "timeout", CLOSED: "closed", BAD: "bad response"}
MAX_CONNECTIONS = 4096


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        so = build_library(_SRC.read_text(), "tandem_loadgen", ["-O2", "-shared", "-fPIC"],
                           Path.home() / ".cache" / "tandem" / "bench", libs=())
        lib = ctypes.CDLL(str(so))
        lib.lg_run.restype = ctypes.c_int64
        lib.lg_run.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_double, ctypes.c_char_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_int64]
        lib.lg_content_length.restype = ctypes.c_int64
        lib.lg_content_length.argtypes = [ctypes.c_char_p, ctypes.c_int64]
        _lib = lib
    return _lib


def content_length(head: bytes, n: int | None = None) -> int:
    """bench/loadgen.c's reading of a lower-cased response head's content-length from its first `n` bytes (all of
    them by default); -1 where there is none or it is not a number."""
    return int(_load().lg_content_length(head, len(head) if n is None else n))


def arrivals(rate: float, duration: float, seed: int) -> np.ndarray:
    """Poisson arrival times in [0, duration) seconds, the same for the same (rate, duration, seed)."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return np.asarray(out, dtype=np.float64)
        out.append(t)


def open_loop(port: int, payload: bytes, marker: bytes, rate: float, duration: float, seed: int = 0,
              timeout_s: float = 2.0) -> dict:
    """Drive 127.0.0.1:`port` with `payload` at `rate` req/s for `duration` s; a response is good when it is a
    200 holding `marker`. Returns the requests, the good ones' latencies (s), the errors by kind and the
    send lag's p99 (how late the client sent, ms)."""
    at = arrivals(rate, duration, seed)
    n = len(at)
    latency, lag = np.zeros(n), np.zeros(n)
    status = np.full(n, -1, dtype=np.int32)
    conns = _load().lg_run(port, payload, len(payload), at.ctypes.data, n, timeout_s, marker, len(marker),
                           latency.ctypes.data, lag.ctypes.data, status.ctypes.data, MAX_CONNECTIONS)
    if conns < 0:
        raise OSError("bench/loadgen.c could not set up epoll / timerfd")
    errors = {name: int((status == code).sum()) for code, name in STATUS_NAMES.items()}
    return {"requests": n, "latencies_s": latency[status == OK].tolist(), "errors": sum(errors.values()),
            "error_kinds": {k: v for k, v in errors.items() if v}, "connections": int(conns),
            "dispatch_lag_p99_ms": float(np.percentile(lag * 1000, 99)) if n else 0.0}
