"""The end of a request, whichever way it ends: its timing (`Progress`), then `Finisher` aborts what is unfinished,
releases the admission ledger, settles the key's token reservation and records metrics, SLO accounting and spans.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from engines.outputs import RequestOutput
from gateway.limits import TokenReservation
from gateway.routing import ESCALATED, Route, RoutedRun
from gateway.slo import time_per_output_token
from gateway.state import GatewayState
from gateway.tracing import add_child_span, add_engine_spans, add_escalation_span


@dataclass
class Progress:
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


class Finisher:
    """The end of a request, whichever way it ends: abort if unfinished, settle tokens, record telemetry."""

    def __init__(self, state: GatewayState, route: Route, run: RoutedRun, progress: Progress, span: Any,
                 tokens: TokenReservation | None, operation: str, request_model: str,
                 route_span: tuple[int, int, dict[str, Any]] | None = None):
        self.state, self.route, self.run, self.progress, self.span, self.tokens = (
            state, route, run, progress, span, tokens)
        self.operation, self.request_model = operation, request_model
        self.route_span = route_span  # (start ns, end ns, attributes) of the routing decision
        self.finished_ok = False
        self.failed = False  # ended by an engine or server error (a miss in the SLO accounting)
        self.cancelled = False  # the client left (or the server stopped) while it waited
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
        admission = self.state.admission
        if admission is not None:  # every engine request it started (a cascade may have two)
            for _, request_id in self.run.request_ids:
                admission.release(request_id)
        if self.failed or (not self.finished_ok and out is not None and out.error):
            self.state.slo.observe_failure(self.route.name)
        if self.route_span is not None:
            add_child_span(self.state.telemetry.tracer, self.span, "route", *self.route_span)
        prompt_tokens = len(out.prompt_token_ids) if out is not None else 0
        output_tokens = sum(len(c.token_ids) for c in out.outputs) if out is not None else 0
        if self.tokens is not None:  # the usage the answer reports; nothing when no output came
            self.tokens.settle(prompt_tokens + output_tokens)
        now = time.monotonic()
        telemetry = self.state.telemetry
        if out is None:
            if self.cancelled:  # before any output (queued, or a cascade's buffered small answer): an abort
                telemetry.observe_request(route=self.route.name, model=self.run.engine.name, ttft_s=None,
                                          tpot_s=None, e2e_s=now - self.progress.arrival, itls=[],
                                          output_tokens=0, prompt_tokens=0, finish_reason="abort", queue_s=None,
                                          operation=self.operation, request_model=self.request_model)
            return
        reasons = [c.finish_reason or "abort" for c in out.outputs]
        p = self.progress
        ttft = None if p.first_token is None else p.first_token - p.arrival
        e2e = now - p.arrival
        tpot = time_per_output_token(ttft, e2e, output_tokens)
        metrics = out.metrics
        queue = (metrics.first_scheduled_time - metrics.arrival_time
                 if metrics and metrics.first_scheduled_time is not None else None)
        telemetry.observe_request(route=self.route.name, model=self.run.engine.name, ttft_s=ttft, tpot_s=tpot,
                                  e2e_s=e2e, itls=p.itls, output_tokens=output_tokens,
                                  prompt_tokens=prompt_tokens, finish_reason=reasons[0], queue_s=queue,
                                  operation=self.operation, request_model=self.request_model, output=out)
        if self.finished_ok:
            self.state.slo.observe_request(self.route.name, self.run.engine.name, ttft_s=ttft, tpot_s=tpot,
                                           prompt_tokens=prompt_tokens, output_tokens=output_tokens)
        span = self.span
        if not span.is_recording():  # no span processor, or sampled out: nothing below would be kept
            return
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
