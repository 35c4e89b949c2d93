"""What a router or cascade route sees of its own live traffic: a bounded sliding window of recent scores (a
Fenwick tree over logit bins: add, evict and quantile in O(log bins)), the threshold that holds a target large
fraction on it, the drift of its score distribution from the artifact's held-out one (Kolmogorov-Smirnov), and a
short history of per-interval buckets. Pure policy with an injectable clock; the gateway only feeds and reads it.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tandem.routing")

LOGIT_RANGE = 20.0  # scores are binned on logit(score) in [-20, 20]: fine where calibrated scores crowd near 0
NUM_BINS = 1 << 14  # 0.0024 logit per bin (0.24% of a score); ties inside a bin are split at random
SUMMARY_QUANTILES = (0.1, 0.5, 0.9)
FEEDBACK_GAIN = 3.0  # on step shifts (tests/gateway/test_route_monitor.py): 1 lags, window-long horizons overshoot


def _bin_of(score: float) -> int:
    p = min(max(score, 1e-12), 1.0 - 1e-12)
    z = math.log(p / (1.0 - p))
    b = int((z + LOGIT_RANGE) * NUM_BINS / (2 * LOGIT_RANGE))
    return min(max(b, 0), NUM_BINS - 1)


def _score_at_edge(b: int) -> float:
    """The score at the lower edge of bin `b` (the threshold a quantile in that bin reports)."""
    z = b * 2 * LOGIT_RANGE / NUM_BINS - LOGIT_RANGE
    return 1.0 / (1.0 + math.exp(-z))


class ScoreWindow:
    """The last `size` scores in [0, 1]: counts per logit bin in a Fenwick tree plus the ring of their bins."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self.size = size
        self._tree = [0] * (NUM_BINS + 1)
        self._ring: deque[int] = deque()
        self._top = 1 << (NUM_BINS.bit_length() - 1)

    def __len__(self) -> int:
        return len(self._ring)

    def _add(self, b: int, delta: int) -> None:
        i, tree = b + 1, self._tree
        while i <= NUM_BINS:
            tree[i] += delta
            i += i & -i

    def count_below(self, b: int) -> int:
        """Scores in bins < b."""
        i, total, tree = b, 0, self._tree
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    def push(self, score: float) -> int:
        """Add a score (evicting the oldest once full); returns its bin."""
        b = _bin_of(score)
        if len(self._ring) == self.size:
            self._add(self._ring.popleft(), -1)
        self._ring.append(b)
        self._add(b, 1)
        return b

    def bin_of_rank(self, k: int) -> int:
        """The bin holding the k-th smallest score (k from 1), by binary lifting down the tree."""
        pos, step, tree = 0, self._top, self._tree
        while step:
            nxt = pos + step
            if nxt <= NUM_BINS and tree[nxt] < k:
                pos = nxt
                k -= tree[nxt]
            step >>= 1
        return pos  # 0-based bin index

    def quantile(self, q: float) -> float | None:
        n = len(self._ring)
        if n == 0:
            return None
        b = self.bin_of_rank(min(n, max(1, math.ceil(q * n))))
        return _score_at_edge(b)

    def cdf(self, score: float) -> float:
        """Share of the window at or below `score` (to the bin)."""
        n = len(self._ring)
        return self.count_below(_bin_of(score) + 1) / n if n else 0.0


@dataclass
class Bucket:
    """One history interval of a route: decisions, how many went large (escalated), score summary."""

    start: float  # wall-clock seconds
    requests: int = 0
    large: int = 0
    scores: list[float] = field(default_factory=list)  # bounded: at most MAX_BUCKET_SCORES
    threshold: float | None = None
    verified: int = 0  # cascade escalations whose verification finished
    accepted: float = 0.0  # the sum of their accepted shares of the small answer


MAX_BUCKET_SCORES = 512


@dataclass(frozen=True)
class DriftReport:
    ks: float | None  # sup |F_live - F_reference| over the reference's percentiles
    p_value: float | None  # asymptotic Kolmogorov p-value of the window against the reference
    warning: bool
    samples: int


def kolmogorov_p(d: float, n: int) -> float:
    """P(D_n >= d) under the null, Kolmogorov's asymptotic series with Stephens' small-n correction."""
    if d <= 0:
        return 1.0
    root = math.sqrt(n)
    lam = (root + 0.12 + 0.11 / root) * d
    total = sum((-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam) for k in range(1, 101))
    return min(1.0, max(0.0, 2.0 * total))


