"""Gateway overhead: the latency the tandem gateway adds to a request whose engine answers instantly.

Four servers, each in its own process, answer the same chat request of 16 tokens, streamed (SSE: role,
content, finish, usage, [DONE]) and not (one JSON body): `bare` (an asyncio socket server writing canned
bytes: the floor of client + loopback), `asgi` (uvicorn + a minimal ASGI app writing the same bytes: the
HTTP server's share), `gateway` (the full tandem app: auth, limits, routing, OpenAI formatting,
OpenTelemetry spans, Prometheus metrics) and `untraced` (the same with OTEL_TRACES_SAMPLER=always_off),
both over an instant fake engine (the only fake engine in the project; it has the whole answer at once).
Open-loop Poisson arrivals; latency = last byte minus scheduled send; server CPU per request from /proc.
The client is bench/loadgen.c (a few microseconds of CPU a request) because an asyncio client costs ~0.15 ms
and the general load generator (traces.client) about 1 ms, as much as or more than what is measured here. Added latency = gateway percentile - bare percentile.
Target: p50 <= 1 ms, p99 <= 5 ms added at 200 req/s.

    .venv/bin/python bench/gateway_overhead.py [--duration 10] [--rates 200,300,400,600,800] [--nice -5]
    .venv/bin/python bench/gateway_overhead.py --sequential 3000   # CPU per request, one at a time
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loadgen import open_loop  # noqa: E402
from bench.results_meta import write_results  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gateway_overhead.json"
TOKENS = 16
TIMEOUT_S = 2.0  # a response slower than this counts as an error: the server is not keeping up
REQUEST = {"model": "fast", "messages": [{"role": "user", "content": "Say hello to the benchmark."}],
           "max_completion_tokens": TOKENS}
STREAM_OPTIONS = {"stream": True, "stream_options": {"include_usage": True}}
MODES = ("stream", "json")


# ------------------------------------------------------------------------------ the instant fake engine


class _FakeTokenizer:
    has_chat_template = True

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt
                                                                             else "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + i % 90) for i in ids)

    def token_text(self, token_id: int) -> str:
        return chr(32 + token_id % 90)


class FakeEngine:
    """Answers at once: the whole completion (`max_tokens` tokens) in one finished output, no model, no queue."""

    def __init__(self, name: str):
        self.name = name
        self.tokenizer = _FakeTokenizer()
        self.max_model_len = 4096

    async def generate(self, prompt, params, request_id=None, *, priority=0, draft_token_ids=None, ttft_s=None,
                       tpot_s=None) -> AsyncIterator:
        from engines.outputs import CompletionOutput, RequestMetrics, RequestOutput

        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        now = time.monotonic()
        metrics = RequestMetrics(arrival_time=now, first_scheduled_time=now, first_token_time=now,
                                 finished_time=now)
        n = params.max_tokens or TOKENS
        tokens = list(range(1, n + 1))
        out = CompletionOutput(index=0, text="w" * n, token_ids=tokens, delta_text="w" * n,
                               delta_token_ids=tokens, finish_reason="length")
        yield RequestOutput(request_id or "r", prompt if isinstance(prompt, str) else None, ids, [out],
                            finished=True, metrics=metrics, model=self.name)

    def abort(self, request_id: str) -> None:
        pass

    def stats(self) -> dict:
        return {"kv_usage": 0.0, "num_running": 0, "num_waiting": 0, "prefix_cache_queries": 0,
                "prefix_cache_hits": 0, "num_preemptions": 0, "used_blocks": 0}


class FakeHost:
    def __init__(self, names: list[str]):
        self.engines = {n: FakeEngine(n) for n in names}

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def engine(self, name: str) -> FakeEngine:
        return self.engines[name]

    def stats(self) -> dict:
        return {"engines": {n: e.stats() for n, e in self.engines.items()}}


# ---------------------------------------------------------------------------------------------- servers


def _canned(stream: bool) -> bytes:
    """What the gateway answers to REQUEST, in shape and size (ids and timestamps aside)."""
    rid = b'"id":"chatcmpl-0123456789abcdef0123456789abcdef","created":1796000000,"model":"fast",'
    usage = b'{"prompt_tokens":40,"completion_tokens":16,"total_tokens":56}'
    if not stream:
        return (b'{' + rid + b'"object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",'
                b'"content":"' + b"w" * TOKENS + b'","refusal":null,"tool_calls":null},"logprobs":null,'
                b'"finish_reason":"length"}],"usage":' + usage + b',"system_fingerprint":null,"service_tier":null}')
    head = b'data: {' + rid + b'"object":"chat.completion.chunk","choices":['
    tail = b'],"usage":null,"system_fingerprint":null,"service_tier":null}\n\n'
    return b"".join([
        head + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}' + tail,
        head + b'{"index":0,"delta":{"content":"' + b"w" * TOKENS + b'"},"logprobs":null,"finish_reason":null}'
        + tail,
        head + b'{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}' + tail,
        b'data: {' + rid + b'"object":"chat.completion.chunk","choices":[],"usage":' + usage
        + b',"system_fingerprint":null,"service_tier":null}\n\n',
        b"data: [DONE]\n\n"])


def _wants_stream(body: bytes) -> bool:
    return b'"stream": true' in body


def serve_bare(port: int) -> None:
    responses = {}
    for stream in (True, False):
        body, kind = _canned(stream), b"text/event-stream" if stream else b"application/json"
        responses[stream] = (b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
                             % (kind, len(body))) + body

    class Endpoint(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buf = transport, b""

        def data_received(self, data):
            self.buf += data
            while (head_end := self.buf.find(b"\r\n\r\n")) >= 0:
                length = 0
                for line in self.buf[:head_end].split(b"\r\n")[1:]:
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                if len(self.buf) < head_end + 4 + length:
                    return
                request_body = self.buf[head_end + 4:head_end + 4 + length]
                self.buf = self.buf[head_end + 4 + length:]
                self.transport.write(responses[_wants_stream(request_body)])

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Endpoint, "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def serve_asgi(port: int) -> None:
    import uvicorn

    events = [c + b"\n\n" for c in _canned(True).split(b"\n\n") if c]
    whole = _canned(False)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if not _wants_stream(body):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(whole)).encode())]})
            await send({"type": "http.response.body", "body": whole})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for event in events:  # one body event per SSE event, as a streaming server sends them
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off")


class _DiscardSpans:
    """A span exporter that drops what it is given: the `traced` server pays for building, sampling and handing
    spans to a BatchSpanProcessor, as with a real exporter, but not for an exporter's encoding and network."""

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def serve_traced(port: int) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_DiscardSpans()))
    serve_gateway(port, tracer_provider=provider)


