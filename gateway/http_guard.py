"""The HTTP edge under uvicorn: `GuardedHttpToolsProtocol` answers what never reaches the app (an oversized head
431, a head or body that does not arrive in time 408, bytes that are not HTTP 400) with OpenAI's error body,
within `HTTPLimits` ([server] in the config), sends a response's head in the same write as its first body
bytes, and tells a request's watchers when its client has gone (`ClientGone`); `free_port` finds a port to
listen on."""

from __future__ import annotations

import logging
import socket
from asyncio import TimerHandle, Transport
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger("tandem.gateway")

LINGER_S, LINGER_BYTES = 2.0, 1 << 20  # after a refusal, how long and how much to read before closing


@dataclass(frozen=True)
class HTTPLimits:
    """What one connection may take from the server before it is answered and closed ([server] in the config)."""

    max_header_bytes: int  # request line plus headers; beyond it a 431
    header_timeout_s: float  # from a request's first byte (or the connection's opening) to its last header
    body_timeout_s: float  # from the last header to the body's last byte (a short body never ends)


def error_body(status: int, message: str, code: str) -> bytes:
    from gateway.answers import encode
    from gateway.errors import APIError  # the app is loaded by the time the server answers by itself

    return encode(APIError(status, message, code=code).body())


def _error_bytes(status: int, message: str, code: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete `Connection: close` response carrying the OpenAI error body."""
    body = error_body(status, message, code)
    head = [STATUS_LINE[status]]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
    return b"".join(head) + body


class _HeadHeld:
    """A request cycle's transport whose first write (the response head) waits for the next one (the body's
    first bytes) to go out in one send: a JSON answer is one syscall and one wake-up of the client, not two.
    Held at most until the loop's next turn, the response's end or the connection's refusal (`flush`)."""

    __slots__ = ("_transport", "_protocol", "_held", "_fresh")

    def __init__(self, transport: Transport, protocol: GuardedHttpToolsProtocol):
        self._transport, self._protocol = transport, protocol
        self._held: bytes | None = None
        self._fresh = True  # nothing written yet: the next write is held

    def write(self, data: bytes) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
            self._protocol.holding = None
        elif self._fresh:
            self._fresh = False
            self._held = bytes(data)
            self._protocol.holding = self
            self._protocol.loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            if self._protocol.holding is self:
                self._protocol.holding = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, ...: the transport's own
        return getattr(self._transport, name)


CLIENT_GONE = "tandem.client_gone"  # the ASGI scope's extensions key of a request's `ClientGone`


class ClientGone:
    """One request's "the client has gone", told by its connection's protocol when the connection is lost (or
    refused) before the response completes: what `gateway.streaming.ClientWatch` and `send_events` otherwise
    learn from a task that awaits `receive()` for the `http.disconnect` message, without that task (one made,
    run, cancelled and collected for every request). In the scope's extensions under `CLIENT_GONE`; `watch()`
    gives each watcher its own `GoneWatch`."""

    __slots__ = ("loop", "_flow", "_watches", "gone")

    def __init__(self, loop: Any, flow: Any):
        self.loop, self._flow = loop, flow
        self._watches: list[GoneWatch] = []
        self.gone = False

    def watch(self) -> GoneWatch:
        if not self._watches and self._flow is not None:
            self._flow.resume_reading()  # as uvicorn's receive() does: a lost connection must be read to be seen
        watch = GoneWatch(self)
        if self.gone:
            watch.state = GoneWatch.GONE
        else:
            self._watches.append(watch)
        return watch

    def fire(self) -> None:
        """The client has gone: every watch's callbacks run soon (the loop's next turn, as a task's would)."""
        if self.gone:
            return
        self.gone = True
        watches, self._watches = self._watches, []
        for watch in watches:
            watch.fire()


