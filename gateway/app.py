"""The Litestar app: OpenAI-compatible endpoints over the engines, with thin handlers; routing, auth, limits,
errors and telemetry live in their own modules. `create_app(config)` builds it; the engines load in the
background at start-up (`/ready` answers 503 until they are up).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.exceptions import ValidationException
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.params import JSONBody, QueryParameter
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import Receive, Send
from opentelemetry import trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engines.errors import EngineDeadError, ErrorCode, RequestRejected
from engines.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from gateway.admission import AdmissionController, AdmissionDecision, AdmissionSettings
from gateway.auth import AuthMiddleware, KeyRing
from gateway.autoscale import Autoscaler, AutoscaleSettings, signals_from
from gateway.config import TandemConfig, engine_core_args
from gateway.errors import EXCEPTION_HANDLERS, APIError, handle_api_error, handle_http_exception
from gateway.protocol import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    InvalidParameter,
    ModelCard,
    ModelList,
    TokenLogprob,
    TopLogprob,
    Usage,
    encode,
    prompt_input,
    sampling_params,
    sse,
)
from gateway.routing import Route, RoutedRun, Routes, RoutingContext, start_on
from gateway.slo import SLOAccounting
from gateway.telemetry import (
    Telemetry,
    add_child_span,
    add_engine_spans,
    add_escalation_span,
    build_meter_provider,
    build_tracer_provider,
    otel_plugin,
)

log = logging.getLogger("tandem.gateway")
# Run attribute a cascade sets once it has decided (gateway/cascade.py); the app turns it into a header.
ESCALATED = "tandem.cascade.escalated"


class EngineHost(Protocol):
    """What the app needs from `engines.EngineCore` (the benchmark's fake engine implements it too)."""

    def start(self) -> None: ...
    def shutdown(self) -> None: ...
    def engine(self, name: str) -> Any: ...
    def stats(self) -> dict: ...


def default_host_factory(cfg: TandemConfig) -> Callable[[], EngineHost]:
    def build() -> EngineHost:
        from engines import EngineCore

        specs, pool, device = engine_core_args(cfg)
        return EngineCore(specs, pool, device=device)
    return build


@dataclass
class GatewayState:
    cfg: TandemConfig
    routes: Routes
    keyring: KeyRing
    telemetry: Telemetry
    slo: SLOAccounting
    autoscaler: Autoscaler
    admission: AdmissionController | None = None  # None: [admission] enabled = false
    host: EngineHost | None = None
    engines: dict[str, Any] = field(default_factory=dict)
    load_error: str | None = None
    inflight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def ready(self) -> bool:
        return self.host is not None and bool(self.engines)

    def engine_stats(self) -> dict[str, dict]:
        """Every engine's stats, with its busy seconds fed to the cost accounting on the way."""
        stats = {name: engine.stats() for name, engine in self.engines.items()}
        for name, s in stats.items():
            if "busy_s" in s:
                self.slo.observe_engine_busy(name, float(s["busy_s"]))
        return stats


# ------------------------------------------------------------------------------------------ handlers


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


@get("/health", sync_to_thread=False)
def health() -> dict[str, str]:
    return {"status": "ok"}


@get("/ready")
async def ready(request: Request) -> Response:
    state = _state(request)
    if state.ready:
        return Response({"status": "ready", "engines": sorted(state.engines)})
    detail = state.load_error or "models are loading"
    return Response({"status": "not_ready", "detail": detail}, status_code=503, headers={"retry-after": "5"})


@get("/metrics", sync_to_thread=False, include_in_schema=False)
def metrics(request: Request) -> Response:
    return Response(generate_latest(_state(request).telemetry.registry), media_type=CONTENT_TYPE_LATEST)


@get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state = _state(request)
    cards = []
    for name, route in state.routes.routes.items():
        if name in state.routes.unavailable:
            continue
        lens = [getattr(state.engines.get(e), "max_model_len", None) for e in route.config.engines]
        cards.append(ModelCard(id=name, created=state.created, owned_by="tandem",
                               kind="engine" if route.direct else "route",
                               max_model_len=min(lens) if lens and None not in lens else None))
    return ModelList(data=cards)


@get("/v1/routes")
async def list_routes(request: Request) -> dict[str, Any]:
    state = _state(request)
    state.engine_stats()  # busy time for the cost columns
    reports = state.slo.reports()
    out = []
    for name, route in state.cfg.routes.items():
        out.append({"name": name, "description": route.description, "strategy": route.strategy,
                    "engines": route.engines, "available": name not in state.routes.unavailable,
                    "priority": route.priority, "max_tokens": route.max_tokens,
                    "allow_downgrade": route.allow_downgrade, "slo": msgspec.to_builtins(route.slo),
                    "max_waiting": route.max_waiting,
                    "waiting": state.admission.num_waiting(name) if state.admission is not None else None,
                    "attainment": msgspec.to_builtins(reports[name])})
    return {"object": "list", "data": out,
            "admission": state.admission.stats() if state.admission is not None else None}


@get("/v1/autoscale")
async def autoscale(request: Request, replicas: Annotated[int, QueryParameter(ge=1)] = 1) -> dict[str, Any]:
    """The desired replica count for this deployment and why (KEDA / Ray Serve poll it; `replicas`: now)."""
    state = _state(request)
    signals = signals_from(state.engine_stats(), state.slo.reports(), max(1, replicas))
    return msgspec.to_builtins(state.autoscaler.evaluate(signals))


# template variables the gateway itself passes: a request may not override them through chat_template_kwargs
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, data: JSONBody[ChatCompletionRequest]) -> Response | Stream:
    state = _state(request)
    route = _admit(request, state, data.model)
    messages = [m.to_template() for m in data.messages]
    if not messages:
        raise APIError(400, "messages must contain at least one message", param="messages", code="invalid_value")
    extra = dict(data.chat_template_kwargs or {})
    reserved = sorted(extra.keys() & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {reserved}: pass them as request fields",
                       param=f"chat_template_kwargs.{reserved[0]}", code="invalid_value")
    if "chat_template" in extra and not state.cfg.server.allow_request_chat_template:
        raise APIError(400, "chat_template_kwargs.chat_template: a request's own chat template is disabled on "
                       "this server (the operator can allow it with [server] allow_request_chat_template)",
                       param="chat_template_kwargs.chat_template", code="invalid_value")
    if "chat_template" in extra and not isinstance(extra["chat_template"], str):
        raise APIError(400, "chat_template_kwargs.chat_template must be a string",
                       param="chat_template_kwargs.chat_template", code="invalid_value")

    def render(engine: Any) -> str:
        tokenizer = engine.tokenizer
        if not tokenizer.has_chat_template:
            raise APIError(400, f"model {engine.name!r} has no chat template; use /v1/completions",
                           param="messages", code="no_chat_template")
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=data.add_generation_prompt,
                                                 **extra)
        except ValueError as exc:  # ChatTemplateError: the template rejected this conversation
            raise APIError(400, f"chat template error: {exc}", param="messages", code="invalid_value") from None

    ctx_kwargs = {"conversation": messages}
    return await _serve(request, state, route, data, "chat", render, ctx_kwargs)


