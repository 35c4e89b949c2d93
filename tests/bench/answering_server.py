"""The small socket servers tests/bench/test_loadgen.py drives bench/loadgen.c against, run as their own process
(`python answering_server.py '<json spec>'`; it prints its port, then serves until killed), so that a stall of the
test process (a full GC pass of everything the suite imported) cannot hold up the server it measures. (The runs
where every request timed out after 20 s were the client's: bench/loadgen.c read a last content-length header on
past the head; test_loadgen.py's `test_the_content_length_is_read_within_the_head_only`.)

Spec: {"kind": "answer", "status": "200 OK", "body": "...", "delay": 0.0, "chunked": false} answers each request
(after `delay` s, in one piece or as two chunks); {"kind": "silent"} reads requests and never answers;
{"kind": "closing"} closes the connection after the first request."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time


def requests(conn: socket.socket):
    """Each whole request on a keep-alive connection (the tests' payload: a head and a 2-byte body)."""
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


def handler_for(spec: dict):
    kind = spec["kind"]
    if kind == "silent":
        def silent(conn: socket.socket) -> None:
            with conn:
                for _ in requests(conn):
                    pass
        return silent
    if kind == "closing":
        def closing(conn: socket.socket) -> None:
            with conn:
                next(requests(conn), None)
        return closing
    status, body = spec["status"].encode(), spec["body"].encode()
    delay, chunked = float(spec.get("delay", 0.0)), bool(spec.get("chunked", False))

    def answer(conn: socket.socket) -> None:
        with conn:
            for _ in requests(conn):
                time.sleep(delay)
                if chunked:
                    mid = len(body) // 2
                    conn.sendall(b"HTTP/1.1 %s\r\ntransfer-encoding: chunked\r\n\r\n" % status)
                    conn.sendall(b"%x\r\n%s\r\n" % (mid, body[:mid]))  # a chunk, then the rest and the end
                    conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - mid, body[mid:]))
                else:
                    conn.sendall(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body))
    return answer


def main() -> None:
    handler = handler_for(json.loads(sys.argv[1]))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handler, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
