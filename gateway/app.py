"""The Litestar app: OpenAI-compatible endpoints over the engines. Handlers stay thin: a request's way through
lives in gateway/lifecycle.py, routing, admission, auth, limits, errors and telemetry in their own modules.
`create_app(config)` builds it; the engines load in the background at start-up (`/ready` answers 503 until
they are up).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import threading
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec
from litestar import HttpMethod, Litestar, Request, Response, get, post
from litestar import route as route_handler
from litestar.exceptions import ValidationException
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.params import JSONBody, QueryParameter
from litestar.response import Stream
from opentelemetry.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engines.model_config import CheckpointError
from gateway.admission import AdmissionController
from gateway.answers import ChatCompletion, ChatCompletionChunk, Completion, ErrorBody, ModelList
from gateway.anthropic_api import HANDLERS as ANTHROPIC_HANDLERS
from gateway.anthropic_api import AnthropicErrorBody, CountTokensRequest, MessagesRequest, MessageStreamEvent
from gateway.auth import AuthMiddleware, KeyRing
from gateway.autoscale import Autoscaler, ScaleSignals, evaluate_periodically, signals_from
from gateway.completions import serve_completion
from gateway.config import TandemConfig
from gateway.dashboard import HANDLERS as DASHBOARD_HANDLERS
from gateway.embeddings_api import HANDLERS as EMBEDDINGS_HANDLERS
from gateway.embeddings_api import EmbeddingRequest
from gateway.engine_setup import default_host_factory
from gateway.errors import EXCEPTION_HANDLERS, APIError, handle_api_error, handle_http_exception
from gateway.lifecycle import resolve_route, serve
from gateway.openapi import amend, bound_parameter, error_responses, publish, streaming
from gateway.prompts import chat_prompt
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.request_contract import bound_tokens, constrain, engine_bounds
from gateway.responses_api import HANDLERS as RESPONSES_HANDLERS
from gateway.responses_api import ResponsesRequest, ResponseStreamEvent
from gateway.responses_store import ResponseStore
from gateway.route_metrics import RouteMonitorCollector, routing_reports
from gateway.routes import Routes
from gateway.slo import SLOAccounting
from gateway.state import EngineHost, GatewayState
from gateway.strict_request import StrictJSONRequest
from gateway.telemetry import Telemetry, build_meter_provider
from gateway.tokenize_pool import POOL as TOKENIZE_POOL
from gateway.tracing import build_tracer_provider, otel_plugin
from gateway.vllm_metrics import VllmLabelView
from gateway.vllm_routes import HANDLERS as VLLM_HANDLERS
from gateway.vllm_routes import SCHEMAS as VLLM_SCHEMAS
from gateway.vllm_routes import model_card

log = logging.getLogger("tandem.gateway")


async def in_own_thread(fn: Callable[[], Any], name: str = "tandem-start-up") -> Any:
    """fn() on a thread started for it that ends with it, not the default executor's (which outlives it): a thread
    that ran the kernels' multi-threaded start-up timing keeps an OpenMP pool while it lives, and a second pool
    beside the step loop's turns that one's spin-waits down (kernels/thread_governor.py)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if not done.done():
            done.set_exception(exc) if exc is not None else done.set_result(result)

    def run() -> None:
        try:
            result, exc = fn(), None
        except BaseException as e:  # handed to the awaiting task as it is
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop closed meanwhile (shutdown during start-up): nobody waits
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done


class GatewayApp(Litestar):
    """The tandem app: Litestar without the pydantic and attrs plugins it adds whenever those packages import.
    Every handler here takes and returns msgspec Structs, so they had nothing to do, and importing them (pydantic
    itself) was 0.2-0.25 s of every start-up. tests/gateway/test_startup.py checks the hook is still Litestar's."""

    @staticmethod
    def _get_default_plugins(plugins: list[Any]) -> list[Any]:  # Litestar's own hook for its default plugins
        from litestar.plugins.core import MsgspecDIPlugin

        return [*plugins, MsgspecDIPlugin()]


# ------------------------------------------------------------------------------------------ handlers


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


class Health(msgspec.Struct, kw_only=True, omit_defaults=True):
    status: Literal["ok", "degraded"]
    detail: str | None = None  # when degraded: what is stalled


