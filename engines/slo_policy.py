"""What the scheduler asks about SLOs, in one object: the waiting order (priority class, then earliest TTFT
deadline, with aging; or plain (priority, arrival)), the batch caps the running TPOT targets allow, and which
waiting requests to drop once their TTFT deadline is nearer than the measured lead from a prefill's first step
to its first token."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from engines.sequence import Sequence
from engines.step_model import BatchCapController, BatchCaps, FirstTokenLead
from engines.waiting_queue import WaitingQueue

DEFAULT_TTFT_DEADLINE_S = 60.0  # a request without a TTFT target is due this long after arrival


class SLOPolicy:
    """One per scheduler. `slo_scheduling=False`: plain order, no caps; `drop_expired`: drop late requests."""

    def __init__(self, *, slo_scheduling: bool = True, cap_controller: BatchCapController | None = None,
                 priority_aging_s: float = 30.0, drop_expired: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.slo_scheduling = slo_scheduling
        self.priority_aging_s = priority_aging_s
        self.cap_controller = cap_controller if slo_scheduling else None
        self.drop_expired = drop_expired
        self.clock = clock  # the clock of Request.arrival_time
        # started late, a request misses its deadline anyway and takes the capacity another one needed
        self.first_token_lead = FirstTokenLead()
        self._prefill_started: dict[int, float] = {}  # seq_id -> when its prefill was first scheduled

    def waiting_queue(self) -> WaitingQueue[Sequence]:
        expires = _ttft_deadline if self.drop_expired else None
        if self.slo_scheduling:
            return WaitingQueue(_deadline_key, aging_s=self.priority_aging_s, expires=expires)
        return WaitingQueue(_arrival_key, aging_s=math.inf, expires=expires)

    def expired(self, waiting: WaitingQueue[Sequence]) -> list[Sequence]:
        """Waiting sequences that can no longer make their TTFT deadline (taken out of `waiting`)."""
        if not self.drop_expired or not len(waiting):
            return []
        return waiting.pop_expired(self.clock() + self.first_token_lead.estimate_s, _not_started)

    def caps(self, running: list[Sequence]) -> BatchCaps | None:
        """This step's caps (None: SLO scheduling off, the configured limits apply)."""
        if self.cap_controller is None:
            return None
        return self.cap_controller.caps(sum(1 for s in running if s.num_tokens - s.num_computed <= 1))

    def admitted(self, seq: Sequence) -> None:
        if self.drop_expired and seq.num_output_tokens == 0:
            self._prefill_started[seq.seq_id] = self.clock()
        if self.cap_controller is not None:
            self.cap_controller.targets.add(seq.request.tpot_s)

    def left_running(self, seq: Sequence) -> None:
        if self.cap_controller is not None:
            self.cap_controller.targets.remove(seq.request.tpot_s)

    def dropped(self, seq: Sequence) -> None:
        """Finished or preempted: its prefill (if still running) no longer measures the lead."""
        self._prefill_started.pop(seq.seq_id, None)

    def computed(self, seq: Sequence) -> None:
        """The sequence's K/V advanced; once its prompt is in, its lead to the first token is known."""
        if self._prefill_started and seq.num_computed >= seq.num_tokens and seq.seq_id in self._prefill_started:
            self.first_token_lead.observe(self.clock() - self._prefill_started.pop(seq.seq_id))


def _deadline_key(seq: Sequence) -> tuple[int, int, float]:
    req = seq.request
    ttft = req.ttft_s if req.ttft_s is not None else DEFAULT_TTFT_DEADLINE_S
    return seq.seq_id, req.priority, req.arrival_time + ttft


def _ttft_deadline(seq: Sequence) -> float | None:
    req = seq.request
    return None if req.ttft_s is None else req.arrival_time + req.ttft_s


def _not_started(seq: Sequence) -> bool:
    """Only a request that has not produced a token may be dropped (a preempted one keeps its place)."""
    m = seq.request.metrics
    return (m is None or m.first_token_time is None) and not any(s.num_output_tokens for s in seq.request.seqs)


def _arrival_key(seq: Sequence) -> tuple[int, int, float]:
    return seq.seq_id, seq.request.priority, seq.request.arrival_time
