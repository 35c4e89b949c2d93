"""Speculation in the server on the memory-bound pair: `tandem serve` of training/widen.py's widened tandem-tiny-l
with and without tandem-tiny-s drafting (w8a8), both servers up at once and measured alternately by the same
closed-loop streaming client, on windows of held-out standard-library modules (bench/speculative.py's prompts):
client-measured output tokens/s and TPOT p50 / p99 at 1, 8 and 32 streams (greedy) and at 1 stream with
temperature 0.8. The ratio per cell is the median over rounds of speculative / plain (each round runs both,
the order swapped every round); beside it the same ratio of tokens per second of each server's own CPU time,
which neighbours on a shared machine move much less than wall-clock rates, and the TPOT p99 over all rounds'
requests pooled per server with a bootstrap interval of its ratio. Prints a table, writes
bench/results/spec_server_wide.json.

    .venv/bin/python bench/spec_server.py [--streams 1 8 32] [--rounds 2] [--seconds 20] [--max-tokens 64]
        [--threads 1] [--wide-factor 5] [--draft-quantization w8a8] [--k 4] [--aa] [--swap-starts] [--rates 3 5]
        [--concurrent]

`--rates`: open-loop cells, requests arriving at Poisson times (the same times for both servers in a round).
A closed loop of equal requests keeps plain decoding's requests in lockstep (they start, prefill and end
together, so none decodes while another prefills); speculation's accepted drafts break the lockstep and its
requests then share steps with others' prefills, which raises its TPOT tail for a reason traffic that does not
arrive in lockstep does not have (bench/spec_tail.py --trace shows it step by step).

`--concurrent` runs both servers at once under the same load, each pinned to one core of two (swapped every
round): the slow spells of a shared VM (compute 40-70% slower for seconds, on both cores at once) then fall on
both servers alike instead of on whichever ran at the time.

`--aa` starts the second server without its draft: the same table then compares two identical plain servers,
the spread a ratio of this harness has on this machine when nothing differs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from bench.speculative import SMALL, prompts_from_heldout  # noqa: E402
from bench.vs_llamacpp import free_port, server_cpu_s, wait_ready  # noqa: E402
from engines.tokenizer import Tokenizer  # noqa: E402
from training.widen import DEFAULT_FACTOR, cached_wide  # noqa: E402


def start(folder: Path, threads: int, ctx: int, log: Path, draft: Path | None, draft_quant: str, k: int):
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", str(folder), "--served-model-name", "tandem",
           "--port", str(port), "--max-model-len", str(ctx), "--log-level", "warning"]
    if draft is not None:
        cmd += ["--draft", str(draft), "--draft-quantization", draft_quant, "--num-speculative-tokens", str(k)]
    env = dict(os.environ, TANDEM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    wait_ready(f"http://127.0.0.1:{port}/ready", proc, timeout=300)
    return proc, f"http://127.0.0.1:{port}"


async def one_request(client, url: str, prompt: list[int], max_tokens: int, temperature: float) -> dict:
    body = {"model": "tandem", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
    if not times:
        raise RuntimeError(f"{url}: no tokens streamed")
    # a chunk can carry several tokens (a verified window): TPOT over the tokens, not the chunks
    return {"ttft": times[0] - t0, "tpot": (times[-1] - times[0]) / max(max_tokens - 1, 1), "tokens": max_tokens}


async def closed_loop(url: str, prompts: list[list[int]], streams: int, max_tokens: int, temperature: float,
                      seconds: float) -> dict:
    import httpx

    results: list[dict] = []
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        stop = t0 + seconds

        async def worker(w: int) -> None:
            i = w
            while time.perf_counter() < stop:
                results.append(await one_request(client, url, prompts[i % len(prompts)], max_tokens, temperature))
                i += streams

        await asyncio.gather(*(worker(w) for w in range(streams)))
        wall = time.perf_counter() - t0
    return summary(results, wall)


def summary(results: list[dict], wall: float) -> dict:
    """A run's requests (`one_request`'s results) over `wall` seconds: tok/s, TTFT p50, TPOT p50 / p99."""
    pct = {q: lambda key, q=q: 1e3 * float(np.percentile([r[key] for r in results], q)) for q in (50, 99)}
    return {"requests": len(results), "tok_s": sum(r["tokens"] for r in results) / wall, "wall_s": wall,
            "ttft_p50_ms": pct[50]("ttft"), "tpot_p50_ms": pct[50]("tpot"), "tpot_p99_ms": pct[99]("tpot"),
            "tpots_ms": [1e3 * r["tpot"] for r in results]}


async def open_loop(url: str, prompts: list[list[int]], rate: float, max_tokens: int, temperature: float,
                    seconds: float, seed: int) -> dict:
    """Requests arriving at Poisson times of `rate` per second for `seconds` (the same times for a given
    `seed`), whatever the server's pace; the results of `closed_loop`, the wall time running until the last
    request ends."""
    import httpx

    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate, int(seconds * rate * 2) + 10))
    times = times[times < seconds]
    results: list[dict] = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)) as client:
        t0 = time.perf_counter()

        async def arrive(i: int, at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            results.append(await one_request(client, url, prompts[i % len(prompts)], max_tokens, temperature))

        await asyncio.gather(*(arrive(i, float(at)) for i, at in enumerate(times)))
        wall = time.perf_counter() - t0
    return summary(results, wall)


def round_ratio(runs: dict[str, list[dict]], key: str) -> dict:
    """Speculative / plain of `key` per round, their geometric mean and its 95% t-interval over rounds: rounds,
    not requests, are the independent draws (a round's requests share its minute of the machine)."""
    logs = np.log([s[key] / p[key] for s, p in zip(runs["spec"], runs["plain"])])
    n = logs.size
    half = 0.0
    if n > 1:
        from scipy import stats

        half = float(stats.t.ppf(0.975, n - 1) * logs.std(ddof=1) / np.sqrt(n))
    m = float(logs.mean())
    return {"rounds": [float(x) for x in np.exp(logs)], "geomean": float(np.exp(m)),
            "ci95": [float(np.exp(m - half)), float(np.exp(m + half))]}


def pin(pid: int, core: int) -> None:
    """Every thread of process `pid` onto `core` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), {core})


def pooled_p99(runs: dict[str, list[dict]], resamples: int = 2000, seed: int = 0) -> dict:
    """TPOT p99 over every round's requests of each server (a round's p99 is its slowest one or two requests at
    32 streams), their ratio speculative / plain, and its 95% bootstrap interval (requests resampled per server)."""
    tpots = {name: np.asarray([t for run in v for t in run["tpots_ms"]]) for name, v in runs.items()}
    p99 = {name: float(np.percentile(t, 99)) for name, t in tpots.items()}
    rng = np.random.default_rng(seed)
    boot = [np.percentile(rng.choice(tpots["spec"], tpots["spec"].size), 99)
            / np.percentile(rng.choice(tpots["plain"], tpots["plain"].size), 99) for _ in range(resamples)]
    return {"requests": {k: int(t.size) for k, t in tpots.items()}, "tpot_p99_ms": p99,
            "ratio": p99["spec"] / p99["plain"], "ratio_ci95": [float(np.percentile(boot, 2.5)),
                                                               float(np.percentile(boot, 97.5))]}


async def greedy_text(url: str, prompt: list[int], n: int) -> str:
    import httpx

    async with httpx.AsyncClient() as client:
        r = await client.post(url + "/v1/completions", json={"model": "tandem", "prompt": prompt, "max_tokens": n,
                                                             "temperature": 0, "ignore_eos": True}, timeout=300)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--sampled-streams", type=int, nargs="*", default=[1], help="stream counts also run at T=0.8")
    ap.add_argument("--rates", type=float, nargs="*", default=[],
                    help="open-loop cells: requests per second at Poisson times, the same times for both servers "
                         "in a round (closed loops of equal requests keep them in lockstep, see docs/benchmarks.md)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0, help="closed-loop seconds per run")
    ap.add_argument("--warmup-seconds", type=float, default=6.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wide-factor", type=int, default=DEFAULT_FACTOR)
    ap.add_argument("--draft-quantization", default="w8a8", choices=["none", "int8", "w8a8"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--aa", action="store_true", help="the 'speculative' server without its draft: two identical "
                    "plain servers, the ratios this harness gives when nothing differs (the run's noise floor)")
    ap.add_argument("--swap-starts", action="store_true", help="restart both servers every round, the one started "
                    "first alternating (cancels a bias of start order between two server processes)")
    ap.add_argument("--concurrent", action="store_true", help="run both servers at once, each pinned to its own "
                    "core (swapped every round), under the same load: this VM's slow spells, which take both cores "
                    "at once, then fall on both servers instead of on whichever ran at the time")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_server_wide.json"))
    args = ap.parse_args(argv)
    if args.concurrent and (os.cpu_count() or 1) < 2:
        ap.error("--concurrent needs two cores")
    folder = cached_wide(args.wide_factor)
    tok = Tokenizer.from_pretrained(folder)
    prompts = prompts_from_heldout(tok, 48, args.prompt_tokens, seed=7)
    ctx = args.prompt_tokens + args.max_tokens + 16
    work = folder.parent
    load0 = os.getloadavg()
    def launch(name: str) -> tuple[subprocess.Popen, str]:
        draft = None if name == "plain" or args.aa else SMALL
        return start(folder, args.threads, ctx, work / f"{name}.log", draft, args.draft_quantization, args.k)

    def relaunch(order: tuple[str, ...]) -> None:
        """Both servers anew, started in `order`: of two identical servers the one started second ran ~4% slower
        at 32 streams on one VM (`--aa`), so `--swap-starts` starts them in swapped order every round."""
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
        servers.update({name: launch(name) for name in order})

    servers = {name: launch(name) for name in ("plain", "spec")}
    cells = []
    try:
        texts = {name: [asyncio.run(greedy_text(url, p, 32)) for p in prompts[:2]]
                 for name, (_, url) in servers.items()}
        agree = texts["plain"] == texts["spec"]
        print(f"greedy 32 tokens, 2 prompts, speculative == plain: {agree}", flush=True)
        plan = ([(s, 0.0, None) for s in args.streams] + [(s, 0.8, None) for s in args.sampled_streams]
                + [(0, 0.0, rate) for rate in args.rates])

        def load(url: str, streams: int, temp: float, rate: float | None, seconds: float, seed: int):
            if rate is None:
                return closed_loop(url, prompts, streams, args.max_tokens, temp, seconds)
            return open_loop(url, prompts, rate, args.max_tokens, temp, seconds, seed)

        def drive(url: str, streams: int, temp: float, rate: float | None, seconds: float, seed: int) -> dict:
            return asyncio.run(load(url, streams, temp, rate, seconds, seed))

        def measure(names: tuple[str, ...], streams: int, temp: float, rate: float | None, r: int) -> dict:
            """One round's runs of `names`: one after another, or all at once (--concurrent)."""
            async def run(group: tuple[str, ...]) -> list[dict]:
                return await asyncio.gather(*(load(servers[n][1], streams, temp, rate, args.seconds, r)
                                              for n in group))

            results = {}
            for group in [names] if args.concurrent else [(n,) for n in names]:
                before = {n: (server_cpu_s(servers[n][0].pid), os.getloadavg()[0]) for n in group}
                for n, res in zip(group, asyncio.run(run(group))):
                    res["server_cpu_s"] = server_cpu_s(servers[n][0].pid) - before[n][0]
                    # tokens per second of the server's own CPU time: what a neighbour's share of the cores
                    # cannot move (a loaded 2-core VM gave the 1-stream server 0.23-0.34 of a core)
                    res["tok_per_cpu_s"] = res["tok_s"] * res["wall_s"] / res["server_cpu_s"]
                    res["loadavg_1m"] = (before[n][1], os.getloadavg()[0])
                    results[n] = res
            return results

        for streams, temp, rate in plan:
            runs: dict[str, list[dict]] = {"plain": [], "spec": []}
            for _, url in servers.values():
                if args.warmup_seconds > 0:
                    drive(url, streams, temp, rate, args.warmup_seconds, 1000)
            for r in range(args.rounds):
                if args.swap_starts:  # each round on servers started anew, the first-started one alternating
                    relaunch(("plain", "spec") if r % 2 == 0 else ("spec", "plain"))
                    for _, url in servers.values():
                        if args.warmup_seconds > 0:
                            drive(url, streams, temp, rate, args.warmup_seconds, 1000)
                order = ("plain", "spec") if r % 2 == 0 else ("spec", "plain")
                if args.concurrent:  # the first of `order` on core 0: each server meets each core
                    for core, name in enumerate(order):
                        pin(servers[name][0].pid, core)
                for name, res in measure(order, streams, temp, rate, r).items():
                    runs[name].append(res)
                    print(f"  {f'rate={rate}/s' if rate else f'streams={streams}'} T={temp} round {r} {name}: {res['tok_s']:.1f} tok/s "
                          f"({res['tok_per_cpu_s']:.1f} per server CPU-s) TPOT p50/p99 "
                          f"{res['tpot_p50_ms']:.1f}/{res['tpot_p99_ms']:.1f} ms, load {res['loadavg_1m'][0]:.1f}",
                          flush=True)
            ratios = [s["tok_s"] / p["tok_s"] for s, p in zip(runs["spec"], runs["plain"])]
            cpu_ratios = [s["tok_per_cpu_s"] / p["tok_per_cpu_s"] for s, p in zip(runs["spec"], runs["plain"])]
            med = {k: {m: statistics.median(x[m] for x in v) for m in v[0] if isinstance(v[0][m], (int, float))}
                   for k, v in runs.items()}  # the numbers (loadavg_1m is a pair)
            cells.append({"streams": streams, "rate": rate, "temperature": temp, "runs": runs, "median": med,
                          "round_ratios": ratios, "ratio_tok_s": statistics.median(ratios),
                          "round_ratios_per_cpu_s": cpu_ratios, "ratio_tok_per_cpu_s": statistics.median(cpu_ratios),
                          "ratio_tpot_p99": med["spec"]["tpot_p99_ms"] / med["plain"]["tpot_p99_ms"],
                          "pooled_tpot_p99": pooled_p99(runs), "round_tpot_p99": round_ratio(runs, "tpot_p99_ms")})
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    print("\n| streams | temperature | plain tok/s | speculative tok/s | ratio (rounds) | per server CPU-s "
          "| TPOT p50 ms p / s | TPOT p99 ms p / s | pooled TPOT p99 ms p / s, ratio (95% CI) "
          "| TPOT p99 ratio, rounds' geomean (95% CI) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        p, s, q = c["median"]["plain"], c["median"]["spec"], c["pooled_tpot_p99"]
        load = f"{c['rate']}/s" if c.get("rate") else c["streams"]
        print(f"| {load} | {c['temperature']} | {p['tok_s']:.1f} | {s['tok_s']:.1f} | "
              f"{c['ratio_tok_s']:.2f}x ({', '.join(f'{x:.2f}' for x in c['round_ratios'])}) | "
              f"{c['ratio_tok_per_cpu_s']:.2f}x | "
              f"{p['tpot_p50_ms']:.1f} / {s['tpot_p50_ms']:.1f} | {p['tpot_p99_ms']:.1f} / {s['tpot_p99_ms']:.1f} | "
              f"{q['tpot_p99_ms']['plain']:.1f} / {q['tpot_p99_ms']['spec']:.1f}, {q['ratio']:.2f} "
              f"({q['ratio_ci95'][0]:.2f}-{q['ratio_ci95'][1]:.2f}) | {c['round_tpot_p99']['geomean']:.2f} "
              f"({c['round_tpot_p99']['ci95'][0]:.2f}-{c['round_tpot_p99']['ci95'][1]:.2f}) |")
    out = {"config": {**vars(args), "target": f"tandem-tiny-l widened x{args.wide_factor} (training/widen.py)",
                      "draft": None if args.aa else "models/tandem-tiny-s"},
           "greedy_agree": agree, "cells": cells, "loadavg_start": load0, "loadavg_end": os.getloadavg()}
    write_results(Path(args.out), out, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
