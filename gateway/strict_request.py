"""The request class the app decodes bodies with (`Litestar(request_class=StrictJSONRequest)`): JSON only (415
otherwise), decoded by `gateway.protocol.decode_request` (strict, bounded nesting), and a client gone mid-body
told apart from a server error."""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.connection.base import empty_receive, empty_send
from litestar.exceptions import InternalServerException

from gateway.protocol import decode_request


class UnsupportedMediaType(ValueError):
    """A request body that is not JSON (a 415)."""


def is_json_media_type(media_type: str) -> bool:
    """application/json, application/*+json, or no Content-Type at all (as vLLM's FastAPI accepts)."""
    media_type = media_type.lower()
    return media_type in ("", "application/json") or (media_type.startswith("application/")
                                                      and media_type.endswith("+json"))


class ClientDisconnected(Exception):
    """The client left before its request body arrived (or the server refused it, see gateway/server.py)."""


class _DisconnectWatch:
    """A receive that notes the client's disconnect. Its own object, not a closure over the request: a request
    holding a function that holds the request is a reference cycle, and each request's cycle (the request, its
    scope, uvicorn's request cycle) was left to the cyclic GC, a pass every ~30 requests."""

    __slots__ = ("inner", "left")

    def __init__(self, inner: Any):
        self.inner, self.left = inner, False

    async def receive(self) -> Any:
        event = await self.inner()
        if event["type"] == "http.disconnect":
            self.left = True
        return event


class StrictJSONRequest(Request):
    """Litestar's Request with the handler's `data` decoded by `decode_request` instead of Litestar's lenient
    conversion (which turns "NaN" into a float and "true" into a bool); a non-JSON body is a 415, and a client
    gone mid-body is ClientDisconnected, not a server error. The app selects it with
    `Litestar(request_class=StrictJSONRequest)`."""

    def __init__(self, scope: Any, receive: Any = empty_receive, send: Any = empty_send) -> None:
        super().__init__(scope, receive, send)
        self._watch = _DisconnectWatch(self.receive)
        self.receive = self._watch.receive

    @property
    def client_left(self) -> bool:
        return self._watch.left

    async def body(self) -> bytes:
        try:
            return await super().body()
        except InternalServerException:  # Litestar's way of saying "client disconnected prematurely"
            if self.client_left:
                raise ClientDisconnected("The client closed the connection before its request body arrived") \
                    from None
            raise

    async def json(self) -> Any:
        media_type, _ = self.content_type
        if not is_json_media_type(media_type):
            raise UnsupportedMediaType(f"Content-Type {media_type!r} is not supported: send the request body as "
                                       f"application/json")
        data_field = self.route_handler.parsed_data_field
        if data_field is None:
            return await super().json()
        return decode_request(await self.body(), data_field.annotation)
