"""The `router` route strategy: score each request with the route's trained router (whole conversation, text
features only, microseconds) and send it to the route's small or large engine. The artifact loads once at
start-up; the threshold is the route's own, or calibrated from a target large fraction and then held on live
traffic by the route's `RouteMonitor` (gateway/route_monitor.py), which also watches its scores drift.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.config import DEFAULT_ROUTER_ARTIFACT, ConfigError, RouteConfig, TandemConfig
from gateway.route_monitor import RouteMonitor
from gateway.router_refit import PeriodicRefit
from gateway.routing import Plan, RoutedRun, RoutingContext, start_planned
from gateway.shadow import LabelStore, ShadowRunner, ShadowSampler
from router_model import Router, RouterArtifactError
from router_model.features import Conversation


def route_threshold(router: Router, route: RouteConfig) -> tuple[float, str]:
    """(threshold, where it came from): the route's explicit threshold, else its target large fraction turned
    into a threshold through the artifact's held-out score quantiles, else the artifact's own threshold."""
    if route.router.threshold is not None:
        return route.router.threshold, "route threshold"
    if route.router.target_large_fraction is not None:
        fraction = route.router.target_large_fraction
        return router.threshold_for_fraction(fraction), f"route target_large_fraction {fraction:g}"
    return router.threshold, f"artifact threshold (target large fraction {router.target_large_fraction})"


def conversation_of(ctx: RoutingContext, small: Any, large: Any) -> Conversation:
    """What a router (or the cascade's escalation scorer) reads: every chat message, or the raw prompt
    (token-id prompts decoded)."""
    if ctx.conversation is not None:
        return ctx.conversation
    if ctx.prompt_text is not None:
        return ctx.prompt_text
    # no more than a context holds, and only ids the tokenizer has: the engine refuses a longer prompt or an
    # unknown id (400), the router need not read them
    longest = max(getattr(small, "max_model_len", 0) or 0, getattr(large, "max_model_len", 0) or 0) or None
    vocab = small.tokenizer.vocab_size
    return small.tokenizer.decode(t for t in (ctx.prompt_token_ids or [])[:longest] if 0 <= t < vocab)


class RouterStrategy:
    """P(large needed) >= threshold -> the large engine, else the small one."""

    def __init__(self, name: str, route: RouteConfig, router: Router, *, record_content: bool = False):
        self.name = name
        self.small, self.large = route.engines
        self.router = router
        static, self.threshold_source = route_threshold(router, route)
        cfg = route.router
        held = cfg.target_large_fraction if cfg.threshold is None and cfg.hold_target else None
        if held is not None:
            self.threshold_source += f", held on the last {cfg.window} scores"
        self.monitor = RouteMonitor(name, static_threshold=static, target_fraction=held,
                                    reference_quantiles=router.score_quantiles.tolist(), window=cfg.window,
                                    warmup=cfg.warmup, drift_min_ks=cfg.drift_min_ks,
                                    interval_s=cfg.history_interval_s)
        self.shadow: ShadowRunner | None = None
        if cfg.shadow_fraction > 0:
            self.shadow = ShadowRunner(
                name, (self.small, self.large), ShadowSampler(cfg.shadow_fraction, cfg.shadow_max_inflight),
                LabelStore(cfg.shadow_labels, cfg.shadow_max_records), features=router.features,
                max_tokens=cfg.shadow_max_tokens, record_content=record_content,
                artifact=str(router.metadata.get("trained_at", "")) + " " + (cfg.artifact or "default"))

        self.refit: PeriodicRefit | None = None
        if cfg.refit_interval_s is not None:
            if not cfg.shadow_labels or cfg.shadow_fraction <= 0 or not cfg.refit_dir:
                raise ConfigError(f"routes.{name}.router.refit_interval_s needs shadow_fraction > 0, shadow_labels "
                                  f"(the labels it refits from) and refit_dir (where an adapted artifact goes)")
            self.refit = PeriodicRefit(self, labels=cfg.shadow_labels, out=cfg.refit_dir,
                                       interval_s=cfg.refit_interval_s, min_labels=cfg.refit_min_labels,
                                       current_dir=cfg.artifact or str(DEFAULT_ROUTER_ARTIFACT))
            self.refit.start()

    def swap(self, router: Router, folder: str) -> None:
        """Serve `router` from the next decision on (one assignment: a decision reads the old or the new one);
        the drift check compares with its held-out scores from now on."""
        self.router = router
        self.monitor.reference = router.score_quantiles.tolist()
        if self.shadow is not None:
            self.shadow.features = router.features
            self.shadow.artifact = str(router.metadata.get("trained_at", "")) + " " + folder

    @property
    def threshold(self) -> float:
        """The threshold the next decision uses (the held one moves with the route's recent scores)."""
        return self.monitor.threshold

    def conversation(self, ctx: RoutingContext, engines: Mapping[str, Any]) -> Conversation:
        return conversation_of(ctx, engines[self.small], engines[self.large])

    def decide(self, conversation: Conversation) -> tuple[str, float]:
        """("small" | "large", score) for one conversation under this route's threshold (then the score joins
        the route's window)."""
        score = self.router.score(conversation)
        return ("large" if self.monitor.decide(score) else "small"), score

    def plan(self, ctx: RoutingContext, engines: Mapping[str, Any]) -> Plan:
        threshold = self.threshold  # the one this decision is taken against
        choice, score = self.decide(self.conversation(ctx, engines))
        return Plan(self.large if choice == "large" else self.small, score=score,
                    attributes={"tandem.router.choice": choice, "tandem.router.threshold": threshold})

    async def start(self, plan: Plan, ctx: RoutingContext, engines: Mapping[str, Any]) -> RoutedRun:
        run = await start_planned(plan, ctx, engines)
        if self.shadow is not None and self.shadow.sampler.admit():
            self.shadow.start(ctx, engines, plan.score, plan.attributes["tandem.router.choice"],
                              self.conversation(ctx, engines))
        return run


def load_route_router(name: str, route: RouteConfig, cfg: TandemConfig) -> Router:
    """The route's artifact, or a ConfigError naming the route's setting and the fix."""
    folder = route.router.artifact or str(DEFAULT_ROUTER_ARTIFACT)
    where = f"{cfg.source}: routes.{name}.router.artifact = {folder!r}"
    try:
        router = Router.load(folder)
    except RouterArtifactError as exc:
        raise ConfigError(f"{where} cannot be loaded: {exc}") from None
    if router.kind != "router" or router.needs_answer:
        raise ConfigError(f"{where} is a cascade escalation scorer (it reads the small answer), not a router; use "
                          f"it as routes.<name>.cascade.scorer")
    if router.required_extras:
        # The gateway scores from text alone; model-derived features would need a small-model prefill first.
        raise ConfigError(f"{where} needs extra feature(s) {', '.join(router.required_extras)}, which the gateway "
                          f"does not compute; train the route's router without extras")
    return router
