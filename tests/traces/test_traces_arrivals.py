"""Arrival processes: rate and dispersion checked statistically with fixed seeds."""

from __future__ import annotations

import numpy as np
import pytest

from traces.arrivals import gamma_arrivals, make_arrivals, on_off_arrivals, poisson_arrivals, trace_arrivals
from traces.workloads import WorkloadError


def _cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


def test_poisson_has_the_rate_and_unit_dispersion():
    t = poisson_arrivals(50.0, 400.0, seed=1)
    assert len(t) == pytest.approx(20_000, rel=0.03)  # 3% is > 4 sigma of sqrt(20000)
    assert np.all(np.diff(t) >= 0) and t[-1] < 400.0
    assert _cv(t) == pytest.approx(1.0, abs=0.03)
    # Counts per 1 s window: Poisson means variance == mean (index of dispersion 1).
    counts = np.bincount(t.astype(int), minlength=400)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.15)


@pytest.mark.parametrize("shape", [0.25, 4.0])
def test_gamma_burstiness_sets_the_coefficient_of_variation(shape):
    t = gamma_arrivals(20.0, 1000.0, burstiness=shape, seed=2)
    assert len(t) / 1000.0 == pytest.approx(20.0, rel=0.04)
    assert _cv(t) == pytest.approx(1 / np.sqrt(shape), rel=0.05)


def test_on_off_keeps_the_mean_rate_and_has_idle_gaps():
    t = on_off_arrivals(10.0, 2000.0, off_fraction=0.2, period_s=10.0, burstiness=0.2, seed=3)
    assert len(t) / 2000.0 == pytest.approx(10.0, rel=0.1)
    counts = np.bincount(t.astype(int), minlength=2000)
    assert 0.12 < (counts == 0).mean() < 0.35  # ~20% idle plus quiet seconds inside bursts
    assert counts.var() / counts.mean() > 5  # far burstier than Poisson


def test_trace_replay_rescales_to_a_rate_or_by_a_factor():
    ts = [10.0, 11.0, 13.0, 14.0, 20.0]
    assert list(trace_arrivals(ts)) == [0.0, 1.0, 3.0, 4.0, 10.0]
    assert list(trace_arrivals(ts, time_scale=0.5)) == [0.0, 0.5, 1.5, 2.0, 5.0]
    at = trace_arrivals(ts, rate=2.0)
    assert at[-1] == pytest.approx(2.0)  # 4 gaps at 2 req/s
    jittered = trace_arrivals(np.repeat([0.0, 3.0, 6.0], 100), jitter_s=3.0, seed=0)
    assert np.all(np.diff(jittered) >= 0) and len(np.unique(jittered)) == 300


def test_arrival_errors_name_the_problem():
    with pytest.raises(WorkloadError, match="must be > 0"):
        gamma_arrivals(0.0, 10.0)
    with pytest.raises(WorkloadError, match="unknown arrival process"):
        make_arrivals("weibull", 1.0, 10.0)
    assert len(make_arrivals("gamma", 5.0, 10.0, burstiness=0.5, seed=0)) > 0