def serve_gateway(port: int, tracer_provider=None) -> None:
    from gateway.app import create_app
    from gateway.config import config_from_dict
    from gateway.server import build_server

    cfg = config_from_dict({"engines": {"fake": {"checkpoint": "/nonexistent/fake"}},
                            "routes": {"fast": {"engines": ["fake"], "slo": {"ttft_ms": 100, "tpot_ms": 10}}},
                            "server": {"port": port, "log_level": "warning", "max_inflight_requests": 100000}})
    app = create_app(cfg, host_factory=lambda: FakeHost(["fake"]), tracer_provider=tracer_provider)
    build_server(cfg, app).run()


SERVERS = {"bare": serve_bare, "asgi": serve_asgi, "gateway": serve_gateway, "traced": serve_traced,
           "untraced": serve_gateway}
# `gateway`: as `tandem serve` runs by default, no trace exporter configured (so, since issue 41, no spans are
# built); `traced`: the same with a span processor that receives every span (a BatchSpanProcessor over an
# exporter that drops them), which prices the tracing of every request; `untraced`: OpenTelemetry's standard
# sampler switch set to drop every trace.
SERVER_ENV = {"untraced": {"OTEL_TRACES_SAMPLER": "always_off"}}


def start_server(kind: str, nice: int = 0) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)], cwd=ROOT,
                            env={**os.environ, **SERVER_ENV.get(kind, {})},
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    deadline = time.monotonic() + 60
    path = b"/ready" if kind in ("gateway", "traced", "untraced") else b"/"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                c.sendall(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
                if c.recv(64).startswith(b"HTTP/1.1 200"):
                    return proc, port
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{kind} server did not start")


# ------------------------------------------------------------------------------------------------ client


def _complete(buf: bytes | bytearray) -> bool:
    """Whether `buf` holds one whole HTTP response (chunked or with a content-length)."""
    head_end = buf.find(b"\r\n\r\n")
    if head_end < 0:
        return False
    head = bytes(buf[:head_end]).lower()
    if b"transfer-encoding: chunked" in head:
        return buf.endswith(b"\r\n0\r\n\r\n")
    start = head.find(b"content-length:")
    end = head.find(b"\r\n", start)
    return len(buf) >= head_end + 4 + int(head[start + 15:end if end > 0 else None])


def _payload(mode: str) -> bytes:
    body = json.dumps(REQUEST | (STREAM_OPTIONS if mode == "stream" else {})).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)) + body


