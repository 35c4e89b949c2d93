"""Load-generator capacity: how many requests/s `traces.client` can fire on schedule on loopback.

Runs an instant OpenAI-style SSE endpoint (a bare asyncio HTTP/1.1 server, in its own process, so only the
generator is measured) and drives it open-loop with Poisson arrivals at rising rates. Target: >= 200 req/s
with p99 dispatch lag under 10 ms and every request completed. Prints a table, writes bench/results/.

    .venv/bin/python bench/loadgen_capacity.py [--rates 100,200,400] [--duration 5] [--tokens 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results_meta import write_results  # noqa: E402
from traces.arrivals import poisson_arrivals  # noqa: E402
from traces.client import PlannedRequest, run_requests  # noqa: E402
from traces.metrics import percentiles  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "loadgen_capacity.json"


def _sse_body(tokens: int) -> bytes:
    events = [b'data: {"choices":[{"index":0,"text":" t","finish_reason":null}]}\n\n'] * tokens
    events.append(b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":%d}}\n\n' % tokens)
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


class InstantEndpoint(asyncio.Protocol):
    """Answers every POST at once with a whole SSE stream; keep-alive; nothing else."""

    body = b""

    def connection_made(self, transport):
        self.transport, self.buf = transport, b""

    def data_received(self, data):
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            length = 0
            for line in self.buf[:head_end].split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            end = head_end + 4 + length
            if len(self.buf) < end:
                return
            self.buf = self.buf[end:]
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-tandem-route: auto\r\n"
                                 b"content-length: %d\r\n\r\n" % len(self.body) + self.body)


def serve(sock: socket.socket, tokens: int) -> None:
    InstantEndpoint.body = _sse_body(tokens)

    async def main():
        server = await asyncio.get_running_loop().create_server(InstantEndpoint, sock=sock)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


async def drive(url: str, rate: float, duration: float, tokens: int) -> dict:
    at = poisson_arrivals(rate, duration, seed=int(rate))
    plan = [PlannedRequest(i, float(t), "auto", "hello there", 2, tokens) for i, t in enumerate(at)]
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    result = await run_requests(url, plan)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    recs = result.records
    lags = percentiles(r.dispatch_lag_s for r in recs)
    ttft = percentiles(r.ttft_s for r in recs if r.outcome == "completed")
    completed = sum(r.outcome == "completed" for r in recs)
    span = max(r.sent_s for r in recs) - min(r.sent_s for r in recs)
    return {"rate": rate, "planned": len(plan), "completed": completed,
            "achieved_send_rate": (len(recs) - 1) / span if span > 0 else None,
            "dispatch_lag_p50_ms": lags["p50"], "dispatch_lag_p99_ms": lags["p99"], "dispatch_lag_max_ms": lags["max"],
            "client_ttft_p50_ms": ttft["p50"], "client_ttft_p99_ms": ttft["p99"],
            "generator_cpu_per_request_ms": 1000 * cpu / max(1, len(recs)), "wall_s": wall,
            "keeps_up": completed == len(plan) and (lags["p99"] or 0) < 10.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="100,200,400")
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--tokens", type=int, default=8, help="streamed chunks per response")
    ap.add_argument("--repeats", type=int, default=3, help="runs per rate; the median one is reported")
    args = ap.parse_args()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    proc = mp.get_context("fork").Process(target=serve, args=(sock, args.tokens), daemon=True)
    proc.start()
    rows = []
    try:
        for rate in (float(r) for r in args.rates.split(",")):
            # Repeat each rate and keep the median run (by p99 lag): the machine is shared, and one
            # descheduling of the generator should not decide the verdict either way.
            runs = []
            for _ in range(args.repeats):
                run = asyncio.run(drive(url, rate, args.duration, args.tokens))
                runs.append(run | {"loadavg_1m": os.getloadavg()[0]})
            runs.sort(key=lambda r: r["dispatch_lag_p99_ms"])
            median = runs[len(runs) // 2]
            rows.append(median | {"repeats": args.repeats,
                                  "runs_keeping_up": sum(r["keeps_up"] for r in runs),
                                  "dispatch_lag_p99_ms_all": [round(r["dispatch_lag_p99_ms"], 2) for r in runs]})
    finally:
        proc.terminate()
        proc.join(5)
    print(f"{'rate':>6} {'sent':>6} {'done':>6} {'achieved':>9} {'lag p50':>8} {'lag p99':>8} {'lag max':>8} "
          f"{'ttft p50':>9} {'ttft p99':>9} {'cpu/req':>8} {'load':>5}  keeps up (runs)")
    for r in rows:
        print(f"{r['rate']:6.0f} {r['planned']:6d} {r['completed']:6d} {r['achieved_send_rate']:9.1f} "
              f"{r['dispatch_lag_p50_ms']:8.2f} {r['dispatch_lag_p99_ms']:8.2f} {r['dispatch_lag_max_ms']:8.2f} "
              f"{r['client_ttft_p50_ms']:9.2f} {r['client_ttft_p99_ms']:9.2f} "
              f"{r['generator_cpu_per_request_ms']:8.2f} {r['loadavg_1m']:5.1f}  "
              f"{'yes' if r['keeps_up'] else 'NO'} ({r['runs_keeping_up']}/{r['repeats']})")
    best = max((r["rate"] for r in rows if r["keeps_up"]), default=None)
    print(f"highest rate kept up with: {best} req/s (target >= 200)")
    write_results(RESULTS, {"bench": "loadgen_capacity", "duration_s": args.duration, "tokens": args.tokens,
                                   "machine": f"{platform.machine()} {mp.cpu_count()} cores, {platform.python_version()}",
                                   "rows": rows, "highest_rate_kept_up": best}, indent=1)
    return 0 if best is not None and best >= 200 else 1


if __name__ == "__main__":
    sys.exit(main())
