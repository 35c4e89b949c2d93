"""How far a chat request travels in the gateway before the engine sees it: the project's function calls
(gateway/ and engines/, not the libraries) from the handler's entry to `RoutingContext.start`, which
calls the engine's `generate`, and how often
control comes back to the module that drives the request. Prints one line and writes bench/results/gateway_hops.json;
run before and after a change.

    .venv/bin/python bench/gateway_hops.py [--driver gateway/lifecycle.py]
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import REQUEST, FakeHost  # noqa: E402
from bench.results_meta import write_results  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--driver", default="gateway/lifecycle.py", help="the module that drives a request")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gateway_hops.json"))
    args = ap.parse_args(argv)
    import asyncio

    from litestar.testing import AsyncTestClient

    from gateway.app import create_app
    from gateway.config import config_from_dict

    cfg = config_from_dict({"engines": {"fake": {"checkpoint": "/nonexistent/fake"}},
                            "routes": {"fast": {"engines": ["fake"], "slo": {"ttft_ms": 100, "tpot_ms": 10}}}})
    app = create_app(cfg, host_factory=lambda: FakeHost(["fake"]))
    project = (str(ROOT / "gateway") + "/", str(ROOT / "engines") + "/")
    driver = str(ROOT / args.driver)
    seen: dict[str, int | bool] = {"armed": False, "on": False, "hops": 0, "returns": 0}
    calls: list[str] = []

    def profile(frame, event, arg):  # noqa: ANN001
        code = frame.f_code
        if not seen["armed"]:
            return
        if event == "call" and code.co_name == "chat_completions" and code.co_filename.endswith("gateway/app.py"):
            seen["on"] = True
        if not seen["on"]:
            return
        if event == "call" and code.co_filename.startswith(project):
            seen["hops"] += 1
            calls.append(f"{Path(code.co_filename).name}:{code.co_name}")
            if code.co_name == "start" and code.co_filename.endswith("gateway/routing.py"):
                seen["on"] = False  # RoutingContext.start: the call into engine.generate
        elif event == "return" and code.co_filename.startswith(project) and code.co_filename != driver:
            back = frame.f_back
            if back is not None and back.f_code.co_filename == driver:
                seen["returns"] += 1

    async def run():  # noqa: ANN202
        async with AsyncTestClient(app) as client:
            for _ in range(300):  # the fake host loads in the background: wait for /ready (30 s at most)
                if (await client.get("/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.1)
            await client.post("/v1/chat/completions", json=REQUEST)  # warm: first-request paths
            seen["armed"] = True
            return await client.post("/v1/chat/completions", json=REQUEST)

    threading.setprofile(profile)  # the test client may run the app in a portal thread
    sys.setprofile(profile)
    try:
        r = asyncio.run(run())
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert r.status_code == 200, r.text
    print(f"{seen['hops']} project function calls from the handler to the engine's generate; control returns "
          f"to {args.driver} {seen['returns']} times on the way")
    print(" -> ".join(calls))
    write_results(args.out, {"driver": args.driver, "hops": seen["hops"], "returns_to_driver": seen["returns"],
                             "path": calls})
    return 0


if __name__ == "__main__":
    sys.exit(main())
