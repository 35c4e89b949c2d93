"""/health reports degraded (503) and /ready stops admitting while the engine loop, the compile pool or the
tokenisation pool is stalled, and both recover when it is not; the stall checks of each part without HTTP."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from engines.compile_pool import CompileLimits, CompilePool
from gateway.config import config_from_dict
from gateway.server import ServerThread
from gateway.tokenize_pool import POOL as TOKENIZE_POOL
from gateway.tokenize_pool import TokenizePool


class _Engine:
    name = "e"
    max_model_len = 512

    def stats(self) -> dict:
        return {"num_waiting": 0, "kv_usage": 0.0}


class _Host:
    """A host whose stall the test sets, as EngineCore.stalled reports its loop's and compile pool's."""

    def __init__(self) -> None:
        self.why: str | None = None
        self.asked: list[float] = []

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def engine(self, name: str) -> _Engine:
        return _Engine()

    def stats(self) -> dict:
        return {"engines": {"e": {}}, "pool": {"used_pages": 0}}

    def stalled(self, after_s: float) -> str | None:
        self.asked.append(after_s)
        return self.why


def test_health_and_ready_report_a_stalled_engine_or_tokenisation_pool_and_recover():
    host = _Host()
    cfg = config_from_dict({"engines": {"e": {"checkpoint": "/unused"}}, "preparation": {"stall_after_s": 0.2}})
    with ServerThread(cfg, host_factory=lambda: host) as srv:
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        assert httpx.get(srv.url + "/ready").status_code == 200
        host.why = "an engine step has run for 40 s"
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503
        assert health.json() == {"status": "degraded", "detail": "an engine step has run for 40 s"}
        ready = httpx.get(srv.url + "/ready")
        assert ready.status_code == 503 and "an engine step" in ready.json()["detail"]
        assert host.asked[-1] == 0.2  # [preparation] stall_after_s
        host.why = None
        assert httpx.get(srv.url + "/health").status_code == 200

        release = threading.Event()  # a tokenisation task that does not return (until released)
        thread = threading.Thread(target=lambda: asyncio.run(TOKENIZE_POOL.run(release.wait)), daemon=True)
        thread.start()
        time.sleep(0.5)
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "tokenisation" in health.json()["detail"], health.text
        assert httpx.get(srv.url + "/ready").status_code == 503
        release.set()
        thread.join(5)
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/ready").status_code == 200


def test_a_tokenisation_pool_task_older_than_the_limit_is_a_stall():
    pool = TokenizePool(1)
    release = threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(pool.run(release.wait)), daemon=True)
    thread.start()
    time.sleep(0.3)
    assert pool.stalled(60.0) is None
    assert "tokenisation task" in pool.stalled(0.1)
    release.set()
    thread.join(5)
    assert pool.stalled(0.1) is None


def test_an_in_process_compile_older_than_the_limit_is_a_compile_pool_stall():
    pool = CompilePool(CompileLimits(stall_after_s=0.1))
    release = threading.Event()
    try:
        done = pool.run_compile(release.wait)
        time.sleep(0.3)
        assert "in-process grammar compile" in pool.stalled()
        release.set()
        done.result(5)
        assert pool.stalled() is None
    finally:
        release.set()
        pool.close()


def test_an_engine_step_older_than_the_limit_is_a_stall_of_the_core(monkeypatch):
    from engines.core import EngineCore

    core = EngineCore.__new__(EngineCore)  # only the fields `stalled` reads
    core._dead, core._stop = None, False
    core.compile_pool = CompilePool()
    try:
        core.step_started = None
        assert core.stalled(1.0) is None
        core.step_started = time.monotonic() - 5
        assert "engine step has run" in core.stalled(1.0)
        core.step_started, core._dead = None, "engine loop crashed: RuntimeError: boom"
        assert core.stalled(1.0) == "engine loop crashed: RuntimeError: boom"
    finally:
        core.compile_pool.close()
