"""The hot endpoints' way past Litestar's per-request layers: POST /v1/chat/completions and /v1/completions with a
JSON body of known length go straight from the server to the same auth middleware, decoder, handler, response
and exception handlers Litestar would call, without its router, middleware wrappers and parameter model.
Anything else (other paths, no Content-Length, a body over the limit, a non-JSON type) goes to Litestar.
"""

from __future__ import annotations

from typing import Any

from litestar import Litestar, Response
from litestar.background_tasks import BackgroundTask
from litestar.exceptions import LitestarException
from litestar.middleware._internal.exceptions.middleware import get_exception_handler
from opentelemetry import trace

from gateway.auth import AuthMiddleware
from gateway.protocol import ChatCompletionRequest, CompletionRequest, decode_request
from gateway.streaming import EventStream, send_events
from gateway.strict_request import ClientDisconnected, StrictJSONRequest, is_json_media_type
from gateway.tracing import http_semconv_mode, spans_reach_anyone, traced

# path -> the body type; the app's route handler there gives the function, response rules and exception handlers
HOT = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


class FastPath:
    """ASGI in front of the tandem Litestar app (`over` wraps it; any other app is returned as it is).

    What a request on a hot path meets is what Litestar would do with it, in its order: `AuthMiddleware`
    (request id, arrival, key, requests/minute), the body read and decoded by `decode_request`, the handler,
    `to_response` with the handler's own defaults, and on an exception the handler's resolved exception
    handlers (OpenAI's error shape, the error counter). It takes a request only when Litestar would have
    nothing else to do: Content-Length given and within `[server] max_body_bytes`, a JSON Content-Type, and no
    guard, hook, cache or other middleware on the route; the rest goes to Litestar whole. The server span is
    started as ServerSpanMiddleware starts it (`gateway.tracing.traced`), when spans reach anyone.
    """

    def __init__(self, app: Litestar):
        self.app = app
        state = app.state.gateway
        self.provider = state.telemetry.provider
        self.tracer = trace.get_tracer("tandem.gateway", tracer_provider=self.provider)  # the server span's
        self.stable, self.old = http_semconv_mode()
        self.hot: dict[str, tuple[Any, ...]] = {}
        for route in app.routes:
            handler = getattr(route, "route_handler_map", {}).get("POST", (None,))[0]
            if route.path not in HOT or handler is None or _hooked(handler) or handler.resolve_response_headers() \
                    or handler.resolve_response_cookies() or handler.status_code != 200:
                continue
            auth = [m for m in handler.resolve_middleware() if isinstance(m, AuthMiddleware)]
            if len(auth) != len(handler.resolve_middleware()) or len(auth) != 1 or \
                    handler.resolve_request_class() is not StrictJSONRequest:
                continue  # Litestar would run more than this path knows of
            self.hot[route.path] = (handler, HOT[route.path], auth[0], handler.resolve_request_max_body_size(),
                                    handler.resolve_exception_handlers(), handler.resolve_type_encoders())

    @classmethod
    def over(cls, app: Any) -> Any:
        state = getattr(getattr(app, "state", None), "gateway", None)
        return cls(app) if isinstance(app, Litestar) and state is not None and not app.before_send else app

    def __getattr__(self, name: str) -> Any:  # the wrapped app's attributes (state, ...) for whoever holds this
        return getattr(self.app, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        hot = self.hot.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if hot is None or not _plain(scope, hot[3]):
            await self.app(scope, receive, send)
        elif spans_reach_anyone(self.provider):  # the server span, as ServerSpanMiddleware starts it
            await traced(self.tracer, self.stable, self.old, lambda s, r, w: self._serve(hot, s, r, w), scope,
                         receive, send)
        else:
            await self._serve(hot, scope, receive, send)

    async def _serve(self, hot: tuple[Any, ...], scope: Any, receive: Any, send: Any) -> None:
        handler, body_type, auth, _, exception_handlers, type_encoders = hot
        scope["app"] = scope["litestar_app"] = self.app
        scope.setdefault("state", {})
        scope["route_handler"] = handler
        started = False

        async def send_watched(message: Any) -> None:
            nonlocal started
            started = True
            await send(message)

        async def endpoint(scope: Any, receive: Any, send: Any) -> None:
            body = await _read_body(receive)
            data = decode_request(body, body_type)
            request = StrictJSONRequest(scope, receive, send)
            response = await handler.fn(request=request, data=data)
            if not await _emit(response, receive, send):
                asgi = await handler.to_response(app=self.app, data=response, request=request)
                await asgi(scope, receive, send)

        try:
            await auth.handle(scope, receive, send_watched, endpoint)
        except Exception as exc:
            if started:
                raise LitestarException("Exception caught after response started") from exc
            request = StrictJSONRequest(scope, receive, send)
            response = get_exception_handler(exception_handlers, exc)(request, exc)
            await response.to_asgi_response(app=None, request=request, type_encoders=type_encoders)(scope, receive, send)



def _plain(scope: Any, max_body: int | None) -> bool:
    """A JSON body whose length is given and within the limit (else Litestar answers: 413, 415, chunked)."""
    length = media_type = None
    for name, value in scope["headers"]:
        if name == b"content-length":
            if length is not None:
                return False
            length = value
        elif name == b"content-type":
            if media_type is not None:
                return False
            media_type = value
        elif name == b"transfer-encoding":
            return False
    if length is None or not length.isdigit() or int(length) == 0 or (max_body and int(length) > max_body):
        return False  # an empty body is Litestar's: a missing `data`
    if media_type is not None:
        main = media_type.split(b";", 1)[0].strip().decode("latin-1")
        if not is_json_media_type(main):
            return False
    return True


async def _emit(response: Any, receive: Any, send: Any) -> bool:
    """Send the two answers the hot handlers give as Litestar's `to_asgi_response` would send them (the same
    messages: the response's headers, then its content type and length, the body, then its background task),
    without building its response objects; False for anything else (Litestar then sends it)."""
    kind = type(response)
    if (kind is not Response and kind is not EventStream) or response.cookies or response.encoding != "utf-8" \
            or not isinstance(response.background, BackgroundTask | None):
        return False
    status = response.status_code or 200
    if not 200 <= status < 600 or status in (204, 304) or "content-type" in response.headers:
        return False
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()]
    if kind is Response:
        if response.media_type != "application/json" or not isinstance(response.content, bytes) or \
                "content-length" in response.headers:
            return False
        body = response.content
        headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    else:
        if response.media_type != "text/event-stream":
            return False
        headers.append((b"content-type", b"text/event-stream; charset=utf-8"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send_events(response.iterator, send, receive, response.watcher)
    if response.background is not None:
        await response.background()
    return True


def _hooked(handler: Any) -> bool:
    """Whether Litestar would run something of its own around this handler (guards, hooks, a cache)."""
    layers = handler.ownership_layers
    return bool(handler.resolve_guards() or handler.resolve_before_request() or handler.resolve_after_response()
                or any(getattr(layer, "after_request", None) for layer in layers) or handler.cache
                or handler.resolve_dependencies())


async def _read_body(receive: Any) -> bytes:
    """The whole body (its length is known and bounded); a client gone before its end is ClientDisconnected."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected("The client closed the connection before its request body arrived")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
