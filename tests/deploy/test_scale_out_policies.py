"""The scale-out pieces without a Ray cluster: the prompt's chained block hashes, the router's policy (prefix
affinity against load, KV and SLO pressure, power of two otherwise, route-aware), the autoscaling policy on
tandem's signals (up at once, down after the window), the ingress's routing key, the in-process ASGI bridge
(disconnect reaches the app), the application's options.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed (make test installs it)")

from deploy.autoscale_policy import TandemAutoscalingPolicy, fleet_signals  # noqa: E402
from deploy.ingress import routing_key  # noqa: E402
from deploy.prefix import BLOCK_CHARS, block_hashes, prompt_text  # noqa: E402
from deploy.ray_serve import ScaleOutOptions, _coerce, build_app  # noqa: E402
from deploy.replica import TandemReplica, call_asgi  # noqa: E402
from deploy.router import AffinityTable, ReplicaLoad, RoutingSettings, rank  # noqa: E402

PREFIX = "x" * (BLOCK_CHARS * 4)


def test_block_hashes_chain_the_prefix_and_depend_on_the_route():
    a = block_hashes("fast", PREFIX + "tail one")
    b = block_hashes("fast", PREFIX + "y" * BLOCK_CHARS)
    assert len(a) == 4 and len(b) == 5 and a == b[:4]  # full blocks only; equal prefixes, equal hashes
    assert block_hashes("best", PREFIX) != a  # another route: another engine's pages
    changed = block_hashes("fast", "z" + PREFIX[1:])
    assert all(x != y for x, y in zip(changed, a))  # the chain: a change in block 0 changes every hash
    assert block_hashes("fast", list(range(40))) == block_hashes("fast", list(range(32)) + [7])  # 2 token blocks
    assert len(block_hashes("fast", list(range(40)))) == 2


def test_prompt_text_reads_chat_and_completion_bodies():
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert prompt_text(chat) == "<system>Be brief.\n<user>Hi\n"
    assert prompt_text({"prompt": "abc"}) == "abc" and prompt_text({"prompt": ["abc"]}) == "abc"
    assert prompt_text({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_text({}) is None


def test_routing_key_only_for_generation_bodies_that_parse():
    body = b'{"model": "fast", "prompt": "' + PREFIX.encode() + b'"}'
    key = routing_key("/v1/completions", body, affinity=True)
    assert key["route"] == "fast" and len(key["hashes"]) == 4 and key["affinity"] is True
    assert routing_key("/v1/models", body, affinity=True) == {}
    assert routing_key("/v1/completions", b"{bad", affinity=True) == {}  # the replica answers the 400


def loads(*specs: tuple) -> list[ReplicaLoad]:
    return [ReplicaLoad(id=i, queue_len=q, kv_usage=kv, slo_headroom=h, routes=frozenset(["fast", "best"]))
            for i, q, kv, h in specs]


def test_prefix_holder_wins_unless_it_is_overloaded():
    table, settings, rng = AffinityTable(), RoutingSettings(max_imbalance=4), random.Random(0)
    hashes = block_hashes("fast", PREFIX)
    table.record(hashes, "b")
    ranks, why = rank(loads(("a", 0, 0, 0), ("b", 3, 0, 0)), "fast", hashes, table, settings, rng)
    assert ranks[0] == ["b"] and why == "prefix: 4 blocks"
    ranks, why = rank(loads(("a", 0, 0, 0), ("b", 5, 0, 0)), "fast", hashes, table, settings, rng)
    assert why == "power of two" and ranks[0] == ["a"]  # 5 more in flight than the idle one: balance wins


def test_longest_chain_wins_and_a_broken_chain_does_not_count():
    table, settings, rng = AffinityTable(), RoutingSettings(), random.Random(0)
    long, short = block_hashes("fast", PREFIX), block_hashes("fast", PREFIX[:BLOCK_CHARS * 2])
    table.record(short, "a")
    table.record(long, "b")
    table.record(long[2:], "c")  # later blocks without the first ones: no prefix of c's
    assert table.matched_blocks(long, ["a", "b", "c"]) == {"a": 2, "b": 4, "c": 0}
    ranks, _ = rank(loads(("a", 0, 0, 0), ("b", 0, 0, 0)), "fast", long, table, settings, rng)
    assert ranks[0] == ["b"]


def test_kv_and_slo_pressure_move_a_prefix_only_when_another_replica_has_room():
    table, settings, rng = AffinityTable(), RoutingSettings(), random.Random(0)
    hashes = block_hashes("fast", PREFIX)
    table.record(hashes, "a")
    _, why = rank(loads(("a", 0, 0.97, 0), ("b", 0, 0.2, 0)), "fast", hashes, table, settings, rng)
    assert why == "power of two"
    _, why = rank(loads(("a", 0, 0.97, 0), ("b", 0, 0.98, 0)), "fast", hashes, table, settings, rng)
    assert why.startswith("prefix")  # every pool is full: the cached prefix still saves work
    _, why = rank(loads(("a", 0, 0, -0.2), ("b", 0, 0, 0.0)), "fast", hashes, table, settings, rng)
    assert why == "power of two"
    _, why = rank(loads(("a", 0, 0, -0.2), ("b", 0, 0, -0.18)), "fast", hashes, table, settings, rng)
    assert why.startswith("prefix")


def test_affinity_off_is_power_of_two_and_routes_filter_replicas():
    table, rng = AffinityTable(), random.Random(1)
    hashes = block_hashes("fast", PREFIX)
    table.record(hashes, "a")
    picks = {rank(loads(("a", 0, 0, 0), ("b", 0, 0, 0)), "fast", hashes, table, RoutingSettings(affinity=False),
                  rng)[0][0][0] for _ in range(40)}
    assert picks == {"a", "b"}
    mixed = [ReplicaLoad("a", 0, routes=frozenset(["fast"])), ReplicaLoad("b", 0, routes=frozenset(["best"]))]
    assert rank(mixed, "best", [], table, RoutingSettings(), rng)[0] == [["b"]]
    assert sorted(g[0] for g in rank(mixed, "nope", [], table, RoutingSettings(), rng)[0]) == ["a", "b"]


def test_affinity_table_is_bounded_and_forgets_dead_replicas():
    table = AffinityTable(capacity=3)
    table.record([1, 2, 3, 4], "a")
    assert len(table) == 3 and table.matched_blocks([1], ["a"]) == {"a": 0}  # the oldest block went
    table.forget("a")
    assert table.matched_blocks([2, 3], ["a"]) == {"a": 0}


def ctx(current: int, target: int, metrics: dict, running: list[str] | None = None) -> SimpleNamespace:
    running = running if running is not None else sorted(metrics.get("ongoing", {}))
    return SimpleNamespace(current_num_replicas=current, target_num_replicas=target, aggregated_metrics=metrics,
                           running_replicas=running, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4)


def test_fleet_signals_weigh_ongoing_against_the_queue_target():
    s = fleet_signals({"waiting": {"a": 0.0, "b": 2.0}, "ongoing": {"a": 16.0, "b": 16.0},
                       "kv_usage": {"a": 0.2, "b": 0.4}, "slo_headroom": {"a": 0.0, "b": -0.1}}, 2,
                      target_waiting=8.0, target_ongoing=8.0)
    assert s.waiting_per_replica == 16.0 and s.kv_usage == pytest.approx(0.3)
    half = fleet_signals({"ongoing": {"a": 16.0}}, 2, target_waiting=8.0, target_ongoing=8.0)
    assert half.waiting_per_replica == 16.0  # b sent nothing: it is not counted as idle
    assert s.slo_attainment["fleet"] == pytest.approx(0.9) and s.slo_targets["fleet"] == 1.0


def test_policy_scales_up_at_once_and_down_only_after_the_window(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("deploy.autoscale_policy.time.monotonic", lambda: now[0])
    policy = TandemAutoscalingPolicy(target_ongoing_requests=4.0, down_stabilization_s=30.0, down_cooldown_s=10.0,
                                     max_replicas=4, slo_up_cooldown_s=1000.0)
    busy = {"ongoing": {"r1": 12.0}, "waiting": {"r1": 0.0}, "kv_usage": {"r1": 0.1}}
    n, state = policy(ctx(1, 1, busy))
    assert n == 3 and "scale up 1 -> 3 at once" in state["reasons"]
    idle = {"ongoing": {"a": 0.0, "b": 0.0, "c": 0.0}, "kv_usage": {"a": 0.0, "b": 0.0, "c": 0.0}}
    decisions = []
    for t in range(1, 60, 5):
        now[0] = float(t)
        decisions.append((t, policy(ctx(3, 3 if not decisions else decisions[-1][1], idle))[0]))
    first_down = next(t for t, n in decisions if n < 3)
    assert first_down >= 30  # the stabilisation window
    assert decisions[-1][1] < 3 and all(b - a <= 1 for (_, a), (_, b) in zip(decisions[1:], decisions[:-1]))


async def test_asgi_bridge_streams_and_tells_the_app_when_the_caller_leaves():
    seen: list[str] = []

    async def app(scope, receive, send):
        assert (await receive())["type"] == "http.request"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        seen.append((await receive())["type"])  # blocks until the caller goes away

    stream = call_asgi(app, "POST", "/v1/completions", [], b"{}", extra_headers={"x-tandem-replica": "r"})
    start = await anext(stream)
    assert start["status"] == 200 and ("x-tandem-replica", "r") in start["headers"]
    assert await anext(stream) == b"data: 1\n\n"
    await stream.aclose()
    await asyncio.sleep(0)
    assert seen == ["http.disconnect"]


def test_options_from_serve_run_arguments_and_their_checks():
    o = _coerce({"replicas": "3", "num_gpus": "1", "routing": "pow2", "overrides": '{"kv_pool.block_size": 32}'})
    assert (o.replicas, o.num_gpus, o.routing, o.overrides) == (3, 1.0, "pow2", {"kv_pool.block_size": 32})
    with pytest.raises(ValueError, match="routing"):
        ScaleOutOptions(routing="random")
    with pytest.raises(ValueError, match="min_replicas"):
        ScaleOutOptions(autoscale=True, replicas=9, max_replicas=8)
    app = build_app(ScaleOutOptions(autoscale=True, replicas=1, num_gpus=1))
    assert app is not None


def test_policy_does_not_shrink_while_a_running_replica_is_silent(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("deploy.autoscale_policy.time.monotonic", lambda: now[0])
    policy = TandemAutoscalingPolicy(target_ongoing_requests=4.0, down_stabilization_s=0.0, down_cooldown_s=0.0)
    idle_b = {"ongoing": {"b": 0.0}, "kv_usage": {"b": 0.0}}
    now[0] = 10.0
    assert policy(ctx(2, 2, idle_b, running=["a", "b"]))[0] == 2  # a, busy, missed its report
    now[0] = 20.0
    assert policy(ctx(2, 2, idle_b, running=["b"]))[0] == 1


def test_a_prefix_stays_with_its_home_after_one_request_went_elsewhere():
    table, settings, rng = AffinityTable(), RoutingSettings(), random.Random(0)
    hashes = block_hashes("fast", PREFIX)
    for _ in range(3):
        table.record(hashes, "home")
    table.record(hashes, "other")  # once, while home was busy
    ranks, why = rank(loads(("home", 2, 0, 0), ("other", 0, 0, 0)), "fast", hashes, table, settings, rng)
    assert ranks[0] == ["home"] and why.startswith("prefix")


def test_tandem_serve_ray_hands_over_to_the_ray_serve_runner(capsys):
    from gateway.server import main as serve_main

    with pytest.raises(SystemExit) as exit_info:
        serve_main(["--ray", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tandem serve --ray") and "--replicas" in out and "--routing" in out


def test_the_imbalance_bound_grows_with_load_and_counts_kv_usage():
    table, settings, rng = AffinityTable(), RoutingSettings(max_imbalance=2, imbalance_ratio=0.25), random.Random(0)
    hashes = block_hashes("fast", PREFIX)
    table.record(hashes, "a")
    assert rank(loads(("a", 3, 0, 0), ("b", 0, 0, 0)), "fast", hashes, table, settings, rng)[1] == "power of two"
    _, why = rank(loads(("a", 21, 0, 0), ("b", 16, 0, 0)), "fast", hashes, table, settings, rng)
    assert why.startswith("prefix")  # 5 more than 16 in flight: within 2 + 0.25 * 16
    ranks, why = rank(loads(("a", 23, 0, 0), ("b", 16, 0, 0)), "fast", hashes, table, settings, rng)
    assert why == "power of two" and ranks[0] == ["b"]
    _, why = rank(loads(("a", 1, 0.9, 0), ("b", 0, 0, 0)), "fast", hashes, table, settings, rng)
    assert why == "power of two"  # 1 in flight + 0.9 of a pool (2 requests' weight) is 2.8 > 2


async def test_asgi_bridge_sends_the_body_messages_already_waiting_as_one_chunk():
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(3):
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    items = [item async for item in call_asgi(app, "POST", "/v1/completions", [], b"{}")]
    assert items[0]["status"] == 200
    assert items[1:] == [b"data: 0\n\ndata: 1\n\ndata: 2\n\n"]


async def test_asgi_bridge_with_a_stream_interval_holds_later_chunks_but_never_the_first():
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(4):
            await send({"type": "http.response.body", "body": f"{i};".encode(), "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    items = [item async for item in call_asgi(app, "POST", "/v1/completions", [], b"{}", stream_interval_s=0.5)]
    assert items[1:] == [b"0;", b"1;2;3;"]  # the first token at once, the rest after the interval, together
    items = [item async for item in call_asgi(app, "POST", "/v1/completions", [], b"{}")]
    assert items[1:] == [b"0;", b"1;", b"2;", b"3;"]


def _replica_with(state) -> TandemReplica:
    replica = TandemReplica.__new__(TandemReplica)
    replica.state = state
    return replica


def test_health_check_fails_while_loading_on_a_load_error_and_when_the_engine_loop_stalls():
    """Serve's `check_health`: raising takes the replica out of routing (and Serve replaces it)."""
    stalled_for = {"value": None}
    host = SimpleNamespace(stalled=lambda after_s: stalled_for["value"])
    cfg = SimpleNamespace(preparation=SimpleNamespace(stall_after_s=30.0))
    state = SimpleNamespace(cfg=cfg, host=None, load_error=None, ready=False)
    with pytest.raises(RuntimeError, match="not loaded"):
        _replica_with(state).check_health()
    state.load_error = "checkpoint missing"
    with pytest.raises(RuntimeError, match="checkpoint missing"):
        _replica_with(state).check_health()
    state.load_error, state.host, state.ready = None, host, True
    assert _replica_with(state).check_health() is None
    stalled_for["value"] = "engine loop: step running for 41.0 s"
    with pytest.raises(RuntimeError, match="engine loop: step running for 41.0 s"):
        _replica_with(state).check_health()


