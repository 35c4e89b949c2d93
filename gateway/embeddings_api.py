"""OpenAI's `POST /v1/embeddings`: text or token-id inputs embedded by one engine of the route (its first, always
the same, so the vectors of a route share one space) from the model's last hidden state, pooled as its
`[engines.NAME] pooling` says and normalised, each input a prefill-only request in that engine's step loop
(engines/embedding.py); `float` or `base64` vectors, usage counted against the key's tokens/minute.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Annotated, Any, Literal

from litestar import Request, Response, post
from litestar.params import JSONBody
from msgspec import Meta, Struct
from opentelemetry import trace

from engines.embedding import EmbeddingBusy, EmbeddingFailed
from engines.errors import RequestRejected
from gateway.answers import encode
from gateway.engine_errors import engine_api_error
from gateway.errors import APIError
from gateway.lifecycle import engine_request_id, resolve_route, shed
from gateway.openapi import error_responses
from gateway.prompts import INLINE_CHARS

MAX_INPUTS = 2048  # inputs in one request (OpenAI's bound)
MAX_REQUEST_TOKENS = 65536  # tokens in one request, all inputs together: the work one request may ask for


class EmbeddingRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: Annotated[str, Meta(min_length=1)] | Annotated[list[Any], Meta(
        min_length=1, description=f"a string, token ids, or a list of 1 to {MAX_INPUTS} strings or token-id lists")]
    encoding_format: Literal["float", "base64"] | None = None  # null (LiteLLM sends it) is the default, float
    dimensions: Annotated[int, Meta(ge=1)] | None = None  # only the model's own size: no truncation is done
    user: str | None = None


def _inputs(data: EmbeddingRequest) -> list[tuple[str, str | list[int]]]:
    """(param, text or token ids) per input, in OpenAI's four forms."""
    value: Any = data.input
    if isinstance(value, str):
        return [("input", value)]
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [("input", value)]
    if len(value) > MAX_INPUTS:
        raise APIError(400, f"input holds {len(value)} inputs; at most {MAX_INPUTS} per request", param="input",
                       code="invalid_value")
    out: list[tuple[str, str | list[int]]] = []
    for i, one in enumerate(value):
        where = f"input[{i}]"
        token_ids = isinstance(one, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in one)
        if not (isinstance(one, str) or token_ids) or not one:
            raise APIError(400, f"{where} must be a non-empty string or list of token ids", param=where,
                           code="invalid_value")
        out.append((where, one))
    return out


async def _token_ids(engine: Any, inputs: list[tuple[str, str | list[int]]]) -> list[list[int]]:
    tokenizer = engine.tokenizer
    chars = sum(len(one) for _, one in inputs if isinstance(one, str))
    if any(isinstance(one, str) for _, one in inputs) and tokenizer is None:
        raise APIError(400, f"model {engine.name!r} has no tokenizer: send token ids", param="input",
                       code="invalid_value")

    def encode_all() -> list[list[int]]:
        return [tokenizer.encode(one) if isinstance(one, str) else one for _, one in inputs]

    ids = await asyncio.to_thread(encode_all) if chars > INLINE_CHARS else encode_all()
    vocab = tokenizer.vocab_size if tokenizer is not None else None
    for (param, _), one in zip(inputs, ids, strict=True):
        if not one:
            raise APIError(400, f"{param} has no tokens", param=param, code="invalid_value")
        if len(one) > engine.max_model_len:
            raise APIError(400, f"{param} has {len(one)} tokens but {engine.name!r} has a context of "
                           f"{engine.max_model_len}", param=param, code="context_length_exceeded")
        if vocab is not None and (max(one) >= vocab or min(one) < 0):
            raise APIError(400, f"{param}: token ids must be in [0, {vocab}) for model {engine.name!r}",
                           param=param, code="invalid_value")
    return ids


@post("/v1/embeddings", status_code=200, responses=error_responses(400, 401, 404, 413, 415, 429, 503))
async def create_embeddings(request: Request, data: JSONBody[EmbeddingRequest]) -> Response:
    """Embeddings (docs/api.md): one vector per input, in input order."""
    started = time.monotonic()
    state = request.app.state.gateway
    route = resolve_route(request, state, data.model)
    name = route.config.engines[0]
    engine = state.engines[name]
    inputs = _inputs(data)
    size = engine.embedding_size
    if data.dimensions is not None and data.dimensions != size:
        raise APIError(400, f"dimensions = {data.dimensions} is not supported: model {name!r} gives {size} "
                       f"dimensions and this server does not shorten them", param="dimensions",
                       code="unsupported_value")
    span = trace.get_current_span()
    span.update_name(f"embeddings {data.model}")
    span.set_attributes({"gen_ai.operation.name": "embeddings", "gen_ai.provider.name": "tandem",
                         "gen_ai.request.model": data.model, "tandem.route": route.name,
                         "gen_ai.response.model": name})
    scope_state = request.scope["state"]
    tokens = state.keyring.limiter.reservation(scope_state.get("api_key"))
    state.inflight += 1
    try:
        ids = await _token_ids(engine, inputs)
        count = sum(len(one) for one in ids)
        if count > MAX_REQUEST_TOKENS:
            raise APIError(400, f"input holds {count} tokens; at most {MAX_REQUEST_TOKENS} per request (split it)",
                           param="input", code="invalid_value")
        if tokens is not None:  # the whole cost is known: reserved (429 past the budget) and settled at once
            await tokens.reserve(count)
            tokens.settle(count)
        admission = state.admission
        request_id = engine_request_id(scope_state)
        if admission is not None:  # booked on the route's engine as its prompt tokens: shed like chat is
            d = admission.admit(request_id, route.name, name, count, pinned=True)
            span.set_attributes({"tandem.admission.action": d.action, "tandem.admission.reason": d.reason})
            if not d.admitted:
                raise shed(state, route.name, d)
        try:  # one prefill-only request per input in the engine's step loop, batched with everything else
            vectors = await engine.embed(ids, state.cfg.engines[name].pooling, priority=route.config.priority)
            if admission is not None:
                admission.first_token(request_id)  # its prefill time teaches the TTFT prediction
        except EmbeddingBusy as exc:
            raise APIError(503, f"The server is overloaded: {exc}", code="overloaded", retry_after=1) from None
        except EmbeddingFailed as exc:
            raise engine_api_error(exc.error.code, exc.error.message) from None
        except RequestRejected as exc:
            raise engine_api_error(exc.code, str(exc), param=exc.param or "input") from None
        finally:
            if admission is not None:
                admission.release(request_id)
    finally:
        state.inflight -= 1
    state.telemetry.observe_request(route=route.name, model=name, ttft_s=None, tpot_s=None,
                                    e2e_s=time.monotonic() - started, itls=[], output_tokens=0, prompt_tokens=count,
                                    finish_reason="stop", queue_s=None, operation="embeddings",
                                    request_model=data.model)
    span.set_attribute("gen_ai.usage.input_tokens", count)
    if data.encoding_format == "base64":  # little-endian float32, as OpenAI's SDKs decode it
        rows: list[Any] = [base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() for v in vectors]
    else:
        rows = vectors.tolist()
    body = {"object": "list", "model": data.model, "usage": {"prompt_tokens": count, "total_tokens": count},
            "data": [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]}
    headers = {"x-request-id": scope_state["request_id"], "x-tandem-route": route.name, "x-tandem-model": name}
    return Response(content=encode(body), media_type="application/json", headers=headers)


HANDLERS = [create_embeddings]
