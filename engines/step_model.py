"""Per-engine step-time model and the batch caps it implies: an online, forgetting least-squares fit of
`step_s = a + b * decode_seqs + c * prefill_tokens`, and the decode-batch cap and per-step prefill budget
that keep the predicted step time (one decode token's latency) inside the tightest running TPOT target; and
the measured lead from a request's first scheduled step to its first token (`FirstTokenLead`); and the
engine's one step timer (`StepTimer`) with the clock step costs are compared on (`step_clock`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

_MIN_COEF = 1e-9  # seconds; a fitted cost never reaches zero, so caps stay finite
_CHANGE_INFLATION = 10.0  # covariance widening when a run of outliers says the step time really changed


class StepTimeModel:
    """Recursive least squares with forgetting on (1, decode_seqs, prefill_tokens) -> step seconds; O(1)."""

    __slots__ = ("forgetting", "min_samples", "max_variance", "theta", "p", "num_samples", "num_decode_samples",
                 "num_prefill_samples", "_resid_scale", "_outliers")

    def __init__(self, *, forgetting: float = 0.99, min_samples: int = 8, prior_variance: float = 1e4):
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self.forgetting = forgetting
        self.min_samples = min_samples
        # Anti-windup: forgetting inflates P without bound in directions the data stops exciting (hours of
        # decode-only steps); capping each variance at the prior keeps the fit adaptive and well-conditioned.
        self.max_variance = prior_variance
        self.theta = [0.0, 0.0, 0.0]  # a (s), b (s per decode sequence), c (s per prefill token)
        self.p = [prior_variance, 0.0, 0.0, 0.0, prior_variance, 0.0, 0.0, 0.0, prior_variance]  # 3x3 row-major
        self.num_samples = 0
        self.num_decode_samples = 0
        self.num_prefill_samples = 0
        self._resid_scale = 0.0  # EWMA of |residual|, to recognise outliers (GC pauses, first-call compiles)
        self._outliers = 0  # consecutive outliers skipped; a run of them is a real change and is learned

    def observe(self, step_s: float, num_decode_seqs: int, num_prefill_tokens: int) -> None:
        """Fold one measured step into the fit."""
        if step_s < 0 or (num_decode_seqs <= 0 and num_prefill_tokens <= 0):
            return
        x0, x1, x2 = 1.0, float(num_decode_seqs), float(num_prefill_tokens)
        p = self.p
        px0 = p[0] * x0 + p[1] * x1 + p[2] * x2
        px1 = p[3] * x0 + p[4] * x1 + p[5] * x2
        px2 = p[6] * x0 + p[7] * x1 + p[8] * x2
        lam = self.forgetting
        denom = lam + x0 * px0 + x1 * px1 + x2 * px2
        k0, k1, k2 = px0 / denom, px1 / denom, px2 / denom
        th = self.theta
        err = step_s - (th[0] * x0 + th[1] * x1 + th[2] * x2)
        predicted = step_s - err
        if self.num_samples >= self.min_samples and abs(err) > max(6.0 * self._resid_scale, 0.1 * abs(predicted)):
            self._outliers += 1
            if self._outliers < 3:  # one or two odd steps must not swing the caps; three in a row are news
                return
            # News: the machine changed (another job took the CPU, a clock dropped). After a long steady run
            # the covariance has shrunk and forgetting alone takes ~100 steps to follow; widening it makes the
            # fit (and so the caps) follow within about ten steps.
            for i in range(9):
                self.p[i] *= _CHANGE_INFLATION
        self._outliers = 0
        self._resid_scale = abs(err) if self.num_samples == 0 else 0.95 * self._resid_scale + 0.05 * abs(err)
        th[0] += k0 * err
        th[1] += k1 * err
        th[2] += k2 * err
        # P <- (P - k (P x)^T) / lambda, kept exactly symmetric
        inv = 1.0 / lam
        k = (k0, k1, k2)
        px = (px0, px1, px2)
        for i in range(3):
            for j in range(i, 3):
                v = (p[3 * i + j] - k[i] * px[j]) * inv
                p[3 * i + j] = v
                p[3 * j + i] = v
        cap = self.max_variance
        for i in range(3):
            if p[4 * i] > cap:  # scale row and column i (D P D keeps P positive definite)
                f = math.sqrt(cap / p[4 * i])
                for j in range(3):
                    p[3 * i + j] *= f
                    p[3 * j + i] *= f
        self.num_samples += 1
        self.num_decode_samples += num_decode_seqs > 0
        self.num_prefill_samples += num_prefill_tokens > 0

    @property
    def ready(self) -> bool:
        """Enough steps seen to trust predictions (before that, callers use their configured limits)."""
        return self.num_samples >= self.min_samples

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c) made physical: non-negative overhead, positive per-sequence and per-token costs."""
        a, b, c = self.theta
        # A decode sequence and a prefill token both push one token through the model: while the data has not
        # shown one of them yet, its cost is borrowed from the other rather than assumed free.
        seen_b = self.num_decode_samples >= self.min_samples // 2
        seen_c = self.num_prefill_samples >= self.min_samples // 2
        if not seen_b and seen_c:
            b = c
        elif not seen_c and seen_b:
            c = b
        return max(a, 0.0), max(b, _MIN_COEF), max(c, _MIN_COEF)

    def predict(self, num_decode_seqs: int, num_prefill_tokens: int) -> float:
        """Predicted seconds for a step with this many decode sequences and prefill tokens."""
        a, b, c = self.coefficients()
        return a + b * num_decode_seqs + c * num_prefill_tokens


