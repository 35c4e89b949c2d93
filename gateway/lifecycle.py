"""A request's way through the gateway as one pipeline of named stages over one `Job`: (Litestar decodes the
body and `resolve_route` finds the route before the handler builds the prompt), then decode, resolve, render,
reserve, admit, run, format, settle, each one function below in that order; `serve` runs them. The client is
watched from the reservation on: when it leaves, every engine request the run started is aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream
from opentelemetry import trace

from engines.errors import EngineDeadError, ErrorCode, RequestRejected
from engines.outputs import RequestOutput
from engines.sampling_params import SamplingParams
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


@dataclass
class Job:
    """One request's state as it goes through the stages: what the handler decoded, then what each stage adds."""

    request: Request
    state: GatewayState
    route: Route
    data: ChatCompletionRequest | CompletionRequest
    operation: str
    prompt: Prompt
    conversation: list[dict[str, Any]] | None = None
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    part: int | None = None
    answer_format: AnswerFormat | None = None
    span: Any = None
    recording: bool = False  # the server span records: its attributes are worth building
    arrival: float = 0.0
    request_id: str = ""
    client_request_id: str = ""  # the id the answer shows (the client's X-Request-Id when sent)
    attributes: dict[str, Any] = field(default_factory=dict)  # the server span's, set in one call per stage
    params: SamplingParams | None = None  # decode
    tokens: TokenReservation | None = None  # decode: the key's tokens/minute (None: unlimited)
    ctx: RoutingContext | None = None  # decode: what the route's strategy sees
    strategy: Any = None  # resolve: the route's strategy
    plan: Plan | None = None  # resolve
    route_start: int = 0  # resolve: when the routing decision began (ns)
    prompt_tokens: int = 0  # render: counted when admission or a tokens/minute limit needs them
    run: RoutedRun | None = None  # run
    route_span: tuple | None = None  # run: the routing decision's span, written once the answer is out
    first: RequestOutput | None = None  # run
    finish: Finisher | None = None  # settle, made when the run starts


async def serve(request: Request, state: GatewayState, route: Route,
                data: ChatCompletionRequest | CompletionRequest, operation: str, prompt: Prompt, *,
                conversation: list[dict[str, Any]] | None = None, prompt_text: str | None = None,
                prompt_token_ids: list[int] | None = None, part: int | None = None,
                watch_client: bool = True, answer_format: AnswerFormat | None = None) -> Response | Stream:
    """The pipeline for one decoded request on its resolved route: decode, resolve, render, reserve, admit,
    run, format, settle (each stage below, in this order). From `reserve` to the answer the client is watched:
    if it leaves, the wait is cancelled and every engine request is aborted. `part`: the prompt's index in a
    completion of several prompts (whose caller watches the client); `answer_format`: another API's answer
    (gateway/responses_api.py, gateway/anthropic_api.py) instead of OpenAI chat's, made from the request id and
    the answering engine's tokenizer."""
    job = Job(request, state, route, data, operation, prompt, conversation, prompt_text, prompt_token_ids, part,
              answer_format)
    decode(job)
    if not watch_client:
        return await _stages(job)
    watch = ClientWatch(request.receive, request.scope)  # the body is read: from here a client that leaves cancels the request
    try:
        answered = await _stages(job)
        if isinstance(answered, EventStream):
            answered.watcher = watch.hand_over()  # the stream watches from its first byte with the same task
        return answered
    except asyncio.CancelledError:
        if not watch.uncancel_if_left():
            raise  # cancelled from elsewhere (server shutdown): not ours to swallow
        raise ClientDisconnected("The client closed the connection before its answer") from None
    finally:
        watch.stop()  # a no-op once handed over


async def _stages(job: Job) -> Response | Stream:
    """resolve .. format, watched by `serve`; a failure before the run has started undoes what was booked."""
    await start(job)
    job.state.inflight += 1
    job.finish = Finisher(job.state, job.route, job.run, Progress(job.arrival), job.span, job.tokens,
                          job.operation, job.data.model, job.route_span)
    try:
        await run(job)
        fmt = await formatter(job)
    except BaseException as exc:
        _failed_before_answer(job, exc)
        raise
    return await answer(job, fmt)


