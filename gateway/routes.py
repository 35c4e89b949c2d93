"""The routing table: every configured route plus one implicit fixed route per engine, each with its strategy
built once at start-up, and `resolve`, which turns a request's `model` into its route (404 when unknown).
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.cascade import CascadeStrategy
from gateway.config import STRATEGY_NAMES, RouteConfig, TandemConfig
from gateway.errors import APIError
from gateway.router_strategy import RouterStrategy, load_route_router
from gateway.routing import FixedStrategy, Route, Strategy

StrategyFactory = Callable[[str, RouteConfig, TandemConfig], Strategy]  # (route name, route, config)
STRATEGIES: dict[str, StrategyFactory] = {
    "fixed": lambda name, route, cfg: FixedStrategy(),
    "router": lambda name, route, cfg: RouterStrategy(name, route, load_route_router(name, route, cfg),
                                                      record_content=cfg.telemetry.record_content),
    "cascade": lambda name, route, cfg: CascadeStrategy(name, route),
}


def register_strategy(name: str, factory: StrategyFactory) -> None:
    """Make strategy `name` available to routes (configs are checked against the names known at load)."""
    STRATEGIES[name] = factory
    STRATEGY_NAMES.add(name)


class Routes:
    """Route name -> route and its strategy; engines are routes of their own (`model` = the engine's name),
    except those configured `served = false`."""

    def __init__(self, cfg: TandemConfig):
        self.routes: dict[str, Route] = {name: Route(name, rc) for name, rc in cfg.routes.items()}
        for engine, ec in cfg.engines.items():
            if not ec.served:  # a draft that only drafts: no route of its own
                continue
            self.routes[engine] = Route(engine, RouteConfig(engines=[engine]), direct=True)
        self.strategies: dict[str, Strategy] = {
            name: STRATEGIES[route.config.strategy](name, route.config, cfg) for name, route in self.routes.items()}

    def resolve(self, model: str) -> Route:
        route = self.routes.get(model)
        if route is None:
            raise APIError(404, f"The model {model!r} does not exist; available: {', '.join(self.routes)}",
                           code="model_not_found", param="model")
        return route

    def strategy(self, route: Route) -> Strategy:
        return self.strategies[route.name]
