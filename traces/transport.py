"""An httpx transport with an O(1) keep-alive pool for the load generator.

httpcore's pool (1.0.x) rescans every open connection, with a poll() per idle one and a quadratic idle count,
on each request start and end; under an open-loop burst that cost grows with the connections in flight and
the generator falls behind exactly when the server is slow. This transport keeps idle HTTP/1.1 connections
per origin in a LIFO free list: take one (or dial), return it when its response is fully read.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator

import httpcore
import httpx

_DEFAULT_PORTS = {b"http": 80, b"https": 443}


class _PooledStream(httpx.AsyncByteStream):
    """The response body; closing it hands the connection back to the pool (or closes it)."""

    def __init__(self, stream, conn: httpcore.AsyncHTTPConnection, pool: KeepAliveTransport, key):
        self._stream, self._conn, self._pool, self._key = stream, conn, pool, key

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._stream:
            yield part

    async def aclose(self) -> None:
        await self._stream.aclose()
        await self._pool._release(self._key, self._conn)


class KeepAliveTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 keep-alive connections reused across requests, at most `max_idle` kept per origin."""

    def __init__(self, max_idle: int = 1024, keepalive_expiry: float = 30.0,
                 ssl_context: ssl.SSLContext | None = None):
        self._idle: dict[tuple, list[httpcore.AsyncHTTPConnection]] = {}
        self._max_idle = max_idle
        self._expiry = keepalive_expiry
        self._ssl = ssl_context
        self.dialled = 0  # connections opened (a measure of keep-alive reuse)

    def _connection(self, key: tuple) -> httpcore.AsyncHTTPConnection:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.is_idle() and not conn.has_expired():
                return conn
        scheme, host, port = key
        if scheme == b"https" and self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        self.dialled += 1
        return httpcore.AsyncHTTPConnection(httpcore.Origin(scheme, host, port), ssl_context=self._ssl,
                                            keepalive_expiry=self._expiry)

    async def _release(self, key: tuple, conn: httpcore.AsyncHTTPConnection) -> None:
        idle = self._idle.setdefault(key, [])
        if conn.is_idle() and len(idle) < self._max_idle:
            idle.append(conn)
        else:
            await conn.aclose()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.raw_scheme, url.raw_host, url.port or _DEFAULT_PORTS.get(url.raw_scheme, 80))
        conn = self._connection(key)
        req = httpcore.Request(method=request.method,
                               url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port,
                                                target=url.raw_path),
                               headers=request.headers.raw, content=request.stream, extensions=request.extensions)
        try:
            resp = await conn.handle_async_request(req)
        except BaseException:
            await conn.aclose()
            raise
        return httpx.Response(status_code=resp.status, headers=resp.headers,
                              stream=_PooledStream(resp.stream, conn, self, key), extensions=resp.extensions)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                await conn.aclose()
        self._idle.clear()
