"""bench/loadgen.c, the open-loop client of the gateway benchmarks, against small socket servers that answer
well, badly, late or not at all: every request is counted once under the right kind, latencies count from the
scheduled send, connections are reused, and a server's 200 without the marker is not a success."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from bench import loadgen

SERVER = Path(__file__).with_name("answering_server.py")
PAYLOAD = b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}"
# an answer counts as one unless it takes this long (not the benchmarks' 2 s): slack for a loaded CI machine
SLOW = 20.0


@contextmanager
def serving(**spec) -> Iterator[int]:
    """A server of tests/bench/answering_server.py's kind `spec` in its own process; yields its port."""
    proc = subprocess.Popen([sys.executable, str(SERVER), json.dumps(spec)], stdout=subprocess.PIPE, text=True)
    try:
        yield int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def _answer(status: str, body: bytes, delay: float = 0.0, chunked: bool = False) -> dict:
    return {"kind": "answer", "status": status, "body": body.decode(), "delay": delay, "chunked": chunked}


@pytest.mark.parametrize("chunked", [False, True])
def test_every_request_answered_counts_once_with_its_latency(chunked):
    with serving(**_answer("200 OK", b'data: {"a": 1}\n\ndata: [DONE]\n\n', delay=0.002, chunked=chunked)) as port:
        row = loadgen.open_loop(port, PAYLOAD, b"data: [DONE]", rate=200, duration=1.0, seed=3, timeout_s=SLOW)
    assert row["requests"] == len(loadgen.arrivals(200, 1.0, 3)) > 100
    assert row["errors"] == 0 and len(row["latencies_s"]) == row["requests"]
    lat = np.asarray(row["latencies_s"])
    assert lat.min() >= 0.002 and lat.max() < SLOW  # the server's delay is in every latency
    assert row["connections"] < row["requests"]  # keep-alive: connections are reused


def test_a_200_without_the_marker_or_another_status_is_a_bad_response():
    for status, body in (("200 OK", b'{"no": "usage"}'), ("503 Service Unavailable", b'"usage":{')):
        with serving(**_answer(status, body)) as port:
            row = loadgen.open_loop(port, PAYLOAD, b'"usage":{', rate=100, duration=0.3, seed=1, timeout_s=SLOW)
        assert row["latencies_s"] == [] and row["error_kinds"] == {"bad response": row["requests"]} != {}


def test_the_content_length_is_read_within_the_head_only():
    # these answers' content-length is their head's last line: the client once read the number on past the head
    # into stale bytes, and a leftover digit there (1 run in ~20) made every request of the run time out
    head = b"http/1.1 200 ok\r\ncontent-length: 15"
    assert loadgen.content_length(head + b"99", len(head)) == 15
    assert loadgen.content_length(b"http/1.1 200 ok\r\ncontent-length:\t7\r\nx-a: 1") == 7
    assert loadgen.content_length(b"http/1.1 200 ok\r\nx-a: 1") == -1
    assert loadgen.content_length(b"http/1.1 200 ok\r\ncontent-length: x1") == -1
    assert loadgen.content_length(head + b"0", len(head) - 1) == 1  # cut inside the value: what the head holds


def test_a_server_that_never_answers_times_out_and_one_that_closes_is_closed():
    for server, kind in (("silent", "timeout"), ("closing", "closed")):
        with serving(kind=server) as port:
            t0 = time.monotonic()
            row = loadgen.open_loop(port, PAYLOAD, b"x", rate=50, duration=0.2, seed=2, timeout_s=0.3)
            took = time.monotonic() - t0
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
