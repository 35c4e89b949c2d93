"""A request's way through the gateway over spy engines (no model, no torch): the strategy decides the engine,
admission books that engine, every engine start carries the route's priority and TTFT/TPOT targets, and
engine errors reach the client by their typed code.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
from opentelemetry import trace

from engines.errors import EngineDeadError, EngineError, ErrorCode
from engines.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engines.sampling_params import SamplingParams
from gateway.app import create_app
from gateway.config import config_from_dict
from gateway.lifecycle import start_request
from gateway.prompts import INLINE_CHARS, Prompt, completion_prompt
from gateway.protocol import CompletionRequest
from gateway.routing import RoutingContext
from gateway.server import ServerThread
from tests.gc_probe import http_roundtrip, left_for_the_collector

SLO = {"ttft_ms": 800, "tpot_ms": 40}


class _Tokenizer:
    has_chat_template = False
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def token_text(self, token_id: int) -> str:
        return chr(token_id)


TOKENIZER = _Tokenizer()


class SpyEngine:
    """Records what every `generate` call received; answers `tokens` tokens at `logprob` each, or fails."""

    def __init__(self, name: str, *, logprob: float = -0.1, tokens: int = 3, error: ErrorCode | None = None,
                 dead: bool = False, max_model_len: int = 4096):
        self.name, self.logprob, self.tokens, self.error, self.dead = name, logprob, tokens, error, dead
        self.tokenizer = TOKENIZER  # one for all: a cascade's drafts need a shared vocabulary
        self.max_model_len = max_model_len
        self.calls: list[dict[str, Any]] = []
        self.aborted: list[str] = []

    async def generate(self, prompt, params, request_id=None, *, priority=0, **kwargs):
        self.calls.append({"prompt": prompt, "request_id": request_id, "priority": priority, **kwargs})
        if self.dead:
            raise EngineDeadError("the engine loop has stopped")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        now = time.monotonic()
        metrics = RequestMetrics(arrival_time=now, first_scheduled_time=now, first_token_time=now, finished_time=now)
        if self.error is not None:
            yield RequestOutput(request_id, None, ids, [CompletionOutput(index=0, finish_reason="error")],
                                finished=True, error=EngineError(self.error, "the forward pass failed"),
                                metrics=metrics, model=self.name)
            return
        tokens = list(range(65, 65 + self.tokens))
        logprobs = [{t: Logprob(self.logprob, rank=1)} for t in tokens]
        out = CompletionOutput(index=0, text="A" * self.tokens, token_ids=tokens, logprobs=logprobs,
                               finish_reason="length", delta_text="A" * self.tokens, delta_token_ids=tokens,
                               delta_logprobs=logprobs)
        yield RequestOutput(request_id, None, ids, [out], finished=True, metrics=metrics, model=self.name)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict:
        return {"num_running": 0, "num_waiting": 0}


class SpyHost:
    def __init__(self, engines: dict[str, SpyEngine]):
        self.engines = engines

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def engine(self, name: str) -> SpyEngine:
        return self.engines[name]

    def stats(self) -> dict:
        return {"engines": {n: e.stats() for n, e in self.engines.items()}, "pool": {"used_pages": 0}}


def _state(routes: dict[str, Any], engines: dict[str, SpyEngine]):
    """A gateway's state over spy engines, without a server (the engines are in place at once)."""
    cfg = config_from_dict({"engines": {name: {"checkpoint": "/unused"} for name in engines}, "routes": routes})
    state = create_app(cfg, host_factory=lambda: SpyHost(engines)).state.gateway
    state.engines = dict(engines)
    return state


def _context(state, route: str, prompt: str = "hello there", request_id: str = "r1", **params) -> RoutingContext:
    prompt_obj, text = completion_prompt(CompletionRequest(model=route, prompt=prompt))
    prompt_obj.tokenize = state.admission is not None  # as the lifecycle sets it
    return RoutingContext(request_id=request_id, route=state.routes.resolve(route),
                          params=SamplingParams(max_tokens=4, **params), prompt=prompt_obj, prompt_text=text,
                          ledger=state.admission)


async def _drain(run) -> list[RequestOutput]:
    return [out async for out in run.outputs]


