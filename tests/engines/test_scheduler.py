"""The scheduler on its own (no model): token budget, running-first order, chunked prefill mixed with decodes,
priority admission, max_num_seqs, preemption of the lowest-priority latest-admitted sequence with no
admissions in that step, and lazy removal of aborted waiting sequences."""

from __future__ import annotations

import torch
from scheduler_steps import run_step  # tests/ is on sys.path (conftest.py)

from engines.kv_pool import KVGeometry, KVPool
from engines.sampling_params import SamplingParams
from engines.scheduler import Scheduler
from engines.sequence import Request, SeqStatus, Sequence

GEOM = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)


def make(num_pages: int = 64, budget: int = 16, max_seqs: int = 8, caching: bool = True) -> Scheduler:
    pool = KVPool([GEOM], memory_bytes=num_pages * GEOM.page_bytes(4), block_size=4,
                  enable_prefix_caching=caching)
    return Scheduler(pool, 0, max_num_seqs=max_seqs, max_num_batched_tokens=budget)


def seq(prompt_len: int, priority: int = 0, arrival: float = 0.0, first_token: int = 0) -> Sequence:
    ids = list(range(first_token, first_token + prompt_len))
    req = Request(f"r{arrival}-{priority}", None, ids, SamplingParams(), priority=priority, arrival_time=arrival)
    s = Sequence(req, 0, list(ids), prompt_len, prompt_len + 100)
    req.seqs.append(s)
    return s



def test_chunked_prefill_respects_the_budget_and_rides_with_decodes():
    sched = make(budget=8)
    a, b = seq(3, arrival=1), seq(20, arrival=2)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == {a.seq_id: 3, b.seq_id: 5}  # a whole, b's first chunk
    assert run_step(sched) == {a.seq_id: 1, b.seq_id: 7}  # a decodes first, b continues its prefill
    assert run_step(sched) == {a.seq_id: 1, b.seq_id: 7}
    assert run_step(sched) == {a.seq_id: 1, b.seq_id: 1}  # b's last prompt token, then both decode
    assert b.num_computed == 20 and b.num_tokens == 21
    assert len(b.pages) == 5  # pages cover computed tokens only: the 21st gets its page when scheduled


def test_waiting_requests_are_admitted_by_priority_then_arrival_up_to_max_num_seqs():
    sched = make(budget=100, max_seqs=2)
    late_urgent, early, earliest = seq(2, priority=-1, arrival=3), seq(2, arrival=2), seq(2, arrival=1)
    for s in (early, earliest, late_urgent):
        sched.add(s)
    assert set(run_step(sched)) == {late_urgent.seq_id, earliest.seq_id}
    assert sched.num_waiting == 1 and early.status is SeqStatus.WAITING
    sched.finish(late_urgent)
    assert set(run_step(sched)) == {earliest.seq_id, early.seq_id}


def test_preemption_takes_the_lowest_priority_latest_admitted_and_admits_nobody_that_step():
    sched = make(num_pages=4, budget=100)
    hi = seq(4, priority=0, arrival=1, first_token=100)
    lo_old = seq(4, priority=1, arrival=2, first_token=200)
    lo_new = seq(4, priority=1, arrival=3, first_token=300)
    for s in (hi, lo_old, lo_new):
        sched.add(s)
    run_step(sched)  # three sequences, one page each (4 prompt tokens)
    assert sched.pool.num_free == 1
    newcomer = seq(1, priority=-5, arrival=4)
    sched.add(newcomer)
    # every sequence now needs a second page: hi takes the last free one, lo_old needs one more
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == [lo_new.seq_id]
    assert out.as_dict() == {hi.seq_id: 1, lo_old.seq_id: 1}
    assert newcomer.status is SeqStatus.WAITING and lo_new.status is SeqStatus.WAITING
    assert lo_new.num_computed == 0 and lo_new.pages == [] and lo_new.num_tokens == 5  # keeps its token
    assert sched.num_preemptions == 1


