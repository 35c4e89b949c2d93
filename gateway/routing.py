"""The seam between a request and the route strategies: what a strategy sees (`RoutingContext`), decides
(`Plan`: the engine admission books) and returns (`RoutedRun`), and `RoutingContext.start`, the one way any
strategy starts the request on an engine. The one-engine `fixed` strategy lives here; the table of routes
is gateway/routes.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from engines.outputs import RequestOutput
from engines.sampling_params import SamplingParams
from gateway.config import RouteConfig
from gateway.prompts import Prompt


@dataclass(frozen=True)
class Route:
    """A resolved route: its name, config and whether the client named an engine directly."""

    name: str
    config: RouteConfig
    direct: bool = False


@dataclass
class Plan:
    """A strategy's decision before anything starts: the engine admission books and the request starts on."""

    engine: str
    score: float | None = None  # router score P(large needed), when a router decided
    attributes: dict[str, Any] = field(default_factory=dict)  # span attributes of the decision


class Ledger(Protocol):
    """The admission ledger as a strategy that starts a second engine sees it (gateway/admission.py)."""

    def book(self, request_id: str, route: str, engine: str, prompt_tokens: int) -> None: ...
    def first_token(self, request_id: str) -> None: ...
    def release(self, request_id: str) -> None: ...


class _NoLedger:
    """Admission is off: nothing to book."""

    def book(self, request_id: str, route: str, engine: str, prompt_tokens: int) -> None:
        pass

    def first_token(self, request_id: str) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


NO_LEDGER = _NoLedger()


@dataclass
class RoutingContext:
    """One request as a strategy sees it, and `start`, the one way to start it on an engine."""

    request_id: str
    route: Route
    params: SamplingParams
    prompt: Prompt  # the prompt per engine (its chat template), prepared on first use
    conversation: list[dict[str, Any]] | None = None  # chat messages (the router scores the whole conversation)
    prompt_text: str | None = None  # the raw text prompt of /v1/completions
    prompt_token_ids: list[int] | None = None  # or its token ids
    ledger: Ledger = NO_LEDGER  # where a second engine's start is booked (the first is admitted before start)

    def start(self, engine: Any, prompt: str | list[int], *, request_id: str | None = None,
              params: SamplingParams | None = None, draft_token_ids: list[int] | None = None
              ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for this request, started with the route's priority and TTFT/TPOT targets."""
        kwargs: dict[str, Any] = {}
        slo = self.route.config.slo
        # passed only when set: engines without SLO scheduling or drafts need not know the names
        if slo.ttft_ms is not None:
            kwargs["ttft_s"] = slo.ttft_ms / 1000.0
        if slo.tpot_ms is not None:
            kwargs["tpot_s"] = slo.tpot_ms / 1000.0
        if draft_token_ids is not None:
            kwargs["draft_token_ids"] = draft_token_ids
        return engine.generate(prompt, params or self.params, request_id or self.request_id,
                               priority=self.route.config.priority, **kwargs)


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
    """A route strategy: first decide which engine starts (admission books it), then start the request."""

    def plan(self, ctx: RoutingContext, engines: Mapping[str, Any]) -> Plan: ...
    async def start(self, plan: Plan, ctx: RoutingContext, engines: Mapping[str, Any]) -> RoutedRun: ...


async def start_planned(plan: Plan, ctx: RoutingContext, engines: Mapping[str, Any]) -> RoutedRun:
    """Start the request on the planned engine alone (every one-engine strategy's `start`)."""
    engine = engines[plan.engine]
    outputs = ctx.start(engine, await ctx.prompt.get(engine))
    return RoutedRun(engine=engine, outputs=outputs, request_ids=[(engine, ctx.request_id)], score=plan.score,
                     attributes=plan.attributes)


class FixedStrategy:
    """Always the route's one engine."""

    def plan(self, ctx: RoutingContext, engines: Mapping[str, Any]) -> Plan:
        return Plan(ctx.route.config.engines[0])

    start = staticmethod(start_planned)
