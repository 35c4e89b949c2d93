"""One Ray Serve replica = one whole tandem: the Litestar gateway app with its engines and KV pool in this
process, called as an ASGI app in-process (no socket). `handle` streams one HTTP exchange as a `ResponseStart`
dict then body bytes; `record_routing_stats` and `record_autoscaling_stats` report tandem's own signals to
the request router and the autoscaling policy. The class is plain Python (`TandemReplica.create` builds one
outside Ray); `deploy/ray_serve.py` declares it as a deployment with its resources.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

log = logging.getLogger("tandem.deploy")

LOCK_DIR = "/tmp"
_NOTHING = object()  # call_asgi: no message held back


def pin_to_free_core(prefix: str = "tandem-ray-cpu") -> tuple[int, int] | None:
    """Pin this process to one core no other live replica holds (an flock per core, released when the process
    dies, so a restarted replica takes its predecessor's core). Returns (core, lock fd), or None when every
    core is taken (then the process stays unpinned)."""
    for core in sorted(os.sched_getaffinity(0)):
        fd = os.open(os.path.join(LOCK_DIR, f"{prefix}-{core}.lock"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.sched_setaffinity(0, {core})
        return core, fd
    return None


class Lifespan:
    """Runs an ASGI app's lifespan protocol in-process: `startup()` before the first request, `shutdown()`."""

    def __init__(self, app: Any):
        self.app = app
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def _receive(self) -> dict:
        return await self._inbox.get()

    async def _send(self, message: dict) -> None:
        await self._outbox.put(message)

    async def _expect(self, kind: str) -> None:
        message = await self._outbox.get()
        if message["type"] != kind:
            raise RuntimeError(f"ASGI lifespan: expected {kind}, got {message}")

    async def startup(self) -> None:
        self._task = asyncio.create_task(self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                                  self._receive, self._send))
        await self._inbox.put({"type": "lifespan.startup"})
        await self._expect("lifespan.startup.complete")

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._expect("lifespan.shutdown.complete")
        await self._task


def http_scope(method: str, path: str, headers: list[tuple[str, str]], query: str = "") -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method.upper(), "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": query.encode(), "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            "server": ("tandem-replica", 0), "client": ("127.0.0.1", 0), "state": {}}


async def call_asgi(app: Any, method: str, path: str, headers: list[tuple[str, str]], body: bytes,
                    query: str = "", extra_headers: dict[str, str] | None = None,
                    stream_interval_s: float = 0.0, body_with_start: bool = False) -> AsyncIterator[dict | bytes]:
    """One HTTP exchange with `app`: yields {"status", "headers"} first, then body chunks: the body messages
    waiting when one is read go together, and with `stream_interval_s` a chunk after the first waits until that
    long after the previous one (the first token is never held). With `body_with_start` the start waits for the
    first body chunk and carries it as its "body" (one item fewer: each item is a Ray streaming message on
    every hop, and the app sends the start just before its first body anyway). When the caller stops iterating
    (its client
    left, or it was cancelled), the app sees `http.disconnect` and its request ends there (tandem aborts the
    engine requests and frees their KV blocks)."""
    outbox: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await outbox.put(message)

    task = asyncio.create_task(app(http_scope(method, path, headers, query), receive, send))
    task.add_done_callback(lambda t: outbox.put_nowait(None))  # the app returned (or failed): no more messages
    held: Any = _NOTHING
    loop = asyncio.get_running_loop()
    last_chunk: float | None = None
    start: dict | None = None  # body_with_start: the start, held until the first body chunk
    try:
        while True:
            message, held = (await outbox.get() if held is _NOTHING else held), _NOTHING
            if message is None:
                if start is not None:
                    yield start
                if task.exception() is not None:
                    raise task.exception()
                return
            if message["type"] == "http.response.start":
                out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                out += list((extra_headers or {}).items())
                start = {"status": message["status"], "headers": out}
                if not body_with_start:
                    yield start
                    start = None
            elif message["type"] == "http.response.body":
                # body messages already waiting go out as one chunk: each chunk costs a Ray streaming item on
                # every hop (replica -> ingress -> proxy), so under load a stream's events travel together
                chunk, more = bytes(message.get("body", b"")), message.get("more_body", False)
                if more and last_chunk is not None and (wait := last_chunk + stream_interval_s - loop.time()) > 0:
                    await asyncio.sleep(wait)
                while more and not outbox.empty():
                    queued = outbox.get_nowait()
                    if queued is None or queued["type"] != "http.response.body":
                        held = queued
                        break
                    chunk += queued.get("body", b"")
                    more = queued.get("more_body", False)
                if start is not None and (chunk or not more):
                    first, start = {**start, "body": chunk}, None
                    yield first
                    last_chunk = loop.time()
                elif chunk:
                    yield chunk
                    last_chunk = loop.time()
                if not more:
                    return
    finally:
        left.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
            except Exception:
                pass


