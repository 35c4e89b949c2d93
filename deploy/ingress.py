"""The one OpenAI endpoint in front of the replicas: reads a generation request's body just enough to route it
(the model names the route, the prompt's leading blocks the prefix key), calls a replica through its
streaming handle and passes status, headers and body through unchanged, SSE included. Its own errors keep
tandem's semantics: a replica lost before the first byte is retried on another; one lost mid-stream ends the
stream with an error event and `[DONE]` (never a hang); no capacity is a 503 with Retry-After. It loads no
torch and no tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from deploy.prefix import block_hashes, prompt_text

log = logging.getLogger("tandem.deploy")

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
REPLICA_LOST = (ActorDiedError, ActorUnavailableError, RayActorError)
SSE_DONE = b"data: [DONE]\n\n"
HOP_BY_HOP = {"connection", "transfer-encoding", "keep-alive", "content-length"}


def error_body(status: int, message: str, code: str) -> bytes:
    """OpenAI's error shape, as gateway/errors.py writes it (not imported: it would load torch here)."""
    kind = {429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


def error_response(status: int, message: str, code: str, retry_after: int | None = None) -> Response:
    headers = {"retry-after": str(retry_after)} if retry_after is not None else {}
    return Response(error_body(status, message, code), status_code=status, media_type="application/json",
                    headers=headers)


def routing_key(path: str, body: bytes, *, affinity: bool) -> dict[str, Any]:
    """What the request router reads: the route (the body's `model`) and the prompt's chained block hashes.
    A body that does not parse gets no key; the replica answers it with tandem's own 400."""
    if path not in GENERATION_PATHS:
        return {}
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("model"), str):
        return {}
    model = data["model"]
    return {"route": model, "hashes": block_hashes(model, prompt_text(data)), "affinity": affinity}


class OpenAIIngress:
    """The ingress deployment. `affinity` False sends every request by power of two choices; with
    `allow_routing_override` a request's `x-tandem-routing: pow2` header does so for that request
    (benchmarks compare both on the same replicas)."""

    def __init__(self, replicas: DeploymentHandle, *, affinity: bool = True, allow_routing_override: bool = False,
                 retries: int = 2, first_byte_timeout_s: float = 600.0):
        self.replicas = replicas.options(stream=True, method_name="handle")
        self.affinity = affinity
        self.allow_routing_override = allow_routing_override
        self.retries = retries
        self.first_byte_timeout_s = first_byte_timeout_s

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/health":
            return Response(b'{"status":"ok"}', media_type="application/json")
        body = await request.body()
        affinity = self.affinity
        if self.allow_routing_override and request.headers.get("x-tandem-routing") == "pow2":
            affinity = False
        forwarded = {"method": request.method, "path": path, "query": request.url.query,
                     "headers": [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP],
                     "body": body, "routing": routing_key(path, body, affinity=affinity)}
        for attempt in range(self.retries + 1):
            stream = self.replicas.remote(forwarded)
            try:
                start = await asyncio.wait_for(stream.__anext__(), self.first_byte_timeout_s)
            except REPLICA_LOST as exc:  # nothing was sent yet: another replica can take it
                log.warning("replica lost before the first byte (attempt %d): %s", attempt + 1, exc)
                if attempt < self.retries:
                    await asyncio.sleep(0.2 * (attempt + 1))
                    continue
                return error_response(503, "No tandem replica could take the request; retry shortly",
                                      "replica_unavailable", retry_after=1)
            except BackPressureError:
                return error_response(503, "Every tandem replica is at capacity; retry shortly", "overloaded",
                                      retry_after=1)
            except TimeoutError:
                stream.cancel()
                return error_response(503, f"No replica answered within {self.first_byte_timeout_s:g} s",
                                      "replica_timeout", retry_after=5)
            except StopAsyncIteration:
                return error_response(500, "The replica ended the exchange without a response", "replica_error")
            return self._pass_through(start, stream)
        raise AssertionError("unreachable")

    def _pass_through(self, start: dict[str, Any], stream: Any) -> Response:
        headers = [(k, v) for k, v in start["headers"] if k.lower() not in HOP_BY_HOP]
        is_sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers)
        response = StreamingResponse(self._body(stream, is_sse, start.get("body", b"")), status_code=start["status"])
        response.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        return response

    async def _body(self, stream: Any, is_sse: bool, first: bytes = b"") -> AsyncIterator[bytes]:
        """The body's first chunk came with the start (`TandemReplica.handle`); the rest is passed on as it
        comes, bytes untouched."""
        try:
            if first:
                yield first
            async for chunk in stream:
                yield chunk
        except Exception as exc:  # the replica died mid-answer: a stream gets an error event and [DONE]
            log.warning("replica failed mid-response: %s: %s", type(exc).__name__, exc)
            if not is_sse:
                raise
            message = "The replica serving this stream failed; retry the request"
            yield b"data: " + error_body(503, message, "replica_failed") + b"\n\n" + SSE_DONE
        finally:
            stream.cancel()  # a client that left: the replica's exchange sees a disconnect and frees its KV


def ingress_deployment(**options: Any) -> Any:
    return serve.deployment(OpenAIIngress, name="OpenAIIngress", **options)
