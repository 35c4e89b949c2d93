"""A client that leaves before its first output is noticed at once: a request still waiting for a batch slot,
and a cascade buffering its small answer (or escalated to the large engine), are aborted on every engine they
started; the engines go idle and every KV page comes back while other requests keep running. A real server
over tiny checkpoints whose engine steps are slowed, so a generation outlasts the client by seconds.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from engine_pacing import slowed  # noqa: E402  (conftest puts tests/ on the path)
from tiny_checkpoints import with_chat_template  # noqa: E402

from gateway.config import config_from_dict
from gateway.server import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = {"prompt": "Speculative decoding", "max_tokens": 400, "ignore_eos": True, "temperature": 0.0}
LEAVE_AFTER_S = 0.5  # the client's read timeout: it hangs up this long after sending
NOTICED_WITHIN_S = 1.5  # the engines must be idle this soon after (a slowed generation takes 4+ s)


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("disconnect-ckpt")
    small = with_chat_template(tiny_checkpoint("llama"), root / "small")
    large = with_chat_template(tiny_checkpoint("qwen2", hidden_size=96, num_heads=6, num_kv_heads=2, seed=1),
                                root / "large")
    cfg = config_from_dict({
        "engines": {"tandem-small": {"checkpoint": str(small), "max_num_seqs": 1},  # one slot: the next waits
                    "tandem-large": {"checkpoint": str(large)}},
        "kv_pool": {"memory_bytes": 32 << 20},
        "routes": {"fast": {"engines": ["tandem-small"]},
                   # escalates every random-model answer: its mean token logprob is far below -0.0001
                   "cascade": {"strategy": "cascade", "engines": ["tandem-small", "tandem-large"],
                               "cascade": {"confidence_threshold": -0.0001}}}})
    with ServerThread(cfg) as srv:
        yield srv


def _stats(server: ServerThread) -> dict:
    return server.app.state.gateway.host.stats()


def _busy(server: ServerThread) -> dict[str, tuple[int, int]]:
    return {name: (s["num_running"], s["num_waiting"]) for name, s in _stats(server)["engines"].items()}


async def _until(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return check()


async def _hang_up(server: ServerThread, path: str, body: dict, leave_after_s: float = LEAVE_AFTER_S) -> None:
    """Send a request and leave `leave_after_s` later, before any answer came."""
    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(30, read=leave_after_s)) as client:
        with pytest.raises(httpx.ReadTimeout):
            if body.get("stream"):
                async with client.stream("POST", path, json=body) as r:
                    await r.aread()
            else:
                await client.post(path, json=body)


async def _all_idle(server: ServerThread, timeout_s: float) -> bool:
    gateway = server.app.state.gateway
    return await _until(lambda: all(v == (0, 0) for v in _busy(server).values())
                        and _stats(server)["pool"]["used_pages"] == 0 and gateway.inflight == 0, timeout_s)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_queued_request_whose_client_leaves_is_dropped_while_the_running_one_goes_on(server, stream):
    with slowed(server, "tandem-small"):
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as holder:
            async with holder.stream("POST", "/v1/completions",
                                     json={"model": "fast", "stream": True, **LONG}) as running:
                lines = running.aiter_lines()  # held: a dropped iterator would close the connection
                async for line in lines:
                    if line.startswith("data: {"):
                        break  # the one slot is taken and stays taken: this client stays, reading nothing
                queued = asyncio.create_task(_hang_up(server, "/v1/completions",
                                                      {"model": "fast", "stream": stream, **LONG}))
                assert await _until(lambda: _busy(server)["tandem-small"] == (1, 1), 5.0), (_busy(server), queued)
                await queued
                # the waiting request is gone, the running one is untouched
                assert await _until(lambda: _busy(server)["tandem-small"] == (1, 0), NOTICED_WITHIN_S), \
                    _busy(server)
            # the holder leaves too: everything ends and every page comes back
        assert await _all_idle(server, 10.0), (_busy(server), _stats(server)["pool"])


@pytest.mark.parametrize("stream", [False, True])
async def test_a_cascade_whose_client_leaves_during_the_small_answer_stops_it_and_never_escalates(server, stream):
    large_steps = _stats(server)["engines"]["tandem-large"]["num_steps"]
    with slowed(server, "tandem-small"):
        await _hang_up(server, "/v1/chat/completions", {
            "model": "cascade", "stream": stream, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 400, "temperature": 0.0, "ignore_eos": True})
        assert await _all_idle(server, NOTICED_WITHIN_S), (_busy(server), _stats(server)["pool"])
    assert _stats(server)["engines"]["tandem-large"]["num_steps"] == large_steps  # the large engine never ran


async def test_a_cascade_whose_client_leaves_after_escalating_aborts_the_large_engine_too(server):
    async def ask() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            await client.post("/v1/chat/completions", json={
                "model": "cascade", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 400,
                "temperature": 0.0, "ignore_eos": True})

    with slowed(server, "tandem-large", per_step_s=0.05):
        # the small answer is fast; the escalated large one verifies it as drafts and regenerates from the first
        # rejected token, one token per 50+ ms step: unless the two random models agree on ~370 of 400 tokens it
        # outlasts NOTICED_WITHIN_S by far. The client leaves the moment the large engine is seen running.
        asking = asyncio.create_task(ask())
        assert await _until(lambda: _busy(server)["tandem-large"] != (0, 0) or asking.done(), 10.0), \
            "never escalated"
        assert not asking.done(), asking  # still waiting for the large answer
        asking.cancel()  # the client hangs up: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await asking
        assert await _all_idle(server, NOTICED_WITHIN_S), (_busy(server), _stats(server)["pool"])
