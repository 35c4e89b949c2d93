"""The open-loop HTTP client: fires planned requests at their send times over one keep-alive httpx client,
streams OpenAI-style SSE, and records per request what the user felt (send, first token, every token,
end, status, usage, tandem headers). It measures its own send lag so an overloaded generator is visible.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import msgspec

from traces.transport import KeepAliveTransport

SHED_STATUSES = (429, 503)  # admission control said no: counted as shed, not failed
LAG_WARN_S = 0.010  # a dispatch this late means the generator, not the server, shapes the load


@dataclass
class PlannedRequest:
    """One request to send: when (seconds from the start), to which model/route, and what."""

    index: int
    at_s: float
    model: str
    prompt: str
    input_tokens: int
    output_tokens: int


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds from the run's start (one monotonic clock)."""

    index: int
    model: str
    input_tokens_target: int
    output_tokens_target: int
    scheduled_s: float
    dispatch_lag_s: float = 0.0  # how late the generator woke up for this request (its own lag)
    sent_s: float | None = None  # when the request was handed to httpx (after any concurrency cap)
    first_token_s: float | None = None
    end_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # arrival of every content-bearing chunk
    status_code: int | None = None
    outcome: str = "pending"  # completed | failed | shed
    error: str | None = None
    prompt_tokens: int | None = None  # from the server's usage
    completion_tokens: int | None = None
    request_id: str | None = None
    route: str | None = None
    served_model: str | None = None
    escalated: bool | None = None
    retry_after: str | None = None

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_s is None or self.sent_s is None:
            return None
        return self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        if self.end_s is None or self.sent_s is None:
            return None
        return self.end_s - self.sent_s

    @property
    def output_tokens(self) -> int:
        """Tokens generated: the server's usage when given, else the number of streamed chunks."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_times_s)

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1), vLLM's convention; undefined for a single token."""
        ttft, e2e, n = self.ttft_s, self.e2e_s, self.output_tokens
        if ttft is None or e2e is None or n < 2:
            return None
        return (e2e - ttft) / (n - 1)

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def _payload(req: PlannedRequest, api: str, temperature: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": req.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        # vLLM-style extras: exact output length regardless of what the model would say.
        "ignore_eos": True,
        "min_tokens": req.output_tokens,
    }
    if temperature is not None:
        body["temperature"] = temperature
    if api == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_tokens
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_tokens
    return body


_decode = msgspec.json.Decoder()


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or ()
    for choice in choices:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            return text
    return ""


async def send_one(client: httpx.AsyncClient, url: str, req: PlannedRequest, rec: RequestRecord,
                   clock: Callable[[], float], api: str, headers: dict[str, str],
                   temperature: float | None) -> None:
    """Send one streaming request and fill `rec`; never raises (every failure is recorded)."""
    body = msgspec.json.encode(_payload(req, api, temperature))
    rec.sent_s = clock()
    try:
        async with client.stream("POST", url, content=body, headers=headers) as resp:
            rec.status_code = resp.status_code
            h = resp.headers
            rec.request_id = h.get("x-request-id")
            rec.route = h.get("x-tandem-route")
            rec.served_model = h.get("x-tandem-model")
            esc = h.get("x-tandem-escalated")
            rec.escalated = None if esc is None else esc.strip().lower() in ("1", "true", "yes")
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                rec.end_s = clock()
                rec.outcome = "shed" if resp.status_code in SHED_STATUSES else "failed"
                rec.retry_after = h.get("retry-after")
                rec.error = f"HTTP {resp.status_code}: {text}"
                return
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    # Keep reading to the end of the body: a fully read response returns its connection
                    # to the keep-alive pool; leaving early would close it.
                    done = True
                    continue
                now = clock()
                chunk = _decode.decode(data)
                if "error" in chunk and chunk["error"]:
                    err = chunk["error"]
                    rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    continue
                if _chunk_text(chunk):
                    if rec.first_token_s is None:
                        rec.first_token_s = now
                    rec.token_times_s.append(now)
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.completion_tokens = usage.get("completion_tokens")
            rec.end_s = clock()
            if rec.error is None and not done:
                rec.error = "stream ended without data: [DONE]"
            rec.outcome = "completed" if rec.error is None else "failed"
    except Exception as e:  # noqa: BLE001 - recorded as this request's failure, never lost
        rec.end_s = clock()
        rec.outcome = "failed"
        rec.error = f"{type(e).__name__}: {e}"[:300]


@dataclass
class RunResult:
    records: list[RequestRecord]
    started_unix: float
    elapsed_s: float  # from the start until the last request finished
    lag_warning: str | None
    connections_opened: int = 0  # keep-alive reuse: far fewer than requests when the server keeps up