@post("/v1/completions", status_code=200)
async def completions(request: Request, data: JSONBody[CompletionRequest]) -> Response | Stream:
    state = _state(request)
    route = _admit(request, state, data.model)
    try:
        prompt = prompt_input(data)
    except InvalidParameter as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None

    def render(engine: Any) -> str | list[int]:
        return prompt

    ctx_kwargs = {"prompt_text": prompt if isinstance(prompt, str) else None}
    return await _serve(request, state, route, data, "text_completion", render, ctx_kwargs)


# ------------------------------------------------------------------------------------- the core path


def _admit(request: Request, state: GatewayState, model: str) -> Route:
    if not state.ready:
        raise APIError(503, f"The server is not ready: {state.load_error or 'models are loading'}",
                       code="not_ready", retry_after=5)
    if state.inflight >= state.cfg.server.max_inflight_requests:
        raise APIError(503, f"The server is overloaded ({state.inflight} requests in flight); retry shortly",
                       code="overloaded", retry_after=1)
    route = state.routes.resolve(model)
    request.scope["state"]["route"] = route.name  # the error counter's route label from here on
    return route


@dataclass
class _Progress:
    """Timing and token counts of one request, for usage, metrics and spans."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    itls: list[float] = field(default_factory=list)
    last: RequestOutput | None = None

    def saw(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if any(c.delta_token_ids for c in out.outputs):
            if self.first_token is None:
                self.first_token = now
            elif self.last_token is not None:
                self.itls.append(now - self.last_token)
            self.last_token = now
        self.last = out


async def _serve(request: Request, state: GatewayState, route: Route,
                 data: ChatCompletionRequest | CompletionRequest, operation: str,
                 render: Callable[[Any], str | list[int]], ctx_kwargs: dict[str, Any]) -> Response | Stream:
    arrival = request.scope["state"].get("arrival") or time.monotonic()
    request_id = request.scope["state"]["request_id"]
    telemetry = state.telemetry
    span = trace.get_current_span()
    span.update_name(f"{operation} {data.model}")
    attributes = {"gen_ai.operation.name": operation, "gen_ai.provider.name": "tandem",
                  "gen_ai.request.model": data.model, "tandem.route": route.name}
    for attr, value in (("temperature", data.temperature), ("top_p", data.top_p), ("seed", data.seed)):
        if value is not None:
            attributes[f"gen_ai.request.{attr}"] = value
    span.set_attributes(attributes)  # one call: each attribute set takes the span's lock
    try:
        params = sampling_params(data, default_max_tokens=None if operation == "chat" else 16,
                                 max_tokens_cap=route.config.max_tokens)
    except InvalidParameter as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    if params.max_tokens is not None:
        span.set_attribute("gen_ai.request.max_tokens", params.max_tokens)
    if state.cfg.telemetry.record_content:
        span.set_attribute("gen_ai.input.messages", json.dumps(
            ctx_kwargs.get("conversation") or [{"role": "user", "content": ctx_kwargs.get("prompt_text")}]))
    slo = route.config.slo
    ctx = RoutingContext(request_id=request_id, params=params, priority=route.config.priority, render=render,
                         ttft_s=slo.ttft_ms / 1000.0 if slo.ttft_ms is not None else None,
                         tpot_s=slo.tpot_ms / 1000.0 if slo.tpot_ms is not None else None, **ctx_kwargs)
    admitted = _admission(state, route, ctx, span)  # sheds with 503 + Retry-After
    route_start = time.time_ns()
    try:
        if admitted is not None and admitted.action == "downgrade":  # SLO pressure: the small engine
            run = start_on(state.engines[admitted.engine], ctx)
            run.attributes["tandem.admission.downgraded"] = True
        else:
            run = state.routes.start(route, ctx, state.engines)
    except BaseException as exc:
        if state.admission is not None:
            state.admission.release(request_id)
        if span.is_recording():
            add_child_span(telemetry.tracer, span, "route", route_start, time.time_ns(),
                           {"tandem.route": route.name, "tandem.route.strategy": route.config.strategy}, error=exc)
        raise
    # The route span is written with the others once the answer is out: spans cost CPU, not before the answer.
    route_span = None
    if span.is_recording():
        decision = {"tandem.route": route.name, "tandem.route.strategy": route.config.strategy,
                    "tandem.route.engine": run.engine.name, **run.attributes}
        if run.score is not None:
            decision["tandem.router.score"] = run.score
        route_span = (route_start, time.time_ns(), decision)
    decided = set(run.attributes)

    state.inflight += 1
    progress = _Progress(arrival)
    finish = _Finisher(state, route, run, progress, span, request.scope["state"].get("api_key"), operation,
                       data.model, request_id, route_span)
    try:
        first = await _first_output(run)
        if state.admission is not None:  # its prefill is done: the backlog shrinks, the drain rate learns
            state.admission.first_token(request_id) if not first.error else state.admission.release(request_id)
        progress.saw(first)
        # A cascade knows who answers only once its first output arrives: engine, headers and metrics are read
        # now.
        for key in run.attributes.keys() - decided:
            span.set_attribute(key, run.attributes[key])
        escalated = run.attributes.get(ESCALATED)
        if not route.direct:
            telemetry.labelled(telemetry.router_decisions, route.name, run.engine.name).inc()
        if escalated:
            telemetry.labelled(telemetry.cascade_escalations, route.name).inc()
        span.set_attribute("gen_ai.response.model", run.engine.name)
        headers = {"x-request-id": request_id, "x-tandem-route": route.name, "x-tandem-model": run.engine.name}
        if run.score is not None:
            headers["x-tandem-router-score"] = f"{run.score:.4f}"
        if escalated is not None:
            headers["x-tandem-escalated"] = "true" if escalated else "false"
        response_id = ("chatcmpl-" if operation == "chat" else "cmpl-") + request_id
        fmt = _Formatter(operation, response_id, int(time.time()), data.model, run.engine.tokenizer, data,
                         params.logprobs, ctx.prompt_text)
    except BaseException as exc:
        if isinstance(exc, APIError) and exc.code == ErrorCode.TTFT_EXPIRED.value:  # dropped late by the engine: a shed
            state.slo.observe_shed(route.name)
            if state.admission is not None:
                exc.retry_after = state.admission.retry_after_s(route.name, run.engine.name)
        finish.failed = isinstance(exc, APIError) and exc.status >= 500 and exc.code != ErrorCode.TTFT_EXPIRED.value
        finish.close()  # rejected, failed or cancelled before a byte went out: abort and release the slot
        raise

    if not data.stream:
        # A client that hangs up on a long non-streamed request must not keep its KV pages busy.
        watcher = None if first.finished else asyncio.create_task(_until_disconnect(request.receive))
        if watcher is not None:
            watcher.add_done_callback(lambda t: None if t.cancelled() else run.abort())
        try:
            out = first
            while not out.finished:
                out = await anext(run.outputs)
                progress.saw(out)
            if out.error:
                raise engine_api_error(out.error.code, out.error.message)
            body = encode(fmt.full(out))
        except BaseException:
            finish.close()
            await run.close()
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
        finish.done(out)

        async def after_body() -> None:  # metrics, spans and accounting once the answer is out, not before
            finish.close()
            await run.close()

        return Response(content=body, media_type="application/json", headers=headers,
                        background=BackgroundTask(after_body))

    include_usage = bool(data.stream_options and data.stream_options.include_usage)
    events = _stream_events(first, run, progress, fmt, finish, include_usage)

    async def after() -> None:
        await events.aclose()  # runs the stream's `finally` even if the client left while it sat at a yield
        finish.close()  # and releases the request if the stream never started

    return _EventStream(events, media_type="text/event-stream", headers=headers | {"cache-control": "no-cache"},
                        background=BackgroundTask(after))


class _EventStreamResponse(ASGIStreamingResponse):
    """Litestar's streaming response without its anyio task group, which cost about 0.05 ms a request: the
    body is written from this task while one watcher task waits for the client to leave and cancels it."""

    async def send_body(self, send: Send, receive: Receive) -> None:
        task = asyncio.current_task()
        streaming = True

        def client_left(watcher: asyncio.Task) -> None:
            if streaming and not watcher.cancelled() and watcher.exception() is None:
                task.cancel()  # the engine request is aborted by the stream's `finally`

        watcher = asyncio.create_task(_until_disconnect(receive))
        watcher.add_done_callback(client_left)
        try:
            done = False
            async for chunk in self.iterator:
                done = chunk.endswith(SSE_DONE)  # the last event: end the body in the same write
                await send({"type": "http.response.body", "body": chunk, "more_body": not done})
            if not done:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # cancelled from elsewhere (server shutdown): not ours to swallow
            task.uncancel()
        finally:
            streaming = False
            watcher.cancel()


class _EventStream(Stream):
    def to_asgi_response(self, app: Any, request: Request, *, background: Any = None, cookies: Any = None,
                         headers: dict[str, str] | None = None, is_head_response: bool = False,
                         media_type: Any = None, status_code: int | None = None, **_: Any) -> ASGIResponse:
        return _EventStreamResponse(
            background=self.background or background, content_length=0,
            cookies=[*self.cookies, *(cookies or [])], encoding=self.encoding,
            headers={**(headers or {}), **self.headers}, is_head_response=is_head_response,
            iterator=self.iterator, media_type=self.media_type or media_type,
            status_code=self.status_code or status_code)


def _admission(state: GatewayState, route: Route, ctx: RoutingContext, span: Any) -> AdmissionDecision | None:
    """Admit, downgrade or shed (APIError 503 + Retry-After) on the engine the route would start on."""
    if state.admission is None:
        return None
    names = route.config.engines
    engine_name = names[0] if len(names) == 1 else names[-1]  # router/cascade: judged on the large engine
    engine = state.engines[engine_name]
    render = ctx.render
    prompt = render(engine)
    ids = prompt if isinstance(prompt, list) else engine.tokenizer.encode(prompt)
    tokens = len(ids)

    def render_once(e: Any) -> str | list[int]:
        # The strategy starts this engine on the ids counted here: the engine need not tokenize them again.
        return ids if e is engine else render(e)

    ctx.render = render_once
    d = state.admission.admit(ctx.request_id, route.name, engine_name, tokens)
    attrs: dict[str, Any] = {"tandem.admission.action": d.action, "tandem.admission.reason": d.reason,
                             "tandem.admission.prompt_tokens": tokens}
    if d.predicted_ttft_s is not None:
        attrs["tandem.admission.predicted_ttft_ms"] = round(d.predicted_ttft_s * 1000.0, 3)
    if d.retry_after_s is not None:
        attrs["tandem.admission.retry_after_s"] = d.retry_after_s
    span.set_attributes(attrs)
    if d.admitted:
        return d
    state.slo.observe_shed(route.name)
    wait = max(1, math.ceil(d.retry_after_s or 1.0))
    why = ("its waiting queue is full" if d.reason == "queue_full" else
           f"the predicted time to first token ({d.predicted_ttft_s or 0.0:.2f} s) misses its "
           f"{(d.target_ttft_s or 0.0) * 1000:.0f} ms target")
    raise APIError(d.status or 503, f"Route {route.name!r} is overloaded: {why}; retry in {wait} s",
                   code="overloaded", retry_after=wait)


async def _until_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the body is already read, so the next ASGI message is the end)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# engine error code -> (HTTP status, Retry-After seconds or None); the message is the engine's, for the caller
_ENGINE_STATUS: dict[ErrorCode, tuple[int, int | None]] = {
    ErrorCode.INVALID_REQUEST: (400, None), ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, None),
    ErrorCode.KV_CAPACITY_EXCEEDED: (400, None), ErrorCode.TTFT_EXPIRED: (503, 1),
    ErrorCode.ENGINE_ERROR: (500, None), ErrorCode.ENGINE_DEAD: (503, 5)}


def engine_api_error(code: ErrorCode, message: str) -> APIError:
    """The client's view of an engine refusal or failure: status and Retry-After by its typed code."""
    status, retry_after = _ENGINE_STATUS[code]
    if code is ErrorCode.TTFT_EXPIRED:
        message = f"The request was dropped: it {message}; retry later"
    elif code is ErrorCode.ENGINE_DEAD:
        message = f"The engine is not running: {message}"
    elif status >= 500:
        message = f"The engine failed this request: {message}"
    param = "max_tokens" if code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and message.startswith("max_tokens") else None
    return APIError(status, message, code=code.value, param=param, retry_after=retry_after)


