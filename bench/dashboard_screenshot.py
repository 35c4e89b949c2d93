"""Regenerate docs/img/dashboard.png: start the gateway on the default models (with a device price, so the cost
panel has values), send mixed traffic to every route for a while, and screenshot `GET /dashboard` in headless
Chromium (Debian's `chromium`, driven by playwright; no browser download).

    .venv/bin/python bench/dashboard_screenshot.py [--seconds 40] [--out docs/img/dashboard.png]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PROMPTS = ["Tell me about the sea.", "What is two plus two?", "Write a short poem about autumn leaves.",
           "Explain how a bicycle works, step by step, for a child.", "Name three colours.",
           "Summarise the plot of a story about a lost dog who finds its way home."]


def traffic(url: str, stop: threading.Event, seed: int) -> None:
    """One client: streaming and plain requests across the routes until `stop`."""
    import httpx

    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            body = {"model": rng.choice(["fast", "best", "auto", "cascade"]), "max_tokens": rng.randint(4, 24),
                    "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "stream": rng.random() < 0.5}
            try:
                client.post("/v1/chat/completions", json=body).read()
            except httpx.HTTPError:
                time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="traffic before the screenshot")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "dashboard.png"))
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "dashboard_screenshot.json"))
    args = ap.parse_args()

    import torch
    from playwright.sync_api import sync_playwright

    from bench.results_meta import write_results
    from gateway.config import load_config
    from gateway.server import ServerThread

    torch.set_num_threads(1)
    cfg = load_config(None, env={**os.environ, "TANDEM_COST__PRICE_PER_DEVICE_HOUR": "2.5",
                                 "TANDEM_AUTOSCALE__EVALUATION_INTERVAL_S": "2"})
    stop = threading.Event()
    with ServerThread(cfg) as server, sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        clients = [threading.Thread(target=traffic, args=(server.url, stop, i), daemon=True)
                   for i in range(args.clients)]
        for c in clients:
            c.start()
        context = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                        headless=True, viewport={"width": 1480, "height": 900})
        page = context.new_page()
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(server.url + "/dashboard?refresh=500")
        time.sleep(args.seconds)
        stop.set()
        for c in clients:
            c.join(timeout=60)
        time.sleep(1.5)  # a last refresh after the traffic
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=args.out, full_page=True)
        context.close()
    write_results(args.json, {"screenshot": args.out, "seconds": args.seconds, "clients": args.clients,
                              "console_errors": errors})
    print(f"wrote {args.out} and {args.json}; console errors: {errors or 'none'}")


if __name__ == "__main__":
    main()
