"""The engine's speculative decoder: `propose` before scheduling hands the step's drafts over as data (a
caller's supplied drafts first, then the drafter's adaptive k), `observe_step` feeds adaptive k the step's
cost, and `rollback` after `Scheduler.update` counts each verified window and trims the draft KV to what the
sequence kept. It never touches the engine: failures go back through the `on_error` callback it is given."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engines.sampler import Sampled, min_tokens_ban
from engines.sequence import Request, Sequence
from engines.spec.adaptive import EXPLORE_SEQS, AdaptiveK
from engines.spec.drafter import Drafter

if TYPE_CHECKING:
    from engines.scheduler import SchedulerOutput

log = logging.getLogger("tandem.speculative")

SUPPLIED_CHUNK = 16  # supplied drafts are verified this many per target pass
# the most tokens a sequence is expected to still decode when a catch-up is weighed against what drafting saves
# (max_tokens, where the caller gave none, is the context's rest: no forecast of the output length)
REMAINING_CAP = 256
# a sequence's own acceptance forgets with this half-life in its tokens (code turns repetitive, or not), and
# a sequence decoding alone that decoded this many tokens without drafting measures it again (`_choose`),
# the gap doubling with each probe (32, 64, 128, ... tokens)
OWN_HALF_LIFE = 32
REPROBE_TOKENS = 32


@dataclass
class DraftPlan:
    """Adaptive k's choice for a step: (sequence, its k) for those that draft, and the k chosen (0: none)."""
    picked: list[tuple[Sequence, int]]
    k: int

    def uniform_k(self, running: list[Sequence]) -> int:
        """k when every one of `running` drafts with that same k (a step of drafting windows may), else 0."""
        if not self.k or len(self.picked) != len(running) or any(k_s != self.k for _, k_s in self.picked):
            return 0
        return self.k


@dataclass
class _Window:
    seq: Sequence
    drafted: bool  # by the drafter (counts toward its measured acceptance), not supplied
    base: int  # the sequence's length when drafted: the draft state's tokens past it are unverified