async def _first_output(run: RoutedRun) -> RequestOutput:
    """Wait for the first output so a rejected request becomes a 400 before any byte is sent."""
    try:
        first = await anext(run.outputs)
    except (RequestRejected, EngineDeadError) as exc:
        raise engine_api_error(exc.code, str(exc)) from None
    except StopAsyncIteration:
        raise APIError(500, "The engine ended the request without any output", code="engine_error") from None
    if first.error and (first.error.code is ErrorCode.TTFT_EXPIRED or not any(c.token_ids for c in first.outputs)):
        raise engine_api_error(first.error.code, first.error.message)
    return first


async def _stream_events(first: RequestOutput, run: RoutedRun, progress: _Progress, fmt: _Formatter,
                         finish: _Finisher, include_usage: bool) -> AsyncIterator[bytes]:
    """SSE events of one request; a failure after the first byte becomes an error event, then [DONE].

    The events of one engine output (every choice's delta, the finish, the usage) go out in one write: a
    write per event would cost a trip through every ASGI layer and a syscall each, for no earlier byte.
    """
    error: APIError | None = None
    pending: list[bytes] = fmt.opening(len(first.outputs))
    try:
        try:
            out = first
            while True:
                if out.error:
                    error = engine_api_error(out.error.code, out.error.message)
                    break
                pending.extend(fmt.deltas(out))
                if out.finished:
                    finish.done(out)
                    if include_usage:
                        pending.append(fmt.usage_chunk(out))
                    break
                if pending:
                    yield b"".join(pending)
                    pending.clear()
                out = await anext(run.outputs)
                progress.saw(out)
        except APIError as exc:
            error = exc
        except (RequestRejected, EngineDeadError) as exc:
            error = engine_api_error(exc.code, str(exc))
        except Exception:
            log.exception("stream of request %s failed", fmt.id)
            error = APIError(500, "Internal server error while streaming; see the server log",
                             code="internal_error")
        if error is not None:
            finish.state.telemetry.count_error(finish.route.name, error.status)
            pending.append(error.sse_event())
        pending.append(SSE_DONE)
        yield b"".join(pending)
    finally:
        finish.close()
        await run.close()


