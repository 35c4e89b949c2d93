"""`GET /dashboard` in a real headless browser (Debian's chromium driven by playwright; .ci/run installs it): after
traffic on the default models every panel draws live series with values, the page raises no console error and
loads nothing but itself and `/dashboard/data`."""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time

import httpx
import pytest

from gateway.config import load_config
from gateway.server import ServerThread

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PANELS = ["ttft_route", "tpot_route", "ttft_engine", "tpot_engine", "attainment", "goodput", "queue", "kv",
          "prefix", "routing", "escalations", "held", "spec", "cost", "replicas"]
MESSAGES = [{"role": "user", "content": "Tell me a short story about the sea."}]

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium; .ci/run does)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")


def _traffic(url: str, stop: threading.Event, seed: int) -> None:
    models = ["fast", "best", "auto", "cascade"]
    i = seed
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set():
            body = {"model": models[i % 4], "messages": MESSAGES, "max_tokens": 6, "stream": i % 2 == 0}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            i += 1


def test_dashboard_renders_live_panels_without_errors():
    cfg = load_config(None, env={"TANDEM_COST__PRICE_PER_DEVICE_HOUR": "2.5"})
    stop = threading.Event()
    with ServerThread(cfg) as server, sync_api.sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        page_html = httpx.get(server.url + "/dashboard")
        assert page_html.status_code == 200 and page_html.headers["content-type"].startswith("text/html")
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page_html.text), "no external assets"
        clients = [threading.Thread(target=_traffic, args=(server.url, stop, i), daemon=True) for i in range(2)]
        for c in clients:
            c.start()
        context = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                        headless=True, viewport={"width": 1400, "height": 900})
        try:
            page = context.new_page()
            errors: list[str] = []
            requests: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(server.url + "/dashboard?refresh=300")
            time.sleep(4)  # traffic while the page polls
            stop.set()
            for c in clients:
                c.join(timeout=120)
            page.wait_for_function("Number(document.body.dataset.samples) >= 10", timeout=30_000)
            time.sleep(0.7)  # a refresh after the last request
            drawn = page.evaluate("Object.fromEntries([...document.querySelectorAll('.panel')].map(p => "
                                  "[p.dataset.panel, Number(p.dataset.series)]))")
            legends = page.evaluate("Object.fromEntries([...document.querySelectorAll('.legend span')].map(s => "
                                    "[s.dataset.series, s.querySelector('b').textContent]))")
            stats = page.evaluate("Object.fromEntries([...document.querySelectorAll('.stat')].map(s => "
                                  "[s.dataset.stat, s.querySelector('.v').textContent]))")
            status = page.text_content("#status")
            paths = page.evaluate("document.querySelectorAll('svg path[data-series]').length")
        finally:
            context.close()
    assert not errors, errors
    assert status == "live"
    assert sorted(drawn) == sorted(PANELS)
    assert all(drawn[p] >= 1 for p in PANELS), drawn
    assert paths >= 30
    # live values from the server's state, in the legends
    for series in ("rt.ttft.fast p99", "rt.ttft.fast.slo", "rt.tpot.best p50", "et.ttft.tandem-large p99",
                   "att.auto", "kv.tandem-small", "hit.tandem-small", "spec.tandem-large", "cost.fast",
                   "rep.desired", "esc.cascade"):
        assert re.search(r"\d", legends.get(series, "")), (series, legends.get(series))
    assert legends["rt.ttft.fast.slo"] == "500 ms" and legends["rt.tpot.best.slo"] == "100 ms"
    assert re.fullmatch(r"\d+(\.\d+)?", stats["rps"]) and float(stats["rps"]) > 0
    assert {u.split("?")[0] for u in requests} == {server.url + "/dashboard", server.url + "/dashboard/data"}