class SpeculativeDecoder:
    """Per target engine; with `drafter=None` it still verifies supplied drafts."""

    def __init__(self, drafter: Drafter | None, k_max: int, eos_token_ids: Set[int], clock: Callable[[], float],
                 on_error: Callable[[Request, str], None]):
        self.drafter = drafter
        self.k_max = k_max if drafter is not None else 0
        self.eos_token_ids = eos_token_ids
        self.on_error = on_error
        self.adaptive = AdaptiveK(self.k_max, clock=clock)
        self.supplied: set[Sequence] = set()  # sequences with supplied drafts left (engine thread only)
        self._windows: dict[int, _Window] = {}
        self.draft_probs: dict[int, torch.Tensor] = {}  # seq_id -> q [k, V] of this step's sampled drafts
        self.num_drafts = 0  # verification windows
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []
        self.num_emitted_tokens = 0  # tokens the windows produced (accepted + the recovered/bonus one)

    def add(self, seq: Sequence) -> None:
        if seq.supplied_draft_ids:
            self.supplied.add(seq)

    def release(self, seq: Sequence) -> None:
        """The sequence left scheduling: its draft KV goes with its pages."""
        if self.drafter is not None:
            self.drafter.release(seq)

    # ---- before scheduling ----------------------------------------------------------------------------------
    def _draftable(self, running: list[Sequence], drafts: Mapping[int, list[int]]) -> list[Sequence]:
        return [s for s in running
                if s.seq_id not in drafts and s.num_tokens - s.num_computed == 1 and s.num_tokens < s.max_len
                and s.request.params.speculative is not False]

    def begin_step(self) -> None:
        """A new step: drafts of the previous one that were not verified go away (`_drop_unverified`)."""
        self._drop_unverified()

    def plan(self, running: list[Sequence]) -> DraftPlan:
        """Adaptive k's choice for this step, made before anything is drafted (`StepPolicy` weighs it against
        the faster plain and windowed steps; `propose` then drafts it): k = 0 or nobody picked where no
        sequence would draft. Call only without supplied drafts."""
        seqs = self._draftable(running, {}) if self.drafter is not None else []
        k = self._choose(seqs) if seqs else 0
        picked = self._select(seqs, k) if k else []
        return DraftPlan(picked, k if picked else 0)

    def count_window(self, seq: Sequence, k: int, num_accepted: int, drafted: bool = True) -> None:
        """One verified window of k drafts for `seq`: the request's counts and, for the drafter's (not a caller's
        supplied ones), the engine's and the sequence's own acceptance (geometric model, older windows decayed)."""
        self._record(k, num_accepted, drafted)
        if drafted:
            acc, rej = self.own_counts(seq)
            seq.draft_accepted = acc + num_accepted
            seq.draft_rejected = rej + (num_accepted < k)
            seq.draft_seen_at = seq.num_tokens
        m = seq.request.metrics
        if m is not None:  # per request, for the decode span and escalation accounting
            m.num_draft_tokens += k
            m.num_accepted_tokens += num_accepted

    def observe_plain_steps(self, batch: int, num_steps: int, forward_s: float, step_s: float) -> None:
        """A multi-step greedy step: `num_steps` plain decode steps of `batch` sequences (forward and whole
        step seconds): what plain decoding costs per step, and a target pass of `batch` tokens."""
        if self.drafter is not None and batch:
            self.adaptive.target.observe(batch, forward_s / num_steps)
            self.adaptive.observe_step(batch, 0, step_s / num_steps)

    def propose(self, running: list[Sequence], planned: DraftPlan | None = None) -> dict[int, list[int]]:
        """seq_id -> draft tokens to verify this step (`planned`: this step's `plan`, if it was made)."""
        drafts: dict[int, list[int]] = {}
        if self.supplied:
            self._propose_supplied(drafts)
        if self.drafter is None:
            return drafts
        if planned is not None and not drafts:
            picked = planned.picked
        else:
            seqs = self._draftable(running, drafts)
            if not seqs:
                return drafts
            k = self._choose(seqs)
            picked = self._select(seqs, k)
        if not picked:
            return drafts
        chosen, states, ks = [], [], []
        spare = len(running) + 1
        for s, k_s in picked:
            ds = self.drafter.reserve(s, k_s, spare)
            if ds is None:
                continue
            chosen.append(s)
            states.append(ds)
            ks.append(k_s)
        if not chosen:
            return drafts
        stop_ids = [min_tokens_ban(s.request.params, self.eos_token_ids) for s in chosen]
        try:
            new, qs = self.drafter.draft(chosen, states, ks, stop_ids, self.adaptive.draft)
        except Exception as e:  # a drafter failure fails the sequences it was drafting for, nothing else
            log.exception("drafting failed")
            for req in {id(s.request): s.request for s in chosen}.values():
                self.on_error(req, f"engine error while drafting: {type(e).__name__}: {e}")
            return drafts
        if self.drafter.caught_up:  # this step's cost includes a catch-up: no measure of a drafting step
            self.adaptive.unsteady()
        for s, d, q in zip(chosen, new, qs):
            drafts[s.seq_id] = d
            self._windows[s.seq_id] = _Window(s, True, s.num_tokens)
            if q is not None:
                self.draft_probs[s.seq_id] = q
        return drafts

    @staticmethod
    def own_counts(seq: Sequence) -> tuple[float, float]:
        """The sequence's accepted drafts and rejections, each weighed by 2^(-tokens since / OWN_HALF_LIFE)."""
        if not seq.draft_seen_at:
            return 0.0, 0.0
        f = 0.5 ** ((seq.num_tokens - seq.draft_seen_at) / OWN_HALF_LIFE)
        return seq.draft_accepted * f, seq.draft_rejected * f

    def _choose(self, seqs: list[Sequence]) -> int:
        """Adaptive k's choice for these sequences, from their own acceptances; where it is plain decoding
        for a sequence decoding alone that has not measured its own acceptance yet, or not in its last
        REPROBE_TOKENS x 2^(its probes so far) tokens (acceptance moves within a sequence: a hard opening,
        then a repetitive body), a probe: it drafts once so that it does. Only alone: in a batch every
        sequence's drafter would catch up for it (in the server, probes of batches of up to 4 made decode-heavy
        traffic slower, docs/benchmarks.md)."""
        ad = self.adaptive
        # sequences with no window of their own have the engine's acceptance: with none anywhere, adaptive k
        # needs no per-sequence list (the common case at large batches, kept off the step's Python)
        accs = ([ad.seq_acceptance(*self.own_counts(s)) for s in seqs]
                if any(s.draft_seen_at for s in seqs) else None)
        s = seqs[0]
        due = (len(seqs) == 1 and ad.fixed is None and s.num_tokens >= s.probe_idle_until
               and (not s.draft_seen_at or s.num_tokens - s.draft_seen_at >= REPROBE_TOKENS << s.draft_probes))
        if due:  # weighed now, not by a choice of plain decoding that stands (`AdaptiveK.reweigh`)
            ad.reweigh()
        k = ad.choose(len(seqs), None if accs is None or None in accs else accs)
        if k == 0 and due:
            k = ad.probe()
            s.draft_probes += k > 0
            if not k:  # nothing worth a probe now: weighed again REPROBE_TOKENS later, not every step
                s.probe_idle_until = s.num_tokens + REPROBE_TOKENS
        return k

    def _select(self, seqs: list[Sequence], k: int) -> list[tuple[Sequence, int]]:
        """(sequence, its k) for those that draft this step at adaptive k's choice `k`: all of them or none
        (a sequence left out of a drafting step gets one token from a step that costs more than a plain one,
        or than a multi-step step's share, so it would pay for the others' gain), and only where the
        drafters' catch-ups (a new prompt, tokens decoded without the drafter) pay back to every sequence.
        Exploring is a measurement, not a bet: its catch-ups may stall the step only a little
        (`AdaptiveK.catch_up_pays`). Up to EXPLORE_SEQS sequences it is all or none too (a 3-step run); in a
        larger batch it is one step of a few sequences, those whose drafter is least behind, as many as that
        stall allows."""
        ad = self.adaptive
        if k <= 0:
            return []
        lags = {s.seq_id: self.drafter.lag(s) for s in seqs}
        all_or_none = not ad.exploring or len(seqs) <= EXPLORE_SEQS
        if ad.exploring:
            seqs = sorted(seqs, key=lambda s: lags[s.seq_id])[:EXPLORE_SEQS]
        picked = [(s, min(k, s.max_len - s.num_tokens)) for s in seqs]
        while picked and not ad.catch_up_pays([lags[s.seq_id] for s, _ in picked],
                                              [min(s.max_len - s.num_tokens, REMAINING_CAP) for s, _ in picked]):
            if all_or_none:
                return []
            picked.pop()  # the one furthest behind
        return picked

    def _drop_unverified(self) -> None:
        """Drafts of the previous step that were not verified (trimmed by the budget, preempted, finished) go
        away; the sequence may have advanced by a plain token, so the draft state keeps only what it had."""
        for w in self._windows.values():
            ds = w.seq.draft_state
            if ds is not None and ds.num_tokens > w.base:
                self.drafter.rollback(w.seq, w.base)
        self._windows.clear()
        self.draft_probs.clear()

    def _propose_supplied(self, drafts: dict[int, list[int]]) -> None:
        for seq in list(self.supplied):
            sup = seq.supplied_draft_ids
            out = seq.num_output_tokens
            if seq.finished or out >= len(sup) or seq.token_ids[seq.prompt_len:] != sup[:out]:
                self.supplied.discard(seq)  # done, or the output left the supplied path
                seq.supplied_draft_ids = []
                continue
            # the scheduler attaches them once the sequence's chunk reaches its last known token
            drafts[seq.seq_id] = sup[out:out + SUPPLIED_CHUNK]
            self._windows[seq.seq_id] = _Window(seq, False, seq.num_tokens)

    # ---- after the step -------------------------------------------------------------------------------------
    def observe_step(self, sched: SchedulerOutput, forward_s: float, step_s: float) -> None:
        """The step's cost on the engine's step clock: the forward (and sampling) by tokens, and the whole step
        when it was decode-only with every sequence alike (all k drafts, or none)."""
        self.adaptive.target.observe(sched.total_tokens, forward_s)
        if sched.num_prefill_tokens == 0 and sched.num_decode_seqs and self.drafter is not None:
            drafts = sched.drafts
            ks = {len(d) for d in drafts.values()} if drafts else {0}
            if len(ks) == 1 and (not drafts or len(drafts) == sched.num_decode_seqs):
                self.adaptive.observe_step(sched.num_decode_seqs, ks.pop(), step_s)

    def rollback(self, drafts: Mapping[int, list[int]], sampled: list[Sampled]) -> None:
        """After `Scheduler.update`: count every verified window, keep in the draft KV what the sequence kept."""
        if not drafts:
            return
        for s in sampled:
            seq = s.seq
            d = drafts.get(seq.seq_id)
            if not d:
                continue
            w = self._windows.pop(seq.seq_id, None)  # verified: not for _drop_unverified
            self.count_window(seq, len(d), s.num_accepted, w is not None and w.drafted)
            if not seq.finished and self.drafter is not None:  # the sequence took the accepted drafts + one
                self.drafter.rollback(seq, seq.num_tokens - 1)

    def _record(self, k: int, num_acc: int, drafted: bool) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += num_acc
        self.num_emitted_tokens += num_acc + 1
        if len(self.accepted_per_position) < k:
            self.accepted_per_position.extend([0] * (k - len(self.accepted_per_position)))
        for j in range(num_acc):
            self.accepted_per_position[j] += 1
        if drafted:
            self.adaptive.observe_window(k, num_acc)

    def stats(self) -> dict:
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_position": list(self.accepted_per_position),
                "spec_acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                         if self.num_draft_tokens else 0.0),
                "spec_mean_accepted_length": (self.num_emitted_tokens / self.num_drafts
                                              if self.num_drafts else 0.0),
                "spec_k": self.adaptive.k if self.drafter is not None else 0,
                "spec_draft_prefix_hit_tokens": self.drafter.num_prefix_hit_tokens if self.drafter else 0,
                "spec_k_max": self.k_max}