def ks_against_quantiles(window: ScoreWindow, reference: Sequence[float]) -> float | None:
    """Kolmogorov-Smirnov distance between the window and a distribution given by its 0..100th percentiles:
    at each distinct reference value v, the live CDF just below and at v against the reference's."""
    m = len(reference) - 1
    n = len(window)
    if m < 1 or n == 0:
        return None
    worst, k = 0.0, 0
    while k <= m:
        v = reference[k]
        j = k
        while j + 1 <= m and reference[j + 1] == v:
            j += 1
        b = _bin_of(v)
        below = window.count_below(b) / n
        at = window.count_below(b + 1) / n
        worst = max(worst, abs(below - k / m), abs(at - j / m))
        k = j + 1
    return worst


class RouteMonitor:
    """One route's live scores. `decide(score)` (router routes) returns large/small against the threshold: the
    static one, or, with `target_fraction` and `warmup` scores seen, the window's (1 - target) quantile, ties in
    its bin split at random so the window's large share is the target, nudged by the share of the latest
    decisions while a shift passes through the window. `record(score, large)` (cascades) only observes. `report()` is the snapshot for /v1/routes, the dashboard and metrics."""

    def __init__(self, route: str, *, static_threshold: float, target_fraction: float | None = None,
                 reference_quantiles: Sequence[float] | None = None, window: int = 1000, warmup: int = 100,
                 drift_min_ks: float = 0.1, drift_p_value: float = 0.001, interval_s: float = 60.0,
                 history: int = 60, clock: Callable[[], float] = time.time, rng: random.Random | None = None,
                 label: str = "large"):
        self.route = route
        self.static_threshold = static_threshold
        self.target_fraction = target_fraction
        self.reference = list(reference_quantiles) if reference_quantiles is not None else None
        self.window = ScoreWindow(window)
        self.warmup = max(1, warmup)
        self.drift_min_ks, self.drift_p_value = drift_min_ks, drift_p_value
        self.interval_s, self.clock = interval_s, clock
        self.history: deque[Bucket] = deque(maxlen=history)
        self.label = label  # what "large" means here: "large" (router) or "escalated" (cascade)
        self._rng = rng or random.Random(0)
        self._choices: deque[bool] = deque()  # the last `window` decisions, for the realised share
        self._large_in_window = 0
        self._recent = target_fraction or 0.0  # moving average of large over the last ~window/10 decisions
        self._recent_rate = 1.0 / max(10, window // 10)
        self._acceptance: deque[float] = deque(maxlen=window)  # a cascade's accepted share per verification
        self.decisions = 0
        self.large_total = 0
        self._threshold = static_threshold
        self._tie = (None, 1.0)  # (bin, P(large) inside it) while the window quantile holds the target
        self._drift_warned = False
        self._lock = threading.Lock()  # decisions on the event loop, reports from scrape threads

    # ---- the decision ----------------------------------------------------------------------------------------
    @property
    def holding(self) -> bool:
        """True while the threshold follows the window (a target is set and the window is warm)."""
        return self.target_fraction is not None and len(self.window) >= self.warmup

    @property
    def threshold(self) -> float:
        return self._threshold

    def decide(self, score: float) -> bool:
        """Large? for one score, then the score joins the window and the threshold follows it."""
        with self._lock:
            tie_bin, p_tie = self._tie
            if tie_bin is None:
                large = score >= self._threshold
            else:
                b = _bin_of(score)
                large = b > tie_bin or (b == tie_bin and self._rng.random() < p_tie)
            self._observe(score, large)
            self._follow()
        return large

    def record(self, score: float | None, large: bool) -> None:
        """A decision made elsewhere (a cascade's escalation): observed, the threshold untouched."""
        with self._lock:
            self._observe(score, large)

    def record_acceptance(self, share: float) -> None:
        """A finished escalation: the share of the small answer the large model accepted as drafts."""
        with self._lock:
            self._acceptance.append(share)
            if self.history:
                self.history[-1].verified += 1
                self.history[-1].accepted += share

    def acceptance(self) -> float | None:
        """Mean accepted share over the recent verifications (None before the first)."""
        with self._lock:
            return sum(self._acceptance) / len(self._acceptance) if self._acceptance else None

    def _observe(self, score: float | None, large: bool) -> None:
        if score is not None:  # None: a cascade's raw-confidence modes, whose scores are not probabilities
            self.window.push(score)
        self._choices.append(large)
        self._large_in_window += large
        self._recent += self._recent_rate * (large - self._recent)
        if len(self._choices) > self.window.size:
            self._large_in_window -= self._choices.popleft()
        self.decisions += 1
        self.large_total += large
        now = self.clock()
        bucket = self.history[-1] if self.history else None
        if bucket is None or now - bucket.start >= self.interval_s:
            bucket = Bucket(start=now - (now % self.interval_s) if self.interval_s > 0 else now)
            self.history.append(bucket)
        bucket.requests += 1
        bucket.large += large
        bucket.threshold = self._threshold
        if score is not None and len(bucket.scores) < MAX_BUCKET_SCORES:
            bucket.scores.append(score)

    def _follow(self) -> None:
        """The threshold for the next decision: the bin where the top `target` share of the window starts, and
        the chance of large inside that bin so that exactly the target share lies above on average."""
        if not self.holding:
            return
        n = len(self.window)
        target = self.target_fraction
        # lean against the share of the last ~window/10 decisions: while a shift passes through the window its
        # quantile lags, and this pulls the realised share back to the target well within a window
        target = min(1.0, max(0.0, target + FEEDBACK_GAIN * (target - self._recent)))
        want = target * n  # scores that should go large
        if want <= 0:
            self._tie, self._threshold = (NUM_BINS, 0.0), 1.0
            return
        b = self.window.bin_of_rank(max(1, n - math.ceil(want) + 1))
        above = n - self.window.count_below(b + 1)
        inside = self.window.count_below(b + 1) - self.window.count_below(b)
        self._tie = (b, min(1.0, max(0.0, (want - above) / inside)) if inside else 1.0)
        self._threshold = _score_at_edge(b)

    # ---- what is shown ---------------------------------------------------------------------------------------
    def realised_fraction(self) -> float | None:
        with self._lock:
            return self._large_in_window / len(self._choices) if self._choices else None

    def drift(self) -> DriftReport:
        with self._lock:
            n = len(self.window)
            ks = ks_against_quantiles(self.window, self.reference) if self.reference else None
        if ks is None:
            return DriftReport(None, None, False, n)
        p = kolmogorov_p(ks, n)
        warning = n >= self.warmup and ks >= self.drift_min_ks and p < self.drift_p_value
        if warning != self._drift_warned:
            self._drift_warned = warning
            if warning:
                log.warning("route %s: live router scores drifted from the artifact's held-out distribution "
                            "(KS %.3f over the last %d, p %.2g); its threshold and accuracy may no longer hold",
                            self.route, ks, n, p)
            else:
                log.info("route %s: live router scores back near the artifact's distribution (KS %.3f)",
                         self.route, ks)
        return DriftReport(ks, p, warning, n)

    def quantiles(self) -> dict[str, float | None]:
        with self._lock:
            return {f"p{round(q * 100)}": self.window.quantile(q) for q in SUMMARY_QUANTILES}

    def report(self) -> dict[str, Any]:
        drift = self.drift()
        with self._lock:
            history = [_bucket_summary(b, self.label) for b in self.history]
        return {
            "threshold": self._threshold,
            "static_threshold": self.static_threshold,
            "target_fraction": self.target_fraction,
            "holding_target": self.holding,
            "window": {"size": self.window.size, "scores": len(self.window), "decisions": len(self._choices),
                       f"realised_{self.label}_fraction": self.realised_fraction(), "score_quantiles": self.quantiles(),
                       "verifications": len(self._acceptance), "escalation_acceptance": self.acceptance()},
            "decisions": self.decisions, f"{self.label}_total": self.large_total,
            "drift": {"ks": drift.ks, "p_value": drift.p_value, "warning": drift.warning,
                      "min_ks": self.drift_min_ks, "max_p_value": self.drift_p_value},
            "history": history,
        }


def _bucket_summary(b: Bucket, label: str) -> dict[str, Any]:
    scores = sorted(b.scores)

    def q(p: float) -> float | None:
        return scores[min(len(scores) - 1, int(p * len(scores)))] if scores else None

    return {"start": b.start, "requests": b.requests, f"{label}_fraction": b.large / b.requests if b.requests else None,
            "threshold": b.threshold, "escalation_acceptance": b.accepted / b.verified if b.verified else None,
            "score_quantiles": {f"p{round(p * 100)}": q(p) for p in SUMMARY_QUANTILES}}
