"""RouteLLM-style metrics on hand-made cases: PGR, APGR (random = 0.5), CPT."""

from __future__ import annotations

import numpy as np
import pytest

from router_model.evaluate import (
    COST_POINTS,
    apgr_from_points,
    cost_to_reach,
    evaluate_scores,
    format_report,
    pgr_all_k,
    pgr_at,
)

# 10 prompts: the large model helps only on prompts 0 and 1 (gain 1 each); elsewhere both score 0.5
SMALL = np.array([0.0, 0.0] + [0.5] * 8)
LARGE = np.array([1.0, 1.0] + [0.5] * 8)


def test_always_large_is_pgr_one_at_full_cost_and_zero_at_no_cost():
    for scores in (np.zeros(10), np.arange(10.0), -np.arange(10.0)):
        curve = pgr_all_k(scores, SMALL, LARGE)
        assert curve[0] == 0.0 and curve[-1] == pytest.approx(1.0)


def test_perfect_router_recovers_the_gap_with_the_two_helped_prompts():
    perfect = LARGE - SMALL
    assert pgr_at(perfect, SMALL, LARGE)[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert cost_to_reach(perfect, SMALL, LARGE, 0.5) == pytest.approx(0.1)
    assert cost_to_reach(perfect, SMALL, LARGE, 0.8) == pytest.approx(0.2)
    # trapezoids: (0 + .5)/2*.1 + (.5 + 1)/2*.1 + 8 * .1 * 1
    assert evaluate_scores(perfect, SMALL, LARGE).apgr == pytest.approx(0.025 + 0.075 + 0.8)


def test_worst_router_sends_the_helped_prompts_last():
    worst = SMALL - LARGE
    ev = evaluate_scores(worst, SMALL, LARGE)
    assert ev.pgr[:8] == pytest.approx([0.0] * 8)
    assert ev.pgr[8:] == pytest.approx([0.5, 1.0])
    assert ev.cpt50 == pytest.approx(0.9) and ev.cpt80 == pytest.approx(1.0)


def test_pgr_is_the_hand_computed_ratio():
    small = np.array([0.1, 0.2, 0.3, 0.4])
    large = np.array([0.5, 0.2, 0.9, 0.0])  # gains .4, 0, .6, -.4 -> mean gap 0.15
    scores = np.array([3.0, 2.0, 1.0, 0.0])
    curve = pgr_all_k(scores, small, large)
    assert curve == pytest.approx([0.0, 0.4 / 4 / 0.15, 0.4 / 4 / 0.15, 1.0 / 4 / 0.15, 1.0])


def test_random_scores_average_to_apgr_one_half():
    rng = np.random.default_rng(0)
    small = rng.normal(0.0, 1.0, 400)
    large = small + rng.exponential(1.0, 400)
    apgrs = [evaluate_scores(rng.random(400), small, large).apgr for _ in range(200)]
    assert np.mean(apgrs) == pytest.approx(0.5, abs=0.01)


def test_random_router_points_integrate_to_one_half():
    assert apgr_from_points(COST_POINTS, list(COST_POINTS)) == pytest.approx(0.5)


def test_equal_model_quality_makes_pgr_undefined():
    with pytest.raises(ValueError, match="same mean quality"):
        pgr_all_k(np.arange(3.0), np.ones(3), np.ones(3))


def test_report_lists_every_policy_and_cost_point():
    text = format_report(evaluate_scores(LARGE - SMALL, SMALL, LARGE))
    for word in ("APGR", "CPT(50%)", "CPT(80%)", "random", "always-small", "always-large"):
        assert word in text
    assert "   100" in text and "    10" in text


# ---- policy comparison with bootstrap intervals


def test_comparison_curves_end_at_always_small_and_always_large_and_rank_policies():
    from router_model.evaluate import compare_policies, format_comparison

    rng = np.random.default_rng(1)
    small = (rng.random(600) < 0.05).astype(float)
    large = np.maximum(small, (rng.random(600) < 0.10).astype(float))
    noisy = (large - small) + rng.normal(0, 0.3, 600)
    curves = compare_policies({"good": noisy, "bad": -(large - small)}, small, large,
                              groups=[i % 30 for i in range(600)], bootstrap=200)
    for c in curves.values():
        assert c.quality[0] == pytest.approx(small.mean()) and c.quality[-1] == pytest.approx(large.mean())
        assert c.apgr_ci[0] <= c.apgr <= c.apgr_ci[1] or c.policy == "random"
    assert curves["random"].apgr == pytest.approx(0.5)
    assert curves["random"].quality[10] == pytest.approx((small.mean() + large.mean()) / 2)  # cost 50%
    assert curves["oracle"].apgr >= curves["good"].apgr > 0.8 > 0.5 > curves["bad"].apgr
    # the point estimate is the plain (unweighted) evaluation
    assert curves["good"].apgr == pytest.approx(evaluate_scores(noisy, small, large).apgr)
    # the oracle reaches always-large's quality once every large-only win is sent large
    wins = np.mean(large > small)
    assert curves["oracle"].cost_for_95 <= wins + 0.05
    assert curves["bad"].cost_for_95 >= 0.9
    text = format_comparison(curves, "exact match", small.mean(), large.mean())
    assert "good" in text and "95% CI" in text and "cost @95%" in text


def test_bootstrap_by_group_is_wider_when_groups_differ():
    from router_model.evaluate import compare_policies

    rng = np.random.default_rng(2)
    groups = np.repeat(np.arange(20), 30)
    helps = np.isin(groups, [0, 1, 2])  # the large model helps only in three groups
    small = np.zeros(600)
    large = helps.astype(float) * (rng.random(600) < 0.8)
    scores = rng.random(600)
    by_group = compare_policies({"r": scores}, small, large, groups=list(groups), bootstrap=300)["r"]
    by_prompt = compare_policies({"r": scores}, small, large, groups=None, bootstrap=300)["r"]
    width = lambda c: c.quality_ci[10][1] - c.quality_ci[10][0]  # noqa: E731
    assert width(by_group) > width(by_prompt)
