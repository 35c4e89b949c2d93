"""Scale-out on Ray Serve (CPU, bounded): the load tester (traces/, as a library) against 1 vs 2 tandem
replicas, each pinned to one core (num_cpus=1, torch threads 1, CPU affinity), with a shared-prefix workload
(a system-prompt mix: `--groups` distinct prefixes of `--prefix-blocks` 16-token blocks, Zipf-popular, then a
fresh question), and 2 replicas with affinity routing vs power of two choices. The pools are sized so the
distinct prefixes do not fit in one replica's pool but do in two (`--pool-mib`; the JSON records the measured
ratio): the case prefix affinity is for. Prints throughput, TTFT p50/p99, goodput at the same SLO, the pools'
prefix hit rate, and the CPU time each process took per request (replicas, Ray proxy, ingress, load generator,
Ray's own processes, everything else on the machine) with the upper bound on 2-replica throughput it implies;
then an autoscaling run (1 -> 2 replicas under a load step from 1x to 3x one replica's capacity, and back
after the load ends) with its timeline. Writes bench/results/scale_out.json.

    .venv/bin/python bench/scale_out.py                       # the full run (quiet machine: ~15 min)
    .venv/bin/python bench/scale_out.py --smoke               # small sizes, a few minutes

Targets: 2 replicas >= 1.6x the goodput of 1; affinity >= 1.5x the prefix hit rate of power of two; the
autoscaled app grows to >= 2 replicas and shrinks back with no failed request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402

# Replicas push autoscaling metrics every second (default 10 s): set before Ray starts its workers.
os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")

APP = "tandem"
BLOCK = 16
PAGES_PER_BLOCK = 1  # the "best" route's large model, speculation off (a draft would add a page some steps)
# Serve's --ray-mode throughput: Ray's throughput-optimised data plane (gRPC between deployments, user code on
# the replica's own loop, GC frozen after start-up), with the HTTP proxy kept (direct ingress needs HAProxy
# or per-replica ports); set before Ray starts its workers
THROUGHPUT_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
COMPONENTS = ("replicas", "proxy", "ingress", "load generator", "controller", "ray system", "other")
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
PHASES = ("ingress-ab", "one", "two", "pow2", "scale-up", "autoscale")
PHASE_OF = {"1 replica": "one", "2 replicas": "two", "2 replicas pow2": "pow2"}


def component_of(pid: int, cmdline: str) -> str:
    """Which part of the run a process is, from its title (Ray names its workers `ray::<actor>`)."""
    if pid == os.getpid():
        return "load generator"  # this process: the open-loop client (and the Ray driver, idle meanwhile)
    if f"ServeReplica:{APP}:TandemReplica" in cmdline:
        return "replicas"
    if f"ServeReplica:{APP}:OpenAIIngress" in cmdline:
        return "ingress"
    if "ProxyActor" in cmdline:
        return "proxy"
    if "ServeController" in cmdline:
        return "controller"
    if any(k in cmdline for k in ("gcs_server", "raylet", "ray/dashboard", "log_monitor", "runtime_env",
                                  "default_worker.py", "ray::", "ray/_private", "monitor.py")):
        return "ray system"
    return "other"


def process_cpu() -> dict[int, tuple[str, float]]:
    """Every process's CPU seconds so far (user + system, all threads) and its component."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        pid = int(name)
        out[pid] = (component_of(pid, cmdline), (int(fields[11]) + int(fields[12])) / CLOCK_TICK)
    return out


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:8]]
    return (sum(values) - values[3] - values[4]) / CLOCK_TICK  # less idle and iowait


class CpuMeter:
    """CPU seconds per component between `start` and `stop` (a process that ended meanwhile is not counted;
    one that started counts from zero)."""

    def start(self) -> None:
        self.loadavg_before = os.getloadavg()
        self.t0, self.busy0, self.before = time.monotonic(), machine_busy_s(), process_cpu()

    def stop(self) -> dict[str, Any]:
        after, wall = process_cpu(), time.monotonic() - self.t0
        by: dict[str, float] = dict.fromkeys(COMPONENTS, 0.0)
        per_replica: list[float] = []
        for pid, (comp, cpu) in after.items():
            prev = self.before.get(pid)
            delta = cpu - (prev[1] if prev and prev[0] == comp else 0.0)
            by[comp] += delta
            if comp == "replicas":
                per_replica.append(round(delta, 2))
        return {"wall_s": round(wall, 2), "cpu_s": {k: round(v, 3) for k, v in by.items()},
                "replica_cpu_s": sorted(per_replica, reverse=True),
                "machine_busy_s": round(machine_busy_s() - self.busy0, 2),
                "loadavg_before": [round(x, 2) for x in self.loadavg_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()]}


def cpu_per_request(cpu: dict[str, Any], completed: int) -> dict[str, float]:
    """CPU seconds per completed request, each component, plus `overhead` (all ours but the replicas)."""
    n = max(1, completed)
    out = {k: v / n for k, v in cpu["cpu_s"].items()}
    out["overhead"] = sum(out[k] for k in ("proxy", "ingress", "load generator", "controller", "ray system"))
    return out


