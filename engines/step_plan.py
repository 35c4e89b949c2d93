"""The step's plan: one policy (`StepPolicy.choose`) says how the next engine step runs, and the scheduler books
it (drafts and explicit lookahead, as vLLM's `num_lookahead_tokens`) before the runner carries it out.

- forward: one forward over the scheduled tokens, then sampling, or verification of `drafts` (a caller's
  supplied drafts, or the drafter's at adaptive k's choice);
- tokens_per_seq = n > 1: every running sequence decodes n tokens in one C call (`ModelRunner.draft_greedy`),
  where nothing could differ from n single steps;
- windows = W > 1 with k: every running sequence drafts k greedy tokens and is verified, W times one after
  another in one step (`engines.spec.windows`), adaptive k weighing each window again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.kv_pool import KVPool
    from engines.scheduler import Scheduler, SchedulerOutput
    from engines.sequence import Sequence
    from engines.spec.decoder import SpeculativeDecoder

# greedy (or unseeded temperature) tokens a step may take per sequence in one C call when nothing else could
# differ; TANDEM_MULTI_STEP=1 turns it off (and with it the drafting windows, which share its eligibility)
MULTI_STEP_TOKENS = int(os.environ.get("TANDEM_MULTI_STEP", "4"))
# drafting windows a step may verify one after another where every sequence drafts greedily; TANDEM_SPEC_WINDOWS=1
# turns it off
SPEC_WINDOWS = int(os.environ.get("TANDEM_SPEC_WINDOWS", "4"))


@dataclass
class StepPlan:
    drafts: dict[int, list[int]] = field(default_factory=dict)  # forward: seq_id -> drafts to verify
    tokens_per_seq: int = 1  # > 1: the multi-token C loop
    k: int = 0  # windows: drafts per window
    windows: int = 0  # > 0: at most this many drafting windows
    lookahead: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens booked past the next one

    @property
    def kind(self) -> str:
        return "multi" if self.tokens_per_seq > 1 else "windows" if self.windows else "forward"


class StepPolicy:
    """Chooses each step's plan from the scheduler's running batch and the speculator's adaptive k; the only
    place that weighs the faster ways to run a step."""

    def __init__(self, scheduler: Scheduler, runner: object, pool: KVPool, vocab_size: int):
        """runner: the engine's `ModelRunner` (asked whether its C forward takes a multi-token step)."""
        self.scheduler = scheduler
        self.runner = runner
        self.pool = pool
        self.vocab_size = vocab_size

    def choose(self, sp: SpeculativeDecoder, arriving: bool) -> StepPlan:
        """This step's plan (`arriving`: requests queued since the inbox was drained: no multi-token step then,
        a newcomer would wait for it)."""
        sp.begin_step()
        running = self.scheduler.running
        n = 0 if arriving or sp.supplied else self._decode_only_tokens(running)
        planned = sp.plan(running) if n and sp.drafter is not None else None
        if n and (planned is None or not planned.k):  # plain decoding: n tokens in one C call
            return StepPlan(tokens_per_seq=n, lookahead={s.seq_id: n - 1 for s in running})
        if planned is not None:
            windows = self._windows(running, planned.uniform_k(running), sp)
            if windows:
                k = planned.k
                return StepPlan(k=k, windows=windows, lookahead={
                    s.seq_id: min(windows * (k + 1), s.max_len - s.num_tokens + 1) - 1 for s in running})
        return StepPlan(drafts=sp.propose(running, planned))

    @staticmethod
    def observe(sp: SpeculativeDecoder, plan: StepPlan, sched: SchedulerOutput, fast: int, forward_s: float,
                step_s: float) -> None:
        """The step's cost for adaptive k, as its plan ran (`fast`: `StepOutcome.fast`): a forward step by its
        tokens and drafts, a multi-token step as `fast` plain steps, a windows step as `fast` steps at its k; a
        fast plan that fell back to a forward is no measure of anything."""
        if plan.kind == "forward":
            sp.observe_step(sched, forward_s, step_s)
        elif fast and plan.tokens_per_seq > 1:
            sp.observe_plain_steps(len(sched.seqs), fast, forward_s, step_s)
        elif fast:  # every window drafted for the whole batch: a measure of a step at k
            sp.adaptive.observe_step(len(sched.seqs), plan.k, step_s / fast)

    def _decode_only_tokens(self, running: list[Sequence]) -> int:
        """Tokens per sequence of a multi-token step, or 0: only where nothing could differ from `n` single
        steps: the CPU forward can take it, nobody waiting, every sequence decoding with raw-logit greedy or
        temperature alone without a seed (a seeded draw stays on the sampler's path, which its reproducibility
        is defined by; min_tokens' ban of EOS and stop ids is applied in the C loop), no logprobs or grammar,
        `n` tokens within each one's max length, the token budget and the free pages (no preemption)."""
        n = MULTI_STEP_TOKENS
        sch = self.scheduler
        if (n < 2 or not running or sch.num_waiting or len(running) * n > sch.max_num_batched_tokens
                or not self.runner.can_draft_greedy([1])):
            return 0
        for seq in running:
            p = seq.request.params
            if (seq.num_tokens - seq.num_computed != 1 or (not p.greedy and seq.seed is not None)
                    or p.logprobs is not None or seq.grammar is not None
                    or not p.plain(self.vocab_size, min_tokens_ok=True)):
                return 0
            n = min(n, seq.max_len - seq.num_tokens)
        if n < 2 or sum(sch.pages_needed(seq, n) for seq in running) > self.pool.num_free:
            return 0
        return n

    def _windows(self, running: list[Sequence], k: int, sp: SpeculativeDecoder) -> int:
        """Drafting windows of k for every running sequence in one step, or 0: adaptive k drafts for all of
        them with one k, every one is greedy, no min_tokens ban is left, every drafter is at most its last draft
        and bonus token behind (no catch-up: that step goes the normal way) and drafts in one C call, and the
        token budget and the pool take at least two whole windows of every sequence (up to SPEC_WINDOWS)."""
        dr = sp.drafter
        sch = self.scheduler
        if not k or SPEC_WINDOWS < 2 or dr.lean is not None:
            return 0
        windows = min(SPEC_WINDOWS, sch.max_num_batched_tokens // (len(running) * (k + 1)))
        if windows < 2 or not dr.runner.can_draft_greedy([1]):
            return 0
        pages = 0
        for seq in running:
            p = seq.request.params
            if (not p.greedy or p.min_tokens > seq.num_output_tokens or dr.lag(seq) > 2
                    or seq.max_len - seq.num_tokens < k):  # room for one whole window
                return 0
            pages += sch.pages_needed(seq, min(windows * (k + 1), seq.max_len - seq.num_tokens + 1))
            pages += -(-(seq.num_tokens + windows * (k + 1)) // self.pool.block_size)  # the draft's, at most
        if pages + len(running) + 1 > self.pool.num_free:
            return 0
        return windows
