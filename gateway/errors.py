"""Every error the gateway answers, in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`:
the `APIError` raised by handlers and middleware, and the Litestar exception handlers that turn framework
errors (404, 405, 413, malformed bodies), the protocol's decoding errors (400, 415) and unexpected exceptions
(500, no stack trace) into that shape.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from gateway.answers import ErrorBody, ErrorDetail, encode, sse
from gateway.protocol import InvalidParameter
from gateway.strict_request import ClientDisconnected, UnsupportedMediaType

log = logging.getLogger("tandem.gateway")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
          431: "invalid_request_error", 500: "server_error", 501: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields; `retry_after` adds the header (seconds)."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.retry_after = retry_after

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"retry-after": str(max(1, math.ceil(self.retry_after)))}

    def sse_event(self) -> bytes:
        """The event a stream sends when it fails after the first chunk went out."""
        return sse(self.body())


def error_response(err: APIError, request_id: str | None = None,
                   shape: Callable[[APIError], bytes] | None = None) -> Response:
    """The error as JSON: OpenAI's shape, or `shape`'s (another API's, named by its handlers' `opt`)."""
    headers = err.headers()
    if request_id:
        headers["x-request-id"] = request_id
    return Response(content=shape(err) if shape else encode(err.body()), status_code=err.status,
                    media_type="application/json", headers=headers)


def _shape(request: Request) -> Callable[[APIError], bytes] | None:
    """The error shape of the endpoint asked for: a handler's `opt={"error_body": ...}` (gateway/anthropic_api.py)."""
    handler = request.scope.get("route_handler")
    return handler.opt.get("error_body") if handler is not None else None


def _request_id(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")


def _respond(request: Request, err: APIError, headers: dict[str, str] | None = None) -> Response:
    """The error response, counted by the app's `on_error(route, status)` hook when it has one."""
    on_error = getattr(request.app.state, "on_error", None)
    if on_error is not None:
        on_error(request.scope.get("state", {}).get("route"), err.status)
    response = error_response(err, _request_id(request), _shape(request))
    response.headers.update(headers or {})
    return response


def handle_api_error(request: Request, exc: APIError) -> Response:
    return _respond(request, exc)


def handle_invalid_parameter(request: Request, exc: InvalidParameter) -> Response:
    """A request the protocol refused while decoding or translating it: 400 naming the field."""
    return _respond(request, APIError(400, str(exc), param=exc.param, code=exc.code))


def handle_unsupported_media_type(request: Request, exc: UnsupportedMediaType) -> Response:
    return _respond(request, APIError(415, str(exc), code="unsupported_media_type"))


def handle_client_disconnected(request: Request, exc: ClientDisconnected) -> Response:
    """Nobody reads this answer; it is counted as 499 (nginx's "client closed request"), not as a 500."""
    return _respond(request, APIError(499, str(exc), code="client_closed_request"))


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    """Litestar's own errors (routing, body size, decoding) re-shaped as OpenAI errors."""
    status = exc.status_code
    if status == 404:
        err = APIError(404, f"Unknown path {request.url.path}; see /schema for the API", code="not_found")
    elif status == 405:  # Litestar's exception carries the Allow header a 405 must send
        allow = (exc.headers or {}).get("allow", "")
        err = APIError(405, f"Method {request.method} is not allowed on {request.url.path}; allowed: {allow}",
                       code="method_not_allowed")
        return _respond(request, err, {"allow": allow})
    elif status == 413:
        err = APIError(413, f"Request body is too large: {exc.detail}", code="request_too_large")
    elif status == 400 and ("JSON" in str(exc.detail) or "decode" in str(exc.detail).lower()):
        err = APIError(400, f"Could not parse the JSON body of the request: {exc.detail}", code="invalid_json")
    elif isinstance(exc, ValidationException) or status == 400:
        err = APIError(400, f"Invalid request: {exc.detail}", code="invalid_request")
    else:
        err = APIError(status, str(exc.detail), code=None)
    return _respond(request, err)


def handle_unexpected(request: Request, exc: Exception) -> Response:
    """500 with the request id for the logs; the stack trace goes to the log, never to the client."""
    request_id = _request_id(request)
    log.exception("unhandled error in request %s", request_id, exc_info=exc)
    err = APIError(500, f"Internal server error (request id {request_id}); the details are in the server log",
                   code="internal_error")
    return _respond(request, err)


EXCEPTION_HANDLERS = {APIError: handle_api_error, InvalidParameter: handle_invalid_parameter,
                      UnsupportedMediaType: handle_unsupported_media_type, ClientDisconnected: handle_client_disconnected,
                      HTTPException: handle_http_exception,
                      Exception: handle_unexpected}