class TandemReplica:
    """A whole tandem in this process. Ray Serve calls `async __init__` (the replica counts as started once
    its engines are loaded), `handle` per request, the two `record_*_stats` periodically and `shutdown` (through
    the deployment's `__del__`) when it is stopped, after Serve's graceful drain let in-flight requests finish."""

    async def __init__(self, config: str | None = None, overrides: dict[str, Any] | None = None, *,
                       torch_threads: int | None = 1, pin_cpu: bool = False, ready_timeout_s: float = 600.0,
                       stream_interval_s: float = 0.0, limits_bank: str | None = None, warmup_tokens: int = 2):
        self.core: tuple[int, int] | None = pin_to_free_core() if pin_cpu else None
        self.stream_interval_s = stream_interval_s
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        from gateway.app import create_app
        from gateway.config import load_config
        from gateway.engine_setup import check_checkpoints

        cfg = load_config(config, overrides=dict(overrides or {}))
        check_checkpoints(cfg)
        self.app = create_app(cfg)
        self.state = self.app.state.gateway
        self.lifespan = Lifespan(self.app)
        self.replica_id = _replica_id()
        self.started = time.time()
        self.served = 0
        self.ready_at: float | None = None
        self.first_request_at: float | None = None
        self.chunks = 0  # body chunks streamed back (each one a Ray streaming item on every hop)
        self._flusher: asyncio.Task | None = None
        limiter = self.state.keyring.limiter
        if limits_bank is not None and limiter.active:  # the deployment's one bank, not N replicas' own counts
            from deploy.limits import RayBudgetSource, bank_actor, flush_periodically

            limiter.share(RayBudgetSource(bank_actor(limits_bank)))
            self._flusher = asyncio.create_task(flush_periodically(limiter))
        await self.lifespan.startup()
        deadline = time.monotonic() + ready_timeout_s
        while not self.state.ready:
            if self.state.load_error:
                raise RuntimeError(self.state.load_error)
            if time.monotonic() > deadline:
                raise TimeoutError(f"tandem engines not loaded within {ready_timeout_s} s")
            await asyncio.sleep(0.05)
        self.warmed: dict[str, int] = await self.warm_up(warmup_tokens) if warmup_tokens > 0 else {}
        self.ready_at = time.time()  # the constructor returns now: Serve may route here from this point on
        log.info("tandem replica %s ready (core %s)", self.replica_id, self.core[0] if self.core else "-")

    async def warm_up(self, max_tokens: int) -> dict[str, int]:
        """One short streamed completion per engine through the whole app before Serve marks the replica
        running (the constructor has not returned yet, so no request is routed here meanwhile): the first
        forward, the sampler and the SSE path run once off the clock of real traffic. Returns each engine's
        status; a non-200 (an auth-only config answers 401) is logged, not fatal."""
        import json

        out = {}
        for engine in sorted(self.state.engines):
            body = json.dumps({"model": engine, "prompt": "warm up", "max_tokens": max_tokens,
                               "stream": True}).encode()
            status = 0
            async for item in call_asgi(self.app, "POST", "/v1/completions",
                                        [("content-type", "application/json")], body):
                if isinstance(item, dict):
                    status = item["status"]
            out[engine] = status
            if status != 200:
                log.warning("tandem replica warm-up on %s answered %d", engine, status)
        return out

    def check_health(self) -> None:
        """Ray Serve's health check (every `health_check_period_s`): raising marks the replica unhealthy, so
        Serve stops routing to it and replaces it. Unhealthy: the engines failed or are gone, or the engine
        loop or a preparation pool is stalled (what tandem's /health reports as degraded)."""
        from gateway.app import stalled

        if self.state.load_error:
            raise RuntimeError(f"tandem engines failed: {self.state.load_error}")
        if not self.state.ready:
            raise RuntimeError("tandem engines are not loaded")
        why = stalled(self.state)
        if why is not None:
            raise RuntimeError(f"tandem replica degraded: {why}")

    @classmethod
    async def create(cls, *args: Any, **kwargs: Any) -> TandemReplica:
        """Build one outside Ray (tests): the async constructor run by hand."""
        self = cls.__new__(cls)
        await self.__init__(*args, **kwargs)
        return self

    async def handle(self, request: dict[str, Any]) -> AsyncIterator[dict | bytes]:
        """One HTTP exchange: `request` has method, path, query, headers (pairs), body (bytes) and the router's
        `routing` key (read by the router, ignored here). The start dict carries the body's first chunk."""
        self.served += 1
        if self.first_request_at is None:
            self.first_request_at = time.time()
        async for item in call_asgi(self.app, request["method"], request["path"], request["headers"],
                                    request.get("body", b""), request.get("query", ""),
                                    extra_headers={"x-tandem-replica": self.replica_id},
                                    stream_interval_s=self.stream_interval_s, body_with_start=True):
            self.chunks += 1
            yield item

    def pool_stats(self) -> dict[str, Any]:
        host = self.state.host
        return dict(host.stats()["pool"]) if host is not None else {}

    def record_routing_stats(self) -> dict[str, Any]:
        """For the request router: the routes served, load, KV usage and SLO headroom, and the pool's
        counters (tests and benchmarks read these through the replica actor)."""
        engines = self.state.engine_stats() if self.state.ready else {}
        reports = self.state.slo.reports()
        headroom = [r.attainment - r.percentile / 100.0 for r in reports.values() if r.attainment is not None]
        pool = self.pool_stats()
        return {"replica": self.replica_id, "pid": os.getpid(), "core": self.core[0] if self.core else None,
                "routes": sorted(self.state.routes.routes), "ongoing": self.state.inflight,
                "waiting": sum(float(s.get("num_waiting", 0)) for s in engines.values()),
                "kv_usage": float(pool.get("kv_usage", 0.0)),
                "slo_headroom": min(headroom) if headroom else 0.0,
                "served": self.served, "chunks": self.chunks, "ready_at": self.ready_at,
                "first_request_at": self.first_request_at,
                "used_pages": pool.get("used_pages", 0), "num_pages": pool.get("num_pages", 0),
                "prefix_cache_queries": pool.get("prefix_cache_queries", 0),
                "prefix_cache_hits": pool.get("prefix_cache_hits", 0)}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """For `deploy.autoscale_policy.TandemAutoscalingPolicy`: the inputs of gateway.autoscale's signals."""
        from gateway.autoscale import signals_from

        signals = signals_from(self.state.engine_stats(), self.state.slo.reports())
        misses = [a - signals.slo_targets.get(r, 0.0) for r, a in signals.slo_attainment.items()]
        return {"waiting": signals.waiting_per_replica, "kv_usage": signals.kv_usage,
                "ongoing": float(self.state.inflight),
                "slo_headroom": min(misses) if misses else 0.0}

    async def shutdown(self) -> None:
        """The engines stop (what still runs ends with an engine error); the core's lock goes with the process."""
        flusher = getattr(self, "_flusher", None)
        if flusher is not None:
            flusher.cancel()
        lifespan = getattr(self, "lifespan", None)
        if lifespan is not None:
            await lifespan.shutdown()


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (tests): the process id stands for it
        return f"local-{os.getpid()}"
