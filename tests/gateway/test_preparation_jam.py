"""No request's preparation holds the server (issue 33's six-schema jam, against a live `tandem serve`): with six
10,000-property json_schema requests compiling, a new small json_schema request, a 4,200-character chat and a
4,200-character /tokenize are all answered before any jamming request ends; each jamming request ends with a
400 naming the compile budget and its field; SIGTERM during a jam ends the process within the grace period
(plus the drain's fixed cut and slack)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx

from gateway.server import CUT_S, WATCHDOG_SLACK_S, free_port
from tests.live_server import start_serve

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 1.0
BUDGET_S = 3.0


def _wide(n: int, tag: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"wide_{tag}", "schema": {
        "type": "object", "properties": {f"{tag}_{i}": {"type": "string"} for i in range(n)}}}}


def _chat(url: str, response_format: dict | None = None, content: str = "hi", timeout: float = 300) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    if response_format is not None:
        body["response_format"] = response_format
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def _jam(url: str, tag: str, count: int = 6) -> tuple[list[threading.Thread], list]:
    results: list = [None] * count

    def one(i: int) -> None:
        try:
            results[i] = (_chat(url, _wide(10_000, f"{tag}{i}")), time.monotonic())
        except httpx.HTTPError as exc:
            results[i] = (exc, time.monotonic())
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return threads, results


def test_six_jamming_schemas_delay_no_other_request_end_in_400s_and_sigterm_still_ends_the_process(tmp_path):
    port = free_port()
    config = tmp_path / "tandem.toml"
    config.write_text(f'[engines.tiny]\ncheckpoint = "{ROOT / "models" / "tandem-tiny-l"}"\n'
                      '[kv_pool]\nmemory_bytes = "64MiB"\n'
                      f'[server]\ngrace_period_s = {GRACE_S}\n'
                      f'[preparation]\ncompile_timeout_s = {BUDGET_S}\nmax_schema_properties = 20000\n'
                      'max_schema_bytes = 1048576\n')
    proc, url = start_serve(["--config", str(config), "--port", str(port)], {**os.environ}, port)
    try:
        # the small lane's worker starts with the first constraint (its start-up is not a request's budget)
        warm = _chat(url, {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "boolean"}}})
        assert warm.status_code == 200, warm.text

        threads, results = _jam(url, "a")
        time.sleep(0.5)  # the jam is in flight
        assert all(r is None for r in results)
        small = _chat(url, {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}, timeout=60)
        chat = _chat(url, content="word " * 840, timeout=60)  # 4,200 characters: the tokenisation pool
        tok = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": "x" * 4200}, timeout=60)
        probes_done = time.monotonic()
        assert small.status_code == 200, small.text
        assert chat.status_code == 200 or chat.json()["error"]["code"] == "context_length_exceeded", chat.text
        # 4,200 characters are tokenised (the pool) and then refused when they pass the 512-token context
        assert (tok.status_code == 200 and tok.json()["count"] > 0
                or tok.json()["error"]["code"] == "context_length_exceeded"), tok.text
        pending = sum(r is None for r in results)
        assert pending == 6, f"{6 - pending} jamming request(s) ended before the probes were answered"
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}

        for t in threads:
            t.join(timeout=300)
        for resp, ended in results:
            assert isinstance(resp, httpx.Response), resp
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"].startswith("response_format") and "compile_timeout_s" in err["message"], err
            assert ended > probes_done

        # SIGTERM while a second jam compiles: the process ends within the grace period and the fixed cut
        threads, results = _jam(url, "b")
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out = proc.communicate(timeout=GRACE_S + CUT_S + WATCHDOG_SLACK_S + 30)[0]
        took = time.monotonic() - sent
        assert proc.returncode == 0, out[-3000:]
        assert took <= GRACE_S + CUT_S + WATCHDOG_SLACK_S, (took, out[-3000:])
        for t in threads:
            t.join(timeout=30)
        assert all(r is not None for r in results)  # every jamming client got an answer or a closed connection
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
