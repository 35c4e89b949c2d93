"""One request's way through the gateway, after its handler has parsed it: resolve the route, admit it (or shed
it with 503 + Retry-After), start it through the route's strategy, wait for the first output (so a rejection is
an HTTP error before any byte), then answer with one JSON body or an SSE stream; `Finisher` closes it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream
from opentelemetry import trace

from engines.errors import EngineDeadError, ErrorCode, RequestRejected
from engines.outputs import RequestOutput
from gateway.accounting import Finisher, Progress
from gateway.admission import AdmissionDecision
from gateway.engine_errors import engine_api_error
from gateway.errors import APIError
from gateway.openai_format import Formatter
from gateway.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    InvalidParameter,
    encode,
    sampling_params,
)
from gateway.routing import ESCALATED, Route, RoutedRun, RoutingContext, start_on
from gateway.state import GatewayState
from gateway.streaming import EventStream, until_disconnect
from gateway.telemetry import add_child_span

log = logging.getLogger("tandem.gateway")


def resolve_route(request: Request, state: GatewayState, model: str) -> Route:
    if not state.ready:
        raise APIError(503, f"The server is not ready: {state.load_error or 'models are loading'}",
                       code="not_ready", retry_after=5)
    if state.inflight >= state.cfg.server.max_inflight_requests:
        raise APIError(503, f"The server is overloaded ({state.inflight} requests in flight); retry shortly",
                       code="overloaded", retry_after=1)
    route = state.routes.resolve(model)
    request.scope["state"]["route"] = route.name  # the error counter's route label from here on
    return route


async def serve(request: Request, state: GatewayState, route: Route,
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
    progress = Progress(arrival)
    finish = Finisher(state, route, run, progress, span, request.scope["state"].get("api_key"), operation,
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
        fmt = Formatter(operation, response_id, int(time.time()), data.model, run.engine.tokenizer, data,
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
        watcher = None if first.finished else asyncio.create_task(until_disconnect(request.receive))
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

    return EventStream(events, media_type="text/event-stream", headers=headers | {"cache-control": "no-cache"},
                        background=BackgroundTask(after))


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


async def _stream_events(first: RequestOutput, run: RoutedRun, progress: Progress, fmt: Formatter,
                         finish: Finisher, include_usage: bool) -> AsyncIterator[bytes]:
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
