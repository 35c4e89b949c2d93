"""The `cascade` route strategy: the small engine answers first (with token logprobs); when its confidence
(mean or minimum token logprob) is under the route's threshold, the large engine verifies that answer as
supplied draft tokens in one pass and regenerates from the first rejected token. Streaming buffers until the
decision, so a client sees one answer, never a retracted one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from engines.errors import RequestRejected
from engines.outputs import CompletionOutput, RequestOutput
from gateway.config import RouteConfig
from gateway.errors import APIError
from gateway.routing import ESCALATED, Plan, RoutedRun, RoutingContext

log = logging.getLogger("tandem.gateway")


def confidence(output: CompletionOutput, mode: str) -> float:
    """Mean or minimum log-probability of the tokens the model chose (0.0 for an empty answer)."""
    if not output.token_ids:
        return 0.0
    positions = output.logprobs or []
    values = []
    for token_id, position in zip(output.token_ids, positions):
        chosen = position.get(token_id)
        values.append(chosen.logprob if chosen is not None else -math.inf)
    if len(values) < len(output.token_ids):  # logprobs missing: nothing says the answer is good
        return -math.inf
    return min(values) if mode == "min" else sum(values) / len(values)


def whole_answer(out: RequestOutput, keep_logprobs: bool) -> RequestOutput:
    """The finished output as one delta carrying the whole answer (what a buffered stream sends at once);
    logprobs the client did not ask for are dropped."""
    choices = [dataclasses.replace(
        c, logprobs=c.logprobs if keep_logprobs else None, delta_text=c.text, delta_token_ids=list(c.token_ids),
        delta_logprobs=c.logprobs if keep_logprobs else None) for c in out.outputs]
    return dataclasses.replace(out, outputs=choices)


@dataclass
class CascadeRun(RoutedRun):
    """A cascade's run: `engine` turns to the large engine when it escalates; an abort stops escalation."""

    aborted: bool = False

    def abort(self) -> None:
        self.aborted = True
        super().abort()


class CascadeStrategy:
    """Small first; escalate to large (verifying the small answer as drafts) when it is not confident."""

    def __init__(self, name: str, route: RouteConfig):
        self.name = name
        self.small, self.large = route.engines
        self.mode = route.cascade.mode
        self.threshold = route.cascade.confidence_threshold
        self._same_vocab: dict[tuple[int, int], bool] = {}

    def should_escalate(self, output: CompletionOutput) -> tuple[bool, float]:
        score = confidence(output, self.mode)
        return score < self.threshold, score

    def plan(self, ctx: RoutingContext, engines: Mapping[str, Any]) -> Plan:
        if ctx.params.n != 1:
            raise APIError(400, f"n = {ctx.params.n} is not supported on the cascade route {self.name!r} (one "
                           f"answer is checked and escalated); use n = 1 or a fixed route", param="n",
                           code="invalid_value")
        return Plan(self.small)

    async def start(self, plan: Plan, ctx: RoutingContext, engines: Mapping[str, Any]) -> RoutedRun:
        small, large = engines[self.small], engines[self.large]
        prompt = await ctx.prompt.get(small)
        run = CascadeRun(engine=small, outputs=None, request_ids=[(small, ctx.request_id)])  # type: ignore[arg-type]
        run.outputs = self._outputs(run, ctx, small, prompt, large)  # attached now: the iterator needs the run
        return run

    async def _outputs(self, run: CascadeRun, ctx: RoutingContext, small: Any, prompt: str | list[int],
                       large: Any) -> AsyncIterator[RequestOutput]:
        asked = ctx.params.logprobs is not None
        # The confidence needs the chosen tokens' logprobs even when the client did not ask for them.
        small_params = ctx.params if asked else dataclasses.replace(ctx.params, logprobs=0)
        ledger = ctx.ledger  # admission booked the small engine; this run reports its first token and end
        final: RequestOutput | None = None
        try:
            async for out in ctx.start(small, prompt, params=small_params):
                if final is None and not out.error:
                    ledger.first_token(ctx.request_id)
                final = out
        finally:
            ledger.release(ctx.request_id)
        assert final is not None and final.finished
        answer = final.outputs[0]
        if final.error or answer.finish_reason in ("abort", "error") or run.aborted:
            yield whole_answer(final, asked)
            return
        escalate, score = self.should_escalate(answer)
        run.attributes.update({"tandem.cascade.confidence": max(score, -1e9), "tandem.cascade.mode": self.mode,
                               "tandem.cascade.threshold": self.threshold,
                               "tandem.cascade.small_completion_tokens": len(answer.token_ids), ESCALATED: False})
        if not escalate:
            yield whole_answer(final, asked)
            return

        large_id = f"{ctx.request_id}-escalated"
        drafts = list(answer.token_ids) if self._shares_vocabulary(small, large) else None
        large_prompt = await ctx.prompt.get(large)
        if run.aborted:  # aborted while the large prompt was prepared: start nothing more
            yield whole_answer(final, asked)
            return
        run.request_ids.append((large, large_id))
        ledger.book(large_id, ctx.route.name, large.name, len(large_prompt))
        outputs = ctx.start(large, large_prompt, request_id=large_id, draft_token_ids=drafts)
        try:
            first = await anext(outputs)
        except RequestRejected as exc:
            # The large engine cannot take this prompt (e.g. a shorter context): the small answer stands.
            ledger.release(large_id)
            log.warning("cascade %s: request %s not escalated: %s", self.name, ctx.request_id, exc)
            run.attributes["tandem.cascade.escalation_rejected"] = str(exc)
            yield whole_answer(final, asked)
            return
        ledger.release(large_id) if first.error else ledger.first_token(large_id)
        run.engine = large
        run.attributes[ESCALATED] = True
        run.attributes["tandem.cascade.draft_tokens"] = len(drafts or ())
        yield first
        async for out in outputs:
            yield out

    def _shares_vocabulary(self, small: Any, large: Any) -> bool:
        """Drafts are token ids: only meaningful when both engines tokenize identically (checked once)."""
        key = (id(small.tokenizer), id(large.tokenizer))
        same = self._same_vocab.get(key)
        if same is None:
            a, b = small.tokenizer, large.tokenizer
            same = a is b or (a.vocab_size == b.vocab_size and a.backend.to_str() == b.backend.to_str())
            if not same:
                log.warning("cascade %s: %s and %s tokenize differently; escalations regenerate without drafts",
                            self.name, self.small, self.large)
            self._same_vocab[key] = same
        return same