class FirstTokenLead:
    """How long a request takes from the step that starts its prefill to its first token (its prompt's chunks
    and the step that samples), measured per request with forgetting; `estimate_s` is mean + 2 x mean absolute
    deviation, so a request started that late before its TTFT deadline is expected to miss it."""

    __slots__ = ("forgetting", "mean_s", "dev_s", "count")

    def __init__(self, *, forgetting: float = 0.95):
        self.forgetting = forgetting  # per observation: about the last 20 requests count
        self.mean_s = 0.0
        self.dev_s = 0.0
        self.count = 0

    def observe(self, lead_s: float) -> None:
        if lead_s < 0:
            return
        if self.count == 0:
            self.mean_s = lead_s
        else:
            w = 1.0 - self.forgetting
            self.dev_s += w * (abs(lead_s - self.mean_s) - self.dev_s)
            self.mean_s += w * (lead_s - self.mean_s)
        self.count += 1

    @property
    def estimate_s(self) -> float:
        return self.mean_s + 2.0 * self.dev_s if self.count else 0.0


class RunningTargets:
    """Multiset of the TPOT targets of running requests; `tightest` in O(1), add/remove O(1) amortised."""

    __slots__ = ("_counts", "_min")

    def __init__(self) -> None:
        self._counts: dict[float, int] = {}
        self._min: float | None = None

    def add(self, target_s: float | None) -> None:
        if target_s is None:
            return
        self._counts[target_s] = self._counts.get(target_s, 0) + 1
        if self._min is None or target_s < self._min:
            self._min = target_s

    def remove(self, target_s: float | None) -> None:
        if target_s is None or target_s not in self._counts:
            return
        left = self._counts[target_s] - 1
        if left:
            self._counts[target_s] = left
            return
        del self._counts[target_s]
        if target_s == self._min:  # distinct targets are few (one per route): the rescan is short
            self._min = min(self._counts) if self._counts else None

    @property
    def tightest(self) -> float | None:
        return self._min

    def __len__(self) -> int:
        return sum(self._counts.values())


class BatchCaps(NamedTuple):
    """What the scheduler may run this step: decode sequences and prefill tokens, and why (a tuple: cheap)."""

    max_decode_seqs: int
    max_prefill_tokens: int
    target_s: float | None  # the TPOT target the caps protect (None: no target, configured limits apply)
    predicted_step_s: float | None  # predicted time of a step at these caps
    limited_by: str  # "config" | "no_target" | "warming_up" | "tpot"