async def test_admission_books_the_engine_the_router_chose_not_the_large_one():
    small, large = SpyEngine("small"), SpyEngine("large")
    # threshold 1.0: the shipped router never scores P(large) that high, so it always chooses small
    state = _state({"auto": {"strategy": "router", "engines": ["small", "large"], "slo": SLO,
                             "router": {"threshold": 1.0}}}, {"small": small, "large": large})
    run, _ = await start_request(state, _context(state, "auto"), trace.INVALID_SPAN)
    assert run.engine is small and run.attributes["tandem.router.choice"] == "small"
    admission = state.admission
    assert admission.waiting_by_engine() == {"small": 1}  # its prompt tokens wait on the small engine
    await _drain(run)
    admission.first_token("r1")
    engines = admission.stats()["engines"]
    assert engines["small"]["waiting"] == 0 and engines["small"]["running"] == 1
    assert "large" not in engines  # the large engine's drain rate learnt nothing from this request
    assert small.calls and not large.calls


async def test_admission_books_large_when_the_router_chooses_large():
    small, large = SpyEngine("small"), SpyEngine("large")
    state = _state({"auto": {"strategy": "router", "engines": ["small", "large"], "slo": SLO,
                             "router": {"threshold": 0.0}}}, {"small": small, "large": large})
    run, _ = await start_request(state, _context(state, "auto"), trace.INVALID_SPAN)
    assert run.engine is large and state.admission.waiting_by_engine() == {"large": 1}
    await _drain(run)


async def test_a_cascade_carries_its_route_targets_and_priority_to_both_engines_and_books_each():
    small, large = SpyEngine("small", logprob=-5.0), SpyEngine("large")  # small is unsure: escalate
    state = _state({"up": {"strategy": "cascade", "engines": ["small", "large"], "slo": SLO, "priority": -2,
                           "cascade": {"confidence_threshold": -1.0}}}, {"small": small, "large": large})
    admission = state.admission
    run, _ = await start_request(state, _context(state, "up"), trace.INVALID_SPAN)
    assert admission.waiting_by_engine() == {"small": 1}  # the small engine is booked first
    outputs = await _drain(run)
    assert run.engine is large and outputs[-1].model == "large"
    for engine, request_id in ((small, "r1"), (large, "r1-escalated")):
        (call,) = engine.calls
        assert call["request_id"] == request_id and call["priority"] == -2
        assert call["ttft_s"] == pytest.approx(0.8) and call["tpot_s"] == pytest.approx(0.04)
    assert large.calls[0]["draft_token_ids"] == [65, 66, 67]  # the small answer, verified as drafts
    engines = admission.stats()["engines"]
    # the small request ended (its slot is free), the escalation is running on large since its first token
    assert (engines["small"]["waiting"], engines["small"]["running"]) == (0, 0)
    assert (engines["large"]["waiting"], engines["large"]["running"]) == (0, 1)
    admission.release("r1-escalated")
    assert admission.stats()["engines"]["large"]["running"] == 0


async def test_a_confident_cascade_never_starts_or_books_the_large_engine():
    small, large = SpyEngine("small", logprob=-0.01), SpyEngine("large")
    state = _state({"up": {"strategy": "cascade", "engines": ["small", "large"], "slo": SLO}},
                   {"small": small, "large": large})
    run, _ = await start_request(state, _context(state, "up"), trace.INVALID_SPAN)
    await _drain(run)
    assert run.engine is small and not large.calls and "large" not in state.admission.stats()["engines"]


async def test_a_downgrade_starts_the_small_engine_through_the_same_entry_with_the_route_targets():
    small, large = SpyEngine("small"), SpyEngine("large")
    state = _state({"auto": {"strategy": "router", "engines": ["small", "large"], "slo": SLO,
                             "allow_downgrade": True, "router": {"threshold": 0.0}}},
                   {"small": small, "large": large})
    admission = state.admission
    admission.predicted_ttft = lambda engine, priority, tokens: 5.0 if engine == "large" else 0.1  # large is late
    run, _ = await start_request(state, _context(state, "auto"), trace.INVALID_SPAN)
    assert run.engine is small and run.attributes["tandem.admission.downgraded"] is True
    assert admission.waiting_by_engine() == {"small": 1}
    await _drain(run)
    (call,) = small.calls
    assert call["ttft_s"] == pytest.approx(0.8) and call["tpot_s"] == pytest.approx(0.04) and not large.calls


