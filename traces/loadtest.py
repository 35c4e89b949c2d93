"""One load test and a rate sweep: turns a workload or trace into a timed plan of prompts, runs it with the
open-loop client while scraping /metrics, and writes the report (JSON, Markdown, plots) for each rate.
"""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from traces.arrivals import make_arrivals, trace_arrivals
from traces.client import PlannedRequest, RequestRecord, run_requests
from traces.metrics import Slo, highest_passing_rate, summarise
from traces.readers import read_trace
from traces.report import markdown_summary, plot_run, plot_sweep, sweep_markdown, write_json
from traces.server_metrics import MetricsScraper
from traces.workloads import RequestSpec, WorkloadError, build_workload, default_arrivals, fit_to_context


@dataclass
class LoadTestConfig:
    """Everything one `tandem loadtest` invocation needs (the CLI fills it; tests build it directly)."""

    url: str
    out: Path
    workload: str | None = None
    trace: str | None = None
    trace_format: str = "auto"
    rate: float | None = None
    duration_s: float | None = 60.0
    models: list[str] = field(default_factory=lambda: ["auto"])
    slos: dict[str, Slo] = field(default_factory=dict)
    price_per_hour: float | None = None
    api_key: str | None = None
    api: str = "completions"
    tokenizer: str | None = None
    max_model_len: int | None = None
    arrivals: str | None = None  # poisson | gamma | on_off | trace; default: the workload's own
    burstiness: float | None = None
    time_scale: float = 1.0
    trace_jitter_s: float = 0.0
    concurrency: int | None = None
    warmup_s: float = 0.0
    cooldown_s: float = 0.0
    seed: int = 0  # arrivals and lengths
    # Prompt text. None: a fresh random seed per run, so prompts of an earlier run (or an earlier sweep
    # point) cannot hit the server's warm prefix cache and flatter the numbers; recorded in the report.
    prompt_seed: int | None = None
    timeout_s: float = 600.0
    temperature: float | None = 0.0
    scrape_interval_s: float = 1.0
    plots: bool = True
    progress: bool = False


def _pick_process(cfg: LoadTestConfig) -> tuple[str, float | None]:
    if cfg.arrivals:
        return cfg.arrivals, cfg.burstiness
    if cfg.trace:
        return "trace", cfg.burstiness
    shape = default_arrivals(cfg.workload or "")
    process = {"gamma": "gamma", "on_off_gamma": "on_off", "poisson": "poisson"}.get(shape["process"], "poisson")
    burst = cfg.burstiness or shape.get("shape") or shape.get("shape_within_bursts")
    return process, burst