class _Finisher:
    """The end of a request, whichever way it ends: abort if unfinished, charge tokens, record telemetry."""

    def __init__(self, state: GatewayState, route: Route, run: RoutedRun, progress: _Progress, span: Any,
                 api_key: str | None, operation: str, request_model: str, request_id: str = "",
                 route_span: tuple[int, int, dict[str, Any]] | None = None):
        self.state, self.route, self.run, self.progress, self.span, self.api_key = (
            state, route, run, progress, span, api_key)
        self.operation, self.request_model, self.request_id = operation, request_model, request_id
        self.route_span = route_span  # (start ns, end ns, attributes) of the routing decision
        self.finished_ok = False
        self.failed = False  # ended by an engine or server error (a miss in the SLO accounting)
        self.closed = False

    def done(self, out: RequestOutput) -> None:
        self.finished_ok = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.state.inflight -= 1
        out = self.progress.last
        if not self.finished_ok:
            self.run.abort()  # a dropped client or a failure: free the engine's KV pages now
        if self.state.admission is not None:
            self.state.admission.release(self.request_id)  # no-op once its first token was counted
        if self.failed or (not self.finished_ok and out is not None and out.error):
            self.state.slo.observe_failure(self.route.name)
        if self.route_span is not None:
            add_child_span(self.state.telemetry.tracer, self.span, "route", *self.route_span)
        if out is None:
            return
        prompt_tokens = len(out.prompt_token_ids)
        output_tokens = sum(len(c.token_ids) for c in out.outputs)
        if self.api_key is not None and self.state.keyring.limiter.active:
            self.state.keyring.limiter.charge_tokens(self.api_key, prompt_tokens + output_tokens)
        now = time.monotonic()
        reasons = [c.finish_reason or "abort" for c in out.outputs]
        p = self.progress
        ttft = None if p.first_token is None else p.first_token - p.arrival
        metrics = out.metrics
        queue = (metrics.first_scheduled_time - metrics.arrival_time
                 if metrics and metrics.first_scheduled_time is not None else None)
        telemetry = self.state.telemetry
        telemetry.observe_request(route=self.route.name, model=self.run.engine.name, ttft_s=ttft,
                                  e2e_s=now - p.arrival, itls=p.itls, output_tokens=output_tokens,
                                  prompt_tokens=prompt_tokens, finish_reason=reasons[0], queue_s=queue,
                                  operation=self.operation, request_model=self.request_model)
        if self.finished_ok:
            tpot = ((p.last_token - p.first_token) / (output_tokens - 1)
                    if p.first_token is not None and p.last_token is not None and output_tokens > 1 else None)
            self.state.slo.observe_request(self.route.name, self.run.engine.name, ttft_s=ttft, tpot_s=tpot,
                                           prompt_tokens=prompt_tokens, output_tokens=output_tokens)
        span = self.span
        span.set_attributes({"gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.usage.output_tokens": output_tokens,
                             "gen_ai.response.finish_reasons": reasons,
                             "gen_ai.response.id": self.run.request_ids[0][1] if self.run.request_ids else ""})
        if self.state.cfg.telemetry.record_content:
            span.set_attribute("gen_ai.output.messages", json.dumps([c.text for c in out.outputs]))
        if self.run.attributes.get(ESCALATED):
            cascade = {k: v for k, v in self.run.attributes.items() if k.startswith("tandem.cascade.")}
            add_escalation_span(telemetry.tracer, span, metrics, time.monotonic(), cascade)
        else:
            add_engine_spans(telemetry.tracer, span, metrics, time.monotonic())