def test_a_sequence_already_scheduled_this_step_can_be_preempted_and_gives_back_its_tokens():
    sched = make(num_pages=3, budget=100)
    old = seq(4, priority=5, arrival=1)  # admitted first but lowest priority
    new = seq(4, priority=0, arrival=2, first_token=50)
    sched.add(old)
    sched.add(new)
    run_step(sched)
    new.token_ids.extend([1, 2, 3, 4])  # new needs two more pages: only one is free
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == [old.seq_id]
    assert out.as_dict() == {new.seq_id: 5}
    assert out.total_tokens == 5


def test_a_recomputed_sequence_reuses_its_own_cached_blocks():
    sched = make(num_pages=8, budget=100)
    s = seq(9)
    sched.add(s)
    run_step(sched)
    sched._preempt(s)
    out = sched.schedule()
    assert out.as_dict() == {s.seq_id: 2}  # 8 of 10 tokens come from the two cached full blocks
    assert s.num_cached_tokens == 8


def test_a_block_aligned_prompt_wholly_cached_computes_only_its_last_token_on_a_copy_of_its_last_page():
    sched = make(num_pages=16, budget=100)
    first = seq(8)
    sched.add(first)
    run_step(sched)  # 8 prompt tokens computed: both blocks hashed
    view = sched.pool.view(0)
    view[first.pages] = torch.randn_like(view[first.pages])  # the K/V the model would have written
    before = view[first.pages].clone()
    again = seq(8)
    sched.add(again)
    out = sched.schedule()
    assert out.as_dict() == {first.seq_id: 1, again.seq_id: 1}  # its last token alone, not its last block
    assert again.num_computed == 7 and again.num_cached_tokens == 7
    assert again.pages[0] == first.pages[0]  # the first block shared
    assert again.pages[1] != first.pages[1]  # the last one a page of its own, holding the cached K/V
    assert torch.equal(view[again.pages[1]], before[1])
    assert sched.pool.ref_count[first.pages[1]] == 1 and sched.pool.ref_count[again.pages[1]] == 1
    view[again.pages[1]] = 0.0  # what its step writes there reaches nobody else
    assert torch.equal(view[first.pages[:2]], before)


def test_a_wholly_cached_last_block_that_would_be_evicted_is_copied_before_its_page_is_reused():
    sched = make(num_pages=3, budget=100)  # exactly enough pages: the cached last page is the only free one
    first = seq(8)
    sched.add(first)
    run_step(sched)
    view = sched.pool.view(0)
    view[first.pages] = torch.randn_like(view[first.pages])
    cached = view[first.pages].clone()
    sched.finish(first)
    again = seq(8)
    sched.add(again)
    out = sched.schedule()
    assert out.as_dict() == {again.seq_id: 1}
    assert torch.equal(view[again.pages[0]], cached[0]) and torch.equal(view[again.pages[1]], cached[1])


def test_a_prompt_not_wholly_cached_or_not_block_aligned_keeps_the_capped_hit():
    sched = make(num_pages=32, budget=100)
    first = seq(8)
    sched.add(first)
    run_step(sched)
    longer = seq(12)  # the first 8 tokens cached, the third block new
    aligned_short = seq(4)  # one block, cached: its last token alone
    unaligned = seq(6)  # one block cached, 2 tokens after it
    for s in (longer, aligned_short, unaligned):
        sched.add(s)
    out = sched.schedule().as_dict()
    assert out[longer.seq_id] == 4 and longer.num_cached_tokens == 8
    assert out[aligned_short.seq_id] == 1 and aligned_short.num_cached_tokens == 3
    assert out[unaligned.seq_id] == 2 and unaligned.num_cached_tokens == 4


def test_aborted_waiting_sequences_are_dropped_and_free_nothing_twice():
    sched = make(budget=4)
    a, b = seq(4, arrival=1), seq(4, arrival=2)
    sched.add(a)
    sched.add(b)
    sched.finish(b)  # aborted while queued
    assert sched.num_waiting == 1
    assert run_step(sched) == {a.seq_id: 4}
    sched.finish(a)  # aborted while running
    assert not sched.has_work() and sched.pool.num_used == 0