class GoneWatch:
    """One watcher's view of a `ClientGone`, with the part of `asyncio.Task`'s interface that the watchers use
    in place of a task awaiting the disconnect: `add_done_callback` (called soon, with this object, once the
    client has gone), `cancel` (stop watching: the callbacks are dropped), `done`, `cancelled`, `exception`."""

    __slots__ = ("_source", "_callbacks", "state")

    WATCHING, GONE, CANCELLED = 0, 1, 2

    def __init__(self, source: ClientGone):
        self._source = source
        self._callbacks: list[Callable[[GoneWatch], None]] = []
        self.state = self.WATCHING

    def add_done_callback(self, fn: Callable[[GoneWatch], None]) -> None:
        if self.state == self.GONE:
            self._source.loop.call_soon(fn, self)
        elif self.state == self.WATCHING:
            self._callbacks.append(fn)

    def cancel(self) -> bool:
        if self.state != self.WATCHING:
            return False
        self.state, self._callbacks = self.CANCELLED, []
        watches = self._source._watches
        if self in watches:
            watches.remove(self)
        return True

    def done(self) -> bool:
        return self.state != self.WATCHING

    def cancelled(self) -> bool:
        return self.state == self.CANCELLED

    def exception(self) -> None:
        return None

    def fire(self) -> None:
        if self.state == self.WATCHING:
            self.state = self.GONE
            callbacks, self._callbacks = self._callbacks, []
            for fn in callbacks:
                self._source.loop.call_soon(fn, self)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with HTTPLimits: an oversized head is a 431 before the app sees it, a head or
    body that does not arrive in time is a 408 (a connection that sent nothing is just closed). The parser
    buffers a header's bytes until it ends, so the head is measured as the bytes received while reading it."""

    def __init__(self, *args: Any, limits: HTTPLimits, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._reading_head = True  # between messages or inside a head: received bytes count as head
        self._in_head = False  # a message began and its head is not complete
        self._head_bytes = 0
        self._deadline: TimerHandle | None = None
        self._refused = False
        self._lingered_bytes = 0
        self.holding: _HeadHeld | None = None  # the cycle whose response head waits for its body

    def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._client_gone()
        super().connection_lost(exc)
        # the cycles' transports (`_HeadHeld`) point back here: let go of them, or every closed connection leaves
        # a protocol <-> cycle loop to the GC (a cycle still answering keeps what it needs itself)
        self.cycle = None  # type: ignore[assignment]
        self.pipeline.clear()  # requests pipelined behind the lost one never run

    def data_received(self, data: bytes) -> None:
        if self._refused:  # lingering after a refusal: drop what the client still sends, up to a bound
            self._lingered_bytes += len(data)
            if self._lingered_bytes > LINGER_BYTES:
                self.transport.close()
            return
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._reading_head and self._head_bytes > self.limits.max_header_bytes and not self._refused:
            self._refuse_head(f"more than {self.limits.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._deadline is None and not self._refused:
            self._arm(self.limits.header_timeout_s, self._head_timed_out)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._reading_head, self._in_head, self._head_bytes = False, False, 0
        self._disarm()
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:
            self._refuse_head(f"{size} bytes, at most {self.limits.max_header_bytes}")
            return
        before = self.cycle
        scope = self.scope
        super().on_headers_complete()
        if self.cycle is not before:  # a new request cycle (not an upgrade): its head goes out with its body
            self.cycle.transport = _HeadHeld(self.transport, self)
            gone = self.cycle.client_gone = ClientGone(self.loop, self.flow)  # type: ignore[attr-defined]
            extensions = scope.get("extensions")
            if extensions is None:
                scope["extensions"] = {CLIENT_GONE: gone}
            else:
                extensions[CLIENT_GONE] = gone
        self._arm(self.limits.body_timeout_s, self._body_timed_out)

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._disarm()
        self._reading_head, self._head_bytes = True, 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._flush_held()  # a response without body bytes (HEAD): its head goes now
        super().on_response_complete()

    def shutdown(self) -> None:
        self._flush_held()
        super().shutdown()

    def _flush_held(self) -> None:
        if self.holding is not None:
            self.holding.flush()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP (or a malformed head): OpenAI's error body, not plain text."""
        self._flush_held()
        self._refused = True
        self._disarm()
        log.info("refused a malformed request from %s: %s", self.client, msg)
        self.transport.write(_error_bytes(400, f"The request is not valid HTTP/1.1: {msg.rstrip('.')}",
                                          "invalid_http_request", self.server_state.default_headers))
        self.transport.close()

    def _client_gone(self) -> None:
        """The request being answered has lost its client: its watchers are told (`ClientGone`)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            gone = getattr(cycle, "client_gone", None)
            if gone is not None:
                gone.fire()

    # ---- deadlines and refusals
    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _pipelined_busy(self) -> bool:
        """A new head arrives while the previous request is still answering: no room for our answer."""
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse_head(self, size: str) -> None:
        self._refuse(None if self._pipelined_busy() else (431, f"Request headers are too large: {size}",
                                                           "request_header_fields_too_large"))

    def _head_timed_out(self) -> None:
        self._deadline = None
        if self._pipelined_busy():  # a head pipelined behind a running request: its clock starts after it
            self._arm(self.limits.header_timeout_s, self._head_timed_out)
        elif not self._in_head:
            self._refuse(None)  # nothing of a request arrived: nobody to answer, just close
        else:
            self._refuse((408, f"The request headers did not arrive within {self.limits.header_timeout_s:g} s",
                          "request_timeout"))

    def _body_timed_out(self) -> None:
        self._deadline = None
        if any(cycle is self.cycle for cycle, _ in self.pipeline):  # queued behind a pipelined request, which
            self._arm(self.limits.body_timeout_s, self._body_timed_out)  # pauses reading: its clock starts later
            return
        answer = (408, f"The request body did not arrive within {self.limits.body_timeout_s:g} s", "request_timeout")
        self._refuse(None if self.cycle.response_started else answer)  # an early answer (413) stands alone

    def _refuse(self, answer: tuple[int, str, str] | None) -> None:
        """Send `answer` (status, message, code) when given, and close. A request the app is still serving
        sees a disconnect, and its writes are dropped."""
        self._flush_held()  # what the app sent before the refusal goes first
        self._refused = True
        self._disarm()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
            self._client_gone()
        if self.transport.is_closing():
            return
        if answer is not None:
            status, message, code = answer
            log.info("refused a request from %s: %d %s", self.client, status, message)
            self.transport.write(_error_bytes(status, message, code, self.server_state.default_headers))
        if answer is None or not self.transport.can_write_eof():
            self.transport.close()
            return
        # Closing with unread bytes sends a reset, and the client's stack may drop our answer with it: send
        # FIN after the answer, read and drop a little more, then close.
        self.transport.write_eof()
        self._deadline = self.loop.call_later(LINGER_S, self.transport.close)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS has just handed out on `host` (free until someone else binds it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