class Progress:
    """A one-line terminal progress bar (\\r updates on stderr)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.sent = self.completed = self.failed = self.shed = 0

    def finished(self, outcome: str) -> None:
        if outcome == "completed":
            self.completed += 1
        elif outcome == "shed":
            self.shed += 1
        else:
            self.failed += 1

    def line(self, elapsed: float, max_lag: float) -> str:
        width = 24
        done = self.completed + self.failed + self.shed
        fill = int(width * done / self.total) if self.total else width
        return (f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} done, sent {self.sent}, "
                f"in flight {self.sent - done}, ok {self.completed}, failed {self.failed}, shed {self.shed}, "
                f"{elapsed:5.1f}s, max lag {max_lag * 1e3:.1f} ms ")

    def show(self, elapsed: float, max_lag: float, final: bool = False) -> None:
        if self.enabled:
            sys.stderr.write(self.line(elapsed, max_lag) + ("\n" if final else ""))
            sys.stderr.flush()


async def run_requests(base_url: str, plan: list[PlannedRequest], *, api: str = "completions",
                       api_key: str | None = None, concurrency: int | None = None, timeout_s: float = 600.0,
                       temperature: float | None = 0.0, progress: bool = False,
                       during: Callable[[httpx.AsyncClient, Callable[[], float]], Awaitable[None]] | None = None,
                       ) -> RunResult:
    """Fire `plan` open-loop (each request at its `at_s`) and wait for all of them; returns the records.

    `concurrency` caps requests in flight (later ones wait; the wait shows as sent_s - scheduled_s).
    `during(client, clock)` runs alongside (the /metrics scraper) and is cancelled at the end.
    """
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    url = base_url.rstrip("/") + path
    headers = {"content-type": "application/json", "accept": "text/event-stream"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    plan = sorted(plan, key=lambda r: r.at_s)
    records = [RequestRecord(r.index, r.model, r.input_tokens, r.output_tokens, r.at_s) for r in plan]
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    bar = Progress(len(plan), progress)
    # One client for the whole run: HTTP/1.1 keep-alive connections are reused across requests, through
    # a transport whose pool stays O(1) per request under bursts (see traces.transport).
    transport = KeepAliveTransport()
    async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        t0 = time.perf_counter()
        started_unix = time.time()

        def clock() -> float:
            return time.perf_counter() - t0

        side = asyncio.create_task(during(client, clock)) if during else None
        max_lag = 0.0

        async def fire(req: PlannedRequest, rec: RequestRecord) -> None:
            if sem is not None:
                async with sem:
                    await send_one(client, url, req, rec, clock, api, headers, temperature)
            else:
                await send_one(client, url, req, rec, clock, api, headers, temperature)
            bar.finished(rec.outcome)

        async def show_progress() -> None:
            while True:
                bar.show(clock(), max_lag)
                await asyncio.sleep(0.5)

        ticker = asyncio.create_task(show_progress()) if progress else None
        tasks = []
        warned = False
        for req, rec in zip(plan, records):
            delay = req.at_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            rec.dispatch_lag_s = max(0.0, clock() - req.at_s)
            max_lag = max(max_lag, rec.dispatch_lag_s)
            if rec.dispatch_lag_s > 10 * LAG_WARN_S and not warned and progress:
                warned = True
                sys.stderr.write(f"\nwarning: load generator is {rec.dispatch_lag_s * 1e3:.0f} ms behind schedule\n")
            tasks.append(asyncio.create_task(fire(req, rec)))
            bar.sent += 1
        if tasks:
            await asyncio.gather(*tasks)
        elapsed = clock()
        if ticker:
            ticker.cancel()
        bar.show(elapsed, max_lag, final=True)
        if side:
            side.cancel()
            try:
                await side
            except asyncio.CancelledError:
                pass
    return RunResult(records, started_unix, elapsed, lag_warning(records), transport.dialled)


def lag_warning(records: list[RequestRecord]) -> str | None:
    """A sentence when the generator could not keep its schedule.

    That is a p99 dispatch lag over 10 ms and over a tenth of the mean gap between arrivals: below that the
    offered load keeps its rate and shape, whatever the OS scheduler did to one wake-up.
    """
    lags = sorted(r.dispatch_lag_s for r in records)
    if not lags:
        return None
    p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
    times = sorted(r.scheduled_s for r in records)
    mean_gap = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    if p99 > max(LAG_WARN_S, 0.1 * mean_gap):
        return (f"the load generator fell behind its schedule (p99 dispatch lag {p99 * 1e3:.1f} ms, max "
                f"{lags[-1] * 1e3:.1f} ms): the offered load was lower and smoother than planned")
    return None
