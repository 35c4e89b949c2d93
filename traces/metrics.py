"""Load-test statistics with vLLM's conventions: TTFT, TPOT, pooled ITL, E2E percentiles, throughput,
SLO attainment per dimension and combined, goodput (failed and shed count as misses), routing split,
escalation rate and cost per 1,000 tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from traces.client import RequestRecord

PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)


@dataclass(frozen=True)
class Slo:
    """Per-route latency objectives in milliseconds; None means not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def dims(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2e", self.e2e_ms))
                if v is not None}


def parse_slo(text: str) -> tuple[str, Slo]:
    """`ROUTE:ttft=MS,tpot=MS[,e2e=MS]` (or without `ROUTE:` for every route, stored as "*")."""
    route, sep, spec = text.rpartition(":")
    if not sep:
        route, spec = "*", text
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, eq, val = part.partition("=")
        if not eq or key not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"--slo {text!r}: expected ROUTE:ttft=MS,tpot=MS[,e2e=MS], got part {part!r}")
        try:
            values[f"{key}_ms"] = float(val)
        except ValueError:
            raise ValueError(f"--slo {text!r}: {key} must be a number of milliseconds, got {val!r}") from None
    if not values:
        raise ValueError(f"--slo {text!r}: give at least one of ttft=, tpot=, e2e=")
    return route or "*", Slo(**values)


def percentiles(values: Iterable[float], scale: float = 1000.0) -> dict[str, float | int | None]:
    """p50/p90/p95/p99/p99.9, mean and max of `values` (seconds in, milliseconds out by default)."""
    arr = np.asarray([v for v in values if v is not None], dtype=float) * scale
    out: dict[str, float | int | None] = {"count": int(arr.size)}
    if arr.size == 0:
        out.update({f"p{p:g}": None for p in PERCENTILES} | {"mean": None, "max": None})
        return out
    for p in PERCENTILES:
        out[f"p{p:g}"] = float(np.percentile(arr, p))
    out["mean"] = float(arr.mean())
    out["max"] = float(arr.max())
    return out


def route_of(rec: RequestRecord) -> str:
    """The route that served the request: the server's x-tandem-route header, else the requested model."""
    return rec.route or rec.model


def slo_for(route: str, slos: dict[str, Slo]) -> Slo | None:
    return slos.get(route) or slos.get("*")


def meets(rec: RequestRecord, slo: Slo | None) -> dict[str, bool]:
    """Per-dimension pass/fail of one request; anything not completed misses every dimension."""
    if slo is None:
        return {}
    ok = rec.outcome == "completed"
    measured = {"ttft": rec.ttft_s, "tpot": rec.tpot_s, "e2e": rec.e2e_s}
    out = {}
    for dim, limit_ms in slo.dims().items():
        v = measured[dim]
        # A one-token answer has no TPOT: it cannot break a TPOT objective.
        out[dim] = ok and (v is None and dim == "tpot" or v is not None and v * 1000.0 <= limit_ms)
    return out


def latency_stats(records: list[RequestRecord]) -> dict[str, Any]:
    done = [r for r in records if r.outcome == "completed"]
    return {
        "ttft_ms": percentiles(r.ttft_s for r in done),
        "tpot_ms": percentiles(r.tpot_s for r in done),
        "itl_ms": percentiles(g for r in done for g in r.itl_s),
        "e2e_ms": percentiles(r.e2e_s for r in done),
    }


def in_window(records: list[RequestRecord], start_s: float, end_s: float) -> list[RequestRecord]:
    """Requests scheduled inside [start, end): warm-up and cool-down traffic is sent but not counted."""
    return [r for r in records if start_s <= r.scheduled_s < end_s]


def summarise(records: list[RequestRecord], *, window: tuple[float, float], slos: dict[str, Slo] | None = None,
              price_per_hour: float | None = None) -> dict[str, Any]:
    """The report's numbers for the requests scheduled in `window` (seconds from the start)."""
    slos = slos or {}
    start, end = window
    length = max(end - start, 1e-9)
    rs = in_window(records, start, end)
    outcomes = Counter(r.outcome for r in rs)
    done = [r for r in rs if r.outcome == "completed"]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_tokens_target for r in done)

    per_route: dict[str, Any] = {}
    met_all = 0
    for route in sorted({route_of(r) for r in rs}):
        group = [r for r in rs if route_of(r) == route]
        slo = slo_for(route, slos)
        counts = Counter(r.outcome for r in group)
        entry: dict[str, Any] = {"requests": len(group), "completed": counts["completed"],
                                 "failed": counts["failed"], "shed": counts["shed"], **latency_stats(group)}
        if slo is not None:
            checks = [meets(r, slo) for r in group]
            entry["slo"] = {k: v for k, v in vars(slo).items() if v is not None} | {
                "attainment": {d: sum(c[d] for c in checks) / len(group) for d in slo.dims()},
            }
            met = sum(all(c.values()) for c in checks)
            entry["slo"]["attainment"]["combined"] = met / len(group)
            met_all += met
        per_route[route] = entry

    has_slo = any(slo_for(route_of(r), slos) is not None for r in rs)
    escalation_known = [r for r in done if r.escalated is not None]
    served = Counter(r.served_model for r in done if r.served_model)
    summary: dict[str, Any] = {
        "window_s": [start, end],
        "requests": {"sent": len(rs), "completed": outcomes["completed"], "failed": outcomes["failed"],
                     "shed": outcomes["shed"]},
        "request_throughput_rps": len(done) / length,
        "output_token_throughput_tps": out_tokens / length,
        "total_token_throughput_tps": (out_tokens + in_tokens) / length,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "overall": latency_stats(rs),
        "per_route": per_route,
        "routing_split": {m: n / len(done) for m, n in sorted(served.items())} if served else None,
        "escalation_rate": (sum(bool(r.escalated) for r in escalation_known) / len(escalation_known)
                            if escalation_known else None),
        "offered_rate_rps": len(rs) / length,
    }
    if has_slo:
        summary["slo_attainment"] = met_all / len(rs) if rs else None
        summary["goodput_rps"] = met_all / length
    if price_per_hour is not None:
        cost = price_per_hour * length / 3600.0
        summary["cost"] = {
            "price_per_hour_usd": price_per_hour,
            "usd": cost,
            "usd_per_1k_output_tokens": cost / (out_tokens / 1000.0) if out_tokens else None,
            "usd_per_1k_total_tokens": cost / ((out_tokens + in_tokens) / 1000.0) if out_tokens + in_tokens else None,
        }
    return summary


def highest_passing_rate(points: list[dict[str, Any]], target: float) -> float | None:
    """The highest offered rate whose SLO attainment is at least `target`, below the first rate that fails.

    Stopping at the first failure keeps a lucky point past the knee of the curve from being reported.
    """
    best = None
    for p in sorted(points, key=lambda p: p["rate"]):
        att = p.get("slo_attainment")
        if att is None or att < target:
            break
        best = p["rate"]
    return best
