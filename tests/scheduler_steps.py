"""Test helper shared by the scheduler and SLO tests: one scheduling step with the model's work pretended."""

from __future__ import annotations

from engines.scheduler import Scheduler


def run_step(sched: Scheduler) -> dict[int, int]:
    """Pretend the model ran: commit the scheduled tokens and append a token where a row samples."""
    out = sched.schedule()
    for s, n in zip(out.seqs, out.num_tokens):
        sched.commit_computed(s, n)
        if s.num_computed == s.num_tokens:
            s.token_ids.append(7)
    return out.as_dict()
