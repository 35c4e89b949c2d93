"""The `cascade` route strategy: the small engine answers first (with token logprobs); then the route decides
whether to escalate. `mode = "learned"`: the escalation scorer (a router artifact of kind "escalation",
trained by `tandem router train --kind escalation` on task-success labels) reads the prompt, the small answer's
text and its logprob statistics (router_model.scoring.answer_stats) and predicts P(the large model is right
where the small one is wrong); escalate when it reaches the route's threshold (or the one that escalates
`target_escalation_fraction` of held-out prompts). `mode = "mean" | "min"`: the raw confidence (mean or minimum
token logprob) under `confidence_threshold` escalates. An escalation has the large engine verify the small
answer as supplied draft tokens in one pass and regenerate from the first rejected token, so a greedy cascade
returns exactly the large model's greedy answer when it escalates. Streaming buffers until the decision, so a
client sees one answer, never a retracted one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from engines.errors import RequestRejected
from engines.outputs import CompletionOutput, RequestOutput
from gateway.config import DEFAULT_CASCADE_SCORER, ConfigError, RouteConfig
from gateway.errors import APIError
from gateway.route_monitor import RouteMonitor
from gateway.router_strategy import conversation_of
from gateway.routing import ESCALATED, Plan, RoutedRun, RoutingContext
from gateway.shadow import LabelStore
from router_model import Router, RouterArtifactError
from router_model.scoring import ANSWER_STATS, ENTROPY_TOP_K, agreement, answer_stats

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


def _trim(output: CompletionOutput, top: int | None):
    """The logprobs the client asked for: None drops them; k keeps the chosen token plus the top k."""
    if top is None or output.logprobs is None:
        return None
    return [{tid: lp for tid, lp in position.items() if tid == chosen or (lp.rank is not None and lp.rank <= top)}
            for chosen, position in zip(output.token_ids, output.logprobs)]


def whole_answer(out: RequestOutput, top_logprobs: int | None) -> RequestOutput:
    """The finished output as one delta carrying the whole answer (what a buffered stream sends at once);
    logprobs beyond what the client asked for (`top_logprobs`; None: none) are dropped."""
    choices = []
    for c in out.outputs:
        kept = _trim(c, top_logprobs)
        choices.append(dataclasses.replace(c, logprobs=kept, delta_text=c.text, delta_token_ids=list(c.token_ids),
                                           delta_logprobs=kept))
    return dataclasses.replace(out, outputs=choices)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Leading tokens two answers share: how much of the small answer the large model's verification kept."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def load_cascade_scorer(name: str, route: RouteConfig) -> Router:
    """The route's escalation scorer, or a ConfigError naming the route's setting and the fix."""
    folder = route.cascade.scorer or str(DEFAULT_CASCADE_SCORER)
    where = f"routes.{name}.cascade.scorer = {folder!r}"
    try:
        scorer = Router.load(folder)
    except RouterArtifactError as exc:
        raise ConfigError(f"{where} cannot be loaded: {exc}") from None
    if scorer.kind != "escalation":
        raise ConfigError(f"{where} is a {scorer.kind} artifact, not an escalation scorer; train one with "
                          f"`tandem router train --kind escalation`")
    unknown = [e for e in scorer.required_extras if e not in ANSWER_STATS]
    if unknown:
        raise ConfigError(f"{where} needs extra feature(s) {', '.join(unknown)}, which the cascade does not "
                          f"compute (it supplies {', '.join(ANSWER_STATS)})")
    return scorer


def escalation_threshold(scorer: Router, route: RouteConfig) -> tuple[float, str]:
    """(threshold, where it came from): the route's explicit one, else its target escalation fraction turned
    into a threshold through the scorer's held-out score quantiles, else the artifact's own."""
    cfg = route.cascade
    if cfg.escalation_threshold is not None:
        return cfg.escalation_threshold, "route escalation_threshold"
    if cfg.target_escalation_fraction is not None:
        f = cfg.target_escalation_fraction
        return scorer.threshold_for_fraction(f), f"route target_escalation_fraction {f:g}"
    return scorer.threshold, f"artifact threshold (target escalation fraction {scorer.target_large_fraction})"


@dataclass
class CascadeRun(RoutedRun):
    """A cascade's run: `engine` turns to the large engine when it escalates; an abort stops escalation."""

    aborted: bool = False

    def abort(self) -> None:
        self.aborted = True
        super().abort()


