"""Workload definitions: the mixes shipped in `traces/data/workload_mixes.json`, per-request length specs,
prefix-sharing structure (hash-id chains, as in Mooncake traces) and length scaling to a model's context.

A workload is a list of `RequestSpec` (token lengths and shared-prefix blocks); arrivals and prompts are
added by `traces.arrivals` and `traces.prompts`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

MIXES_PATH = Path(__file__).parent / "data" / "workload_mixes.json"


class WorkloadError(ValueError):
    """A workload name, file or parameter that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class RequestSpec:
    """One request's shape: exact prompt and output token counts, shared-prefix blocks and trace timing."""

    index: int
    input_tokens: int
    output_tokens: int
    # Ids of prompt blocks of `block_tokens` tokens each: equal ids at equal positions are the same text,
    # so requests sharing a hash-id prefix share a real prompt prefix (prefix-cache hits on the server).
    hash_ids: tuple[int, ...] = ()
    block_tokens: int = 512
    timestamp_s: float | None = None  # arrival time from a trace, seconds from the trace's first request


@lru_cache(maxsize=1)
def load_mixes() -> dict[str, Any]:
    return json.loads(MIXES_PATH.read_text())


def workload_names() -> list[str]:
    """Every name `--workload` accepts: the mixes plus the fixed-shape controls."""
    mixes = load_mixes()["mixes"]
    return [n for n in mixes if n != "controls"] + list(mixes["controls"])


def default_arrivals(name: str) -> dict[str, Any]:
    """The arrival process the mix was measured with (a dict with at least `process`)."""
    mixes = load_mixes()["mixes"]
    if name in mixes and "arrivals" in mixes[name]:
        return dict(mixes[name]["arrivals"])
    return {"process": "poisson"}


def quantile_sampler(table: dict[str, float]):
    """Inverse-CDF sampler from a {percentile: value} table with linear interpolation between points."""
    points = sorted((float(p), float(v)) for p, v in table.items())
    ps = np.array([p for p, _ in points]) / 100.0
    vs = np.array([v for _, v in points])

    def sample(rng: np.random.Generator, n: int) -> np.ndarray:
        # Below the first listed percentile np.interp clamps to its value (the tables start at p1).
        return np.maximum(1, np.rint(np.interp(rng.random(n), ps, vs))).astype(int)

    return sample


def build_workload(name: str, num_requests: int, seed: int = 0) -> list[RequestSpec]:
    """`num_requests` specs of the named mix (lengths sampled independently, see the data file's note)."""
    if num_requests < 0:
        raise WorkloadError(f"num_requests must be >= 0, got {num_requests}")
    mixes = load_mixes()["mixes"]
    rng = np.random.default_rng(seed)
    if name in mixes["controls"]:
        c = mixes["controls"][name]
        return [RequestSpec(i, int(c["input"]), int(c["output"])) for i in range(num_requests)]
    if name not in mixes or name == "controls":
        raise WorkloadError(f"unknown workload {name!r}; choose one of: {', '.join(workload_names())}")
    mix = mixes[name]
    ins = quantile_sampler(mix["input_quantiles"])(rng, num_requests)
    outs = quantile_sampler(mix["output_quantiles"])(rng, num_requests)
    specs = [RequestSpec(i, int(a), int(b)) for i, (a, b) in enumerate(zip(ins, outs))]
    sharing = mix.get("prefix_sharing")
    if sharing:
        specs = assign_prefix_blocks(specs, int(sharing["block_tokens"]),
                                     float(sharing["reusable_prefix_fraction"]), rng)
    return specs


def assign_prefix_blocks(specs: list[RequestSpec], block_tokens: int, reusable_fraction: float,
                         rng: np.random.Generator, num_sessions: int | None = None) -> list[RequestSpec]:
    """Give each request a hash-id chain so about `reusable_fraction` of its full blocks repeat earlier text.

    Block 0 (a system prompt) is shared by all; the rest of the reused prefix continues one of a pool of
    sessions (multi-turn conversations whose history grows), the remainder is fresh per request.
    """
    num_sessions = num_sessions or max(1, len(specs) // 16)
    sessions: list[list[int]] = [[] for _ in range(num_sessions)]
    next_id = 1
    out = []
    for spec in specs:
        full = spec.input_tokens // block_tokens
        reused = min(full, max(1, round(full * reusable_fraction))) if full else 0
        chain: list[int] = [0] if reused >= 1 else []
        # Continue a conversation long enough for this turn when one of a few sampled sessions is.
        picks = [sessions[int(i)] for i in rng.integers(num_sessions, size=8)]
        history = next((h for h in picks if len(h) >= reused - 1), max(picks, key=len))
        while len(history) < reused - 1:
            history.append(next_id)
            next_id += 1
        chain += history[: max(0, reused - 1)]
        fresh = math.ceil(spec.input_tokens / block_tokens) - len(chain)
        chain += list(range(next_id, next_id + fresh))
        next_id += fresh
        out.append(replace(spec, hash_ids=tuple(chain), block_tokens=block_tokens))
    return out


@dataclass(frozen=True)
class Scaling:
    """How lengths were fitted to the served model's context (reported in the run metadata)."""

    factor: float
    max_model_len: int | None
    clipped: int  # requests still cut after scaling (their prompt was shortened to fit)


def fit_to_context(specs: list[RequestSpec], max_model_len: int | None, *, reserve: int = 8,
                   quantile: float = 99.0) -> tuple[list[RequestSpec], Scaling]:
    """Scale every length by one factor so the `quantile` of prompt+output fits `max_model_len - reserve`.

    One factor keeps the mix's shape (ratios between requests, input/output balance). `reserve` leaves room
    for tokens the server adds (BOS, chat template). Requests still too long afterwards have their prompt
    cut. Outputs keep at least 2 tokens when they had 2, so TPOT stays defined.
    """
    if not specs or max_model_len is None:
        return specs, Scaling(1.0, max_model_len, 0)
    budget = max_model_len - reserve
    if budget < 3:
        raise WorkloadError(f"max_model_len {max_model_len} leaves no room for a prompt (reserve {reserve})")
    totals = np.array([s.input_tokens + s.output_tokens for s in specs])
    factor = min(1.0, budget / float(np.percentile(totals, quantile)))
    clipped = 0
    out = []
    for s in specs:
        inp = max(1, round(s.input_tokens * factor))
        outp = max(min(s.output_tokens, 2), round(s.output_tokens * factor))
        outp = min(outp, budget - 1)
        if inp + outp > budget:
            inp = budget - outp
            clipped += 1
        block = max(1, round(s.block_tokens * factor))
        ts = s.timestamp_s
        out.append(RequestSpec(s.index, inp, outp, s.hash_ids, block, ts))
    return out, Scaling(factor, max_model_len, clipped)
