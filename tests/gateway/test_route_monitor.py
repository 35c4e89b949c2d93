"""The route monitor as a pure policy, without HTTP: its score window against numpy, the threshold that holds a
target large fraction on shifted streams (where the artifact's fixed threshold does not), ties split to the
target, the drift statistic against scipy's Kolmogorov-Smirnov test and its warning, and history buckets on an
injected clock."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
from scipy import stats

from gateway.route_monitor import RouteMonitor, ScoreWindow, kolmogorov_p

# a training-like score distribution: what an artifact's 0..100th held-out percentiles look like (crowded near 0)
RNG = np.random.default_rng(3)
REFERENCE = np.quantile(RNG.beta(0.6, 25.0, 20_000), np.linspace(0, 1, 101)).tolist()


def _reference_draws(n: int, rng: np.random.Generator) -> np.ndarray:
    return np.interp(rng.uniform(0, 100, n), np.arange(101), REFERENCE)


def _monitor(**kw) -> RouteMonitor:
    args = dict(static_threshold=float(np.quantile(REFERENCE, 0.7)), target_fraction=0.3,
                reference_quantiles=REFERENCE, window=1000, warmup=100)
    return RouteMonitor("auto", **(args | kw))


def test_window_quantiles_and_cdf_match_numpy_to_the_bin_and_evict_the_oldest():
    rng = np.random.default_rng(0)
    w = ScoreWindow(500)
    old = rng.uniform(0.5, 1.0, 300)
    new = rng.beta(1.0, 40.0, 500)
    for s in np.concatenate([old, new]):
        w.push(float(s))
    assert len(w) == 500  # bounded: the 300 high scores are gone
    for q in (0.05, 0.3, 0.5, 0.7, 0.95):
        # a bin is 0.24% of a score wide; the window's quantile is the lower edge of its bin
        assert w.quantile(q) == pytest.approx(np.quantile(new, q, method="inverted_cdf"), rel=0.005)
    for x in (0.001, 0.02, 0.05):
        assert w.cdf(x) == pytest.approx(np.mean(new <= x), abs=0.01)
    assert w.cdf(0.5) == 1.0


def test_held_threshold_keeps_the_target_on_shifted_streams_where_the_fixed_one_does_not():
    rng = np.random.default_rng(1)
    m = _monitor()
    fixed = m.static_threshold
    segments = [_reference_draws(3000, rng), _reference_draws(3000, rng) * 0.3, rng.beta(2.0, 8.0, 3000),
                _reference_draws(3000, rng)]
    for scores in segments:
        choices = np.array([m.decide(float(s)) for s in scores])
        # once a window of the new traffic has passed, every window of decisions holds 30% +- 3 points
        settled = choices[1000:]
        for start in range(0, settled.size - 999, 250):
            assert abs(settled[start:start + 1000].mean() - 0.3) <= 0.03
        assert m.realised_fraction() == pytest.approx(choices[-1000:].mean())
    # the artifact's fixed threshold sends far from 30% of the two shifted segments
    assert np.mean(segments[1] >= fixed) < 0.05 and np.mean(segments[2] >= fixed) > 0.9
    assert m.holding and m.threshold != fixed


def test_before_warmup_and_without_a_target_the_threshold_is_the_static_one():
    m = _monitor(warmup=50)
    for s in [0.9] * 49:
        assert m.decide(s) == (s >= m.static_threshold)
        assert m.threshold == m.static_threshold and not m.holding
    m.decide(0.9)
    assert m.holding
    explicit = _monitor(target_fraction=None, static_threshold=0.25)
    assert [explicit.decide(s) for s in (0.1, 0.25, 0.3, 0.249)] == [False, True, True, False]
    for s in np.linspace(0, 1, 500):
        explicit.decide(float(s))
    assert explicit.threshold == 0.25 and not explicit.holding


def test_identical_scores_are_split_at_random_to_the_target():
    m = _monitor(rng=random.Random(5))
    choices = [m.decide(0.01) for _ in range(5000)]
    assert abs(np.mean(choices[1000:]) - 0.3) <= 0.03
    none = _monitor(target_fraction=0.0)  # past the warm-up (the static threshold's), the held one's choices
    assert not any([none.decide(0.99) for _ in range(300)][100:])
    every = _monitor(target_fraction=1.0)
    assert all([every.decide(float(s)) for s in np.linspace(0.0, 1.0, 300)][100:])


def test_drift_statistic_matches_scipy_and_warns_once_on_a_shift(caplog):
    rng = np.random.default_rng(2)
    m = _monitor()
    same = _reference_draws(1000, rng)
    for s in same:
        m.decide(float(s))
    reference_cdf = lambda x: np.interp(x, REFERENCE, np.linspace(0, 1, 101))  # noqa: E731
    d = m.drift()
    assert d.ks == pytest.approx(stats.kstest(same, reference_cdf).statistic, abs=0.02)
    assert not d.warning and d.p_value > 0.01 and d.samples == 1000
    shifted = rng.beta(2.0, 8.0, 1000)
    with caplog.at_level(logging.WARNING, logger="tandem.routing"):
        for s in shifted:
            m.decide(float(s))
        d = m.drift()
        m.drift()  # still drifted: warned once, not on every read
    expected = stats.kstest(shifted, reference_cdf)
    assert d.ks == pytest.approx(expected.statistic, abs=0.02) and d.ks > 0.5
    assert d.warning and d.p_value < 1e-6
    assert [r.message for r in caplog.records if "drifted" in r.message] and len(caplog.records) == 1
    report = m.report()
    assert report["drift"]["warning"] is True and report["drift"]["ks"] == pytest.approx(d.ks)


def test_kolmogorov_p_matches_scipys_exact_distribution():
    for n, d in ((100, 0.1), (1000, 0.05), (1000, 0.03), (400, 0.12)):
        assert kolmogorov_p(d, n) == pytest.approx(stats.kstwo.sf(d, n), abs=0.01)


def test_history_buckets_follow_the_injected_clock():
    now = [1000.0]
    m = _monitor(interval_s=60.0, clock=lambda: now[0], warmup=10, window=50)
    for i in range(30):
        m.decide(0.9 if i % 3 == 0 else 0.001)
    now[0] += 60.0
    for _ in range(20):
        m.decide(0.001)
    history = m.report()["history"]
    assert [b["start"] for b in history] == [960.0, 1020.0]
    assert [b["requests"] for b in history] == [30, 20]
    assert history[0]["large_fraction"] == pytest.approx(10 / 30)
    assert history[0]["score_quantiles"]["p90"] == 0.9 and history[1]["score_quantiles"]["p50"] == 0.001
    cascade = RouteMonitor("c", static_threshold=0.5, label="escalated", clock=lambda: now[0])
    cascade.record(None, True)
    cascade.record(0.2, False)
    r = cascade.report()
    assert r["escalated_total"] == 1 and r["window"]["realised_escalated_fraction"] == 0.5
    assert r["window"]["scores"] == 1 and r["drift"]["ks"] is None