def stalled(state: GatewayState) -> str | None:
    """What keeps this replica from making progress: the engine loop, the compile pool or the tokenisation
    pool stuck past [preparation] stall_after_s (or the engine loop dead); None when healthy."""
    after = state.cfg.preparation.stall_after_s
    check = getattr(state.host, "stalled", None)
    return (check(after) if check is not None else None) or TOKENIZE_POOL.stalled(after)


@get("/health", sync_to_thread=False, responses={
    200: ResponseSpec(Health, description="Healthy", generate_examples=False),
    503: ResponseSpec(Health | ErrorBody, description="Degraded: the engine loop or a preparation pool is stalled "
                      "(or shutting down: an error body)", generate_examples=False)})
def health(request: Request) -> Response:
    why = stalled(_state(request))
    if why is not None:
        return Response(Health(status="degraded", detail=why), status_code=503)
    return Response(Health(status="ok"))


class Readiness(msgspec.Struct, kw_only=True, omit_defaults=True):
    status: Literal["ready", "not_ready"]
    engines: list[str] | None = None  # when ready
    detail: str | None = None  # when not: loading, or why start-up failed


@get("/ready", responses={
    200: ResponseSpec(Readiness, description="The engines are loaded", generate_examples=False),
    503: ResponseSpec(Readiness | ErrorBody, description="Loading, start-up failed, or shutting down (an error "
                      "body then); retry after Retry-After seconds", generate_examples=False)})
async def ready(request: Request) -> Response:
    state = _state(request)
    why = stalled(state) if state.ready else None
    if state.ready and why is None:
        return Response(Readiness(status="ready", engines=sorted(state.engines)))
    if why is not None:
        return Response(Readiness(status="not_ready", detail=f"degraded: {why}"), status_code=503,
                        headers={"retry-after": "5"})
    detail = state.load_error or "models are loading"
    return Response(Readiness(status="not_ready", detail=detail), status_code=503, headers={"retry-after": "5"})


@get("/metrics", sync_to_thread=False, include_in_schema=False)
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics_source), media_type=CONTENT_TYPE_LATEST)


@get("/v1/models", responses=error_responses(401))
async def list_models(request: Request) -> ModelList:
    state = _state(request)
    return ModelList(data=[model_card(state, route) for route in state.routes.routes.values()])


@get("/v1/routes", responses=error_responses(401))
async def list_routes(request: Request) -> dict[str, Any]:
    state = _state(request)
    state.engine_stats()  # busy time for the cost columns
    reports = state.slo.reports()
    out = []
    routing = routing_reports(state.routes.strategies)
    for name, route in state.cfg.routes.items():
        out.append({"name": name, "description": route.description, "strategy": route.strategy,
                    "engines": route.engines,
                    "priority": route.priority, "max_tokens": route.max_tokens,
                    "allow_downgrade": route.allow_downgrade, "slo": msgspec.to_builtins(route.slo),
                    "max_waiting": route.max_waiting,
                    "waiting": state.admission.num_waiting(name) if state.admission is not None else None,
                    "attainment": msgspec.to_builtins(reports[name]),
                    "routing": routing.get(name)})
    return {"object": "list", "data": out,
            "admission": state.admission.stats() if state.admission is not None else None}


def _replicas(state: GatewayState, replicas: int | None) -> int:
    """The replica count a caller named (1 to [autoscale] max_replicas), or the one last reported."""
    if replicas is None:
        return state.autoscaler.replicas
    top = state.cfg.autoscale.max_replicas
    if not 1 <= replicas <= top:
        raise APIError(400, f"replicas = {replicas} is out of range: expected 1 to {top} ([autoscale] "
                       f"max_replicas)", param="replicas", code="invalid_value")
    return replicas


@get("/v1/autoscale", responses=error_responses(400, 401, 429))
async def autoscale(request: Request, replicas: Annotated[int | None, QueryParameter(ge=1)] = None
                    ) -> dict[str, Any]:
    """The desired replica count and why, with `replicas` running now (default: the count last reported).
    Safe: only the gateway's own periodic evaluation and POST advance the hysteresis (docs/autoscaling.md)."""
    state = _state(request)
    signals = signals_from(state.engine_stats(), state.slo.reports(), _replicas(state, replicas))
    return msgspec.to_builtins(state.autoscaler.preview(signals))