# ------------------------------------------------------------------------------------------ formatting


class _Formatter:
    """RequestOutputs -> OpenAI JSON bodies and SSE chunks for one request (chat or legacy completions)."""

    def __init__(self, operation: str, response_id: str, created: int, model: str, tokenizer: Any,
                 data: ChatCompletionRequest | CompletionRequest, logprobs: int | None,
                 prompt_text: str | None = None):
        self.chat = operation == "chat"
        self.prompt_text = prompt_text  # a text prompt as sent (the engine may have been given its token ids)
        self.id, self.created, self.model, self.tokenizer = response_id, created, model, tokenizer
        self.logprobs = logprobs
        self.echo = (not self.chat) and data.echo
        self.finished: set[int] = set()
        self.offsets: dict[int, int] = {}  # completions logprobs: text offset per choice
        self.started: set[int] = set()  # completion choices that have sent their first chunk

    # ---- chat
    def _chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                       usage=usage))

    def opening(self, n: int) -> list[bytes]:
        if not self.chat:
            return []
        return [self._chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))]) for i in range(n)]

    def deltas(self, out: RequestOutput) -> list[bytes]:
        events = []
        for c in out.outputs:
            if c.index in self.finished:
                continue
            has_delta = bool(c.delta_text) or (self.logprobs is not None and bool(c.delta_logprobs))
            if self.chat:
                if has_delta:
                    events.append(self._chunk([ChunkChoice(
                        index=c.index, delta=Delta(content=c.delta_text),
                        logprobs=self._chat_logprobs(c.delta_token_ids, c.delta_logprobs))]))
                if c.finished:
                    events.append(self._chunk([ChunkChoice(index=c.index, delta=Delta(),
                                                           finish_reason=_finish_reason(c))]))
            elif has_delta or c.finished:
                text = c.delta_text
                if self.echo and c.index not in self.started:
                    text = self._echo(out, c.index) + text
                self.started.add(c.index)
                lp = self._completion_logprobs(c.index, c.delta_token_ids, c.delta_logprobs)
                events.append(sse(Completion(id=self.id, created=self.created, model=self.model, usage=None,
                                             choices=[CompletionChoice(index=c.index, text=text, logprobs=lp,
                                                                       finish_reason=_finish_reason(c))])))
            if c.finished:
                self.finished.add(c.index)
        return events

    def usage_chunk(self, out: RequestOutput) -> bytes:
        if self.chat:
            return self._chunk([], usage=_usage(out))
        return sse(Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=_usage(out)))

    def full(self, out: RequestOutput) -> ChatCompletion | Completion:
        if self.chat:
            return ChatCompletion(id=self.id, created=self.created, model=self.model, usage=_usage(out), choices=[
                ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                           logprobs=self._chat_logprobs(c.token_ids, c.logprobs), finish_reason=_finish_reason(c))
                for c in out.outputs])
        return Completion(id=self.id, created=self.created, model=self.model, usage=_usage(out), choices=[
            CompletionChoice(index=c.index, text=(self._echo(out, c.index) if self.echo else "") + c.text,
                             finish_reason=_finish_reason(c),
                             logprobs=self._completion_logprobs(c.index, c.token_ids, c.logprobs))
            for c in out.outputs])

    def _echo(self, out: RequestOutput, index: int) -> str:
        """The prompt text an `echo` completion starts with; its token offsets then count from its end."""
        prompt = self.prompt_text if self.prompt_text is not None else out.prompt
        if prompt is None:  # the request sent token ids
            prompt = self.tokenizer.decode(out.prompt_token_ids)
        self.offsets[index] = len(prompt)
        return prompt

    # ---- logprobs
    def _chat_logprobs(self, ids: list[int], positions: list[PositionLogprobs] | None) -> ChoiceLogprobs | None:
        if self.logprobs is None or positions is None:
            return None
        content = []
        for token_id, position in zip(ids, positions):
            sampled = position.get(token_id)
            text = self._text(token_id, sampled)
            content.append(TokenLogprob(
                token=text, logprob=_finite(sampled.logprob if sampled else float("-inf")),
                bytes=list(text.encode()),
                top_logprobs=[TopLogprob(token=t, logprob=_finite(lp), bytes=list(t.encode()))
                              for t, lp in self._top(position)]))
        return ChoiceLogprobs(content=content)

    def _completion_logprobs(self, index: int, ids: list[int],
                             positions: list[PositionLogprobs] | None) -> CompletionLogprobs | None:
        if self.logprobs is None or positions is None:
            return None
        offset = self.offsets.get(index, 0)
        tokens, token_lps, tops, offsets = [], [], [], []
        for token_id, position in zip(ids, positions):
            sampled = position.get(token_id)
            text = self._text(token_id, sampled)
            tokens.append(text)
            token_lps.append(_finite(sampled.logprob) if sampled else None)
            tops.append(dict(self._top(position)) if self.logprobs > 0 else None)
            offsets.append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets)

    def _top(self, position: PositionLogprobs) -> list[tuple[str, float]]:
        ranked = sorted(((lp.rank, tid, lp) for tid, lp in position.items()
                         if lp.rank is not None and lp.rank <= (self.logprobs or 0)), key=lambda r: r[0])
        return [(self._text(tid, lp), lp.logprob) for _, tid, lp in ranked]

    def _text(self, token_id: int, lp: Any) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.token_text(token_id)


