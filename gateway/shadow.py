"""Labels from the models themselves: on a `router.shadow_fraction` of a router route's requests (off by default,
at most `shadow_max_inflight` at once), both engines answer the prompt greedily in the background; whether the
small answer is as good as the large one (exact match of the first line and of the whole answer, edit similarity)
is a label, written with the router's features (never the prompt text unless `[telemetry] record_content`) to a
bounded JSONL file: `shadow_max_records` lines, then it rotates to `<file>.1` (the older one dropped).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from engines.sampling_params import SamplingParams
from router_model.scoring import ENTROPY_TOP_K, agreement, answer_stats

log = logging.getLogger("tandem.routing")
OUTCOMES = ("labelled", "skipped_budget", "failed")


class ShadowSampler:
    """Which requests are shadowed: a `fraction` of them at random, while fewer than `max_inflight` run."""

    def __init__(self, fraction: float, max_inflight: int, rng: random.Random | None = None):
        self.fraction, self.max_inflight = fraction, max_inflight
        self.inflight = 0
        self._rng = rng or random.Random(0)
        self.counts = dict.fromkeys(OUTCOMES, 0)

    def admit(self) -> bool:
        if self.fraction <= 0.0 or self._rng.random() >= self.fraction:
            return False
        if self.inflight >= self.max_inflight:
            self.counts["skipped_budget"] += 1  # the budget, not the dice, said no: visible in metrics
            return False
        self.inflight += 1
        return True

    def done(self, outcome: str) -> None:
        self.inflight -= 1
        self.counts[outcome] += 1


class LabelStore:
    """Append-only JSONL of at most `max_records` lines, rotated once to `<path>.1`; None: kept in memory only
    (the counts and agreement rate)."""

    def __init__(self, path: str | None, max_records: int):
        self.path = Path(path) if path else None
        self.max_records = max_records
        self._lines = 0
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_file():
                with self.path.open("rb") as f:
                    self._lines = sum(1 for _ in f)

    def append(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._lines >= self.max_records:
                self.path.replace(self.path.with_name(self.path.name + ".1"))
                self._lines = 0
            with self.path.open("a") as f:
                f.write(line)
            self._lines += 1


class ShadowRunner:
    """Runs the shadow pairs of one route and keeps its agreement statistics and token cost."""

    def __init__(self, route: str, pair: tuple[str, str], sampler: ShadowSampler, store: LabelStore, *,
                 features: Callable[[Any], Any], max_tokens: int, record_content: bool, artifact: str,
                 clock: Callable[[], float] = time.time):
        self.route, self.pair, self.sampler, self.store = route, pair, sampler, store
        self.features = features  # the router's featurizer: what a label stores instead of the prompt
        self.max_tokens, self.record_content, self.artifact = max_tokens, record_content, artifact
        self.clock = clock
        self.tokens: dict[str, int] = {}  # engine -> tokens generated for shadows (prompt + completion)
        self.agreed = 0.0  # sum of first_line_exact over labelled pairs
        self._tasks: set[asyncio.Task] = set()

    def stats(self) -> dict[str, Any]:
        labelled = self.sampler.counts["labelled"]
        return {"fraction": self.sampler.fraction, "max_inflight": self.sampler.max_inflight,
                "inflight": self.sampler.inflight, **self.sampler.counts,
                "first_line_agreement": self.agreed / labelled if labelled else None,
                "tokens": dict(self.tokens), "labels_file": str(self.store.path) if self.store.path else None}

    def start(self, ctx: Any, engines: Mapping[str, Any], score: float, choice: str, conversation: Any) -> None:
        """Run a pair for this request in the background (the sampler has admitted it)."""
        task = asyncio.get_running_loop().create_task(self._pair(ctx, engines, score, choice, conversation))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, ctx: Any, engine: Any, params: SamplingParams, suffix: str) -> tuple[str, Any]:
        prompt = await ctx.prompt.get(engine)
        final = None
        async for out in ctx.start(engine, prompt, request_id=f"{ctx.request_id}-shadow-{suffix}", params=params):
            final = out
        if final is None or final.error:
            raise RuntimeError(f"shadow run on {engine.name} failed: {getattr(final, 'error', 'no output')}")
        answer = final.outputs[0]
        used = len(final.prompt_token_ids or ()) + len(answer.token_ids)
        self.tokens[engine.name] = self.tokens.get(engine.name, 0) + used
        return answer.text, answer

    @staticmethod
    def _stats(engine: Any, out: Any) -> dict[str, float]:
        tok = getattr(engine, "tokenizer", None)
        pieces = [tok.decode([t], skip_special_tokens=False) for t in out.token_ids] if tok is not None else None
        return {k: round(v, 5) for k, v in answer_stats(out.token_ids, out.logprobs, pieces).items()}

    async def _pair(self, ctx: Any, engines: Mapping[str, Any], score: float, choice: str,
                    conversation: Any) -> None:
        small, large = self.pair
        # plain greedy answers, the request's stops kept, at most `max_tokens` each: the label, not the reply
        greedy = SamplingParams(temperature=0.0, stop=list(ctx.params.stop), stop_token_ids=list(
            ctx.params.stop_token_ids), max_tokens=min(ctx.params.max_tokens or self.max_tokens, self.max_tokens))
        # the small run also reports its top logprobs: the answer's statistics let `tandem router adapt` read
        # what a disagreement means (router_model.self_labels), without the text
        small_params = dataclasses.replace(greedy, logprobs=ENTROPY_TOP_K)
        try:
            (small_text, small_out), (large_text, _) = await asyncio.gather(
                self._answer(ctx, engines[small], small_params, "small"),
                self._answer(ctx, engines[large], greedy, "large"))
        except Exception as exc:  # a shadow never fails the request it copies
            log.debug("route %s: shadow of %s failed: %s", self.route, ctx.request_id, exc)
            self.sampler.done("failed")
            return
        label = agreement(small_text, large_text)
        features = self.features(conversation)
        record: dict[str, Any] = {
            "time": self.clock(), "route": self.route, "artifact": self.artifact, "router_score": score,
            "choice": choice, "max_tokens": greedy.max_tokens, **label,
            "small_answer_stats": self._stats(engines[small], small_out),
            "small_chars": len(small_text), "large_chars": len(large_text),
            "features": {"dense": [float(v) for v in features.dense], "indices": features.indices.tolist(),
                         "values": [float(v) for v in features.values]}}
        if self.record_content:
            record |= {"prompt" if isinstance(conversation, str) else "messages": conversation,
                       "small_answer": small_text, "large_answer": large_text}
        try:
            self.store.append(record)
        except OSError as exc:
            log.warning("route %s: shadow label not written: %s", self.route, exc)
            self.sampler.done("failed")
            return
        self.agreed += label["first_line_exact"]
        self.sampler.done("labelled")
