"""The scheduler decides what runs each step, in one language: `{seq_id: num_tokens}`.

Running sequences first (decodes and unfinished prefill chunks, oldest admission first), then waiting ones in
the order its `SLOPolicy` keeps (priority class, then earliest TTFT deadline, with aging), within a token
budget and the policy's batch caps (decodes always run); chunked prefill rides in the same step as decodes.
When pages run out it preempts (by recompute) the lowest-priority, latest-admitted sequence and admits nobody
that step. Waiting requests the policy finds past saving are handed back in `SchedulerOutput.expired` (the
engine ends them with `ErrorCode.TTFT_EXPIRED`) instead of being served late.
The scheduler also owns the end of a step (`update`): it appends the sampled or verified tokens, commits and
hashes the blocks they complete, applies stop ids, stop strings and max length, and finishes sequences.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engines.errors import EngineError, ErrorCode
from engines.kv_pool import KVPool
from engines.output_processor import append_text, flush_text
from engines.sequence import Request, SeqStatus, Sequence
from engines.slo_policy import SLOPolicy
from engines.step_model import BatchCapController, BatchCaps
from engines.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from engines.sampler import Sampled

log = logging.getLogger("tandem.engine")

@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # parallel to seqs; `as_dict` is {seq_id: n}
    # speculative decoding: seq_id -> the k draft tokens verified in this step (what the budget left of the
    # proposed ones); they are included in num_tokens (1 + k for a decode) and have pages, and their K/V is
    # committed only as far as verification accepts them
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # a step of several tokens per sequence (a multi-token or drafting-windows plan, engines/step_plan.py):
    # seq_id -> tokens booked past its last known token (pages and budget, included in num_tokens) that the
    # runner computes itself; their K/V is committed as `update` appends the tokens they became
    lookahead: dict[int, int] = field(default_factory=dict)
    preempted: list[Sequence] = field(default_factory=list)
    num_decode_seqs: int = 0  # sequences scheduled for one decode token (plus drafts): the step model's inputs
    num_prefill_tokens: int = 0  # prompt (or recompute) tokens scheduled
    caps: BatchCaps | None = None  # the SLO caps this step ran under (None: SLO scheduling off)
    expired: list[Sequence] = field(default_factory=list)  # dropped from the waiting queue: past TTFT deadline

    def as_dict(self) -> dict[int, int]:
        return {s.seq_id: n for s, n in zip(self.seqs, self.num_tokens)}

    @property
    def num_draft_tokens(self) -> dict[int, int]:
        return {sid: len(d) for sid, d in self.drafts.items()}

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """One per engine; draws pages for `model_id` from the shared pool."""

    def __init__(self, pool: KVPool, model_id: int, *, max_num_seqs: int, max_num_batched_tokens: int,
                 slo_scheduling: bool = True, cap_controller: BatchCapController | None = None,
                 priority_aging_s: float = 30.0, drop_expired: bool = False,
                 clock: Callable[[], float] = time.monotonic, eos_token_ids: Set[int] = frozenset()):
        self.pool = pool
        self.eos_token_ids = eos_token_ids
        self.model_id = model_id
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = pool.block_size
        self.num_groups = pool.geometries[model_id].num_groups  # pages per block (engines/kv_layout.py)
        self.running: list[Sequence] = []  # in admission order
        self.slo = SLOPolicy(slo_scheduling=slo_scheduling, cap_controller=cap_controller,
                             priority_aging_s=priority_aging_s, drop_expired=drop_expired, clock=clock)
        self._waiting: WaitingQueue[Sequence] = self.slo.waiting_queue()
        self.num_expired = 0
        self._admit_counter = itertools.count()
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up at admission (every admission, every choice)
        self.prefix_hits = 0  # of those, tokens served from the prefix cache
        self.num_generated_tokens = 0  # tokens appended by `update`
        self.on_free: Callable[[Sequence], None] | None = None  # the drafter drops its KV with the sequence's

    # ---- queue management --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._waiting.push(seq)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running) or len(self._waiting) > 0

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of scheduling (finished, aborted or failed) and free its pages."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._left_running(seq)
        elif seq.status is SeqStatus.WAITING:
            self._waiting.remove(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        self.slo.dropped(seq)
        self._free_pages(seq)

    def _free_pages(self, seq: Sequence) -> None:
        if self.on_free is not None:
            self.on_free(seq)
        self.pool.release_holder(seq)
        seq.block_hashes = []

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV (its hashed blocks stay cached), keep the generated tokens."""
        self.running.remove(seq)
        self._left_running(seq)
        self._free_pages(seq)
        seq.num_computed = 0
        self.slo.dropped(seq)
        self.num_preemptions += 1
        self.add(seq)

    def _left_running(self, seq: Sequence) -> None:
        self.slo.left_running(seq)

    def pages_needed(self, seq: Sequence, num_new: int) -> int:
        """Pages `seq` must add to compute `num_new` more tokens (a page per page group and block)."""
        return self._blocks_needed(seq, num_new) * self.num_groups

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = -(-(seq.num_computed + num_new) // self.block_size)
        return max(0, total - len(seq.pages))

    def _blocked(self, seq: Sequence) -> bool:
        """n > 1: the other choices wait for choice 0's prompt so they find its blocks in the prefix cache."""
        if seq.index == 0 or not self.pool.enable_prefix_caching:
            return False
        leader = seq.request.seqs[0]
        return not leader.finished and leader.num_computed < leader.prompt_len

    # ---- one step ----------------------------------------------------------------------------------------
    def schedule(self, drafts: Mapping[int, list[int]] | None = None, lookahead: Mapping[int, int] | None = None
                 ) -> SchedulerOutput:
        """This step's {seq: num_tokens}; `drafts` (seq_id -> proposed draft tokens) ride with the chunk that
        reaches a sequence's last known token, as far as the budget and max_tokens allow; `lookahead` (seq_id ->
        tokens a running decode computes past its next one this step) is booked the same way."""
        out = SchedulerOutput()
        out.expired = self.slo.expired(self._waiting)
        self.num_expired += len(out.expired)
        budget = self.max_num_batched_tokens
        scheduled: dict[int, int] = {}  # seq_id -> position in out.seqs
        max_running = self.max_num_seqs
        prefill_budget = budget  # tokens of prompt chunks (running and newly admitted) this step may carry
        out.caps = caps = self.slo.caps(self.running)
        if caps is not None:
            max_running = min(max_running, caps.max_decode_seqs)
            prefill_budget = caps.max_prefill_tokens

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = seq.num_tokens - seq.num_computed
            prefilling = num_new > 1  # decodes always run; prompt chunks share the step's prefill budget
            room = min(budget, prefill_budget) if prefilling else budget
            fit = self._fit_drafts(seq, num_new, room, drafts)
            ahead = self._fit_lookahead(seq, num_new + len(fit), room, lookahead)
            num_new = min(num_new + len(fit) + ahead, room)
            if num_new <= 0:
                continue
            need = self.pages_needed(seq, num_new)
            while need > self.pool.num_free:
                victim = max(self.running, key=lambda s: (s.request.priority, s.admit_order))
                if victim.seq_id in scheduled:  # give its tokens back to the budget
                    i = scheduled.pop(victim.seq_id)
                    budget += out.num_tokens[i]
                    out.num_tokens[i] = 0
                    out.drafts.pop(victim.seq_id, None)
                    out.lookahead.pop(victim.seq_id, None)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            if need:
                self.pool.grow(self.model_id, seq, self._blocks_needed(seq, num_new))
            scheduled[seq.seq_id] = len(out.seqs)
            out.seqs.append(seq)
            out.num_tokens.append(num_new)
            if fit:
                out.drafts[seq.seq_id] = fit
            if ahead:
                out.lookahead[seq.seq_id] = ahead
            budget -= num_new
            if prefilling:
                prefill_budget -= num_new

        if out.preempted:  # drop entries zeroed by a later preemption
            keep = [(s, n) for s, n in zip(out.seqs, out.num_tokens) if n > 0]
            out.seqs = [s for s, _ in keep]
            out.num_tokens = [n for _, n in keep]
            return self._tally(out)  # no admissions in a step that preempted

        deferred: list[Sequence] = []
        while budget > 0 and prefill_budget > 0 and len(self.running) < max_running:
            seq = self._waiting.peek()
            if seq is None:
                break
            if self._blocked(seq):
                deferred.append(self._waiting.pop())
                continue
            # an embedding under mean pooling needs every prompt token's hidden state: it takes no cache hit
            # (the match of an empty prefix: no blocks, in every page group)
            hit = self.pool.match(self.model_id, [] if seq.pooling == "mean" else seq.token_ids, extra_keys(seq),
                                  whole=True)
            held = hit.held()
            # every block cached: the last one is copied into a page of the sequence's own (the cached page stays
            # as it is for whoever shares it) and only the last token is computed, for its logits
            if hit.last >= 0:
                held.append(hit.last)
            num_cached = hit.num_blocks * self.block_size + (self.block_size - 1 if hit.last >= 0 else 0)
            room = min(budget, prefill_budget)
            fit = self._fit_drafts(seq, seq.num_tokens - num_cached, room, drafts)
            num_new = min(seq.num_tokens - num_cached + len(fit), room)
            new_blocks = -(-(num_cached + num_new) // self.block_size) - hit.num_blocks
            reclaim = sum(1 for p in held if self.pool.ref_count[p] == 0)
            if new_blocks * self.num_groups + reclaim > self.pool.num_free:
                break  # head of line waits for memory; lower-priority requests must not overtake it
            self._waiting.pop()
            self.pool.record_query(seq.num_tokens, num_cached)
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_cached
            self.pool.acquire(held)  # the last block's page too, until copied: growing must not evict it
            shared = hit.num_blocks  # (seq.pages is hit.pages: growing it grows the hit)
            seq.pages, seq.group_pages, seq.block_hashes = hit.pages, hit.group_pages, hit.hashes
            self.pool.grow(self.model_id, seq, new_blocks)
            if hit.last >= 0:
                self.pool.copy_page(hit.last, seq.pages[shared])
                self.pool.release([hit.last])
            seq.num_computed = num_cached
            seq.num_cached_tokens = num_cached
            seq.status = SeqStatus.RUNNING
            seq.admit_order = next(self._admit_counter)
            self.running.append(seq)
            self.slo.admitted(seq)
            out.seqs.append(seq)
            out.num_tokens.append(num_new)
            if fit:
                out.drafts[seq.seq_id] = fit
            budget -= num_new
            prefill_budget -= num_new
        for item in deferred:
            self._waiting.push(item)
        return self._tally(out)

    @staticmethod
    def _tally(out: SchedulerOutput) -> SchedulerOutput:
        """Decode sequences vs prefill tokens of the step (what the step-time model is fitted on)."""
        for seq, n in zip(out.seqs, out.num_tokens):
            d = out.drafts.get(seq.seq_id)
            drafts = (len(d) if d else 0) + out.lookahead.get(seq.seq_id, 0)
            if seq.num_computed + n - drafts >= seq.num_tokens and n - drafts == 1:
                out.num_decode_seqs += 1
            else:
                out.num_prefill_tokens += n
        return out

    @staticmethod
    def _fit_drafts(seq: Sequence, num_new: int, budget: int, drafts: Mapping[int, list[int]] | None
                    ) -> list[int]:
        """The proposed drafts that fit: as many as the budget and max_tokens leave room for."""
        proposed = drafts.get(seq.seq_id) if drafts else None
        if not proposed:
            return _NO_DRAFTS
        return proposed[:max(0, min(len(proposed), budget - num_new, seq.max_len - seq.num_tokens))]

    @staticmethod
    def _fit_lookahead(seq: Sequence, num_new: int, budget: int, lookahead: Mapping[int, int] | None) -> int:
        """The lookahead tokens that fit (a decode's only): as many as the budget and max_tokens leave room for."""
        want = lookahead.get(seq.seq_id, 0) if lookahead else 0
        if not want or seq.num_tokens - seq.num_computed != 1:
            return 0
        return max(0, min(want, budget - num_new, seq.max_len - seq.num_tokens - (num_new - 1)))

    # ---- the end of a step -------------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, sampled: list[Sampled]) -> list[Request]:
        """After the forward pass: commit the K/V the step computed (drafts' only once accepted), append each
        sampling sequence's tokens, stop and finish. A request whose processing raises fails alone. Returns
        the requests with new output (finished ones included)."""
        drafts, ahead = sched.drafts, sched.lookahead
        touched: dict[int, Request] = {}
        now = time.monotonic()
        for seq, n in zip(sched.seqs, sched.num_tokens):
            if not seq.finished:
                d = drafts.get(seq.seq_id) if drafts else None
                if d:
                    n -= len(d)
                if ahead:
                    n -= ahead.get(seq.seq_id, 0)
                self.commit_computed(seq, n)
                if seq.embedding is not None:  # an embedding request's prompt is in: its vector is its answer
                    self._finish(seq, "stop", None)
                    touched[id(seq.request)] = seq.request
                    if seq.request.metrics is not None:
                        seq.request.metrics.first_token_time = now
        for s in sampled:
            seq = s.seq
            req = seq.request
            if req.error is not None or seq.finished:
                continue
            touched[id(req)] = req
            lps = s.logprobs
            try:
                for j, tok in enumerate(s.token_ids):
                    lp, pos_lp = lps[j] if lps is not None else (None, None)
                    self.append_token(seq, tok, lp, pos_lp)
                    self.num_generated_tokens += 1
                    if seq.finished:
                        break
                    if j < s.num_accepted:  # an accepted draft: its K/V from this pass is now valid
                        self.commit_computed(seq, 1)
            except Exception as e:  # one request's processing failed: fail it alone
                log.exception("request %s failed", req.request_id)
                self.fail(req, EngineError(ErrorCode.ENGINE_ERROR, f"engine error: {type(e).__name__}: {e}"))
                continue
            if req.metrics is not None and req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
        return list(touched.values())

    def append_token(self, seq: Sequence, token: int, logprob: float | None, pos_logprobs: dict | None) -> None:
        """One new token: EOS and stop ids (after min_tokens), stop strings, max length."""
        params = seq.request.params
        seq.token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if pos_logprobs is not None:
            seq.logprobs.append(pos_logprobs)
            seq.cumulative_logprob += logprob
        can_stop = seq.num_output_tokens >= params.min_tokens
        if can_stop and not params.ignore_eos and token in self.eos_token_ids:
            return self._finish(seq, "stop", None)
        if can_stop and token in params.stop_token_ids:
            return self._finish(seq, "stop", token)
        if seq.detokenizer is not None:
            stop = append_text(seq, token, can_stop)
            if stop is not None:
                return self._finish(seq, "stop", stop)
        if seq.num_tokens >= seq.max_len:
            flush_text(seq)
            return self._finish(seq, "length", None)
        return None

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.finish(seq)

    def end(self, req: Request, reason: str) -> None:
        """Finish every unfinished sequence of `req` with `reason` (abort, error)."""
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = reason
                self.finish(seq)

    def fail(self, req: Request, error: EngineError) -> None:
        req.error = error
        self.end(req, "error")

    def commit_computed(self, seq: Sequence, num_new: int) -> None:
        """`num_new` more tokens have K/V; hash the blocks that just became full, then free the window groups'
        pages the window has passed (num_computed only grows until preemption drops all pages: a query never
        again sits before it; drafts past it stay unverified here)."""
        seq.num_computed += num_new
        self.slo.computed(seq)
        self.pool.commit_blocks(self.model_id, seq, min(seq.num_computed, seq.num_tokens) // self.block_size,
                                extra_keys(seq))
        if self.num_groups > 1:
            self.pool.free_outside_window(self.model_id, seq)


_NO_DRAFTS: list[int] = []


def extra_keys(seq: Sequence) -> tuple:
    """What joins the token ids in a block's hash (seam: LoRA ids or multimodal hashes would go here)."""
    return ()

