"""A response's head goes out in the same write as its first body bytes (gateway/http_guard.py `_HeadHeld`), and
never waits longer than the loop's next turn, the response's end or a refusal; through a live uvicorn server the
bytes on the wire are what uvicorn sends without it (JSON, HEAD, SSE, keep-alive, pipelined)."""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import time

import pytest
import uvicorn

from gateway.http_guard import GuardedHttpToolsProtocol, HTTPLimits, _HeadHeld, free_port


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


class _Protocol:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.holding = loop, None


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_the_head_and_the_first_body_bytes_are_one_write_and_the_rest_pass_through(loop):
    transport, protocol = _Transport(), _Protocol(loop)
    held = _HeadHeld(transport, protocol)
    held.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert transport.writes == [] and protocol.holding is held
    held.write(b"body-1")
    held.write(b"body-2")
    assert transport.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody-1", b"body-2"]
    assert protocol.holding is None
    loop.run_until_complete(asyncio.sleep(0))  # the scheduled flush finds nothing held
    assert transport.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody-1", b"body-2"]
    assert held.get_extra_info("peername") == "info:peername"


def test_a_lone_head_goes_out_on_the_loops_next_turn(loop):
    transport, protocol = _Transport(), _Protocol(loop)
    held = _HeadHeld(transport, protocol)
    held.write(b"HTTP/1.1 200 OK\r\n\r\n")
    loop.run_until_complete(asyncio.sleep(0))
    assert transport.writes == [b"HTTP/1.1 200 OK\r\n\r\n"] and protocol.holding is None
    held.write(b"later")
    assert transport.writes == [b"HTTP/1.1 200 OK\r\n\r\n", b"later"]


def test_close_sends_what_is_held_first_and_a_closed_transport_gets_nothing(loop):
    transport, protocol = _Transport(), _Protocol(loop)
    held = _HeadHeld(transport, protocol)
    held.write(b"head")
    held.close()
    assert transport.writes == [b"head"] and transport.closed
    other = _Transport()
    held = _HeadHeld(other, _Protocol(loop))
    held.write(b"head")
    other.closed = True  # the connection went away meanwhile
    held.flush()
    assert other.writes == []


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for part in (b"one", b"two"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    body = b'{"ok":true}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def served():
    port = free_port()
    limits = HTTPLimits(max_header_bytes=64 << 10, header_timeout_s=5.0, body_timeout_s=5.0)
    config = uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            http=functools.partial(GuardedHttpToolsProtocol, limits=limits), date_header=False,
                            server_header=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def _exchange(port: int, raw: bytes, until: bytes, count: int = 1) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(raw)
        got = b""
        while got.count(until) < count:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


JSON_ANSWER = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'


def test_json_head_and_keep_alive_answers_on_the_wire(served):
    get = b"GET /json HTTP/1.1\r\nhost: x\r\n\r\n"
    assert _exchange(served, get, b'{"ok":true}') == JSON_ANSWER
    assert _exchange(served, get + get, b'{"ok":true}', count=2) == JSON_ANSWER * 2  # pipelined, in order
    head = _exchange(served, b"HEAD /json HTTP/1.1\r\nhost: x\r\n\r\n", b"\r\n\r\n")
    assert head == b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n"


def test_a_stream_sends_its_head_with_its_first_chunk_and_ends_chunked(served):
    got = _exchange(served, b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n", b"0\r\n\r\n")
    assert got == (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n"
                   b"3\r\none\r\n3\r\ntwo\r\n0\r\n\r\n")


def test_through_the_server_a_json_answer_is_one_write_and_a_stream_one_per_chunk(served, monkeypatch):
    sent: list[bytes] = []
    real_init = _HeadHeld.__init__

    class Spy:
        def __init__(self, transport):
            self.transport = transport

        def write(self, data):
            sent.append(bytes(data))
            self.transport.write(data)

        def __getattr__(self, name):
            return getattr(self.transport, name)

    monkeypatch.setattr(_HeadHeld, "__init__", lambda self, transport, protocol: real_init(self, Spy(transport),
                                                                                         protocol))
    assert _exchange(served, b"GET /json HTTP/1.1\r\nhost: x\r\n\r\n", b'{"ok":true}') == JSON_ANSWER
    assert sent == [JSON_ANSWER]
    sent.clear()
    _exchange(served, b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n", b"0\r\n\r\n")
    assert sent == [b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n",
                    b"3\r\ntwo\r\n", b"0\r\n\r\n"]
