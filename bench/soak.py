"""Soak: a real `tandem serve` (subprocess on 127.0.0.1, the default config and embedded models) under mixed
traffic for a bounded time: every route, chat and completions, JSON and streaming, mixed temperatures
(greedy, sampled, seeded, top-p, penalties), n > 1, stops, 5% client aborts mid-request and 2% bad inputs, and
with `--hostile F` that fraction of requests from issue 33's catalogue (`hostile_request`).
It checks that no request gets an unexpected 5xx (503 + Retry-After is shedding, expected under load), that
every request ends, that no KV page is left in use at the end, and that the server's RSS grows by less than
3% after warm-up. Prints a table and writes bench/results/soak.json.

    .venv/bin/python bench/soak.py [--duration 600] [--workers 4] [--seed 0] [--hostile 0.05] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402

ROUTES = ["fast", "best", "auto", "cascade", "tandem-small", "tandem-large"]
PROMPTS = ["def read_config(path):\n", "import json\n\ndef load(path):", "class Engine:\n    def step(self):",
           "for i in range(10):\n    print(", "def main():\n    args = ", "x = [i * i for i in",
           "# parse the command line\nimport argparse\n", "def fib(n):\n    if n < 2:\n        return n\n"]
# bad inputs with the status each must get (never a 5xx)
BAD_INPUTS: list[tuple[str, object, str, set[int]]] = [
    ("/v1/chat/completions", "{not json", "application/json", {400}),
    ("/v1/chat/completions", {"model": "fast", "messages": "hello"}, "application/json", {400}),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
     "application/json", {404}),
    ("/v1/chat/completions", {"model": "fast", "messages": [{"role": "user", "content": "x"}],
                              "temperature": -1}, "application/json", {400}),
    ("/v1/completions", {"model": "fast", "prompt": "x", "max_tokens": 10 ** 9}, "application/json", {400}),
    ("/v1/chat/completions", {"model": "fast", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, "application/json", {400}),
    ("/v1/chat/completions", {"model": "fast", "messages": [{"role": "user", "content": "x"}], "seed": 2 ** 70},
     "application/json", {400}),
    ("/v1/completions", {"model": "fast", "prompt": "x", "n": 0}, "application/json", {400}),
]




def _wide_schema(rng: random.Random, n: int) -> dict:
    """An object schema of n optional properties, named afresh each time (no compile cache hit)."""
    tag = rng.randrange(1 << 30)
    return {"type": "object", "properties": {f"p{tag}_{i}": {"type": "integer"} for i in range(n)}}


def hostile_request(rng: random.Random) -> tuple[str, bytes, set[int]]:
    """One request from issue 33's catalogue (path, body, the statuses it may get): schemas over and at the size
    budgets, a grammar with no finite derivation, a penalty that masks every token beside a permissive schema,
    token ids out of range, NaN, a 900 KB /tokenize, 10,000 choices, a remote $ref, a 4,200-character prompt."""
    chat = {"model": "fast", "messages": [{"role": "user", "content": "A JSON object"}], "max_tokens": 16}
    kind = rng.randrange(9)
    if kind == 0:  # 10,000 properties: refused by the size budget before any compile
        body = {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "w", "schema": _wide_schema(rng, 10_000)}}}
        return "/v1/chat/completions", json.dumps(body).encode(), {400}
    if kind == 1:  # 900 properties, new names: within the budget, a real compile every time
        body = {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "w", "schema": _wide_schema(rng, 900)}}}
        return "/v1/chat/completions", json.dumps(body).encode(), {200, 400}
    if kind == 2:
        return "/v1/chat/completions", json.dumps({**chat, "guided_grammar": "root ::= root"}).encode(), {400}
    if kind == 3:  # every seen token's logit goes to +inf: the grammar still decides
        body = {**chat, "repetition_penalty": 5e-324, "temperature": 1.0, "guided_json": {"type": "object"}}
        return "/v1/chat/completions", json.dumps(body).encode(), {200}
    if kind == 4:
        body = {**chat, "stop_token_ids": rng.choice([[-1], [2 ** 70], [10 ** 6]])}
        return "/v1/chat/completions", json.dumps(body).encode(), {400}
    if kind == 5:
        return "/v1/chat/completions", json.dumps(chat).encode()[:-1] + b', "temperature": NaN}', {400}
    if kind == 6:
        return "/tokenize", json.dumps({"model": "fast", "prompt": "x" * 900_000}).encode(), {400}
    if kind == 7:
        body = {**chat, "guided_choice": [f"option {i}" for i in range(10_000)]}
        return "/v1/chat/completions", json.dumps(body).encode(), {400}
    body = {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "$ref": "https://example.com/schema.json"}}}}
    return "/v1/chat/completions", json.dumps(body).encode(), {400}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024


def random_body(rng: random.Random, route: str) -> tuple[str, dict]:
    chat = rng.random() < 0.6
    body: dict = {"model": route, "max_tokens": rng.randint(1, 48)}
    t = rng.random()
    if t < 0.4:
        body["temperature"] = 0
    else:
        body["temperature"] = rng.choice([0.5, 0.8, 1.0])
        if rng.random() < 0.3:
            body["top_p"] = 0.9
        if rng.random() < 0.3:
            body["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.1:
        body["presence_penalty"] = 0.5
    if rng.random() < 0.15 and route != "cascade":  # a cascade checks one answer: n > 1 is a documented 400
        body["n"] = 2
    if rng.random() < 0.15:
        body["stop"] = ["\n\n"]
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    prompt = rng.choice(PROMPTS) * rng.randint(1, 6)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, 2
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    if rng.random() < 0.2:
        body["logprobs"] = 2
    return "/v1/completions", body


async def one_request(client: httpx.AsyncClient, rng: random.Random, stats: Counter, failures: list,
                      hostile: float, latencies: list[float]) -> None:
    if rng.random() < hostile:
        path, content, allowed = hostile_request(rng)
        r = await client.post(path, content=content, headers={"content-type": "application/json"})
        stats["hostile"] += 1
        if r.status_code not in allowed and r.status_code not in (429, 503):
            failures.append(f"hostile {path} {content[:80]!r} -> {r.status_code} {r.text[:160]}")
        return
    if rng.random() < 0.02:
        path, payload, ctype, allowed = rng.choice(BAD_INPUTS)
        content = payload if isinstance(payload, str) else json.dumps(payload)
        r = await client.post(path, content=content, headers={"content-type": ctype})
        stats["bad_input"] += 1
        if r.status_code not in allowed:
            failures.append(f"bad input {str(payload)[:80]} -> {r.status_code} (want {sorted(allowed)})")
        return
    path, body = random_body(rng, rng.choice(ROUTES))
    stream = rng.random() < 0.5
    abort = rng.random() < 0.05
    body["stream"] = stream
    stats["sent"] += 1
    start = time.monotonic()
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code == 503 or r.status_code == 429:
                stats["shed"] += 1
                if "retry-after" not in r.headers:
                    failures.append(f"{r.status_code} without Retry-After")
                await r.aread()
                return
            if r.status_code != 200:
                text = (await r.aread()).decode()[:200]
                failures.append(f"{path} {json.dumps(body)[:120]} -> {r.status_code} {text}")
                stats[f"unexpected_{r.status_code}"] += 1
                return
            if abort:  # the client leaves mid-request: the server must free the request's KV pages
                async for _ in r.aiter_bytes():
                    break
                stats["aborted"] += 1
                return
            data = b"".join([chunk async for chunk in r.aiter_bytes()])
            if stream:
                events = [line[6:] for line in data.split(b"\n") if line.startswith(b"data: ")]
                if not events or events[-1] != b"[DONE]":
                    failures.append(f"stream without [DONE]: {data[-120:]!r}")
                elif any("error" in json.loads(e) for e in events[:-1]):  # an error event, not a token's text
                    failures.append(f"stream error event: {data[-300:]!r}")
            else:
                json.loads(data)
            stats["ok"] += 1
            latencies.append(time.monotonic() - start)
    except httpx.HTTPError as exc:
        failures.append(f"{path}: {type(exc).__name__}: {exc}")


async def soak(url: str, duration: float, workers: int, seed: int, pid: int, hostile: float = 0.0) -> dict:
    stats: Counter = Counter()
    failures: list[str] = []
    latencies: list[float] = []  # end to end, the ordinary requests that completed
    timeout = httpx.Timeout(120.0, connect=10.0)
    rss: list[tuple[float, int]] = []
    t0 = time.monotonic()

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
            while time.monotonic() - t0 < duration:
                await one_request(client, rng, stats, failures, hostile, latencies)

    async def sample_rss() -> None:
        while time.monotonic() - t0 < duration:
            rss.append((time.monotonic() - t0, _rss_bytes(pid)))
            await asyncio.sleep(1.0)

    await asyncio.gather(*(worker(i) for i in range(workers)), sample_rss())
    elapsed = time.monotonic() - t0
    await asyncio.sleep(1.0)  # aborts reach the engine at its next step
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        metrics = (await client.get("/metrics")).text
    usage = [float(m.group(1)) for m in re.finditer(r'kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)', metrics)]
    running = [float(m.group(1)) for m in re.finditer(r'num_requests_running\{[^}]*\} ([0-9.e+-]+)', metrics)]
    warm = [b for t, b in rss if t >= min(60.0, duration / 4)] or [b for _, b in rss]
    growth = (warm[-1] - warm[0]) / warm[0] if warm else 0.0
    lat = sorted(latencies)
    p50 = lat[len(lat) // 2] if lat else None
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None
    return {"duration_s": round(elapsed, 1), "workers": workers, "seed": seed, "hostile_fraction": hostile,
            **stats, "e2e_p50_s": p50, "e2e_p99_s": p99,
            "unexpected": len(failures), "failures": failures[:20],
            "kv_usage_at_end": max(usage) if usage else None, "running_at_end": max(running) if running else None,
            "rss_after_warmup_mb": round(warm[0] / 2 ** 20, 1) if warm else None,
            "rss_end_mb": round(warm[-1] / 2 ** 20, 1) if warm else None, "rss_growth": round(growth, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hostile", type=float, default=0.0, help="fraction of requests from issue 33's catalogue")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = ap.parse_args(argv)
    port = _free_port()
    code = "import sys; from gateway.server import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=os.environ | {"OTEL_TRACES_SAMPLER": "always_off"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/ready", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server not ready in 180 s")
            time.sleep(0.5)
        result = asyncio.run(soak(url, args.duration, args.workers, args.seed, proc.pid, args.hostile))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    ok = (result["unexpected"] == 0 and not result["kv_usage_at_end"] and not result["running_at_end"]
          and result["rss_growth"] < 0.03)
    result["pass"] = ok
    rows = [("requests sent", result.get("sent", 0)), ("completed", result.get("ok", 0)),
            ("shed (429/503 + Retry-After)", result.get("shed", 0)), ("client aborts", result.get("aborted", 0)),
            ("bad inputs (all 4xx)", result.get("bad_input", 0)), ("hostile (as catalogued)", result.get("hostile", 0)),
            ("ordinary E2E p50 / p99 (s)", f"{result['e2e_p50_s']:.3f} / {result['e2e_p99_s']:.3f}"
             if result["e2e_p99_s"] is not None else "-"), ("unexpected", result["unexpected"]),
            ("KV usage at end", result["kv_usage_at_end"]), ("running at end", result["running_at_end"]),
            ("RSS after warm-up / end (MB)", f"{result['rss_after_warmup_mb']} / {result['rss_end_mb']}"),
            ("RSS growth", f"{100 * result['rss_growth']:.2f}%"), ("pass", ok)]
    print(f"soak: {result['duration_s']} s, {args.workers} workers")
    for k, v in rows:
        print(f"  {k:<32} {v}")
    for f in result["failures"]:
        print("  !", f)
    write_results(Path(args.out), result, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