# ------------------------------------------------------------------------------ engine errors over HTTP


@pytest.fixture(scope="module")
def failing_server():
    engines = {"ok": SpyEngine("ok"), "broken": SpyEngine("broken", error=ErrorCode.ENGINE_ERROR),
               "dead": SpyEngine("dead", dead=True), "short": SpyEngine("short", max_model_len=8)}
    cfg = config_from_dict({"engines": {name: {"checkpoint": "/unused"} for name in engines},
                            "server": {"max_body_bytes": 4 << 20}})
    with ServerThread(cfg, host_factory=lambda: SpyHost(engines)) as server:
        yield server


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_is_a_500_engine_error(failing_server, stream):
    r = httpx.post(failing_server.url + "/v1/completions",
                   json={"model": "broken", "prompt": "hi", "max_tokens": 2, "stream": stream})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    assert "The engine failed this request: the forward pass failed" in r.json()["error"]["message"]


def test_a_dead_engine_is_a_503_with_retry_after(failing_server):
    r = httpx.post(failing_server.url + "/v1/completions", json={"model": "dead", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "engine_dead"


def test_the_text_size_cap_answers_400_before_any_work(failing_server):
    engine = failing_server.app.state.gateway.engines["short"]
    r = httpx.post(failing_server.url + "/v1/completions",
                   json={"model": "short", "prompt": "x" * (8 * 16 + 1), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt" and not engine.calls
    assert httpx.post(failing_server.url + "/v1/completions",
                      json={"model": "ok", "prompt": "x" * 200, "max_tokens": 2}).status_code == 200


async def test_a_long_prompt_does_not_stall_the_event_loop(failing_server):
    """Four 1 MB prompts in flight (chat and completions): each is refused with a 400 by the size check before
    any rendering or tokenising, and /health stays quick."""
    text = "lorem ipsum " * ((1 << 20) // 12)
    bodies = [("/v1/completions", {"model": "ok", "prompt": text, "max_tokens": 2}),
              ("/v1/chat/completions", {"model": "ok", "messages": [{"role": "user", "content": text}]})] * 2
    async with httpx.AsyncClient(base_url=failing_server.url, timeout=30) as client:
        await client.get("/health")
        stop = asyncio.Event()
        worst = 0.0

        async def probe() -> None:
            nonlocal worst
            while not stop.is_set():
                start = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                worst = max(worst, time.monotonic() - start)
                await asyncio.sleep(0.005)

        prober = asyncio.create_task(probe())
        answers = await asyncio.gather(*(client.post(path, json=body) for path, body in bodies))
        stop.set()
        await prober
    assert [a.status_code for a in answers] == [400] * 4
    assert [a.json()["error"]["code"] for a in answers] == ["context_length_exceeded"] * 4
    assert [a.json()["error"]["param"] for a in answers] == ["prompt", "messages"] * 2
    assert worst < 0.1, f"/health took {worst * 1000:.0f} ms while the big prompts were in flight"


async def test_a_long_prompt_renders_and_tokenises_in_a_worker_thread_and_a_short_one_inline():
    engine = SpyEngine("e")
    loop_thread = threading.get_ident()
    for chars, off_loop in ((INLINE_CHARS, False), (INLINE_CHARS + 1, True)):
        where: list[int] = []

        def render(e, chars=chars, where=where):
            where.append(threading.get_ident())
            return "x" * chars

        prompt = Prompt(render, chars, "prompt")
        prompt.tokenize = True
        ids = await prompt.get(engine)
        assert ids == [ord("x")] * chars and await prompt.get(engine) is ids  # prepared once per engine
        assert len(where) == 1 and (where[0] != loop_thread) == off_loop


def test_start_up_freezes_the_long_lived_objects_out_of_the_gc_and_shutdown_unfreezes_them():
    # A full collection over torch's and the models' objects stalled every request for ~200 ms; the freeze
    # after the engines load keeps the steady state's collections to the young objects of requests.
    import gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    cfg = config_from_dict({"engines": {"ok": {"checkpoint": "/unused"}}})
    with ServerThread(cfg, host_factory=lambda: SpyHost({"ok": SpyEngine("ok")})) as server:
        assert gc.get_freeze_count() > 10_000  # the interpreter's, the gateway's and the test's modules at least
        r = httpx.post(server.url + "/v1/completions", json={"model": "ok", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "AAA"
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_served_request_leaves_no_reference_cycle_for_the_gc(stream):
    # Each request's objects (its Request, scope, uvicorn's cycle) go when their last reference does; a cycle
    # among them left ~24 objects a request to the cyclic GC, a collector pass every ~30 requests.
    import json
    import socket

    cfg = config_from_dict({"engines": {"ok": {"checkpoint": "/unused"}}})
    body = json.dumps({"model": "ok", "prompt": "hi", "max_tokens": 3, "stream": stream}).encode()
    with ServerThread(cfg, host_factory=lambda: SpyHost({"ok": SpyEngine("ok")})) as server, \
            socket.create_connection(("127.0.0.1", server.port)) as conn:
        for _ in range(20):  # first requests fill caches
            http_roundtrip(conn, body)
        with left_for_the_collector() as left:
            answers = [http_roundtrip(conn, body) for _ in range(50)]
    assert all(a.startswith(b"HTTP/1.1 200") and b"AAA" in a for a in answers)
    assert [t for t in left if t in ("StrictJSONRequest", "RequestResponseCycle", "ScopeState")] == []
    assert len(left) < 50  # nothing a request (a timer's stray object aside)


@pytest.mark.parametrize("stream", [False, True])
def test_a_closed_connection_leaves_no_reference_cycle_for_the_gc(stream):
    # A cycle's transport (`_HeadHeld`) points back at its protocol, which holds the cycle: the protocol lets
    # go of its cycles when the connection is lost, or each closed connection left ~26 objects to the GC.
    import json
    import socket

    cfg = config_from_dict({"engines": {"ok": {"checkpoint": "/unused"}}})
    body = json.dumps({"model": "ok", "prompt": "hi", "max_tokens": 3, "stream": stream}).encode()
    with ServerThread(cfg, host_factory=lambda: SpyHost({"ok": SpyEngine("ok")})) as server:
        def one_connection() -> bytes:
            with socket.create_connection(("127.0.0.1", server.port)) as conn:
                return http_roundtrip(conn, body)

        def all_closed() -> None:
            deadline = time.monotonic() + 5
            while server.server.server_state.connections and time.monotonic() < deadline:
                time.sleep(0.005)

        for _ in range(5):  # first connections fill caches
            one_connection()
        all_closed()
        with left_for_the_collector() as left:
            answers = [one_connection() for _ in range(20)]
            all_closed()
    assert all(a.startswith(b"HTTP/1.1 200") and b"AAA" in a for a in answers)
    assert [t for t in left if t in ("GuardedHttpToolsProtocol", "RequestResponseCycle", "ScopeState")] == []
    assert len(left) < 20  # nothing a connection


@pytest.mark.parametrize("gone", [True, False])
async def test_a_body_cut_by_the_clients_disconnect_is_client_disconnected_not_a_server_error(gone):
    from litestar.exceptions import InternalServerException

    from gateway.strict_request import ClientDisconnected, StrictJSONRequest

    events = [{"type": "http.request", "body": b'{"model": ', "more_body": True},
              {"type": "http.disconnect"} if gone else {"type": "http.request", "body": b"1}", "more_body": False}]

    async def receive():
        return events.pop(0)

    class Handler:  # what Litestar's body() asks of the route handler
        def resolve_request_max_body_size(self) -> None:
            return None

    request = StrictJSONRequest({"type": "http", "method": "POST", "path": "/", "headers": [], "state": {},
                                 "route_handler": Handler()}, receive)
    assert request.client_left is False
    if gone:
        with pytest.raises(ClientDisconnected):
            await request.body()
        assert request.client_left is True
    else:
        assert await request.body() == b'{"model": 1}'
        assert request.client_left is False
    assert not isinstance(ClientDisconnected(), InternalServerException)