@post("/v1/autoscale", status_code=200, responses=error_responses(400, 401, 429))
async def report_replicas(request: Request, replicas: Annotated[int, QueryParameter(ge=1)]) -> dict[str, Any]:
    """Report the replicas running now and evaluate at once, advancing the hysteresis; the periodic
    evaluations use this count from then on (for a controller that acts on `desired_replicas`)."""
    state = _state(request)
    scaler = state.autoscaler
    scaler.replicas = _replicas(state, replicas)
    return msgspec.to_builtins(scaler.evaluate(signals_from(state.engine_stats(), state.slo.reports(),
                                                            scaler.replicas)))


def with_options(handlers: list[HTTPRouteHandler]) -> list[HTTPRouteHandler]:
    """`handlers` with an OPTIONS answer for each path served by several of them: Litestar's own lists only the
    methods of the first handler registered for a path (GET, not POST, for /v1/autoscale)."""
    methods: dict[str, set[str]] = {}
    for handler in handlers:
        for path in handler.paths:
            methods.setdefault(path, set()).update(handler.http_methods)
    extra = [_options(path, ", ".join(sorted(verbs | {"OPTIONS"}))) for path, verbs in methods.items()
             if len(verbs) > 1 and "OPTIONS" not in verbs]
    return [*extra, *handlers]


def _options(path: str, allow: str) -> HTTPRouteHandler:
    def options() -> Response:
        return Response(None, status_code=204, headers={"Allow": allow})

    return route_handler(path, http_method=[HttpMethod.OPTIONS], include_in_schema=False, sync_to_thread=False,
                 name=f"options:{path}")(options)


# a request's own errors, then the gateway's: auth, rate limits (429), no such model (404), not ready or shed (503)
GENERATION_ERRORS = error_responses(400, 401, 404, 413, 415, 429, 503)


@post("/v1/chat/completions", status_code=200, operation_class=streaming(ChatCompletionChunk), responses={
    200: ResponseSpec(ChatCompletion, description="The chat completion; with `stream: true` an SSE stream of "
                      "ChatCompletionChunk events ending with `data: [DONE]`", generate_examples=False),
    **GENERATION_ERRORS})
async def chat_completions(request: Request, data: JSONBody[ChatCompletionRequest]) -> Response | Stream:
    state = _state(request)
    route = resolve_route(request, state, data.model)
    prompt, messages = chat_prompt(data, allow_request_template=state.cfg.server.allow_request_chat_template)
    return await serve(request, state, route, data, "chat", prompt, conversation=messages)


@post("/v1/completions", status_code=200, operation_class=streaming(Completion), responses={
    200: ResponseSpec(Completion, description="The text completion; with `stream: true` an SSE stream of "
                      "Completion events ending with `data: [DONE]`", generate_examples=False),
    **GENERATION_ERRORS})