def drive(port: int, mode: str, rate: float, duration: float, seed: int = 0) -> dict:
    """Open-loop Poisson load at `rate` for `duration` s (bench/loadgen.c: same arrivals for the same seed);
    a response counts when it is a 200 and whole (the stream's [DONE], the JSON body's usage)."""
    marker = b"data: [DONE]" if mode == "stream" else b'"usage":{'
    row = open_loop(port, _payload(mode), marker, rate, duration, seed=seed, timeout_s=TIMEOUT_S)
    return {"mode": mode, "rate": rate, "ok": len(row["latencies_s"]),
            "error_sample": [f"{k}: {v}" for k, v in row["error_kinds"].items()][:3], **row,
            **_summary(row["latencies_s"])}


def _summary(latencies: list[float]) -> dict:
    lat = np.asarray(latencies) * 1000
    if not lat.size:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "max_ms": None}
    return {"p50_ms": float(np.percentile(lat, 50)), "p90_ms": float(np.percentile(lat, 90)),
            "p99_ms": float(np.percentile(lat, 99)), "max_ms": float(lat.max())}


def interleaved_at(rate: float, duration: float, rounds: int, nice: int) -> dict[str, dict[str, dict]]:
    """Every server and mode at `rate`, in `rounds` short alternating slices pooled together, so a burst of
    background load on a shared machine lands on all of them alike instead of on whichever ran then."""
    servers = {kind: start_server(kind, nice) for kind in SERVERS}
    pooled: dict[str, dict[str, dict]] = {m: {k: {"latencies_s": [], "requests": 0, "errors": 0, "cpu_s": 0.0}
                                              for k in SERVERS} for m in MODES}
    try:
        for _, port in servers.values():
            for mode in MODES:
                drive(port, mode, 50, 1.0)  # warm-up: connections, first-request paths
        for r in range(rounds):
            for mode in MODES:
                for kind, (proc, port) in servers.items():
                    cpu0 = _cpu_seconds(proc.pid)
                    row = drive(port, mode, rate, duration / rounds, seed=r)
                    acc = pooled[mode][kind]
                    acc["cpu_s"] += _cpu_seconds(proc.pid) - cpu0
                    acc["latencies_s"] += row["latencies_s"]
                    acc["requests"] += row["requests"]
                    acc["errors"] += row["errors"]
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(10)
    out: dict[str, dict[str, dict]] = {}
    for mode, kinds in pooled.items():
        out[mode] = {}
        for kind, acc in kinds.items():
            out[mode][kind] = {"requests": acc["requests"], "ok": len(acc["latencies_s"]), "errors": acc["errors"],
                               **_summary(acc["latencies_s"]),
                               "server_cpu_ms_per_request": 1000 * acc["cpu_s"] / max(1, acc["requests"])}
    return out


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _roundtrip(conn: socket.socket, payload: bytes) -> None:
    conn.sendall(payload)
    buf = b""
    while not _complete(buf):
        buf += conn.recv(65536)
    if not buf.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"unexpected answer: {buf[:80]!r}")


def sequential(requests: int, nice: int = 0) -> dict[str, dict[str, dict]]:
    """Server CPU and wall time per request, one request at a time on one warm keep-alive connection: what a
    request costs with queueing out of the picture (the shared machine's load still slows every row alike)."""
    out: dict[str, dict[str, dict]] = {mode: {} for mode in MODES}
    for kind in ("asgi", "gateway", "traced", "untraced"):
        proc, port = start_server(kind, nice)
        try:
            for mode in MODES:
                payload = _payload(mode)
                with socket.create_connection(("127.0.0.1", port)) as conn:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    for _ in range(300):  # warm-up
                        _roundtrip(conn, payload)
                    cpu0, t0 = _cpu_seconds(proc.pid), time.perf_counter()
                    for _ in range(requests):
                        _roundtrip(conn, payload)
                    cpu_s, wall_s = _cpu_seconds(proc.pid) - cpu0, time.perf_counter() - t0
                out[mode][kind] = {"server_cpu_ms_per_request": 1000 * cpu_s / requests,
                                   "wall_ms_per_request": 1000 * wall_s / requests}
        finally:
            proc.terminate()
            proc.wait(10)
    return out


