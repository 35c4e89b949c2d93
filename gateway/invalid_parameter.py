"""`InvalidParameter`, the 400 a request parameter earns, in a module of its own so that the request types
(gateway/protocol.py) and the helpers that read them (gateway/structured_outputs.py) both raise it without
importing each other; gateway/protocol.py re-exports it."""

from __future__ import annotations


class InvalidParameter(ValueError):
    """A request parameter the server cannot accept (a 400); `param` names it for the OpenAI error body."""

    def __init__(self, param: str | None, message: str, *, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code