def build_plan(cfg: LoadTestConfig, rate: float | None, max_model_len: int | None,
               prompt_seed: int = 0) -> tuple[list[PlannedRequest], dict[str, Any]]:
    """The timed requests of one run, and metadata saying how they were made."""
    warnings: list[str] = []
    process, burst = _pick_process(cfg)
    if cfg.trace:
        specs = read_trace(cfg.trace, cfg.trace_format)
        if process == "trace":
            at = trace_arrivals([s.timestamp_s or 0.0 for s in specs], time_scale=cfg.time_scale, rate=rate,
                                jitter_s=cfg.trace_jitter_s, seed=cfg.seed)
        else:
            if rate is None:
                raise WorkloadError(f"--arrivals {process} needs --rate")
            at = make_arrivals(process, rate, cfg.duration_s or 60.0, burstiness=burst, seed=cfg.seed)
            specs = [specs[i % len(specs)] for i in range(len(at))]  # trace lengths, synthetic timing
        source = f"trace {Path(cfg.trace).name}"
    else:
        if cfg.workload is None:
            raise WorkloadError("give --workload NAME or --trace FILE")
        if rate is None:
            raise WorkloadError("--workload needs --rate (or --sweep)")
        if process == "trace":
            raise WorkloadError("--arrivals trace needs --trace FILE")
        at = make_arrivals(process, rate, cfg.duration_s or 60.0, burstiness=burst, seed=cfg.seed)
        specs = build_workload(cfg.workload, len(at), cfg.seed)
        source = f"workload {cfg.workload}"
    pairs = [(float(t), s) for t, s in zip(at, specs) if cfg.duration_s is None or t < cfg.duration_s]
    specs, scaling = fit_to_context([s for _, s in pairs], max_model_len)
    if max_model_len is None:
        warnings.append("the served context length is unknown (no --max-model-len, none in /v1/models): "
                        "lengths are not scaled, and requests longer than the context will fail")
    if scaling.factor < 1.0:
        warnings.append(f"lengths scaled by {scaling.factor:.4f} to fit max_model_len {max_model_len}"
                        + (f"; {scaling.clipped} prompts cut" if scaling.clipped else ""))
    synth = _synthesizer(cfg, prompt_seed, warnings)
    plan = []
    for i, ((t, _), spec) in enumerate(zip(pairs, specs)):
        spec = RequestSpec(i, spec.input_tokens, spec.output_tokens, spec.hash_ids, spec.block_tokens)
        plan.append(PlannedRequest(i, t, cfg.models[i % len(cfg.models)], synth.prompt(spec),
                                   spec.input_tokens, spec.output_tokens))
    if cfg.duration_s is not None:
        span = cfg.duration_s
    else:  # a whole trace: n requests take n mean gaps, so the last one lies inside the window
        span = plan[-1].at_s * len(plan) / (len(plan) - 1) if len(plan) > 1 and plan[-1].at_s > 0 else 1.0
    meta = {
        "source": source, "url": cfg.url, "api": cfg.api, "models": cfg.models,
        "rate_label": f"{rate:g} req/s" if rate is not None else f"trace time x{cfg.time_scale:g}",
        "rate": rate,
        "arrivals": process + (f" (burstiness {burst:g})" if burst and process != "trace" else ""),
        "planned_requests": len(plan), "span_s": span, "seed": cfg.seed, "prompt_seed": prompt_seed,
        "concurrency": cfg.concurrency,
        "lengths": (f"exact token counts for {cfg.tokenizer}" if cfg.tokenizer else
                    "approximate (no --tokenizer: one word per intended token; see usage for real counts)"),
        "scaling": {"factor": scaling.factor, "max_model_len": max_model_len, "clipped": scaling.clipped},
        "warnings": warnings,
    }
    return plan, meta


def _synthesizer(cfg: LoadTestConfig, seed: int, warnings: list[str]):
    from traces.prompts import PromptSynthesizer, WordPrompts

    if cfg.tokenizer:
        return PromptSynthesizer(cfg.tokenizer, seed=seed)
    warnings.append("no --tokenizer: prompt lengths are approximate (the server's usage has the real counts)")
    return WordPrompts(seed=seed)


async def discover_max_model_len(cfg: LoadTestConfig) -> int | None:
    """The context length from --max-model-len, else from GET /v1/models (vLLM's `max_model_len` field)."""
    if cfg.max_model_len:
        return cfg.max_model_len
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            resp = await client.get(cfg.url.rstrip("/") + "/v1/models", headers=headers)
        data = resp.json().get("data", []) if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return None
    known = {m.get("id"): m.get("max_model_len") for m in data if isinstance(m, dict)}
    targeted = [known.get(name) for name in cfg.models]
    # A route may not state a length (it spans engines): then the smallest any served model takes.
    lens = [n for n in targeted if isinstance(n, int)] if all(isinstance(n, int) for n in targeted) else [
        n for n in known.values() if isinstance(n, int)]
    return min(lens) if lens else None


def _prompt_seed(cfg: LoadTestConfig, point: int) -> int:
    return random.randrange(2**31) if cfg.prompt_seed is None else cfg.prompt_seed + point