async def start(job: Job) -> None:
    """resolve, render, reserve, admit, and the strategy starts the run; what was booked is undone when a later
    step fails. The routing decision's span is kept to be written once the answer is out (spans cost CPU)."""
    resolve(job)
    await render(job)
    await reserve(job)
    try:
        admit(job)
        try:
            job.run = await job.strategy.start(job.plan, job.ctx, job.state.engines)
        except BaseException as exc:
            job.ctx.ledger.release(job.request_id)
            _route_failed(job, exc)
            raise
    except BaseException:
        if job.tokens is not None:
            job.tokens.settle(0)  # nothing ran: the whole reservation goes back
        raise
    if job.recording:
        started = job.run
        decision = {"tandem.route": job.route.name, "tandem.route.strategy": job.route.config.strategy,
                    "tandem.route.engine": started.engine.name, **started.attributes}
        if started.score is not None:
            decision["tandem.router.score"] = started.score
        job.route_span = (job.route_start, time.time_ns(), decision)


async def start_request(state: GatewayState, ctx: RoutingContext, span: Any,
                        tokens: TokenReservation | None = None) -> tuple[RoutedRun, tuple | None]:
    """`start` for a context made elsewhere (tests drive the strategies this way): the run and its route span."""
    job = Job(None, state, ctx.route, None, "", ctx.prompt, span=span, request_id=ctx.request_id,  # type: ignore[arg-type]
              params=ctx.params, tokens=tokens, ctx=ctx, recording=span.is_recording())
    await start(job)
    return job.run, job.route_span


# ------------------------------------------------------------------------------------------- the stages


def decode(job: Job) -> None:
    """The decoded request in engine terms: its id, the size check (before any work), the sampling params
    within the route's max_tokens, the GenAI request attributes, the key's token reservation, the context."""
    state, route, data = job.state, job.route, job.data
    scope_state = job.request.scope["state"]
    job.arrival = scope_state.get("arrival") or time.monotonic()
    job.request_id = engine_request_id(scope_state, job.part)
    job.client_request_id = scope_state["request_id"]
    job.prompt.check_size(state.engines[name] for name in route.config.engines)
    job.span = span = trace.get_current_span()
    job.recording = recording = span.is_recording()  # no span processor, or sampled out: nothing to fill
    attributes: dict[str, Any] = {}
    if recording:
        span.update_name(f"{job.operation} {data.model}")
        attributes = {"gen_ai.operation.name": job.operation, "gen_ai.provider.name": "tandem",
                      "gen_ai.request.model": data.model, "tandem.route": route.name}
        for attr, value in (("temperature", data.temperature), ("top_p", data.top_p), ("seed", data.seed)):
            if value is not None:
                attributes[f"gen_ai.request.{attr}"] = value
    try:
        job.params = params = sampling_params(data, default_max_tokens=None if job.operation == "chat" else 16,
                                              max_tokens_cap=route.config.max_tokens)
    except InvalidParameter as exc:
        span.set_attributes(attributes)
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    if recording:
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if state.cfg.telemetry.record_content:
            attributes["gen_ai.input.messages"] = json.dumps(
                job.conversation or [{"role": "user", "content": job.prompt_text}])
        span.set_attributes(attributes)  # one call: each attribute set takes the span's lock
    job.tokens = state.keyring.limiter.reservation(scope_state.get("api_key"))
    job.prompt.tokenize = state.admission is not None or job.tokens is not None  # both count the prompt's tokens
    job.ctx = RoutingContext(request_id=job.request_id, route=route, params=params, prompt=job.prompt,
                             conversation=job.conversation, prompt_text=job.prompt_text,
                             prompt_token_ids=job.prompt_token_ids,
                             ledger=state.admission if state.admission is not None else NO_LEDGER)


