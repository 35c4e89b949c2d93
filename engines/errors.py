"""Errors the engines raise at their edge: a rejected request (the caller's fault, never retried as-is)
and an engine failure carried back to one request as an error output."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request that can never be served as given (too long for the context or the KV pool, bad options).

    Raised by `AsyncEngine.generate` / `LLM.generate` before the first output; the message says what to change.
    """


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down or crashed) and accepts no more requests."""
