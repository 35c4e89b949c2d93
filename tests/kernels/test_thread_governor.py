"""kernels/thread_governor.py: the count the C forward's calls take follows timing (a fake clock here): the
fastest wins, a slowed count is dropped and taken again once it is fast, an explicit thread count is kept."""

from __future__ import annotations

import os

import pytest

from kernels import thread_governor
from kernels.thread_governor import PROBE_EVERY, ThreadGovernor, ladder


class FakeCall:
    """A call whose seconds per thread count the test sets; the governor reads them through its clock."""

    def __init__(self, secs: dict[int, float]):
        self.secs, self.now, self.counts = secs, 0.0, []

    def clock(self) -> float:
        return self.now

    def __call__(self, n: int) -> int:
        self.counts.append(n)
        self.now += self.secs[n]
        return n


@pytest.fixture(autouse=True)
def _on():
    thread_governor.enable(True)
    yield
    thread_governor.enable(True)


def test_ladder():
    assert ladder(1) == [1]
    assert ladder(2) == [2, 1]
    assert ladder(8) == [8, 4, 2, 1]


def test_takes_the_fastest_and_follows_a_neighbour():
    call = FakeCall({2: 0.020, 1: 0.028})  # quiet: two threads win
    gov = ThreadGovernor(clock=call.clock, max_threads=lambda: 2)
    for _ in range(100):
        gov.run("decode", call)
    assert call.counts[:2] == [2, 1]  # each timed once first
    assert call.counts[2:].count(2) >= 95
    assert thread_governor.threads() in (1, 2)
    call.secs[2] = 0.150  # a neighbour takes a core: two threads wait at every barrier
    call.counts.clear()
    for _ in range(600):
        gov.run("decode", call)
    # one slow call moves the estimate past one thread's; the re-timings back off (every 32 -> 256 calls)
    assert call.counts[:PROBE_EVERY].count(2) <= 2
    assert 2 <= call.counts.count(2) <= 12
    assert thread_governor.threads() == 1
    call.secs[2] = 0.020  # the neighbour leaves: two threads are taken again
    call.counts.clear()
    for _ in range(1500):
        gov.run("decode", call)
    assert call.counts[-100:].count(2) >= 95


def test_kinds_are_timed_apart():
    small, big = FakeCall({2: 0.03, 1: 0.02}), FakeCall({2: 0.5, 1: 0.9})
    gov = ThreadGovernor(clock=lambda: small.now + big.now, max_threads=lambda: 2)
    for _ in range(50):
        gov.run(("forward", 1), small)
        gov.run(("forward", 9), big)
    assert small.counts[-10:] == [1] * 10
    assert big.counts[-10:] == [2] * 10


def test_off_or_one_thread_takes_torchs_count():
    call = FakeCall({4: 0.5, 2: 0.1, 1: 0.1})
    thread_governor.enable(False)
    gov = ThreadGovernor(clock=call.clock, max_threads=lambda: 4)
    for _ in range(10):
        gov.run("k", call)
    assert call.counts == [4] * 10
    thread_governor.enable(True)
    one = FakeCall({1: 0.1})
    gov = ThreadGovernor(clock=one.clock, max_threads=lambda: 1)
    gov.run("k", one)
    assert one.counts == [1]


def test_explicit_threads_turn_it_off(monkeypatch):
    import torch

    from engines.core import apply_cpu_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("TANDEM_ADAPTIVE_THREADS", raising=False)
        monkeypatch.delenv("TANDEM_THREADS", raising=False)
        apply_cpu_threads(1)
        assert not thread_governor.enabled()
        apply_cpu_threads(0)
        assert thread_governor.enabled() == (thread_governor.os.environ.get("TANDEM_ADAPTIVE_THREADS") != "0")
        monkeypatch.setenv("TANDEM_THREADS", "1")
        apply_cpu_threads(0)
        assert not thread_governor.enabled()
    finally:
        torch.set_num_threads(before)


def test_adaptive_threads_1_keeps_the_timing_under_an_explicit_count(monkeypatch):
    """TANDEM_ADAPTIVE_THREADS=1: an explicit count (TANDEM_THREADS, `threads`) is the most a call takes, the
    governor still picks the fastest count up to it; "0" keeps it off whatever the count."""
    import torch

    from engines.core import apply_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(thread_governor, "_enabled", thread_governor._enabled)  # as it was, after the test
    try:
        monkeypatch.setenv("TANDEM_ADAPTIVE_THREADS", "1")
        monkeypatch.setenv("TANDEM_THREADS", "2")
        assert apply_cpu_threads(0) == min(2, len(os.sched_getaffinity(0)))
        assert thread_governor.enabled()
        monkeypatch.delenv("TANDEM_THREADS")
        apply_cpu_threads(1)
        assert thread_governor.enabled()
        monkeypatch.setenv("TANDEM_ADAPTIVE_THREADS", "0")
        apply_cpu_threads(0)
        assert not thread_governor.enabled()
    finally:
        torch.set_num_threads(before)


def _on_thread(fn):
    """fn() on a new thread that stays alive until the returned release() is called; (result, release)."""
    import threading

    out, ready, release = [], threading.Event(), threading.Event()

    def run():
        out.append(fn())
        ready.set()
        release.wait()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait()
    return out[0], lambda: (release.set(), t.join())


def test_only_the_claiming_thread_takes_several_threads_while_it_lives(monkeypatch):
    """One OpenMP pool with workers in the process: a thread other than the step loop's (scoring, start-up) takes
    one thread, its timing is not recorded and it does not move the step loop's hint; when the claiming thread
    ends, any thread may take them again."""
    monkeypatch.setattr(thread_governor, "_owner", None)
    monkeypatch.setattr(thread_governor, "_hint", 0)
    monkeypatch.setattr(thread_governor.torch, "get_num_threads", lambda: 2)
    gov = ThreadGovernor(max_threads=lambda: 2)
    assert thread_governor.owns() and thread_governor.threads() == 2  # nobody has claimed: any thread

    def loop_thread():
        thread_governor.claim()
        return thread_governor.owns(), thread_governor.threads(), gov.pick(("step", 1))

    (owns, threads, picked), release = _on_thread(loop_thread)
    assert owns and threads == 2 and picked in (1, 2)
    hint = thread_governor._hint
    assert not thread_governor.owns()  # this (pytest's) thread now takes one
    assert thread_governor.threads() == 1 and gov.pick(("other", 1)) == 1
    assert thread_governor._hint == hint  # another thread's pick leaves the loop's hint alone
    before = gov.current()
    gov.record(("step", 1), 1, 123.0)
    assert gov.current() == before  # and its timing is not the loop's
    release()  # the claiming thread ends: its claim with it
    assert thread_governor.owns() and thread_governor.threads() == 2
    thread_governor.claim()
    assert thread_governor.owns()