class CascadeStrategy:
    """Small first; escalate to large (verifying the small answer as drafts) when it is not confident."""

    def __init__(self, name: str, route: RouteConfig, scorer: Router | None = None):
        self.name = name
        self.small, self.large = route.engines
        self.mode = route.cascade.mode
        self.scorer: Router | None = None
        if self.mode == "learned":
            self.scorer = scorer or load_cascade_scorer(name, route)
            self.threshold, self.threshold_source = escalation_threshold(self.scorer, route)
        else:
            self.threshold, self.threshold_source = route.cascade.confidence_threshold, "route confidence_threshold"
        self._same_vocab: dict[tuple[int, int], bool] = {}
        # finished verifications as labels (learned mode): the scorer's features of what it read, no text
        self.labels = LabelStore(route.cascade.verification_labels, route.cascade.verification_max_records) \
            if self.scorer is not None and route.cascade.verification_labels else None
        # the escalation rate (and, learned, the scorer's score distribution and drift) over recent traffic
        self.monitor = RouteMonitor(name, static_threshold=self.threshold, label="escalated", reference_quantiles=(
            self.scorer.score_quantiles.tolist() if self.scorer is not None else None))

    def should_escalate(self, output: CompletionOutput, conversation: Any = None,
                        tokenizer: Any = None) -> tuple[bool, float]:
        """(escalate?, score): the learned scorer's P(large needed) >= threshold, or the raw confidence below it."""
        if self.scorer is None:
            score = confidence(output, self.mode)
            return score < self.threshold, score
        pieces = ([tokenizer.decode([t], skip_special_tokens=False) for t in output.token_ids]
                  if tokenizer is not None else None)
        stats = answer_stats(output.token_ids, output.logprobs, pieces)
        score = self.scorer.score(conversation if conversation is not None else "", stats, output.text)
        return score >= self.threshold, score

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
        asked = ctx.params.logprobs  # None: the client wants no logprobs; k: the chosen token plus the top k
        # The decision needs the chosen tokens' logprobs even when the client did not ask for them; the learned
        # scorer's entropy also needs the top ENTROPY_TOP_K at each position. The client sees only what it asked.
        need = ENTROPY_TOP_K if self.scorer is not None else 0
        small_params = ctx.params if asked is not None and asked >= need else dataclasses.replace(
            ctx.params, logprobs=need if asked is None else max(asked, need))
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
        escalate, score = self.should_escalate(answer, conversation_of(ctx, small, large), small.tokenizer)
        self.monitor.record(score if self.scorer is not None else None, escalate)
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
        read = (conversation_of(ctx, small, large), answer, score, small.tokenizer)
        self._verified(first, drafts, read)
        yield first
        async for out in outputs:
            self._verified(out, drafts, read)  # before the yield: a consumer stops at the finished output
            yield out

    def _verified(self, out: RequestOutput, drafts: list[int] | None,
                  read: tuple[Any, CompletionOutput, float, Any] | None = None) -> None:
        """On the large answer's end: the verification's label, the share of the small answer it accepted
        (and, with `verification_labels`, a stored label: the scorer's features, the answers' agreement)."""
        if not (out.finished and not out.error):
            return
        accepted = _common_prefix(drafts, out.outputs[0].token_ids) / len(drafts) if drafts else None
        if accepted is not None:
            self.monitor.record_acceptance(accepted)
        if self.labels is not None and self.scorer is not None and read is not None:
            conversation, answer, score, tokenizer = read
            pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in answer.token_ids] \
                if tokenizer is not None else None
            stats = answer_stats(answer.token_ids, answer.logprobs, pieces)  # what should_escalate read
            feats = self.scorer.features(conversation if conversation is not None else "", stats, answer.text)
            large_text = out.outputs[0].text
            try:
                self.labels.append({
                    "time": time.time(), "route": self.name, "escalation_score": score, "accepted_share": accepted,
                    "agreement": agreement(answer.text, large_text),
                    "small_answer_stats": {k: round(v, 5) for k, v in stats.items()},
                    "small_chars": len(answer.text), "large_chars": len(large_text),
                    "features": {"dense": [float(v) for v in feats.dense], "indices": feats.indices.tolist(),
                                 "values": [float(v) for v in feats.values]}})
            except OSError as exc:
                log.warning("cascade %s: verification label not written: %s", self.name, exc)

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