def resolve(job: Job) -> None:
    """The route's strategy plans the engine (fixed: its engine; router: the router's choice; cascade: small)."""
    job.route_start = time.time_ns()
    try:
        job.strategy = job.state.routes.strategy(job.route)
        job.plan = job.strategy.plan(job.ctx, job.state.engines)
    except BaseException as exc:
        _route_failed(job, exc)
        raise


async def render(job: Job) -> None:
    """The prompt for the planned engine: its chat template applied, and tokenised when counted."""
    engine = job.state.engines[job.plan.engine]
    job.prompt_tokens = len(await job.prompt.get(engine)) if job.prompt.tokenize else 0


async def reserve(job: Job) -> None:
    """The key's tokens/minute (429 + Retry-After): before admission books anything, so a 429 undoes nothing.
    Prompt plus n x max_tokens, or without max_tokens a bounded estimate ([auth] reserved_completion_tokens, at
    most what the context leaves); settled to the usage when the request ends."""
    if job.tokens is None:
        return
    params, engine = job.params, job.state.engines[job.plan.engine]
    per_choice = params.max_tokens or min(job.state.cfg.auth.reserved_completion_tokens,
                                          max(1, engine.max_model_len - job.prompt_tokens))
    await job.tokens.reserve(job.prompt_tokens + params.n * per_choice)


def admit(job: Job) -> None:
    """Book the request (its prompt tokens) on the planned engine, move the plan to the small engine
    (downgrade), or shed it (APIError 503 + Retry-After; nothing is booked then)."""
    state, route, plan, tokens = job.state, job.route, job.plan, job.prompt_tokens
    if state.admission is None:
        return
    d = state.admission.admit(job.request_id, route.name, plan.engine, tokens)
    if job.recording:
        attrs: dict[str, Any] = {"tandem.admission.action": d.action, "tandem.admission.reason": d.reason,
                                 "tandem.admission.prompt_tokens": tokens}
        if d.predicted_ttft_s is not None:
            attrs["tandem.admission.predicted_ttft_ms"] = round(d.predicted_ttft_s * 1000.0, 3)
        if d.retry_after_s is not None:
            attrs["tandem.admission.retry_after_s"] = d.retry_after_s
        job.span.set_attributes(attrs)
    if d.action == "downgrade":  # SLO pressure: the small engine meets the target
        plan.engine = d.engine
        plan.attributes["tandem.admission.downgraded"] = True
    if not d.admitted:
        raise shed(state, route.name, d)


def shed(state: GatewayState, route: str, d: Any) -> APIError:
    """The 503 + Retry-After of a request admission shed (`d`: its AdmissionDecision), counted for the route."""
    state.slo.observe_shed(route)
    wait = max(1, math.ceil(d.retry_after_s or 1.0))
    why = ("its waiting queue is full" if d.reason == "queue_full" else
           f"the predicted time to first token ({d.predicted_ttft_s or 0.0:.2f} s) misses its "
           f"{(d.target_ttft_s or 0.0) * 1000:.0f} ms target")
    return APIError(d.status or 503, f"Route {route!r} is overloaded: {why}; retry in {wait} s",
                    code="overloaded", retry_after=wait)


async def run(job: Job) -> None:
    """Wait for the started run's first output (a rejection becomes an HTTP error before any byte); its
    prefill is done, so admission's backlog shrinks; a cascade's decision is known now: span and counters."""
    run_, ctx, span = job.run, job.ctx, job.span
    decided = set(run_.attributes) if job.recording else None
    job.first = first = await _first_output(run_, ctx)
    ctx.ledger.first_token(job.request_id) if not first.error else ctx.ledger.release(job.request_id)
    job.finish.progress.saw(first)
    if decided is not None:
        attributes = {key: run_.attributes[key] for key in run_.attributes.keys() - decided}
        attributes["gen_ai.response.model"] = run_.engine.name
        span.set_attributes(attributes)
    telemetry = job.state.telemetry
    if not job.route.direct:
        telemetry.labelled(telemetry.router_decisions, job.route.name, run_.engine.name).inc()
    if run_.attributes.get(ESCALATED):
        telemetry.labelled(telemetry.cascade_escalations, job.route.name).inc()


