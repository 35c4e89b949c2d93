"""How to notice a client that has gone: `ClientWatch` from admission to the answer (cancelling whatever the
request awaits), then the SSE response: Litestar's `Stream` written from the request's own task, cancelled
when the client leaves (the stream's `finally` then aborts the engine requests).
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Request
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import Receive, Send

from gateway.answers import SSE_DONE
from gateway.http_guard import CLIENT_GONE


def disconnect_watcher(scope: Any, receive: Receive) -> Any:
    """What tells a request's watcher that its client has gone: the server's own notice where it gives one
    (`gateway.http_guard.ClientGone`, under the scope's extensions), else a task awaiting `receive()`'s
    `http.disconnect`. Either has the done-callback interface of an `asyncio.Task`."""
    extensions = scope.get("extensions")
    gone = extensions.get(CLIENT_GONE) if extensions else None
    return gone.watch() if gone is not None else asyncio.create_task(until_disconnect(receive))


async def until_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the body is already read, so the next ASGI message is the end)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientWatch:
    """Watches the client while the request's task prepares its answer (tokenising, the waiting queue, a
    cascade's buffered small answer, a JSON body): when the client leaves, the task is cancelled where it
    waits, and `left` tells that cancellation from any other. `stop` before the response takes over."""

    def __init__(self, receive: Receive, scope: Any):
        self.left = False
        self._watching = True
        self._task = asyncio.current_task()
        assert self._task is not None, "ClientWatch is made inside the request's task"
        self._watcher = disconnect_watcher(scope, receive)
        self._watcher.add_done_callback(self._client_left)

    def _client_left(self, watcher: Any) -> None:
        # A callback runs only while the task waits, so the cancellation lands at that very await.
        if self._watching and not watcher.cancelled() and watcher.exception() is None:
            self.left = True
            self._task.cancel()

    def uncancel_if_left(self) -> bool:
        """After a CancelledError: True when this watch caused it (the cancellation is then taken back)."""
        if self.left:
            self._task.uncancel()
        return self.left

    def stop(self) -> None:
        self._watching = False  # a callback already scheduled must not cancel the response that follows
        if self._watcher is not None:
            self._watcher.cancel()

    def hand_over(self) -> Any:
        """Stop watching for the request's task and give the watcher, still waiting, to the SSE stream that
        answers (`send_events`): one watcher task a streamed request instead of one cancelled and another made."""
        self._watching = False
        watcher, self._watcher = self._watcher, None
        return watcher


class _EventStreamResponse(ASGIStreamingResponse):
    """Litestar's streaming response without its anyio task group, which cost about 0.05 ms a request: the
    body is written from this task while the request's watcher waits for the client to leave and cancels it."""

    watcher: Any = None  # the request's ClientWatch's (a task or a GoneWatch), handed over

    async def send_body(self, send: Send, receive: Receive) -> None:
        await send_events(self.iterator, send, receive, self.watcher)


async def send_events(iterator: Any, send: Send, receive: Receive, watcher: Any = None) -> None:
    """The SSE body: each chunk of `iterator` written from this task, the last in the same write that ends the
    body, while one watcher (`watcher`: the one handed over by the request's ClientWatch, else a new task
    awaiting `until_disconnect`) tells when the client has left and this task is cancelled (the engine request
    is then aborted by the stream's `finally`)."""
    task = asyncio.current_task()
    streaming = True

    def client_left(watcher: Any) -> None:
        if streaming and not watcher.cancelled() and watcher.exception() is None:
            task.cancel()

    if watcher is None:
        watcher = asyncio.create_task(until_disconnect(receive))
    watcher.add_done_callback(client_left)  # run soon if the client has left already
    try:
        done = False
        async for chunk in iterator:
            done = chunk.endswith(SSE_DONE)  # the last event: end the body in the same write
            await send({"type": "http.response.body", "body": chunk, "more_body": not done})
        if not done:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not watcher.done() or watcher.cancelled():
            raise  # cancelled from elsewhere (server shutdown): not ours to swallow
        task.uncancel()
    finally:
        streaming = False
        watcher.cancel()


class EventStream(Stream):
    """A `text/event-stream` response whose body is an async iterator of SSE bytes ending with [DONE]."""

    watcher: Any = None  # set by the pipeline: its ClientWatch's watcher (a task or a GoneWatch), for `send_events`

    def to_asgi_response(self, app: Any, request: Request, *, background: Any = None, cookies: Any = None,
                         headers: dict[str, str] | None = None, is_head_response: bool = False,
                         media_type: Any = None, status_code: int | None = None, **_: Any) -> ASGIResponse:
        response = _EventStreamResponse(
            background=self.background or background, content_length=0,
            cookies=[*self.cookies, *(cookies or [])], encoding=self.encoding,
            headers={**(headers or {}), **self.headers}, is_head_response=is_head_response,
            iterator=self.iterator, media_type=self.media_type or media_type,
            status_code=self.status_code or status_code)
        response.watcher = self.watcher
        return response
