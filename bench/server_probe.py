"""Probe one tandem server the way bench/vs_llamacpp.py's streams cells drive it, for what their medians hide.

    .venv/bin/python bench/server_probe.py ttft --model llama200m --threads 1 --streams 32
        each closed-loop run's request starts and first-token times (client-side), sorted, every 4th
    .venv/bin/python bench/server_probe.py threads --model llama80m --quant w8a8 --threads 2 [ENV=VALUE ...]
        one stream of 64-token requests for 8 s: tok/s and each server thread's share of a core (/proc)

The models are vs_llamacpp's random Llamas (`~/.cache/tandem/vs_llamacpp/<model>`, built by its first run);
64 random 64-token prompts round-robin, greedy, as there. Writes what it prints to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import vs_llamacpp as v  # noqa: E402
from bench.results_meta import write_results  # noqa: E402

CACHE = Path.home() / ".cache" / "tandem" / "vs_llamacpp"


async def closed(url: str, prompts: list[list[int]], streams: int, seconds: float, tag: str) -> dict:
    res: list[dict] = []
    summary = await v.closed_loop(url, "tandem", prompts, streams, 64, seconds, keep=res)
    starts = sorted(r["start"] for r in res)
    ttfts = sorted(r["ttft"] for r in res)
    print(f"{tag}: {len(res)} requests, wall {summary['wall_s']:.2f} s, {summary['tok_s']:.1f} tok/s, "
          f"TPOT p50 {summary['tpot_p50_ms']:.0f} ms\n  starts {[round(x, 2) for x in starts[::4]]}"
          f"\n  first tokens {[round(x, 2) for x in ttfts[::4]]}", flush=True)
    return {"run": tag, **summary, "starts_s": starts, "first_token_s": ttfts}


def threads_cpu(pid: int) -> dict[str, tuple[str, float]]:
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            s = Path(f"/proc/{pid}/task/{t}/stat").read_text()
        except OSError:
            continue
        f = s.rsplit(")", 1)[1].split()
        out[t] = (s[s.index("(") + 1:s.rindex(")")], (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"))
    return out


async def one_stream(url: str, prompts: list[list[int]], seconds: float) -> float:
    import httpx

    n, i = 0, 0
    t0 = time.perf_counter()
    async with httpx.AsyncClient() as c:
        while time.perf_counter() - t0 < seconds:
            await v.one_request(c, url, "tandem", prompts[i % len(prompts)], 64)
            n, i = n + 64, i + 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe", choices=["ttft", "threads"])
    ap.add_argument("--model", default="llama200m")
    ap.add_argument("--quant", default=None, help="tandem's --quantization (default: float32 weights)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--out", default=None, help="results file (default bench/results/server_probe_<probe>.json)")
    ap.add_argument("env", nargs="*", help="ENV=VALUE for the server")
    args = ap.parse_intermixed_args()
    os.environ.update(dict(a.split("=", 1) for a in args.env))
    prompts = v.make_prompts(64, 64, 0)
    proc, url, _ = v.start_tandem(CACHE / args.model, args.threads, args.quant, 64 + 64 + 16,
                                  Path("/tmp") / f"server_probe_{os.getpid()}.log", bf16_reads=False)
    try:
        record: dict = {"args": vars(args)}
        if args.probe == "ttft":
            record["runs"] = [asyncio.run(closed(url, prompts, args.streams, 3, "warm-up"))]
            for r in range(2):
                record["runs"].append(asyncio.run(closed(url, prompts, args.streams, 8, f"run {r}")))
        else:
            asyncio.run(one_stream(url, prompts, 3))
            a, t0 = threads_cpu(proc.pid), time.time()
            rate = asyncio.run(one_stream(url, prompts, 8))
            b, dt = threads_cpu(proc.pid), time.time() - t0
            busy = sorted(((b[k][1] - a.get(k, ("", 0.0))[1]) / dt, k) for k in b)
            shares = [round(x, 3) for x, _ in busy if x > 0.02]
            print(f"{args.model} {args.quant or 'f32'} threads {args.threads} {args.env}: {rate:.1f} tok/s; "
                  f"server threads' share of a core: {shares}")
            record.update(tok_s=rate, thread_shares=shares)
        out = Path(args.out or Path(__file__).with_name("results") / f"server_probe_{args.probe}.json")
        write_results(out, record)
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
