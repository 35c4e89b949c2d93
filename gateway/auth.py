"""API-key authentication (`Authorization: Bearer`, or Anthropic's `x-api-key`) and per-key admission, as ASGI
middleware on the `/v1` API.

With no keys configured auth is off (every request is the anonymous key); `/health`, `/ready`, `/metrics`,
`/version` and `/schema` stay open so probes and scrapers need no key (`/tokenize` and `/detokenize` need one).
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import time

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Receive, Scope, Send

from gateway.config import AuthConfig
from gateway.errors import APIError
from gateway.limits import ANONYMOUS, RateLimiter
from gateway.protocol import InvalidParameter, client_request_id

log = logging.getLogger("tandem.gateway")

AUTHENTICATED_PATHS = frozenset({"/tokenize", "/detokenize"})  # beside /v1/...: they run the tokenizer
_UNLIMITED = re.compile(r"/v1/(models|routes)(/|$)")  # listings spend no request of a key's requests/minute


class KeyRing:
    """The configured keys and their limits; `identify` turns an Authorization header into a key."""

    def __init__(self, auth: AuthConfig):
        self.keys = [k.key for k in auth.keys()]
        self.limiter = RateLimiter(auth.keys(), default_rpm=auth.requests_per_minute,
                                   default_tpm=auth.tokens_per_minute)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def identify(self, authorization: str | None, api_key: str | None = None) -> str:
        """The key of `Authorization: Bearer <key>`, or of Anthropic's `x-api-key: <key>` when that is sent."""
        if not self.enabled:
            return ANONYMOUS
        if not authorization and not api_key:
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                           code="missing_api_key")
        if authorization:
            scheme, _, token = authorization.partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not token:
                raise APIError(401, "Malformed Authorization header: expected 'Bearer <key>'",
                               code="invalid_api_key")
        else:
            token = (api_key or "").strip()
        for key in self.keys:  # constant-time comparison: no timing hints about a key's prefix
            if hmac.compare_digest(key.encode(), token.encode()):
                return key
        raise APIError(401, f"Incorrect API key provided: {_redact(token)}", code="invalid_api_key")


def _redact(token: str) -> str:
    return token[:3] + "..." + token[-2:] if len(token) > 8 else "***"


class AuthMiddleware(ASGIMiddleware):
    """Give the request its id and arrival time, authenticate, then spend one of the key's requests/minute; the
    id and the key land in scope state (one middleware, not three: each layer costs on every request). Its
    tokens/minute are reserved later, once the prompt's size is known (gateway/lifecycle.py)."""

    scopes = (ScopeType.HTTP,)

    def __init__(self, keyring: KeyRing):
        self.keyring = keyring

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        state = scope.setdefault("state", {})
        state["arrival"] = time.monotonic()  # TTFT and E2E count from here, before the body is parsed
        authorization = api_key = client_id = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"x-api-key":
                api_key = value.decode("latin-1")
            elif name == b"x-request-id":
                client_id = value
        state["request_id"] = os.urandom(16).hex()  # as random as uuid4().hex, a third of its cost
        if client_id is not None:  # a client's own id is kept (validated): echoed and the response id's base
            try:
                state["request_id"] = client_request_id(client_id)
            except InvalidParameter as exc:
                raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
            state["client_request_id"] = True  # engine and admission ids then get a suffix: clients may reuse it
        if scope["path"].startswith("/v1/") or scope["path"] in AUTHENTICATED_PATHS:
            key = self.keyring.identify(authorization, api_key)
            if self.keyring.limiter.active and not _UNLIMITED.match(scope["path"]):
                await self.keyring.limiter.admit(key)
            state["api_key"] = key
        await next_app(scope, receive, send)


def warn_if_open(keyring: KeyRing, host: str) -> None:
    """Auth off on an address other machines can reach deserves a loud line in the log."""
    if not keyring.enabled and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no API keys configured and binding to %s: anyone who can reach this address can use the "
                    "API; set auth.api_keys or TANDEM_API_KEYS", host)