async def formatter(job: Job) -> Any:
    """The answer's format: OpenAI chat or completion (`Formatter`), or another API's; with the prompt's
    logprobs scored when asked (echo, prompt_logprobs)."""
    run_, data = job.run, job.data
    if job.answer_format is not None:
        return job.answer_format(job.client_request_id, run_.engine.tokenizer)
    k = prompt_logprobs_k(data)
    prompt_lps = None if k is None or job.first.error else await score_prompt(run_.engine,
                                                                              job.first.prompt_token_ids, k)
    response_id = ("chatcmpl-" if job.operation == "chat" else "cmpl-") + job.client_request_id
    return Formatter(job.operation, response_id, int(time.time()), data.model, run_.engine.tokenizer, data,
                     job.params.logprobs, job.prompt_text, index_base=(job.part or 0) * job.params.n,
                     prompt_logprobs=prompt_lps)


async def answer(job: Job, fmt: Any) -> Response | Stream:
    """One JSON body, or an SSE stream; `settle` (Finisher.close) runs once its last byte is out."""
    headers = _headers(job)
    if not job.data.stream:
        return await _json_answer(job.first, job.run, job.finish.progress, fmt, job.finish, headers)
    include_usage = bool(job.data.stream_options and job.data.stream_options.include_usage)
    events = _stream_events(job.first, job.run, job.finish.progress, fmt, job.finish, include_usage)
    finish = job.finish

    async def after() -> None:
        await events.aclose()  # runs the stream's `finally` even if the client left while it sat at a yield
        finish.close()  # and releases the request if the stream never started

    return EventStream(events, media_type="text/event-stream", headers=headers | {"cache-control": "no-cache"},
                       background=after_answer(after))


def after_answer(fn: Callable[[], Any]) -> BackgroundTask:
    """`BackgroundTask(fn)` for a coroutine function of ours, without Litestar's check (unwrapping partials,
    inspecting the callable) of whether it must be wrapped to be awaited: it is async already."""
    task = BackgroundTask.__new__(BackgroundTask)
    task.fn, task.args, task.kwargs = fn, (), {}
    return task


def _failed_before_answer(job: Job, exc: BaseException) -> None:
    """Rejected, failed or cancelled before a byte went out: settle now (abort, release the slot)."""
    state, finish = job.state, job.finish
    dropped = isinstance(exc, APIError) and exc.code == ErrorCode.TTFT_EXPIRED
    if dropped:  # dropped late by the engine: a shed
        state.slo.observe_shed(job.route.name)
        if state.admission is not None:
            exc.retry_after = state.admission.retry_after_s(job.route.name, job.run.engine.name)
    finish.failed = isinstance(exc, APIError) and exc.status >= 500 and not dropped
    finish.cancelled = isinstance(exc, asyncio.CancelledError)
    finish.close()


def _headers(job: Job) -> dict[str, str]:
    """Who answers: the response headers."""
    run_ = job.run
    headers = {"x-request-id": job.client_request_id, "x-tandem-route": job.route.name,
               "x-tandem-model": run_.engine.name}
    if run_.score is not None:
        headers["x-tandem-router-score"] = f"{run_.score:.4f}"
    escalated = run_.attributes.get(ESCALATED)
    if escalated is not None:
        headers["x-tandem-escalated"] = "true" if escalated else "false"
    return headers


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


def _route_failed(job: Job, exc: BaseException) -> None:
    if job.span.is_recording():
        add_child_span(job.state.telemetry.tracer, job.span, "route", job.route_start, time.time_ns(),
                       {"tandem.route": job.route.name, "tandem.route.strategy": job.route.config.strategy},
                       error=exc)


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
                    background=after_answer(after_body))


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