async def test_a_replica_warms_every_engine_up_before_its_constructor_returns(tmp_path):
    """The constructor (what Serve waits for before it routes to a replica) streams a short completion per
    engine through the app; requests counted from `handle` start after it (`first_request_at` > `ready_at`)."""
    from deploy.testing import default_config_with_routes

    config = default_config_with_routes(tmp_path / "tandem.toml", routes=("fast",))
    replica = await TandemReplica.create(str(config), {"kv_pool.memory_bytes": "32MiB"}, warmup_tokens=2)
    try:
        engines = sorted(replica.state.engines)
        assert len(engines) >= 2 and replica.warmed == dict.fromkeys(engines, 200)
        for name, stats in replica.state.engine_stats().items():
            assert stats["num_generated_tokens"] >= 2 and stats["num_running"] == 0, (name, stats)
        report = replica.record_routing_stats()
        assert report["ready_at"] is not None and report["first_request_at"] is None and report["served"] == 0
        request = {"method": "POST", "path": "/v1/completions", "headers": [("content-type", "application/json")],
                   "body": b'{"model": "fast", "prompt": "hi", "max_tokens": 1}', "query": ""}
        statuses = [item["status"] async for item in replica.handle(request) if isinstance(item, dict)]
        assert statuses == [200]
        report = replica.record_routing_stats()
        assert report["first_request_at"] >= report["ready_at"] and report["served"] == 1
    finally:
        await replica.shutdown()


async def test_asgi_bridge_can_send_the_first_body_chunk_with_the_start():
    """`body_with_start` (what `TandemReplica.handle` uses): one Ray item fewer per response; a response
    with no body still yields its start, and the later chunks are unchanged."""
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": [(b"x-a", b"1")]})
        for i in range(3):
            await send({"type": "http.response.body", "body": f"{i};".encode(), "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    items = [item async for item in call_asgi(app, "POST", "/v1/completions", [], b"{}", body_with_start=True)]
    assert items == [{"status": 201, "headers": [("x-a", "1")], "body": b"0;"}, b"1;", b"2;"]

    async def empty(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    items = [item async for item in call_asgi(empty, "GET", "/x", [], b"", body_with_start=True)]
    assert items == [{"status": 204, "headers": [], "body": b""}]

    async def start_only(scope, receive, send):  # the app returned after its start, no body message
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})

    items = [item async for item in call_asgi(start_only, "GET", "/x", [], b"", body_with_start=True)]
    assert items == [{"status": 200, "headers": []}]
