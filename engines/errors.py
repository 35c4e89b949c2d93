"""Errors the engines raise or report at their edge, with typed codes: a rejected request (the caller's
fault, never retried as-is), an engine failure carried back to one request as an error output, and a dead
engine. The gateway maps codes to HTTP statuses; nobody parses the message text."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ErrorCode(StrEnum):
    """Why the engine refused or ended a request. The value is the OpenAI-style `code` a client sees."""

    INVALID_REQUEST = "invalid_request"  # bad options or prompt (empty, token ids out of range, duplicate id)
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max_tokens beyond the context
    KV_CAPACITY_EXCEEDED = "kv_capacity_exceeded"  # more KV pages than the whole pool has
    TTFT_EXPIRED = "ttft_deadline_exceeded"  # dropped before its first token: its TTFT target had passed
    ENGINE_ERROR = "engine_error"  # the forward pass, sampling or drafting failed for this request
    ENGINE_DEAD = "engine_dead"  # the engine loop has stopped (shut down or crashed)
    COMPILE_BUSY = "compile_pool_busy"  # every grammar compile slot taken and its queue full: retry later


@dataclass(frozen=True)
class EngineError:
    """An engine failure reported on a request's final output (`RequestOutput.error`)."""

    code: ErrorCode
    message: str

    def __str__(self) -> str:
        return self.message


class RequestRejected(ValueError):
    """A request that can never be served as given (too long for the context or the KV pool, bad options).

    Raised by `AsyncEngine.generate` / `LLM.generate` before the first output; the message says what to change.
    """

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param  # the request field at fault, when one is (an API names it in its error)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down or crashed) and accepts no more requests."""

    code = ErrorCode.ENGINE_DEAD