def _finite(x: float) -> float:
    return max(x, -9999.0)  # JSON has no -inf; OpenAI clients expect a number


def _finish_reason(c: CompletionOutput) -> str | None:
    if c.finish_reason in (None, "stop", "length"):
        return c.finish_reason
    return "stop" if c.finish_reason == "abort" else c.finish_reason


def _usage(out: RequestOutput) -> Usage:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# ------------------------------------------------------------------------------------------- the app


def _validation_error(request: Request, exc: ValidationException) -> Response:
    """Body decoding errors name the parameter, as OpenAI's 400s do."""
    extra = exc.extra if isinstance(exc.extra, list) else []
    first = extra[0] if extra and isinstance(extra[0], dict) else None
    if first is None:
        return handle_http_exception(request, exc)
    message = str(first.get("message", exc.detail))
    missing = re.match(r"Object missing required field `(.+?)`", message)
    where = re.search(r" - at `\$\.(.+)`$", message)  # msgspec says where in the body: "... - at `$.n`"
    if missing:
        param = missing.group(1)
        text = f"Missing required parameter {param!r}"
    else:
        param = where.group(1) if where else (first.get("key") if first.get("key") != "data" else None)
        message = message[:where.start()] if where else message
        text = f"Invalid value for {param!r}: {message}" if param else f"Invalid request body: {message}"
    err = APIError(400, text, param=param, code="missing_required_parameter" if missing else "invalid_value")
    return handle_api_error(request, err)