def plan_requests(args: argparse.Namespace, rate: float, duration_s: float, seed: int) -> list[Any]:
    """Open-loop Poisson arrivals; each prompt = one of `groups` shared prefixes (Zipf-popular) + a fresh
    question, with exact token counts from the served tokenizer."""
    from traces.arrivals import poisson_arrivals
    from traces.client import PlannedRequest
    from traces.prompts import PromptSynthesizer
    from traces.workloads import RequestSpec

    rng = np.random.default_rng(seed)
    synth = PromptSynthesizer(ROOT / "models" / "tandem-tiny-s", seed=0)  # the same system prompts every run
    weights = 1.0 / np.arange(1, args.groups + 1) ** args.zipf
    weights /= weights.sum()
    at = poisson_arrivals(rate, duration_s, seed=seed)
    plan = []
    for i, t in enumerate(at):
        g = int(rng.choice(args.groups, p=weights))
        chain = tuple(g * 1000 + b for b in range(args.prefix_blocks))  # group g's system prompt
        fresh = tuple(10**7 + (seed * 10**5 + i) * 100 + k for k in range(-(-args.suffix_tokens // BLOCK)))
        spec = RequestSpec(i, args.prefix_blocks * BLOCK + args.suffix_tokens, args.output_tokens,
                           hash_ids=chain + fresh, block_tokens=BLOCK)
        plan.append(PlannedRequest(i, float(t), args.route, synth.prompt(spec), spec.input_tokens,
                                   spec.output_tokens))
    return plan


COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "chunks", "served")


def pool_counters() -> dict[str, tuple[int, ...]]:
    from deploy.ray_serve import replica_stats

    return {rid: tuple(s[k] for k in COUNTERS) for rid, s in replica_stats(APP).items()}


def counter_deltas(before: dict[str, tuple[int, ...]], after: dict[str, tuple[int, ...]]) -> dict[str, int]:
    zero = (0,) * len(COUNTERS)
    return {k: sum(after[r][i] - before.get(r, zero)[i] for r in after) for i, k in enumerate(COUNTERS)}


def hit_rate(deltas: dict[str, int]) -> float | None:
    """Prompt tokens found in the pools / prompt tokens looked up (both models of the route)."""
    q = deltas["prefix_cache_queries"]
    return deltas["prefix_cache_hits"] / q if q else None


@contextlib.contextmanager
def ray_session(args: argparse.Namespace, ingress: str) -> Iterator[None]:
    """A local Ray cluster for one ingress mode: "proxy" (HTTP -> Serve's proxy -> ingress -> replica) or
    "direct" (Serve's direct ingress: HTTP -> ingress -> replica; the proxy idles). The mode is the cluster's
    environment, read by the controller and replicas at start, so each mode gets a Ray of its own."""
    import ray
    from ray import serve

    from deploy.ray_serve import direct_ingress_env
    from gateway.server import free_port

    env = direct_ingress_env(args.ingress_port)
    for key in env:
        os.environ.pop(key, None)
    if ingress == "direct":
        os.environ.update(env)
    ray.init(num_cpus=2, object_store_memory=128 * 1024 * 1024, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"enable_access_log": False})
        args.ingress, args.proxy_url = ingress, f"http://127.0.0.1:{port}"
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def endpoint(args: argparse.Namespace) -> str:
    """The URL requests go to for the deployed app: the proxy, or the ingress replica's own port."""
    if args.ingress != "direct":
        return args.proxy_url
    import httpx

    from deploy.ray_serve import ingress_urls

    deadline = time.monotonic() + 60
    while True:
        urls = [u for u in ingress_urls(APP, host="127.0.0.1") if u != args.proxy_url]
        if urls:
            try:
                if httpx.get(urls[0] + "/health", timeout=5).status_code == 200:
                    return urls[0]
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError("the ingress replica's own HTTP port did not answer within 60 s")
        time.sleep(0.5)


def deploy(args: argparse.Namespace, *, replicas: int, routing: str, autoscale: bool = False,
           target_ongoing: float | None = None, external_scaler: bool = False) -> dict[str, dict[str, Any]]:
    """Run the app; `args.url` is then its endpoint."""
    from ray import serve

    from deploy.ray_serve import ScaleOutOptions, build_app, replica_stats

    # speculation off: adaptive k drafts on some steps only, and a drafting step keeps the draft's pages too, so
    # the pool's prefix capacity would wander; without it each 16-token block is one page
    overrides: dict[str, Any] = {"kv_pool.memory_bytes": f"{args.pool_mib}MiB", "engines.tandem-large.draft": None,
                                 "engines.tandem-large.num_speculative_tokens": 0}
    if autoscale:
        overrides["admission.enabled"] = False  # the step must queue, not shed: no failed request allowed
    options = ScaleOutOptions(
        config=str(args.config), overrides=overrides, replicas=replicas, routing=routing, pin_cpu=True,
        num_cpus=1.0, torch_threads=1, routing_stats_period_s=args.routing_stats_period_s, stream_interval_ms=args.stream_interval_ms, autoscale=autoscale, min_replicas=1,
        max_replicas=2, target_ongoing_requests=target_ongoing, down_stabilization_s=args.down_window_s,
        down_cooldown_s=args.down_window_s / 2, look_back_period_s=5.0, graceful_shutdown_timeout_s=60.0)
    serve.run(build_app(options), name=APP, route_prefix="/", external_scaler_enabled=external_scaler)
    deadline = time.monotonic() + 300
    while len(stats := replica_stats(APP)) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{replicas} replicas not up within 300 s")
        time.sleep(0.5)
    args.url = endpoint(args)
    return stats


def undeploy() -> None:
    from ray import serve

    from deploy.ray_serve import replica_actors

    serve.delete(APP)
    while replica_actors(APP):  # the cores' locks go with the processes
        time.sleep(0.5)


def run_load(url: str, plan: list[Any], slos: dict[str, Any]) -> dict[str, Any]:
    from traces.client import run_requests
    from traces.metrics import summarise

    result = asyncio.run(run_requests(url, plan, api="completions", timeout_s=600.0))
    span = max((r.at_s for r in plan), default=0.0) or 1.0
    summary = summarise(result.records, window=(0.0, span + 1e-6), slos=slos)
    return {"summary": summary, "records": result.records, "elapsed_s": result.elapsed_s}


def mean_in_flight(records: list[Any]) -> float:
    """Little's law over the run: request-seconds in flight / the run's span."""
    spans = [(r.sent_s, r.end_s) for r in records if r.sent_s is not None and r.end_s is not None]
    if not spans:
        return 0.0
    return sum(e - b for b, e in spans) / max(1e-9, max(e for _, e in spans) - min(b for b, _ in spans))


def row(name: str, replicas: int, routing: str, rate: float, load: dict[str, Any], rate_hits: float | None,
        cpu: dict[str, Any], ingress: str = "direct") -> dict:
    s = load["summary"]
    per_req = cpu_per_request(cpu, s["requests"]["completed"])
    return {"config": name, "replicas": replicas, "routing": routing, "ingress": ingress, "offered_rps": rate,
            "completed": s["requests"]["completed"], "failed": s["requests"]["failed"], "shed": s["requests"]["shed"],
            "throughput_rps": s["request_throughput_rps"], "output_tps": s["output_token_throughput_tps"],
            "ttft_p50_ms": s["overall"]["ttft_ms"]["p50"], "ttft_p99_ms": s["overall"]["ttft_ms"]["p99"],
            "goodput_rps": s.get("goodput_rps"), "slo_attainment": s.get("slo_attainment"),
            "prefix_hit_rate": rate_hits, "mean_in_flight": mean_in_flight(load["records"]),
            "cpu": cpu, "cpu_s_per_request": {k: round(v, 5) for k, v in per_req.items()},
            "cores_used": {k: round(v / max(1e-9, cpu["wall_s"]), 3) for k, v in cpu["cpu_s"].items()}}


def measure(args: argparse.Namespace, name: str, replicas: int, routing: str, slos: dict, seed: int,
            rates: list[float] | None = None) -> list[dict]:
    pool_pages = min(s["num_pages"] for s in deploy(args, replicas=replicas, routing=routing).values())
    url = args.url
    out = []
    try:
        # the system prompts have been seen before (a steady state, not a cold start): one warm-up pass
        run_load(url, plan_requests(args, args.warm_rps, args.warm_s, seed=10_000 + seed), slos)
        idle = idle_cores(args.idle_s)
        for k, rate in enumerate(rates or args.rates):
            plan = plan_requests(args, rate, args.duration, seed=seed * 100 + k)
            before = pool_counters()
            meter = CpuMeter()
            meter.start()
            load = run_load(url, plan, slos)
            cpu = meter.stop()
            deltas = counter_deltas(before, pool_counters())
            r = row(name, replicas, routing, rate, load, hit_rate(deltas), cpu, args.ingress)
            r["chunks_per_request"] = deltas["chunks"] / max(1, deltas["served"])  # the start message included
            c = r["cpu_s_per_request"]
            print(f"  {name:<18} {rate:5.2f} req/s: {r['completed']} done, goodput {r['goodput_rps']:.2f}, "
                  f"hit rate {r['prefix_hit_rate'] or 0:.3f}; CPU ms/request: replicas {1e3 * c['replicas']:.0f}, "
                  f"proxy {1e3 * c['proxy']:.1f}, ingress {1e3 * c['ingress']:.1f}, "
                  f"load gen {1e3 * c['load generator']:.1f}, ray {1e3 * (c['ray system'] + c['controller']):.1f}, "
                  f"other {1e3 * c['other']:.0f}; loadavg {cpu['loadavg_after'][0]:.2f}", flush=True)
            r["pool_pages"] = pool_pages
            if idle is not None:  # what each component burns with no request at all, and the rest per request
                r["idle_cores"] = idle
                r["cpu_s_per_request_net_of_idle"] = {
                    k: round(max(0.0, cpu["cpu_s"][k] - idle[k] * cpu["wall_s"]) / max(1, r["completed"]), 5)
                    for k in COMPONENTS}
                n = r["cpu_s_per_request_net_of_idle"]
                print(f"    idle cores: proxy {idle['proxy']:.3f}, ingress {idle['ingress']:.3f}; net of idle, "
                      f"proxy + ingress {1e3 * (n['proxy'] + n['ingress']):.1f} ms/request", flush=True)
            out.append(r)
    finally:
        undeploy()
    return out


def idle_cores(seconds: float) -> dict[str, float] | None:
    """Cores each component uses with the app deployed and no request in flight (Ray's and Serve's background
    work: health checks, routing-stats and metrics pushes, the core workers' threads), over `seconds`."""
    if seconds <= 0:
        return None
    meter = CpuMeter()
    meter.start()
    time.sleep(seconds)
    cpu = meter.stop()
    return {k: round(v / max(1e-9, cpu["wall_s"]), 4) for k, v in cpu["cpu_s"].items()}


def replica_counts() -> tuple[int, int]:
    """(running, starting or stopping) replicas of the tandem deployment."""
    from ray import serve

    states = serve.status().applications[APP].deployments["TandemReplica"].replica_states
    running = states.get("RUNNING", 0)
    return running, sum(states.values()) - running


def autoscale_run(args: argparse.Namespace, capacity_rps: float, concurrency_1x: float,
                  slos: dict) -> dict[str, Any]:
    """Load 1x for `step_s`, 3x for `step_s`, then nothing; the replica count sampled every second."""
    target = max(1.0, 1.5 * concurrency_1x)
    deploy(args, replicas=1, routing="affinity", autoscale=True, target_ongoing=target)
    url = args.url
    timeline: list[dict[str, Any]] = []
    t0 = time.monotonic()
    stop = False

    def sample() -> None:
        while not stop:
            try:
                running, moving = replica_counts()
            except Exception:  # the status call can fail while the controller reconciles
                running, moving = -1, -1
            timeline.append({"t_s": round(time.monotonic() - t0, 1), "running": running, "changing": moving})
            time.sleep(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        one = plan_requests(args, capacity_rps, args.step_s, seed=777)
        three = plan_requests(args, 3 * capacity_rps, args.step_s, seed=778)
        for r in three:
            r.at_s += args.step_s
            r.index += len(one)
        plan = one + three
        load = run_load(url, plan, slos)
        load_end = time.monotonic() - t0
        deadline = time.monotonic() + args.shrink_wait_s
        peak = max((p["running"] for p in timeline), default=0)
        while time.monotonic() < deadline:  # after the load: back to one replica
            running, moving = replica_counts()
            if peak >= 2 and running == 1 and moving == 0:
                timeline.append({"t_s": round(time.monotonic() - t0, 1), "running": running, "changing": moving})
                break
            time.sleep(1.0)
    finally:
        stop = True
        sampler.join(timeout=5)
        undeploy()
    s = load["summary"]
    peak = max((p["running"] for p in timeline), default=0)
    final = timeline[-1]["running"] if timeline else 0
    grew_at = next((p["t_s"] for p in timeline if p["running"] >= 2), None)
    shrank_at = next((p["t_s"] for p in timeline if p["t_s"] > load_end and p["running"] == 1 and p["changing"] == 0
                      and peak >= 2), None)
    return {"capacity_rps": capacity_rps, "target_ongoing_requests": target, "step_s": args.step_s,
            "load_end_s": round(load_end, 1), "requests": s["requests"], "peak_replicas": peak,
            "final_replicas": final, "grew_to_2_at_s": grew_at, "back_to_1_at_s": shrank_at,
            "ttft_p99_ms": s["overall"]["ttft_ms"]["p99"], "timeline": timeline}


def window_ttft(records: list[Any], start: float, end: float, slos: dict) -> dict[str, Any]:
    """TTFT p50/p99 and outcomes of the requests scheduled in [start, end) (seconds from the run's start)."""
    from traces.metrics import summarise

    s = summarise(records, window=(start, max(end, start + 1e-6)), slos=slos)
    return {"window_s": [round(start, 1), round(end, 1)], "requests": s["requests"],
            "ttft_p50_ms": s["overall"]["ttft_ms"]["p50"], "ttft_p99_ms": s["overall"]["ttft_ms"]["p99"]}


def scale_up_run(args: argparse.Namespace, slos: dict) -> dict[str, Any]:
    """A forced scale-up under constant load: 1 replica at `scale_up_rps` for `steady_s`, then the target set to
    2 (Serve's external scaling API, no autoscaling policy in the way) while the same arrivals go on for
    `after_s`. TTFT p99 of the steady window vs the window from the order to `settle_s` after the second
    replica runs (its start-up, engine load and warm-up on the machine's other core included). The new
    replica's first request must come after its constructor returned (`ready_at`)."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client

    from deploy.ray_serve import replica_stats

    first = deploy(args, replicas=1, routing="affinity", external_scaler=True)
    url = args.url
    events: dict[str, float] = {}
    timeline: list[dict[str, Any]] = []
    stop = threading.Event()
    try:
        run_load(url, plan_requests(args, args.warm_rps, args.warm_s, seed=10_001), slos)  # prefixes seen once
        plan = plan_requests(args, args.scale_up_rps, args.steady_s + args.after_s, seed=4242)
        controller = _get_global_client()._controller

        def scaler() -> None:
            t0 = time.monotonic()
            if stop.wait(args.steady_s):
                return
            import ray

            ray.get(controller.update_deployment_replicas.remote(DeploymentID(name="TandemReplica", app_name=APP), 2))
            events["scale_order_s"] = time.monotonic() - t0
            while not stop.is_set():
                try:
                    running, moving = replica_counts()
                except Exception:  # the status call can fail while the controller reconciles
                    running, moving = -1, -1
                t = round(time.monotonic() - t0, 2)
                if not timeline or (timeline[-1]["running"], timeline[-1]["changing"]) != (running, moving):
                    timeline.append({"t_s": t, "running": running, "changing": moving})
                if running >= 2 and "running_s" not in events:
                    events["running_s"] = t
                stop.wait(0.25)

        thread = threading.Thread(target=scaler, daemon=True)
        meter = CpuMeter()
        meter.start()
        thread.start()  # the load's clock starts within milliseconds of the scaler's
        load = run_load(url, plan, slos)
        cpu = meter.stop()
        stop.set()
        thread.join(timeout=10)
        stats = replica_stats(APP)
    finally:
        stop.set()
        undeploy()
    records, end = load["records"], args.steady_s + args.after_s
    order = events.get("scale_order_s", args.steady_s)
    running = events.get("running_s")
    settled = (running if running is not None else end) + args.settle_s
    steady = window_ttft(records, args.steady_skip_s, order, slos)
    scaling = window_ttft(records, order, min(settled, end), slos)
    after = window_ttft(records, min(settled, end), end, slos)
    new = [s for rid, s in stats.items() if rid not in first]
    ratio = (scaling["ttft_p99_ms"] or 0.0) / max(1e-9, steady["ttft_p99_ms"] or 0.0)
    return {"offered_rps": args.scale_up_rps, "ingress": args.ingress, "steady_s": args.steady_s,
            "after_s": args.after_s, "scale_order_s": round(order, 2), "second_running_s": running,
            "steady": steady, "scale_up_window": scaling, "after": after, "ttft_p99_ratio": ratio,
            "timeline": timeline, "cpu": cpu,
            "new_replica": [{"ready_at": s.get("ready_at"), "first_request_at": s.get("first_request_at"),
                             "served": s.get("served"),
                             "first_request_after_ready_s": (None if s.get("first_request_at") is None
                                                             else round(s["first_request_at"] - s["ready_at"], 3))}
                            for s in new]}


def ingress_ab_summary(rows: list[dict]) -> dict[str, Any]:
    """Proxy vs direct ingress: CPU ms per completed request of each component (mean over rounds), goodput."""
    out: dict[str, Any] = {}
    for mode in ("proxy", "direct"):
        rs = [r for r in rows if r["ingress"] == mode]
        out[mode] = {"cpu_ms_per_request": {k: round(1e3 * float(np.mean([r["cpu_s_per_request"][k] for r in rs])), 2)
                                            for k in (*COMPONENTS, "overhead")},
                     "goodput_rps": [r["goodput_rps"] for r in rs], "ttft_p99_ms": [r["ttft_p99_ms"] for r in rs],
                     "chunks_per_request": [round(r["chunks_per_request"], 2) for r in rs],
                     "loadavg": [r["cpu"]["loadavg_after"][0] for r in rs]}
        c = out[mode]["cpu_ms_per_request"]
        out[mode]["proxy_plus_ingress_ms"] = round(c["proxy"] + c["ingress"], 2)
    return out


def print_ingress_ab(ab: dict[str, Any]) -> None:
    print(f"\nproxy vs direct ingress, CPU ms per completed request (2 replicas)\n{'ingress':<8} "
          + " ".join(f"{c[:10]:>10}" for c in COMPONENTS) + f" {'proxy+ingr':>10} {'goodput':>8} {'loadavg':>8}")
    for mode, m in ab.items():
        c = m["cpu_ms_per_request"]
        print(f"{mode:<8} " + " ".join(f"{c[k]:10.1f}" for k in COMPONENTS)
              + f" {m['proxy_plus_ingress_ms']:10.1f} {np.mean([g or 0 for g in m['goodput_rps']]):8.2f}"
              f" {np.mean(m['loadavg']):8.2f}")


def print_scale_up(up: dict[str, Any]) -> None:
    print(f"\nforced scale-up 1 -> 2 at {up['offered_rps']:.2f} req/s ({up['ingress']} ingress): order at "
          f"{up['scale_order_s']:.1f} s, second replica running at {up['second_running_s']} s")
    for name in ("steady", "scale_up_window", "after"):
        w = up[name]
        print(f"  {name:<16} {w['window_s'][0]:6.1f}-{w['window_s'][1]:6.1f} s: {w['requests']['completed']:4d} done, "
              f"{w['requests']['failed']} failed; TTFT p50 {w['ttft_p50_ms'] or 0:7.0f} ms, p99 {w['ttft_p99_ms'] or 0:7.0f} ms")
    print(f"  TTFT p99 scale-up window / steady = {up['ttft_p99_ratio']:.2f}x (target <= 3x); new replica: "
          f"{up['new_replica']}")


def cpu_bound(rows: list[dict], best: dict[str, dict]) -> dict[str, Any]:
    """What the CPU accounting allows. At 2 replicas every process shares the machine's 2 cores, so throughput
    X2 <= cores / (replica + overhead CPU-s per request); the single replica has a core of its own while its
    overhead runs on the other, so X1 <= 1 / (replica CPU-s per request). The bound on the 2-vs-1 goodput ratio
    is X2's bound over the measured 1-replica goodput (noisy: another tenant's load slows the single replica
    too), and, noise-free, over 1 / its CPU per request (`ideal_scaling_bound`: 2 r1 / (r2 + overhead)); with
    the rest of the machine's measured load (other processes) taken out of the 2 cores, it is tighter still. Per-request costs come from each configuration's
    point of highest offered load (the replicas saturated: their batch at its largest)."""
    def at_peak(name: str) -> dict:
        return max((r for r in rows if r["config"] == name), key=lambda r: r["offered_rps"])

    one, two = at_peak("1 replica"), at_peak("2 replicas")
    cores = float(os.cpu_count() or 2)
    r2, o2 = two["cpu_s_per_request"]["replicas"], two["cpu_s_per_request"]["overhead"]
    other_cores = two["cores_used"]["other"]
    x1 = best["1 replica"]["goodput_rps"] or 0.0
    x2_max, x2_max_shared = cores / (r2 + o2), max(0.0, cores - other_cores) / (r2 + o2)
    return {"cores": cores, "one_replica_cpu_s_per_request": one["cpu_s_per_request"],
            "two_replicas_cpu_s_per_request": two["cpu_s_per_request"],
            "one_replica_cores_used": one["cores_used"], "two_replicas_cores_used": two["cores_used"],
            "overhead_share_of_work": o2 / (r2 + o2),
            "x1_goodput_rps": x1, "x1_max_rps": 1.0 / max(1e-9, one["cpu_s_per_request"]["replicas"]),
            "x2_max_rps": x2_max, "x2_max_rps_with_other_load": x2_max_shared,
            "scaling_bound": x2_max / max(1e-9, x1), "scaling_bound_with_other_load": x2_max_shared / max(1e-9, x1),
            "ideal_scaling_bound": cores * one["cpu_s_per_request"]["replicas"] / (r2 + o2)}


def print_cpu(rows: list[dict], bound: dict[str, Any]) -> None:
    print(f"\nCPU ms per completed request (cores used in parentheses)\n{'config':<18} {'rate':>5} "
          + " ".join(f"{c[:10]:>15}" for c in COMPONENTS) + f" {'loadavg':>8}")
    for r in rows:
        cells = " ".join(f"{1e3 * r['cpu_s_per_request'][c]:7.1f} ({r['cores_used'][c]:4.2f})" for c in COMPONENTS)
        print(f"{r['config']:<18} {r['offered_rps']:5.2f} {cells} {r['cpu']['loadavg_after'][0]:8.2f}")
    print(f"overhead (all ours but the replicas) = {100 * bound['overhead_share_of_work']:.0f}% of the CPU per "
          f"request at 2 replicas; 2 replicas can do at most {bound['x2_max_rps']:.2f} req/s on "
          f"{bound['cores']:.0f} cores ({bound['x2_max_rps_with_other_load']:.2f} with the other load measured), "
          f"= {bound['scaling_bound']:.2f}x ({bound['scaling_bound_with_other_load']:.2f}x) the 1-replica goodput "
          f"{bound['x1_goodput_rps']:.2f}; vs a replica with a core to itself (1 / its CPU per request): "
          f"{bound['ideal_scaling_bound']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="small sizes (a few minutes; numbers not meaningful)")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[3.0, 6.0, 9.0])
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per point")
    p.add_argument("--groups", type=int, default=40, help="distinct shared prefixes (system prompts)")
    p.add_argument("--prefix-blocks", type=int, default=24, help="16-token blocks per shared prefix")
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--zipf", type=float, default=0.3)
    p.add_argument("--pool-mib", type=int, default=48,
                   help="each replica's KV pool (48 MiB: 512 pages; the 40 x 24-block prefixes need 960)")
    p.add_argument("--warm-s", type=float, default=12.0, help="warm-up seconds per deployment (same prefixes)")
    p.add_argument("--warm-rps", type=float, default=4.0)
    p.add_argument("--routing-stats-period-s", type=float, default=0.5,
                   help="how often replicas report KV usage and SLO headroom to the ingress's router")
    p.add_argument("--idle-s", type=float, default=10.0,
                   help="seconds of no load after the warm-up, to measure each component's background CPU (0: off)")
    p.add_argument("--stream-interval-ms", type=float, default=50.0,
                   help="the replicas' stream_interval_ms (0: every chunk as it comes)")
    p.add_argument("--ray-mode", choices=["throughput", "default"], default="throughput",
                   help="throughput: Ray Serve's throughput-optimised data plane (RAY_SERVE_THROUGHPUT_OPTIMIZED)")
    p.add_argument("--route", default="best", help="the large model: replicas, not the Ray proxy, are the bottleneck")
    p.add_argument("--slo", default="ttft=1000,tpot=100", help="client-side SLO for goodput (ms)")
    p.add_argument("--step-s", type=float, default=60.0, help="autoscaling: seconds at 1x, then at 3x")
    p.add_argument("--down-window-s", type=float, default=20.0, help="autoscaling: scale-down stabilisation")
    p.add_argument("--shrink-wait-s", type=float, default=120.0)
    p.add_argument("--no-autoscale", action="store_true")
    p.add_argument("--phases", default=",".join(PHASES),
                   help="what to run: one (1 replica), two (2, affinity), pow2 (2, power of two), ingress-ab "
                        "(proxy vs direct ingress, alternated), scale-up (forced 1 -> 2), autoscale")
    p.add_argument("--ingress", dest="ingress_mode", choices=["direct", "proxy"], default="direct",
                   help="direct: the ingress replica serves HTTP itself (no proxy hop); proxy: via Serve's proxy")
    p.add_argument("--ingress-port", type=int, default=30500, help="direct ingress: the first port tried")
    p.add_argument("--ab-rounds", type=int, default=1, help="ingress-ab: proxy/direct pairs")
    p.add_argument("--ab-rate", type=float, default=6.0, help="ingress-ab: offered req/s (2 replicas)")
    p.add_argument("--scale-up-rps", type=float, default=3.0, help="scale-up: the constant offered load")
    p.add_argument("--steady-s", type=float, default=40.0, help="scale-up: seconds at 1 replica before the order")
    p.add_argument("--steady-skip-s", type=float, default=5.0, help="scale-up: the steady window starts here")
    p.add_argument("--after-s", type=float, default=60.0, help="scale-up: seconds of load after the order")
    p.add_argument("--settle-s", type=float, default=10.0,
                   help="scale-up: the scale-up window ends this long after the second replica runs")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale_out.json")
    args = p.parse_args(argv)
    if args.smoke:
        args.rates, args.duration, args.step_s = [6.0, 10.0], 12.0, 20.0
        args.steady_s, args.after_s = 20.0, 40.0
        args.down_window_s, args.shrink_wait_s = 10.0, 90.0
        if args.out == ROOT / "bench" / "results" / "scale_out.json":
            args.out = args.out.with_name("scale_out_smoke.json")

    from deploy.testing import default_config_with_routes
    from traces.metrics import parse_slo

    if args.ray_mode == "throughput":
        os.environ.update(THROUGHPUT_ENV)
    args.config = default_config_with_routes(Path("/tmp") / f"tandem-scale-out-{os.getpid()}.toml")
    route, slo = parse_slo(f"{args.route}:{args.slo}")
    slos = {route: slo}
    phases = set(args.phases.split(","))
    unknown = phases - set(PHASES)
    if unknown:
        p.error(f"--phases: unknown {sorted(unknown)}; expected some of {','.join(PHASES)}")
    if args.no_autoscale:
        phases.discard("autoscale")
    started = time.time()
    rows: list[dict] = []
    result: dict[str, Any] = {"ingress": args.ingress_mode, "phases": sorted(phases)}
    print(f"shared-prefix workload: {args.groups} prefixes x {args.prefix_blocks * BLOCK} tokens + "
          f"{args.suffix_tokens} fresh, {args.output_tokens} out, rates {args.rates} req/s, {args.duration:g} s "
          f"each; Ray mode {args.ray_mode}; {args.ingress_mode} ingress; phases {sorted(phases)}; "
          f"loadavg {os.getloadavg()[0]:.2f}", flush=True)
    if "ingress-ab" in phases:  # proxy vs direct ingress, alternated, each in a Ray of its own
        ab: list[dict] = []
        for _round in range(args.ab_rounds):
            for mode in ("proxy", "direct"):
                with ray_session(args, mode):
                    ab += measure(args, f"2 replicas {mode}", 2, "affinity", slos, seed=1, rates=[args.ab_rate])
        result["ingress_ab"] = ingress_ab_summary(ab)
        print_ingress_ab(result["ingress_ab"])
        rows += ab
    with ray_session(args, args.ingress_mode):
        matrix = [(n, k, r) for n, k, r in (("1 replica", 1, "affinity"), ("2 replicas", 2, "affinity"),
                                           ("2 replicas pow2", 2, "pow2")) if PHASE_OF[n] in phases]
        for name, count, routing in matrix:
            rows += measure(args, name, count, routing, slos, seed=1)  # the same workload for each
        if "scale-up" in phases:
            result["scale_up"] = scale_up_run(args, slos)
            print_scale_up(result["scale_up"])
        result["rows"] = rows
        if rows:
            print(f"\n{'config':<18} {'rate':>5} {'done':>5} {'fail':>4} {'shed':>4} {'thr/s':>6} {'ttft50':>7} "
                  f"{'ttft99':>7} {'goodput':>7} {'hit':>6}")
            for r in rows:
                print(f"{r['config']:<18} {r['offered_rps']:5.2f} {r['completed']:5d} {r['failed']:4d} {r['shed']:4d} "
                      f"{r['throughput_rps']:6.2f} {r['ttft_p50_ms'] or 0:7.0f} {r['ttft_p99_ms'] or 0:7.0f} "
                      f"{r['goodput_rps'] or 0:7.2f} {r['prefix_hit_rate'] or 0:6.3f}")
        names = {r["config"] for r in rows}
        best = {name: max((r for r in rows if r["config"] == name), key=lambda r: r["goodput_rps"] or 0)
                for name in names}
        if {"1 replica", "2 replicas"} <= names:
            scaling = (best["2 replicas"]["goodput_rps"] or 0) / max(1e-9, best["1 replica"]["goodput_rps"] or 0)
            print(f"\ngoodput 2 vs 1 replica (best point each): {scaling:.2f}x (target >= 1.6x)")
            bound = cpu_bound(rows, best)
            print_cpu([r for r in rows if r["config"] in PHASE_OF], bound)
            result.update(goodput_scaling=scaling, cpu_bound=bound)
        if {"2 replicas", "2 replicas pow2"} <= names:
            hits_aff = [r["prefix_hit_rate"] or 0 for r in rows if r["config"] == "2 replicas"]
            hits_p2 = [r["prefix_hit_rate"] or 0 for r in rows if r["config"] == "2 replicas pow2"]
            hit_ratio = float(np.median(hits_aff)) / max(1e-9, float(np.median(hits_p2)))
            print(f"prefix hit rate affinity vs power of two (median over rates): {hit_ratio:.2f}x (target >= 1.5x)")
            result["hit_rate_ratio"] = hit_ratio
        if rows:
            prefix_pages = args.groups * args.prefix_blocks * PAGES_PER_BLOCK
            pool_pages = rows[0]["pool_pages"]
            print(f"distinct prefixes need {prefix_pages} pages; one replica's pool holds {pool_pages} "
                  f"({prefix_pages / pool_pages:.2f} pools' worth)")
            result.update(prefix_pages=prefix_pages, pool_pages=pool_pages,
                          prefix_pages_per_pool=prefix_pages / pool_pages)
        if "autoscale" in phases:
            # one replica's capacity: its highest completed throughput; its in-flight count there sets the target
            ones = [r for r in rows if r["config"] == "1 replica"]
            one = max(ones, key=lambda r: r["throughput_rps"]) if ones else {"throughput_rps": args.scale_up_rps,
                                                                             "mean_in_flight": 4.0}
            capacity = max(0.5, one["throughput_rps"])
            auto = autoscale_run(args, capacity, one["mean_in_flight"], slos)
            print(f"\nautoscaling: 1x = {capacity:.2f} req/s for {args.step_s:g} s, then 3x; target_ongoing_requests "
                  f"{auto['target_ongoing_requests']:.1f}")
            print("  t_s  running  changing")
            last = None
            for pnt in auto["timeline"]:
                key = (pnt["running"], pnt["changing"])
                if key != last:
                    print(f"  {pnt['t_s']:5.1f}  {pnt['running']:7d}  {pnt['changing']:8d}")
                    last = key
            print(f"  requests {auto['requests']}; peak {auto['peak_replicas']} replicas (2 at {auto['grew_to_2_at_s']} s),"
                  f" load ended at {auto['load_end_s']} s, back to 1 at {auto['back_to_1_at_s']} s")
            result["autoscale"] = auto
    result["metadata"] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                          "cpus": os.cpu_count(), "wall_s": round(time.time() - started, 1),
                          "loadavg_end": list(os.getloadavg()),
                          "note": "each replica pinned to one core; ingress, proxy and load generator share them"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_results(args.out, result, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
