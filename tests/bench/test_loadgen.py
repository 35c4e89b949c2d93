"""bench/loadgen.c, the open-loop client of the gateway benchmarks, against small socket servers that answer
well, badly, late or not at all: every request is counted once under the right kind, latencies count from the
scheduled send, connections are reused, and a server's 200 without the marker is not a success."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from bench import loadgen


def _serve(handler) -> tuple[int, threading.Event]:
    """A thread per connection on 127.0.0.1; `handler(conn)` answers requests until it returns."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=handler, args=(conn,), daemon=True).start()
        listener.close()

    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname()[1], stop


def _requests(conn: socket.socket):
    """Each whole request on a keep-alive connection (the payload below: head and a 2-byte body)."""
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf or len(buf) < buf.index(b"\r\n\r\n") + 6:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
        end = buf.index(b"\r\n\r\n") + 6
        yield buf[:end]
        buf = buf[end:]


PAYLOAD = b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}"
# the test servers answer from Python threads, which a full GC pass of the whole test process (seconds, early in
# a session) stops: an answer counts as one unless it takes this long (not the benchmarks' 2 s)
SLOW = 20.0


def _answer(status: str, body: bytes, delay: float = 0.0, chunked: bool = False):
    def handler(conn: socket.socket) -> None:
        with conn:
            for _ in _requests(conn):
                time.sleep(delay)
                if chunked:
                    mid = len(body) // 2
                    conn.sendall(b"HTTP/1.1 %s\r\ntransfer-encoding: chunked\r\n\r\n" % status.encode())
                    conn.sendall(b"%x\r\n%s\r\n" % (mid, body[:mid]))  # a chunk, then the rest and the end
                    conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - mid, body[mid:]))
                else:
                    conn.sendall(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (status.encode(), len(body), body))
    return handler


@pytest.mark.parametrize("chunked", [False, True])
def test_every_request_answered_counts_once_with_its_latency(chunked):
    port, stop = _serve(_answer("200 OK", b'data: {"a": 1}\n\ndata: [DONE]\n\n', delay=0.002, chunked=chunked))
    try:
        row = loadgen.open_loop(port, PAYLOAD, b"data: [DONE]", rate=200, duration=1.0, seed=3, timeout_s=SLOW)
    finally:
        stop.set()
    assert row["requests"] == len(loadgen.arrivals(200, 1.0, 3)) > 100
    assert row["errors"] == 0 and len(row["latencies_s"]) == row["requests"]
    lat = np.asarray(row["latencies_s"])
    assert lat.min() >= 0.002 and lat.max() < SLOW  # the server's delay is in every latency
    assert row["connections"] < row["requests"]  # keep-alive: connections are reused


def test_a_200_without_the_marker_or_another_status_is_a_bad_response():
    for status, body in (("200 OK", b'{"no": "usage"}'), ("503 Service Unavailable", b'"usage":{')):
        port, stop = _serve(_answer(status, body))
        try:
            row = loadgen.open_loop(port, PAYLOAD, b'"usage":{', rate=100, duration=0.3, seed=1, timeout_s=SLOW)
        finally:
            stop.set()
        assert row["latencies_s"] == [] and row["error_kinds"] == {"bad response": row["requests"]} != {}


def test_a_server_that_never_answers_times_out_and_one_that_closes_is_closed():
    def silent(conn: socket.socket) -> None:
        with conn:
            for _ in _requests(conn):
                pass

    def closing(conn: socket.socket) -> None:
        with conn:
            next(_requests(conn), None)

    for handler, kind in ((silent, "timeout"), (closing, "closed")):
        port, stop = _serve(handler)
        try:
            t0 = time.monotonic()
            row = loadgen.open_loop(port, PAYLOAD, b"x", rate=50, duration=0.2, seed=2, timeout_s=0.3)
            took = time.monotonic() - t0
        finally:
            stop.set()
        assert row["error_kinds"] == {kind: row["requests"]} and row["requests"] > 0
        assert took < 0.2 + 0.3 + 1.0  # it waits out the timeout of the last request, not more


def test_nothing_listening_is_closed_not_a_hang():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        row = loadgen.open_loop(port, PAYLOAD, b"x", rate=50, duration=0.2, seed=4, timeout_s=0.5)
    assert row["error_kinds"] == {"closed": row["requests"]} and row["requests"] > 0


def test_the_arrivals_are_poisson_at_the_rate_and_the_same_for_a_seed():
    a = loadgen.arrivals(1000, 20.0, 7)
    assert np.array_equal(a, loadgen.arrivals(1000, 20.0, 7)) and not np.array_equal(a, loadgen.arrivals(1000, 20.0, 8))
    gaps = np.diff(a)
    assert abs(len(a) / 20.0 - 1000) < 30 and abs(gaps.mean() - 1e-3) < 5e-5 and abs(gaps.std() / gaps.mean() - 1) < 0.05