def test_head_of_line_request_waits_for_memory_instead_of_being_overtaken():
    sched = make(num_pages=4, budget=100)
    big = seq(8, arrival=1)
    sched.add(big)
    run_step(sched)  # holds 3 pages (9 tokens incl. the sampled one)
    blocked, small = seq(8, arrival=2, first_token=40), seq(1, arrival=3, first_token=90)
    sched.add(blocked)
    sched.add(small)
    out = sched.schedule()
    assert out.as_dict() == {big.seq_id: 1}  # blocked needs 2 pages, 1 is free; small may not overtake
    assert blocked.status is SeqStatus.WAITING and small.status is SeqStatus.WAITING


def test_draft_tokens_ride_on_a_decode_within_budget_and_context():
    sched = make(budget=6)
    s = seq(4)
    sched.add(s)
    run_step(sched)  # prefill; s now has a sampled token to decode
    proposed = [11, 12, 13, 14, 15, 16, 17]
    out = sched.schedule({s.seq_id: proposed})
    assert out.as_dict() == {s.seq_id: 6} and out.num_draft_tokens == {s.seq_id: 5}  # the budget caps k
    assert out.drafts == {s.seq_id: [11, 12, 13, 14, 15]} and proposed == [11, 12, 13, 14, 15, 16, 17]
    assert len(s.pages) == -(-(s.num_computed + 6) // 4)  # pages cover the drafts' K/V too
    sched.commit_computed(s, 1)  # a verifier that rejected every draft commits only the decode token
    s.token_ids.append(7)
    s.max_len = s.num_tokens + 1  # one token of room left: one draft at most
    out = sched.schedule({s.seq_id: [1, 2]})
    assert out.num_draft_tokens == {s.seq_id: 1} and out.as_dict() == {s.seq_id: 2}


def test_lookahead_is_booked_within_budget_and_max_length_and_committed_as_update_appends():
    """A multi-token step's lookahead: pages and budget for the tokens past each decode's next one, trimmed by
    the budget (in admission order) and by max_tokens, and committed by `update` only as far as the tokens
    it appends (a stop mid-way leaves the rest uncommitted)."""
    from engines.sampler import Sampled

    sched = make(budget=9)
    a, b = seq(3, arrival=1), seq(5, arrival=2)
    b.max_len = b.prompt_len + 3  # room for 3 tokens: the one being decoded and 2 more
    for s in (a, b):
        sched.add(s)
    run_step(sched)  # prefills; each appends its first token
    out = sched.schedule(lookahead={a.seq_id: 3, b.seq_id: 3})
    assert out.as_dict() == {a.seq_id: 4, b.seq_id: 3} and out.lookahead == {a.seq_id: 3, b.seq_id: 2}
    assert out.num_decode_seqs == 2 and out.num_prefill_tokens == 0 and not out.drafts
    assert len(a.pages) == 2 and len(b.pages) == 2  # a: 8 tokens of K/V in 4-token pages, b: 7
    sched.update(out, [Sampled(a, [11, 12, 13, 14], num_accepted=3), Sampled(b, [21], num_accepted=0)])
    assert a.output_token_ids == [7, 11, 12, 13, 14] and a.num_computed == a.num_tokens - 1
    assert b.output_token_ids == [7, 21] and b.num_computed == b.num_tokens - 1  # the rest never committed
    # 9 tokens: a takes 1 + 8, nothing is left for b (the policy asks only for what the whole batch fits, and
    # the runner takes a short booking as a plain step)
    budget_cut = sched.schedule(lookahead={a.seq_id: 9, b.seq_id: 9})
    assert budget_cut.lookahead == {a.seq_id: 8} and budget_cut.as_dict() == {a.seq_id: 9}
