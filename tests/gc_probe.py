"""What a block of work leaves to Python's cyclic garbage collector (objects only a collection frees: reference
cycles), and one HTTP/1.1 round trip on a kept-alive socket: for the tests that a served request leaves none."""

from __future__ import annotations

import gc
import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def left_for_the_collector() -> Iterator[list[str]]:
    """The type names of the objects made inside the block that only the cyclic GC could free."""
    gc.collect()
    gc.garbage.clear()
    # held through the block, so an object made before it (an earlier test's engine and the ctypes types it made)
    # cannot become garbage inside it and be counted as the block's
    before = gc.get_objects()
    left: list[str] = []
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield left
        gc.collect()
        left.extend(type(o).__qualname__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        del before


def http_roundtrip(conn: socket.socket, body: bytes, path: bytes = b"/v1/completions") -> bytes:
    """POST a JSON body and read the whole answer (chunked to its last chunk, else to its closing brace)."""
    conn.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                 % (path, len(body)) + body)
    answer = b""
    while not (answer.endswith(b"\r\n0\r\n\r\n") if b"chunked" in answer else answer.endswith(b"}")):
        data = conn.recv(65536)
        assert data, f"the server closed the connection after {answer[:200]!r}"
        answer += data
    return answer