def measure(kind: str, mode: str, rates: list[float], duration: float, nice: int = 0) -> list[dict]:
    """Rates in order on a fresh server process; stops after the first rate with errors."""
    proc, port = start_server(kind, nice)
    try:
        drive(port, mode, 50, 1.0)  # warm-up: connections, imports, first-request paths
        rows = []
        for rate in rates:
            cpu0 = _cpu_seconds(proc.pid)
            row = drive(port, mode, rate, duration, seed=int(rate))
            row["server_cpu_ms_per_request"] = 1000 * (_cpu_seconds(proc.pid) - cpu0) / max(1, row["requests"])
            row["server"] = kind
            del row["latencies_s"]
            rows.append(row)
            print(f"  {kind:8s} {mode:6s} {rate:6.0f} req/s: ok {row['ok']:5d} err {row['errors']:4d} "
                  f"p50 {row['p50_ms'] or float('nan'):7.2f} ms  p99 {row['p99_ms'] or float('nan'):7.2f} ms  "
                  f"server CPU {row['server_cpu_ms_per_request']:.3f} ms/req",
                  flush=True)
            if row["errors"]:
                break  # past this server's highest error-free rate
        return rows
    finally:
        proc.terminate()
        proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per rate (and per server and mode at 200)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating slices the 200 req/s duration is cut into")
    ap.add_argument("--rates", default="200,400,600,800,1000,1400,2000", help="sweep for the highest clean rate")
    ap.add_argument("--nice", type=int, default=0,
                    help="niceness for the servers and the client (e.g. -5 on a machine shared with a training "
                         "job; needs root); the same for every server")
    ap.add_argument("--sequential", type=int, default=0, metavar="N",
                    help="instead of the load test: N requests one at a time per server and mode, server CPU per "
                         "request (robust to the machine's load; prints only)")
    ap.add_argument("--serve", choices=list(SERVERS), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        SERVERS[args.serve](args.port)
        return 0
    rates = [float(r) for r in args.rates.split(",")]
    if args.nice:
        os.nice(args.nice)
    if args.sequential:
        print(f"{args.sequential} sequential requests per server and mode on one connection; load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        print(f"{'mode':<8}{'server':<10}{'CPU ms/req':>12}{'wall ms/req':>13}")
        for mode, rows in sequential(args.sequential, args.nice).items():
            for kind, row in rows.items():
                print(f"{mode:<8}{kind:<10}{row['server_cpu_ms_per_request']:>12.3f}{row['wall_ms_per_request']:>13.3f}")
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
        return 0
    print(f"chat completions of {TOKENS} tokens, streamed (SSE) and not (JSON); {args.duration:g} s per rate, "
          f"timeout {TIMEOUT_S:g} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    at200 = interleaved_at(200.0, args.duration, args.rounds, args.nice)
    sweep = {kind: measure(kind, "stream", rates, args.duration, args.nice) for kind in ("bare", "gateway")}
    highest = {kind: max((r["rate"] for r in rows if r["errors"] == 0), default=None)
               for kind, rows in sweep.items()}
    added = {mode: {p: rows["gateway"][f"{p}_ms"] - rows["bare"][f"{p}_ms"] for p in ("p50", "p90", "p99")}
             for mode, rows in at200.items()}
    uvicorn_share = {mode: {p: rows["asgi"][f"{p}_ms"] - rows["bare"][f"{p}_ms"] for p in ("p50", "p90", "p99")}
                     for mode, rows in at200.items()}

    print(f"\nat 200 req/s ({args.duration:g} s per server and mode in {args.rounds} alternating slices, Poisson "
          f"arrivals), latency from scheduled send to the last byte:")
    print(f"{'mode':<8}{'server':<10}{'ok':>7}{'errors':>8}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}"
          f"{'CPU ms/req':>12}")
    for mode, rows in at200.items():
        for kind, row in rows.items():
            print(f"{mode:<8}{kind:<10}{row['ok']:>7}{row['errors']:>8}{row['p50_ms']:>9.2f}{row['p90_ms']:>9.2f}"
                  f"{row['p99_ms']:>9.2f}{row['max_ms']:>9.2f}{row['server_cpu_ms_per_request']:>12.3f}")
        a = added[mode]
        print(f"{mode:<8}{'added':<10}{'':>7}{'':>8}{a['p50']:>9.2f}{a['p90']:>9.2f}{a['p99']:>9.2f}"
              f"   (gateway - bare; uvicorn's share: p50 {uvicorn_share[mode]['p50']:.2f}, "
              f"p99 {uvicorn_share[mode]['p99']:.2f})")
    print(f"highest rate with zero errors (stream): gateway {highest['gateway']} req/s, bare {highest['bare']} "
          f"req/s (rates tried: {args.rates})")
    met = all(a["p50"] <= 1.0 and a["p99"] <= 5.0 for a in added.values())
    print(f"target p50 <= 1 ms, p99 <= 5 ms added at 200 req/s: {'met' if met else 'NOT met'}")
    write_results(RESULTS, {
        "bench": "gateway_overhead", "duration_s": args.duration, "rounds": args.rounds, "nice": args.nice, "tokens": TOKENS, "timeout_s": TIMEOUT_S,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_average": os.getloadavg(), "at_200": at200, "added_ms": added, "uvicorn_share_ms": uvicorn_share,
        "sweep": sweep, "highest_zero_error_rate": highest, "target_met": met}, indent=1)
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
