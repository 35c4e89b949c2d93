"""One request's way through the gateway, after its handler has parsed it: size check, the route's strategy
plans the engine, the key's tokens/minute are reserved, admission books it (or downgrades, or sheds with 503
+ Retry-After), the strategy starts it, the first output is awaited (so a rejection is an HTTP error before
any byte), then one JSON body or an SSE stream answers; `Finisher` closes the request whichever way it ends.
The client is watched from admission on: when it leaves, every engine request the run started is aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream
from opentelemetry import trace

from engines.errors import EngineDeadError, ErrorCode, RequestRejected
from engines.outputs import RequestOutput
from engines.scoring import ScoringBusy
from gateway.accounting import Finisher, Progress
from gateway.answers import encode
from gateway.engine_errors import engine_api_error
from gateway.errors import APIError
from gateway.limits import TokenReservation
from gateway.openai_format import Formatter
from gateway.prompts import Prompt
from gateway.protocol import ChatCompletionRequest, CompletionRequest, InvalidParameter, sampling_params
from gateway.routing import ESCALATED, NO_LEDGER, Plan, Route, RoutedRun, RoutingContext
from gateway.state import GatewayState
from gateway.streaming import ClientWatch, EventStream
from gateway.strict_request import ClientDisconnected
from gateway.tracing import add_child_span

log = logging.getLogger("tandem.gateway")

# another API's answer format: (request id, the answering engine's tokenizer) -> an object with Formatter's
# opening / deltas / full / error_event / closing
AnswerFormat = Callable[[str, Any], Any]


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


def engine_request_id(scope_state: dict[str, Any], part: int | None = None) -> str:
    """The id engines and admission know a request by: the request's id, its prompt's index for one of several
    prompts, and a random suffix when the client chose the id (a client may reuse one; live ids must not clash)."""
    request_id = scope_state["request_id"]
    if part is not None:
        request_id += f"-{part}"
    if scope_state.get("client_request_id"):
        request_id += "-" + os.urandom(4).hex()
    return request_id


async def serve(request: Request, state: GatewayState, route: Route,
                data: ChatCompletionRequest | CompletionRequest, operation: str, prompt: Prompt, *,
                conversation: list[dict[str, Any]] | None = None, prompt_text: str | None = None,
                prompt_token_ids: list[int] | None = None, part: int | None = None,
                watch_client: bool = True, answer_format: AnswerFormat | None = None) -> Response | Stream:
    """Admit, start and answer one parsed request on `route` (the handlers' common path). From admission to the
    answer the client is watched: if it leaves, the wait is cancelled and every engine request is aborted.
    `part`: the prompt's index in a completion of several prompts (whose caller watches the client);
    `answer_format`: another API's answer (gateway/responses_api.py, gateway/anthropic_api.py) instead of
    OpenAI chat's, made from the request id and the answering engine's tokenizer."""
    scope_state = request.scope["state"]
    arrival = scope_state.get("arrival") or time.monotonic()
    request_id = engine_request_id(scope_state, part)
    prompt.check_size(state.engines[name] for name in route.config.engines)  # before any work
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
            conversation or [{"role": "user", "content": prompt_text}]))
    tokens = state.keyring.limiter.reservation(scope_state.get("api_key"))
    prompt.tokenize = state.admission is not None or tokens is not None  # both count the prompt's tokens
    ctx = RoutingContext(request_id=request_id, route=route, params=params, prompt=prompt,
                         conversation=conversation, prompt_text=prompt_text, prompt_token_ids=prompt_token_ids,
                         ledger=state.admission if state.admission is not None else NO_LEDGER)
    answer = _Answer(scope_state["request_id"], (part or 0) * params.n, answer_format)
    if not watch_client:
        return await _answer(state, ctx, data, operation, span, arrival, tokens, answer)
    watch = ClientWatch(request.receive)  # the body is read: from here a client that leaves cancels the request
    try:
        return await _answer(state, ctx, data, operation, span, arrival, tokens, answer)
    except asyncio.CancelledError:
        if not watch.uncancel_if_left():
            raise  # cancelled from elsewhere (server shutdown): not ours to swallow
        raise ClientDisconnected("The client closed the connection before its answer") from None
    finally:
        watch.stop()  # an SSE stream watches for itself from its first byte


@dataclass
class _Answer:
    """What the answer says of the request: its id (the client's X-Request-Id when sent: echoed, and the base of
    the response id) and its first choice's index (prompt i of several prompts starts at i * n)."""

    request_id: str
    index_base: int = 0
    answer_format: AnswerFormat | None = None


def prompt_logprobs_k(data: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many top logprobs the prompt's scoring needs (None: no scoring): echo with logprobs, prompt_logprobs."""
    if not isinstance(data, CompletionRequest):
        return None
    wanted = [k for k in (data.logprobs if data.echo else None, data.prompt_logprobs) if k is not None]
    return max(wanted) if wanted else None


async def score_prompt(engine: Any, token_ids: list[int], k: int) -> list[Any]:
    try:
        return await engine.score_prompt(token_ids, k)
    except ScoringBusy as exc:
        raise APIError(503, f"The server is overloaded: {exc}", code="overloaded", retry_after=1) from None


async def _answer(state: GatewayState, ctx: RoutingContext, data: ChatCompletionRequest | CompletionRequest,
                  operation: str, span: Any, arrival: float, tokens: TokenReservation | None,
                  answer: _Answer) -> Response | Stream:
    """Start the request and wait for its first output (and for a JSON body, its last): what `serve` watches."""
    route, request_id, params = ctx.route, ctx.request_id, ctx.params
    run, route_span = await start_request(state, ctx, span, tokens)
    decided = set(run.attributes)

    state.inflight += 1
    progress = Progress(arrival)
    finish = Finisher(state, route, run, progress, span, tokens, operation, data.model, route_span)
    try:
        first = await _first_output(run, ctx)
        # its prefill is done: the backlog shrinks, the drain rate learns
        ctx.ledger.first_token(request_id) if not first.error else ctx.ledger.release(request_id)
        progress.saw(first)
        # A cascade knows who answers only once its first output arrives: engine, headers and metrics are read
        # now.
        for key in run.attributes.keys() - decided:
            span.set_attribute(key, run.attributes[key])
        headers = _answered_by(state, route, run, answer.request_id, span)
        response_id = ("chatcmpl-" if operation == "chat" else "cmpl-") + answer.request_id
        k = prompt_logprobs_k(data)
        prompt_lps = None if k is None or first.error else await score_prompt(run.engine, first.prompt_token_ids, k)
        fmt = answer.answer_format(answer.request_id, run.engine.tokenizer) if answer.answer_format else \
            Formatter(operation, response_id, int(time.time()), data.model, run.engine.tokenizer, data,
                      params.logprobs, ctx.prompt_text, index_base=answer.index_base, prompt_logprobs=prompt_lps)
    except BaseException as exc:
        dropped = isinstance(exc, APIError) and exc.code == ErrorCode.TTFT_EXPIRED
        if dropped:  # dropped late by the engine: a shed
            state.slo.observe_shed(route.name)
            if state.admission is not None:
                exc.retry_after = state.admission.retry_after_s(route.name, run.engine.name)
        finish.failed = isinstance(exc, APIError) and exc.status >= 500 and not dropped
        finish.cancelled = isinstance(exc, asyncio.CancelledError)
        finish.close()  # rejected, failed or cancelled before a byte went out: abort and release the slot
        raise

    if not data.stream:
        return await _json_answer(first, run, progress, fmt, finish, headers)
    include_usage = bool(data.stream_options and data.stream_options.include_usage)
    events = _stream_events(first, run, progress, fmt, finish, include_usage)

    async def after() -> None:
        await events.aclose()  # runs the stream's `finally` even if the client left while it sat at a yield
        finish.close()  # and releases the request if the stream never started

    return EventStream(events, media_type="text/event-stream", headers=headers | {"cache-control": "no-cache"},
                       background=BackgroundTask(after))


async def start_request(state: GatewayState, ctx: RoutingContext, span: Any,
                        tokens: TokenReservation | None = None) -> tuple[RoutedRun, tuple | None]:
    """The route's strategy plans the engine, the key's tokens are reserved (429), admission books it (or
    downgrades or sheds), the strategy starts it; returns the run and the route span to write once the answer
    is out (spans cost CPU, not before it)."""
    route = ctx.route
    strategy = state.routes.strategy(route)
    route_start = time.time_ns()
    try:
        plan = strategy.plan(ctx, state.engines)
    except BaseException as exc:
        _route_failed(state, span, route, route_start, exc)
        raise
    engine = state.engines[plan.engine]
    prompt_tokens = len(await ctx.prompt.get(engine)) if ctx.prompt.tokenize else 0  # token ids then
    if tokens is not None:  # before admission books anything: a 429 leaves nothing to undo
        await tokens.reserve(prompt_tokens + _completion_budget(state, ctx, engine, prompt_tokens))
    try:
        await _admit(state, ctx, plan, span, prompt_tokens)  # sheds with 503 + Retry-After (nothing is booked then)
        try:
            run = await strategy.start(plan, ctx, state.engines)
        except BaseException as exc:
            ctx.ledger.release(ctx.request_id)
            _route_failed(state, span, route, route_start, exc)
            raise
    except BaseException:
        if tokens is not None:
            tokens.settle(0)  # nothing ran: the whole reservation goes back
        raise
    route_span = None
    if span.is_recording():
        decision = {"tandem.route": route.name, "tandem.route.strategy": route.config.strategy,
                    "tandem.route.engine": run.engine.name, **run.attributes}
        if run.score is not None:
            decision["tandem.router.score"] = run.score
        route_span = (route_start, time.time_ns(), decision)
    return run, route_span


def _completion_budget(state: GatewayState, ctx: RoutingContext, engine: Any, prompt_tokens: int) -> int:
    """What the answer may take of a tokens/minute budget: n x max_tokens, or without max_tokens a bounded
    estimate ([auth] reserved_completion_tokens, at most what the context leaves); settled to usage at the end."""
    params = ctx.params
    per_choice = params.max_tokens or min(state.cfg.auth.reserved_completion_tokens,
                                          max(1, engine.max_model_len - prompt_tokens))
    return params.n * per_choice


def _route_failed(state: GatewayState, span: Any, route: Route, start_ns: int, exc: BaseException) -> None:
    if span.is_recording():
        add_child_span(state.telemetry.tracer, span, "route", start_ns, time.time_ns(),
                       {"tandem.route": route.name, "tandem.route.strategy": route.config.strategy}, error=exc)


async def _admit(state: GatewayState, ctx: RoutingContext, plan: Plan, span: Any, tokens: int) -> None:
    """Book the request (`tokens` in its prompt) on the planned engine, move the plan to the small engine
    (downgrade), or shed it (APIError 503 + Retry-After)."""
    if state.admission is None:
        return
    route = ctx.route
    d = state.admission.admit(ctx.request_id, route.name, plan.engine, tokens)
    attrs: dict[str, Any] = {"tandem.admission.action": d.action, "tandem.admission.reason": d.reason,
                             "tandem.admission.prompt_tokens": tokens}
    if d.predicted_ttft_s is not None:
        attrs["tandem.admission.predicted_ttft_ms"] = round(d.predicted_ttft_s * 1000.0, 3)
    if d.retry_after_s is not None:
        attrs["tandem.admission.retry_after_s"] = d.retry_after_s
    span.set_attributes(attrs)
    if d.action == "downgrade":  # SLO pressure: the small engine meets the target
        plan.engine = d.engine
        plan.attributes["tandem.admission.downgraded"] = True
    if d.admitted:
        return
    state.slo.observe_shed(route.name)
    wait = max(1, math.ceil(d.retry_after_s or 1.0))
    why = ("its waiting queue is full" if d.reason == "queue_full" else
           f"the predicted time to first token ({d.predicted_ttft_s or 0.0:.2f} s) misses its "
           f"{(d.target_ttft_s or 0.0) * 1000:.0f} ms target")
    raise APIError(d.status or 503, f"Route {route.name!r} is overloaded: {why}; retry in {wait} s",
                   code="overloaded", retry_after=wait)


async def _first_output(run: RoutedRun, ctx: RoutingContext) -> RequestOutput:
    """Wait for the first output so a rejected request becomes a 400 before any byte is sent."""
    try:
        first = await anext(run.outputs)
    except (RequestRejected, EngineDeadError) as exc:
        # the field the engine names: a constraint's, or max_tokens when the prompt fits but max_tokens does not
        raise engine_api_error(exc.code, str(exc), param=getattr(exc, "param", None)) from None
    except StopAsyncIteration:
        raise APIError(500, "The engine ended the request without any output", code="engine_error") from None
    if first.error and (first.error.code is ErrorCode.TTFT_EXPIRED or not any(c.token_ids for c in first.outputs)):
        raise engine_api_error(first.error.code, first.error.message)
    return first


def _answered_by(state: GatewayState, route: Route, run: RoutedRun, request_id: str, span: Any) -> dict[str, str]:
    """Count the routing decision and say who answers: span attribute and response headers."""
    telemetry = state.telemetry
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
    return headers


async def _json_answer(first: RequestOutput, run: RoutedRun, progress: Progress, fmt: Formatter,
                       finish: Finisher, headers: dict[str, str]) -> Response:
    """The whole answer as one JSON body; metrics, spans and accounting run once it is out."""
    try:
        out = first
        while not out.finished:
            out = await anext(run.outputs)
            progress.saw(out)
        if out.error:
            raise engine_api_error(out.error.code, out.error.message)
        body = encode(fmt.full(out))
    except BaseException:
        finish.close()  # a client that hung up (the watch cancels this wait) or a failure: abort, release
        await run.close()
        raise
    finish.done(out)

    async def after_body() -> None:
        finish.close()
        await run.close()

    return Response(content=body, media_type="application/json", headers=headers,
                    background=BackgroundTask(after_body))


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
            pending.append(fmt.error_event(error))
        pending.append(fmt.closing())
        yield b"".join(pending)
    finally:
        finish.close()
        await run.close()
