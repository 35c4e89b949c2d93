"""The one table from an engine's typed error code (`engines.errors.ErrorCode`) to what the client sees: HTTP
status, Retry-After and the OpenAI error fields. The engine's message is passed on, never parsed.
"""

from __future__ import annotations

from engines.errors import ErrorCode
from gateway.errors import APIError

# engine error code -> (HTTP status, Retry-After seconds or None)
ENGINE_STATUS: dict[ErrorCode, tuple[int, int | None]] = {
    ErrorCode.INVALID_REQUEST: (400, None), ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, None),
    ErrorCode.KV_CAPACITY_EXCEEDED: (400, None), ErrorCode.TTFT_EXPIRED: (503, 1),
    ErrorCode.ENGINE_ERROR: (500, None), ErrorCode.ENGINE_DEAD: (503, 5),
    ErrorCode.COMPILE_BUSY: (503, 1)}


def engine_api_error(code: ErrorCode, message: str, param: str | None = None) -> APIError:
    """The client's view of an engine refusal or failure: status and Retry-After by its typed code; `param`
    names the request field at fault when the caller knows it."""
    status, retry_after = ENGINE_STATUS[code]
    if code is ErrorCode.TTFT_EXPIRED:
        message = f"The request was dropped: it {message}; retry later"
    elif code is ErrorCode.ENGINE_DEAD:
        message = f"The engine is not running: {message}"
    elif status >= 500:
        message = f"The engine failed this request: {message}"
    return APIError(status, message, code=code.value, param=param, retry_after=retry_after)