def create_app(cfg: TandemConfig, *, host_factory: Callable[[], EngineHost] | None = None,
               tracer_provider: TracerProvider | None = None, meter_provider: MeterProvider | None = None,
               on_load_error: Callable[[str], None] | None = None) -> Litestar:
    """Build the gateway for `cfg`. The engines come from `host_factory` (default: an EngineCore for the
    config), built and started in a worker thread at start-up so `/health` answers while they load."""
    provider = tracer_provider or build_tracer_provider(cfg.telemetry)
    telemetry = Telemetry(cfg.telemetry, cfg.routes, provider,
                          meter_provider or build_meter_provider(cfg.telemetry))
    keyring = KeyRing(cfg.auth)
    adm = cfg.admission
    admission = AdmissionController(cfg.routes, AdmissionSettings(
        max_waiting_per_route=adm.max_waiting_per_route, ttft_slack=adm.ttft_slack,
        route_max_waiting={n: r.max_waiting for n, r in cfg.routes.items() if r.max_waiting is not None},
        rate_halflife_s=adm.rate_halflife_s, min_rate_observations=adm.min_rate_observations,
        min_retry_after_s=adm.min_retry_after_s, max_retry_after_s=adm.max_retry_after_s,
        engine_slots={n: e.max_num_seqs for n, e in cfg.engines.items()})) if adm.enabled else None
    slo = SLOAccounting(cfg.routes, window_s=cfg.telemetry.slo_window_s,
                        price_per_device_hour=cfg.cost.price_per_device_hour)
    autoscaler = Autoscaler(AutoscaleSettings(**msgspec.to_builtins(cfg.autoscale)))
    state = GatewayState(cfg=cfg, routes=Routes(cfg), keyring=keyring, telemetry=telemetry, slo=slo,
                         autoscaler=autoscaler, admission=admission)
    telemetry.bind_engines(lambda: state.engines)
    telemetry.bind_slo(slo)
    for why in state.routes.unavailable.values():
        log.warning("%s; requests for it get 501 until a strategy is registered", why)
    build = host_factory or default_host_factory(cfg)
    loading: list[asyncio.Task] = []

    def load() -> None:
        host = build()
        host.start()
        engines = {name: host.engine(name) for name in cfg.engines}
        # torch and the models leave ~200k long-lived objects; a full GC pass over them stalls every request
        # for ~200 ms (the p99 of the overhead benchmark). Freeze them out of the collector's view.
        gc.collect()
        gc.freeze()
        state.host, state.engines = host, engines

    async def start_loading(app: Litestar) -> None:
        async def run() -> None:
            try:
                await asyncio.to_thread(load)
                log.info("engines ready: %s", ", ".join(state.engines))
            except Exception as exc:
                state.load_error = f"engine start-up failed: {type(exc).__name__}: {exc}"
                log.exception("engine start-up failed")
                if on_load_error is not None:
                    on_load_error(state.load_error)
        loading.append(asyncio.create_task(run()))

    async def stop(app: Litestar) -> None:
        for task in loading:
            if not task.done():
                await asyncio.wait([task], timeout=60)
        if state.host is not None:
            await asyncio.to_thread(state.host.shutdown)
        gc.unfreeze()  # let interpreter shutdown collect them (extension types report leaks otherwise)

    app = Litestar(
        route_handlers=[health, ready, metrics, list_models, list_routes, autoscale, chat_completions, completions],
        on_startup=[start_loading], on_shutdown=[stop],
        middleware=[AuthMiddleware(keyring)],
        plugins=[otel_plugin(provider)],
        exception_handlers={**EXCEPTION_HANDLERS, ValidationException: _validation_error},
        request_max_body_size=cfg.server.max_body_bytes,
        openapi_config=OpenAPIConfig(title="tandem", version="0.1.0", path="/schema",
                                     render_plugins=[SwaggerRenderPlugin()]),
        logging_config=None,
        debug=False,
    )
    app.state.gateway = state
    app.state.on_error = telemetry.count_error
    return app


def gateway_state(app: Litestar) -> GatewayState:
    return app.state.gateway