async def run_once(cfg: LoadTestConfig, rate: float | None, out: Path, max_model_len: int | None,
                   point: int = 0) -> dict[str, Any]:
    """One load test at `rate`; writes report.json, summary.md and plots under `out`; returns the report."""
    plan, meta = build_plan(cfg, rate, max_model_len, _prompt_seed(cfg, point))
    scraper = MetricsScraper(cfg.url, cfg.scrape_interval_s)
    result = await run_requests(cfg.url, plan, api=cfg.api, api_key=cfg.api_key, concurrency=cfg.concurrency,
                                timeout_s=cfg.timeout_s, temperature=cfg.temperature, progress=cfg.progress,
                                during=scraper.run)
    async with httpx.AsyncClient() as client:  # a last scrape so counter deltas cover the whole run
        await scraper.scrape_once(client, cfg.url.rstrip("/") + "/metrics", result.elapsed_s)
    span = meta["span_s"]
    window = (cfg.warmup_s, max(cfg.warmup_s, span - cfg.cooldown_s))
    summary = summarise(result.records, window=window, slos=cfg.slos, price_per_hour=cfg.price_per_hour)
    if result.lag_warning:
        meta["warnings"].append(result.lag_warning)
    meta.update(started_unix=result.started_unix, elapsed_s=result.elapsed_s,
                connections_opened=result.connections_opened,
                slos={k: vars(v) for k, v in cfg.slos.items()})
    server = scraper.summary()
    if not server["available"]:
        meta["warnings"].append(f"server metrics unavailable: {server['reason']}")
    report = {"metadata": meta, "summary": summary, "server_metrics": server,
              "records": [r.to_dict() for r in result.records]}
    out.mkdir(parents=True, exist_ok=True)
    if cfg.plots:
        plots = plot_run(out, result.records, server)
        if isinstance(plots, str):
            meta["warnings"].append(plots)
        meta["plots"] = plots if isinstance(plots, list) else []
    write_json(out / "report.json", report)
    (out / "summary.md").write_text(markdown_summary(report))
    return report


def sweep_point(rate: float, report: dict[str, Any]) -> dict[str, Any]:
    s = report["summary"]
    return {"rate": rate, **s["requests"], "offered_rate_rps": s["offered_rate_rps"],
            "slo_attainment": s.get("slo_attainment"),
            "goodput_rps": s.get("goodput_rps"), "request_throughput_rps": s["request_throughput_rps"],
            "output_token_throughput_tps": s["output_token_throughput_tps"],
            "ttft_p50_ms": s["overall"]["ttft_ms"]["p50"], "ttft_p99_ms": s["overall"]["ttft_ms"]["p99"],
            "tpot_p50_ms": s["overall"]["tpot_ms"]["p50"], "tpot_p99_ms": s["overall"]["tpot_ms"]["p99"]}


async def run_sweep(cfg: LoadTestConfig, rates: list[float]) -> dict[str, Any]:
    """One run per rate (lowest first) into `out/rate_<R>/`, then the goodput curve into `out/`."""
    max_len = await discover_max_model_len(cfg)
    points = []
    for point, rate in enumerate(sorted(rates)):
        if cfg.progress:
            print(f"rate {rate:g} req/s", file=sys.stderr)
        report = await run_once(cfg, rate, cfg.out / f"rate_{rate:g}", max_len, point)
        points.append(sweep_point(rate, report))
    source = f"workload {cfg.workload}" if cfg.workload else f"trace {Path(cfg.trace or '').name}"
    sweep = {"source": source, "points": points, "slos": {k: vars(v) for k, v in cfg.slos.items()},
             "max_rate_at_90": highest_passing_rate(points, 0.90) if cfg.slos else None,
             "max_rate_at_99": highest_passing_rate(points, 0.99) if cfg.slos else None}
    if cfg.plots:
        plots = plot_sweep(cfg.out, points)
        sweep["plots"] = plots if isinstance(plots, list) else []
        if isinstance(plots, str):
            sweep["warning"] = plots
    write_json(cfg.out / "sweep.json", sweep)
    (cfg.out / "sweep.md").write_text(sweep_markdown(sweep))
    return sweep


async def run_single(cfg: LoadTestConfig) -> dict[str, Any]:
    return await run_once(cfg, cfg.rate, cfg.out, await discover_max_model_len(cfg))


def load_records(report: dict[str, Any]) -> list[RequestRecord]:
    """Records back from a report.json (for re-analysis)."""
    return [RequestRecord.from_dict(d) for d in report["records"]]


def run(cfg: LoadTestConfig, sweep: list[float] | None = None) -> dict[str, Any]:
    return asyncio.run(run_sweep(cfg, sweep) if sweep else run_single(cfg))
