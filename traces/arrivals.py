"""Open-loop arrival processes: Poisson, gamma with a burstiness factor, on/off bursts and trace timestamps.

Each returns send offsets in seconds from the start of the run, sorted; the load generator fires at these
times whatever the server's state (open loop), so a slow server sees its queue grow as real users make it.
"""

from __future__ import annotations

import numpy as np

from traces.workloads import WorkloadError


def gamma_arrivals(rate: float, duration_s: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Gamma inter-arrival times with mean 1/rate and shape `burstiness` (1.0 = Poisson; < 1 burstier).

    The coefficient of variation of the gaps is 1/sqrt(burstiness), as in vLLM's benchmark.
    """
    if rate <= 0 or duration_s <= 0 or burstiness <= 0:
        raise WorkloadError(f"rate, duration and burstiness must be > 0 (got {rate}, {duration_s}, {burstiness})")
    rng = np.random.default_rng(seed)
    expected = rate * duration_s
    n = int(expected + 10 * np.sqrt(expected / burstiness) + 20)
    times = np.cumsum(rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n))
    while times[-1] < duration_s:  # rare: draw more until the window is covered
        more = np.cumsum(rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)) + times[-1]
        times = np.concatenate([times, more])
    return times[times < duration_s]


def poisson_arrivals(rate: float, duration_s: float, seed: int = 0) -> np.ndarray:
    return gamma_arrivals(rate, duration_s, 1.0, seed)


def on_off_arrivals(rate: float, duration_s: float, *, off_fraction: float = 0.2, period_s: float = 10.0,
                    burstiness: float = 0.2, seed: int = 0) -> np.ndarray:
    """Bursts separated by idle periods: on/off period lengths are exponential (means (1-f)*P and f*P).

    Within on periods arrivals are gamma(`burstiness`) at rate / (1 - f), so the long-run mean rate is
    `rate`; off periods have no arrivals (Azure code: about 20% idle minutes, bursty within bursts).
    """
    if not 0 <= off_fraction < 1 or period_s <= 0:
        raise WorkloadError(f"off_fraction must be in [0, 1) and period_s > 0 (got {off_fraction}, {period_s})")
    rng = np.random.default_rng(seed + 1)
    # Lay out on/off segments over the wall-clock window; map "active time" arrivals into the on segments.
    on_starts, on_lengths, t, active = [], [], 0.0, 0.0
    while t < duration_s:
        on = rng.exponential((1 - off_fraction) * period_s)
        on_starts.append(t)
        on_lengths.append(on)
        active += on
        t += on + (rng.exponential(off_fraction * period_s) if off_fraction > 0 else 0.0)
    if active <= 0:
        return np.empty(0)
    active_times = gamma_arrivals(rate / (1 - off_fraction), active, burstiness, seed)
    cum = np.concatenate([[0.0], np.cumsum(on_lengths)])
    seg = np.searchsorted(cum, active_times, side="right") - 1
    wall = np.asarray(on_starts)[seg] + (active_times - cum[seg])
    return np.sort(wall[wall < duration_s])


def trace_arrivals(timestamps: np.ndarray | list[float], *, time_scale: float = 1.0,
                   rate: float | None = None, jitter_s: float = 0.0, seed: int = 0) -> np.ndarray:
    """Replay trace timestamps: multiplied by `time_scale`, or rescaled to mean `rate` requests/s if given.

    `jitter_s` spreads requests uniformly inside quantised buckets (Mooncake timestamps are ~3 s buckets).
    """
    ts = np.sort(np.asarray(timestamps, dtype=float))
    if ts.size == 0:
        return ts
    ts = ts - ts[0]
    if jitter_s > 0:
        ts = np.sort(ts + np.random.default_rng(seed).uniform(0, jitter_s, ts.size))
        ts = ts - ts[0]
    if rate is not None:
        if rate <= 0:
            raise WorkloadError(f"rate must be > 0, got {rate}")
        span = ts[-1] if ts[-1] > 0 else 1.0
        # (n - 1) gaps over the span: mean gap becomes 1/rate.
        time_scale = (ts.size - 1) / (rate * span) if ts.size > 1 else 1.0
    if time_scale <= 0:
        raise WorkloadError(f"time_scale must be > 0, got {time_scale}")
    return ts * time_scale


def make_arrivals(process: str, rate: float, duration_s: float, *, burstiness: float | None = None,
                  seed: int = 0, **kwargs) -> np.ndarray:
    """Arrivals by name: poisson | gamma | on_off (trace replay goes through `trace_arrivals`)."""
    if process == "poisson":
        return poisson_arrivals(rate, duration_s, seed)
    if process == "gamma":
        return gamma_arrivals(rate, duration_s, burstiness or 1.0, seed)
    if process in ("on_off", "on_off_gamma"):
        return on_off_arrivals(rate, duration_s, burstiness=burstiness or 0.2, seed=seed, **kwargs)
    raise WorkloadError(f"unknown arrival process {process!r}; choose poisson, gamma, on_off or trace")