async def completions(request: Request, data: JSONBody[CompletionRequest]) -> Response | Stream:
    return await serve_completion(request, _state(request), data)


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
    TOKENIZE_POOL.resize(cfg.preparation.tokenize_threads)
    slo = SLOAccounting(cfg.routes, window_s=cfg.telemetry.slo_window_s,
                        price_per_device_hour=cfg.cost.price_per_device_hour)
    telemetry = Telemetry(provider, slo, meter_provider or build_meter_provider(cfg.telemetry),
                          prefix=cfg.telemetry.metric_prefix)
    keyring = KeyRing(cfg.auth)
    admission = AdmissionController(cfg.routes, cfg.admission, engine_slots={
        name: e.max_num_seqs for name, e in cfg.engines.items()}) if cfg.admission.enabled else None
    autoscaler = Autoscaler(cfg.autoscale)
    state = GatewayState(cfg=cfg, routes=Routes(cfg), keyring=keyring, telemetry=telemetry, slo=slo,
                         autoscaler=autoscaler, admission=admission)
    telemetry.bind_state(state)  # engines, admission and autoscaler for the scrape-time metrics
    # the router and cascade routes' held thresholds, realised shares and drift (gateway/route_metrics.py)
    telemetry.registry.register(RouteMonitorCollector(telemetry.prefix, lambda: state.routes.strategies))
    build = host_factory or default_host_factory(cfg)
    loading: list[asyncio.Task] = []
    periodic: list[asyncio.Task] = []

    def load() -> None:
        host = build()
        host.start()
        engines = {name: host.engine(name) for name in cfg.engines}
        # torch and the models leave ~250k long-lived objects; a full GC pass over them stalls every request
        # for ~200 ms: freeze them out of the collector's view. Where start-up ran with the collector off
        # (`tandem serve`: its automatic passes over those objects cost ~0.1 s each), start-up's own garbage
        # (~10k objects) is frozen with them rather than collected, a collection here being 0.13-0.19 s of
        # the way to /ready.
        if gc.isenabled():
            gc.collect()
        gc.freeze()
        gc.enable()
        vocab, context = engine_bounds(engines.values())  # token ids' bounds, published before /ready says so
        amend(app, lambda schemas: bound_tokens(schemas, vocab, context))
        state.host, state.engines = host, engines

    async def start_loading(app: Litestar) -> None:
        async def run() -> None:
            try:
                await in_own_thread(load)
                log.info("engines ready: %s", ", ".join(state.engines))
            except Exception as exc:
                state.load_error = f"engine start-up failed: {type(exc).__name__}: {exc}"
                if isinstance(exc, CheckpointError):  # a file that cannot load: the message says it all
                    log.error("engine start-up failed: %s", exc)
                else:
                    log.exception("engine start-up failed")
                if on_load_error is not None:
                    on_load_error(state.load_error)
        loading.append(asyncio.create_task(run()))

    def read_signals(replicas: int) -> ScaleSignals | None:
        return signals_from(state.engine_stats(), slo.reports(), replicas) if state.ready else None

    async def start_autoscaling(app: Litestar) -> None:
        periodic.append(asyncio.create_task(evaluate_periodically(
            autoscaler, read_signals, cfg.autoscale.evaluation_interval_s)))

    async def stop(app: Litestar) -> None:
        for task in periodic:
            task.cancel()
        for task in loading:
            if not task.done():
                await asyncio.wait([task], timeout=60)
        if state.host is not None:
            await asyncio.to_thread(state.host.shutdown)
        gc.unfreeze()  # let interpreter shutdown collect them (extension types report leaks otherwise)

    app = GatewayApp(
        route_handlers=with_options([health, ready, metrics, list_models, list_routes, autoscale, report_replicas,
                                     chat_completions, completions, *RESPONSES_HANDLERS, *ANTHROPIC_HANDLERS,
                                     *EMBEDDINGS_HANDLERS, *VLLM_HANDLERS, *DASHBOARD_HANDLERS]),
        on_startup=[start_loading, start_autoscaling], on_shutdown=[stop],
        middleware=[AuthMiddleware(keyring)],
        plugins=[otel_plugin(provider)],
        exception_handlers={**EXCEPTION_HANDLERS, ValidationException: _validation_error},
        request_max_body_size=cfg.server.max_body_bytes,
        request_class=StrictJSONRequest,  # bodies decoded strictly: JSON only, bounded nesting, no coercion
        openapi_config=OpenAPIConfig(title="tandem", version="0.1.0", path="/schema",
                                     render_plugins=[SwaggerRenderPlugin()]),
        logging_config=None,
        debug=False,
    )
    publish(app, [ChatCompletionRequest, CompletionRequest, ChatCompletion, ChatCompletionChunk, Completion,
                  ModelList, Readiness, *VLLM_SCHEMAS, ResponsesRequest, MessagesRequest, CountTokensRequest,
                  EmbeddingRequest, ResponseStreamEvent, MessageStreamEvent],
            error_shapes={"/v1/messages": AnthropicErrorBody})
    bound_parameter(app, "/v1/autoscale", "replicas", cfg.autoscale.max_replicas)
    constrain(app.openapi_schema.components.schemas, cfg)  # the rules across fields (gateway/request_contract.py)
    app.state.gateway = state
    # under vLLM's names, vLLM's families keep vLLM's labels (route copies under their own names)
    app.state.metrics_source = VllmLabelView(telemetry.registry, cfg.telemetry.metric_prefix) \
        if cfg.telemetry.metric_prefix == "vllm" else telemetry.registry
    app.state.responses = ResponseStore()  # /v1/responses' stored responses (gateway/responses_store.py)
    app.state.on_error = telemetry.count_error
    return app