class BatchCapController:
    """One per engine: times steps (injectable clock), learns the step model, and turns the tightest running
    TPOT target into `BatchCaps`. Call `caps()` once per step; it is a handful of float operations."""

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, headroom: float = 0.85,
                 min_prefill_tokens: int = 16, model: StepTimeModel | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.headroom = headroom  # aim below the target: the fit is an average, and TPOT is judged at p99
        self.min_prefill_tokens = min_prefill_tokens  # waiting requests always progress (no TTFT starvation)
        self.model = model or StepTimeModel()
        self.targets = RunningTargets()
        self.clock = clock
        self._started: float | None = None

    def step_started(self) -> None:
        self._started = self.clock()

    def step_finished(self, num_decode_seqs: int, num_prefill_tokens: int) -> float:
        """Close the step opened by `step_started`, feed the model, return the step's seconds."""
        if self._started is None:
            raise RuntimeError("step_finished() without step_started()")
        elapsed = self.clock() - self._started
        self._started = None
        self.model.observe(elapsed, num_decode_seqs, num_prefill_tokens)
        return elapsed

    def caps(self, num_decode_seqs: int) -> BatchCaps:
        """Caps for the next step, given how many running sequences will decode in it."""
        target = self.targets.tightest
        if target is None or not self.model.ready:
            return BatchCaps(self.max_num_seqs, self.max_num_batched_tokens, target, None,
                             "no_target" if target is None else "warming_up")
        return caps_for_target(self.model, target * self.headroom, target, num_decode_seqs,
                               self.max_num_seqs, self.max_num_batched_tokens, self.min_prefill_tokens)


def caps_for_target(model: StepTimeModel, budget_s: float, target_s: float, num_decode_seqs: int,
                    max_num_seqs: int, max_num_batched_tokens: int, min_prefill_tokens: int) -> BatchCaps:
    """The largest decode batch and prefill budget whose predicted step fits `budget_s` (pure function)."""
    a, b, c = model.coefficients()
    decode_cap = max(1, min(max_num_seqs, math.floor((budget_s - a) / b + 1e-6)))  # 1e-6: float dust
    decoding = min(num_decode_seqs, decode_cap)
    room = budget_s - a - b * decoding
    token_room = max_num_batched_tokens - decoding
    prefill = math.floor(room / c + 1e-6) if room > 0 else 0
    prefill = max(min(min_prefill_tokens, token_room), min(prefill, token_room))
    limited = "tpot" if decode_cap < max_num_seqs or prefill < token_room else "config"
    return BatchCaps(decode_cap, max(0, prefill), target_s, a + b * decoding + c * prefill, limited)


def step_clock(device: torch.device) -> Callable[[], float]:
    """The clock step costs are compared on: a single-threaded CPU engine's thread CPU time, steady when other
    jobs share the cores (the ratio of costs is what matters); elsewhere wall time (a GPU runs asynchronously
    to this thread)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


class StepTimer:
    """The one owner of an engine's step timing: the whole step (drafting included, and the gap since the
    previous step when steps run back to back: what the choice of k really trades), the forward and sampling
    on `clock`, and the busy seconds (wall time, for cost accounting)."""

    BACK_TO_BACK_S = 0.005  # a step starting this soon after the previous one ended continues its clock

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.busy_s = 0.0
        self._step0 = 0.0
        self._t0 = 0.0
        self._busy0 = 0.0
        self._last_end: float | None = None

    def step_started(self) -> None:
        now = self.clock()
        if self._last_end is not None and now - self._last_end < self.BACK_TO_BACK_S:
            now = self._last_end
        self._step0 = now
        self._last_end = None

    def forward_started(self) -> None:
        self._t0 = self.clock()
        self._busy0 = time.perf_counter()

    def forward_failed(self) -> None:
        self.busy_s += time.perf_counter() - self._busy0

    def step_finished(self) -> tuple[float, float]:
        """(seconds since `forward_started`, seconds of the whole step) on `clock`."""
        self.busy_s += time.perf_counter() - self._busy0
        now = self.clock()
        self._last_end = now
        return now - self._t0, now - self._step0
