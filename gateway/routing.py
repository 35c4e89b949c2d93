"""Route -> engine: resolve the request's `model` to a route (a configured one, or an engine named directly)
and let the route's strategy start the generation. `fixed` lives here; `router` and `cascade` plug into
the same seam: a module named in STRATEGY_MODULES calls `register_strategy` when imported (a strategy may run
one engine, or several in turn, as a cascade does).
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from engines.outputs import RequestOutput
from engines.sampling_params import SamplingParams
from gateway.config import STRATEGY_NAMES, RouteConfig, TandemConfig
from gateway.errors import APIError


@dataclass(frozen=True)
class Route:
    """A resolved route: its name, config and whether the client named an engine directly."""

    name: str
    config: RouteConfig
    direct: bool = False


@dataclass
class RoutingContext:
    """What a strategy may look at and needs to start a request on an engine."""

    request_id: str
    params: SamplingParams
    priority: int
    render: Callable[[Any], str | list[int]]  # engine -> the prompt for that engine (its chat template)
    conversation: list[dict[str, Any]] | None = None  # chat messages (the router scores the whole conversation)
    prompt_text: str | None = None  # the raw prompt of /v1/completions
    ttft_s: float | None = None  # the route's SLO targets in seconds (the engine's deadline order and caps)
    tpot_s: float | None = None


# Run attribute a cascade sets once it has decided (True: escalated); the lifecycle turns it into a header.
ESCALATED = "tandem.cascade.escalated"


@dataclass
class RoutedRun:
    """A started generation: which engine answers, its outputs, and how to abort everything it started."""

    engine: Any  # AsyncEngine
    outputs: AsyncIterator[RequestOutput]
    request_ids: list[tuple[Any, str]] = field(default_factory=list)  # (engine, request id) pairs to abort
    score: float | None = None  # router score P(large needed), when a router decided
    attributes: dict[str, Any] = field(default_factory=dict)  # extra span attributes of the decision

    def abort(self) -> None:
        for engine, request_id in self.request_ids:
            engine.abort(request_id)

    async def close(self) -> None:
        """End the outputs generator now: left to the garbage collector, it is closed by a task the event
        loop schedules through its self-pipe, one wake-up per request."""
        aclose = getattr(self.outputs, "aclose", None)
        if aclose is not None:
            await aclose()


class Strategy(Protocol):
    """A route strategy: given the route's engines, start the request and say who answers."""

    def start(self, route: Route, ctx: RoutingContext, engines: Mapping[str, Any]) -> RoutedRun: ...


StrategyFactory = Callable[[str, RouteConfig, TandemConfig], Strategy]
_FACTORIES: dict[str, StrategyFactory] = {}
# Where the strategies that live outside this module are found: importing the module registers the strategy.
STRATEGY_MODULES = {"router": "gateway.router_strategy", "cascade": "gateway.cascade"}


def register_strategy(name: str, factory: StrategyFactory) -> None:
    """Make `name` available to routes; the factory builds one strategy per route at start-up."""
    _FACTORIES[name] = factory
    STRATEGY_NAMES.add(name)


def start_on(engine: Any, ctx: RoutingContext, **kwargs: Any) -> RoutedRun:
    """Start ctx's request on one engine (the building block every strategy uses)."""
    if ctx.ttft_s is not None:  # passed only when set: engines without SLO scheduling need not know the names
        kwargs.setdefault("ttft_s", ctx.ttft_s)
    if ctx.tpot_s is not None:
        kwargs.setdefault("tpot_s", ctx.tpot_s)
    outputs = engine.generate(ctx.render(engine), ctx.params, ctx.request_id, priority=ctx.priority, **kwargs)
    return RoutedRun(engine=engine, outputs=outputs, request_ids=[(engine, ctx.request_id)])


class FixedStrategy:
    """Always the route's one engine."""

    def start(self, route: Route, ctx: RoutingContext, engines: Mapping[str, Any]) -> RoutedRun:
        return start_on(engines[route.config.engines[0]], ctx)


register_strategy("fixed", lambda name, route, cfg: FixedStrategy())


def _import_strategy(name: str) -> StrategyFactory | None:
    """Import the module that registers strategy `name`; None when this build does not have it."""
    module = STRATEGY_MODULES.get(name)
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:  # the module exists but something it needs is missing: say so loudly
            raise
        return None
    return _FACTORIES.get(name)


class Routes:
    """The routing table: configured routes plus one implicit fixed route per engine."""

    def __init__(self, cfg: TandemConfig):
        self.cfg = cfg
        self.routes: dict[str, Route] = {name: Route(name, rc) for name, rc in cfg.routes.items()}
        for engine in cfg.engines:
            self.routes[engine] = Route(engine, RouteConfig(engines=[engine]), direct=True)
        self.strategies: dict[str, Strategy] = {}
        self.unavailable: dict[str, str] = {}  # route -> why it cannot serve (its strategy is not installed)
        for name, route in self.routes.items():
            factory = _FACTORIES.get(route.config.strategy) or _import_strategy(route.config.strategy)
            if factory is None:
                self.unavailable[name] = (f"route {name!r} uses strategy {route.config.strategy!r}, which this "
                                          f"build does not provide yet")
                continue
            self.strategies[name] = factory(name, route.config, cfg)

    def resolve(self, model: str) -> Route:
        route = self.routes.get(model)
        if route is None:
            raise APIError(404, f"The model {model!r} does not exist; available: {', '.join(self.routes)}",
                           code="model_not_found", param="model")
        if model in self.unavailable:
            raise APIError(501, self.unavailable[model] + "; use another route", code="strategy_unavailable",
                           param="model")
        return route

    def start(self, route: Route, ctx: RoutingContext, engines: Mapping[str, Any]) -> RoutedRun:
        return self.strategies[route.name].start(route, ctx, engines)
