"""tandem on a local Ray cluster (this CPU machine, 2 CPUs, a small object store): 2 replicas of the default
tiny models behind the Ray Serve OpenAI endpoint. The official openai client streams through it; requests
sharing a long prefix land on one replica (the pools' prefix hit rate with affinity vs power of two is
printed); killing a replica mid-stream ends its clients' streams with an error event, the next requests
succeed on the other replica, Ray starts a replacement, and the survivor's pool holds no pages; scaling 2 -> 1
drains the removed replica (its streams finish whole). One Ray session for the module.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid

import httpx
import msgspec
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (make test installs it)")
openai = pytest.importorskip("openai")

from ray import serve  # noqa: E402

from deploy.ray_serve import ScaleOutOptions, build_app, replica_actors, replica_stats  # noqa: E402
from deploy.testing import default_config_with_routes  # noqa: E402
from gateway.server import free_port  # noqa: E402

pytestmark = pytest.mark.ray

APP = "tandem"
OPTIONS: dict[str, ScaleOutOptions] = {}


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    config = default_config_with_routes(tmp_path_factory.mktemp("ray") / "tandem.toml")
    ray.init(num_cpus=2, object_store_memory=96 * 1024 * 1024, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = ScaleOutOptions(config=str(config), replicas=2, allow_routing_override=True,
                                  overrides={"kv_pool.memory_bytes": "64MiB"}, routing_stats_period_s=0.5,
                                  health_check_period_s=1.0, max_imbalance=64.0)
        serve.run(build_app(options), name=APP, route_prefix="/")
        OPTIONS["deployed"] = options
        url = f"http://127.0.0.1:{port}"
        wait_for_replicas(2)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_for_replicas(n: int, timeout_s: float = 180.0, exclude: set[str] = frozenset()) -> dict[str, dict]:
    """Until `n` replicas (none of `exclude`) answer their stats; returns them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = {rid: s for rid, s in replica_stats(APP, timeout_s=2.0).items() if rid not in exclude}
        if len(stats) >= n:
            return stats
        time.sleep(0.5)
    raise TimeoutError(f"{n} replicas not running within {timeout_s} s")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_client_streams_through_the_ray_endpoint(endpoint):
    raw = client(endpoint).chat.completions.with_raw_response.create(
        model="fast", messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=12,
        stream=True, stream_options={"include_usage": True})
    assert raw.headers["x-tandem-route"] == "fast"
    assert raw.headers["x-tandem-model"] == "tandem-small"
    assert raw.headers["x-tandem-replica"] in replica_actors(APP)
    assert raw.headers["content-type"].startswith("text/event-stream")
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12 and text


def test_errors_keep_tandem_semantics_through_the_ingress(endpoint):
    with pytest.raises(openai.NotFoundError) as err:
        client(endpoint).completions.create(model="no-such-route", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    bad = httpx.post(endpoint + "/v1/chat/completions", content=b"{not json", timeout=60,
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    models = httpx.get(endpoint + "/v1/models", timeout=60).json()
    assert {"fast", "best", "tandem-small", "tandem-large"} <= {m["id"] for m in models["data"]}


def _pool_counters() -> tuple[int, int]:
    stats = replica_stats(APP)
    return (sum(s["prefix_cache_queries"] for s in stats.values()),
            sum(s["prefix_cache_hits"] for s in stats.values()))


def _shared_prefix_phase(url: str, routing: str, groups: int, per_group: int) -> tuple[float, dict[int, set]]:
    """Sequential requests, `groups` fresh long prefixes of `per_group` requests each; returns the pools'
    prefix hit rate over the phase (hit prompt tokens / prompt tokens) and the replicas each group met."""
    tag = uuid.uuid4().hex[:8]
    q0, h0 = _pool_counters()
    seen: dict[int, set] = {g: set() for g in range(groups)}
    with httpx.Client(timeout=120) as http:
        for i in range(per_group):
            for g in range(groups):
                prefix = f"[{tag}-{g}] " + " ".join(f"policy clause {g}.{k} applies to every answer." for k in range(30))
                r = http.post(url + "/v1/completions", headers={"x-tandem-routing": routing},
                              json={"model": "fast", "prompt": f"{prefix}\nQuestion {i}: what now?", "max_tokens": 2})
                assert r.status_code == 200, r.text
                seen[g].add(r.headers["x-tandem-replica"])
    q1, h1 = _pool_counters()
    return (h1 - h0) / max(1, q1 - q0), seen


def test_shared_prefixes_land_on_one_replica_and_hit_its_cache(endpoint):
    groups, per_group = 4, 6
    affinity_rate, affinity_seen = _shared_prefix_phase(endpoint, "affinity", groups, per_group)
    pow2_rate, pow2_seen = _shared_prefix_phase(endpoint, "pow2", groups, per_group)
    print(f"\nprefix hit rate over {groups} x {per_group} requests: affinity {affinity_rate:.3f} "
          f"(replicas per prefix {[len(s) for s in affinity_seen.values()]}), power of two {pow2_rate:.3f} "
          f"(replicas per prefix {[len(s) for s in pow2_seen.values()]})")
    assert all(len(s) == 1 for s in affinity_seen.values())  # every request of a prefix on one replica
    # each prefix's first request misses and its other 5 hit every full block of the ~300-token prefix: ~0.82
    assert affinity_rate >= 0.75
    if any(len(s) == 2 for s in pow2_seen.values()):  # the baseline split a prefix: a second cold prefill
        assert affinity_rate > pow2_rate
    else:  # sequential requests can all meet one replica under power of two (the other's cost is higher: an
        # SLO missed by its first, cold requests, or KV in use when it reported), so the placement is the same
        assert pow2_rate == pytest.approx(affinity_rate, abs=0.02)


def _stream_until_error(url: str, prompt: str, started: threading.Event, replica: list[str],
                        headers: dict[str, str] | None = None, max_tokens: int = 400) -> str:
    """Stream a long completion (the large model, to the 512-token context); returns how it ended: 'error: ...'
    (an error event) or 'finished N' (N completion tokens)."""
    raw = client(url).completions.with_raw_response.create(
        model="best", prompt=prompt, max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True}, extra_headers=headers or {})
    replica.append(raw.headers["x-tandem-replica"])
    usage = None
    try:
        for n, chunk in enumerate(raw.parse()):
            if n == 2:
                started.set()
            usage = chunk.usage or usage
    except openai.APIError as exc:
        return f"error: {exc}"
    return f"finished {usage.completion_tokens if usage else None}"


def test_killing_a_replica_mid_stream_ends_its_streams_and_the_next_requests_succeed(endpoint):
    prompt = "The same system prompt for both clients. " * 5  # affinity: both on one replica
    started = [threading.Event(), threading.Event()]
    replicas: list[list[str]] = [[], []]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(_stream_until_error, endpoint, prompt, started[i], replicas[i]) for i in range(2)]
        deadline = time.monotonic() + 120
        while not all(e.is_set() for e in started):
            assert time.monotonic() < deadline, "the streams did not start"
            for s in streams:
                if s.done():
                    s.result()  # raises what stopped a stream before it started
            time.sleep(0.05)
        assert replicas[0] == replicas[1]
        victim = replicas[0][0]
        survivor = next(r for r in replica_actors(APP) if r != victim)
        ray.kill(replica_actors(APP)[victim])
        ends = [s.result(timeout=60) for s in streams]  # never a hang
    assert all(e.startswith("error") and "replica" in e for e in ends), ends  # the error event, then the end
    for i in range(3):  # the next requests succeed on the surviving replica
        r = client(endpoint).completions.with_raw_response.create(model="fast", prompt=prompt + str(i), max_tokens=4)
        assert r.headers["x-tandem-replica"] != victim
        assert r.parse().choices[0].text is not None
    replacement = wait_for_replicas(2, exclude={victim})  # Ray Serve starts a new replica
    assert survivor in replacement and len(replacement) == 2
    time.sleep(1.0)  # the survivor's requests have all finished: its pool holds no pages
    assert replica_stats(APP)[survivor]["used_pages"] == 0


def test_scaling_down_drains_the_removed_replicas_streams(endpoint):
    wait_for_replicas(2)
    n = 4
    started = [threading.Event() for _ in range(n)]
    replicas: list[list[str]] = [[] for _ in range(n)]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        streams = [pool.submit(_stream_until_error, endpoint, f"Drain test {i} {uuid.uuid4().hex}. " * 4, started[i],
                               replicas[i], {"x-tandem-routing": "pow2"}, 300) for i in range(n)]
        deadline = time.monotonic() + 120
        while not all(e.is_set() for e in started):
            assert time.monotonic() < deadline, "the streams did not start"
            for s in streams:
                if s.done():
                    s.result()
            time.sleep(0.05)
        used = {r[0] for r in replicas}
        assert not any(s.done() for s in streams)  # every stream is mid-flight when the count drops
        serve.run(build_app(msgspec.structs.replace(OPTIONS["deployed"], replicas=1)), name=APP, route_prefix="/")
        ends = [s.result(timeout=120) for s in streams]
    assert ends == ["finished 300"] * n, ends  # in-flight requests finish on the replica being removed
    assert len(used) == 2  # power of two spread them: one of the two replicas was drained
    deadline = time.monotonic() + 60
    while len(replica_actors(APP)) != 1:
        assert time.monotonic() < deadline, "the removed replica did not stop"
        time.sleep(0.5)
    r = client(endpoint).completions.create(model="fast", prompt="after the drain", max_tokens=3)
    assert r.usage.completion_tokens == 3


async def test_two_replicas_share_one_keys_limit_through_the_bank_actor(endpoint, tmp_path):
    """Issue 33 item 6: per-key limits counted inside each replica let N replicas admit N times the limit. Two
    whole replicas (the Ray Serve replica class, built in this process) lease from one bank actor in the
    module's Ray cluster; a burst of 240 one-token requests spread over both admits the key's 60 per minute
    (plus what refills while the burst runs), within 10%."""
    import asyncio
    import json

    from deploy.replica import TandemReplica

    config = default_config_with_routes(tmp_path / "tandem.toml", routes=("fast",))
    bank = f"test-bank-{uuid.uuid4().hex[:8]}"
    overrides = {"kv_pool.memory_bytes": "32MiB",
                 "auth.api_keys": [{"key": "sk-burst-0001", "requests_per_minute": 60}]}
    replicas = [await TandemReplica.create(str(config), overrides, limits_bank=bank) for _ in range(2)]
    body = json.dumps({"model": "fast", "prompt": "def f():", "max_tokens": 1}).encode()
    headers = [("authorization", "Bearer sk-burst-0001"), ("content-type", "application/json")]

    async def one(replica: TandemReplica) -> int:
        request = {"method": "POST", "path": "/v1/completions", "headers": headers, "body": body, "query": ""}
        async for item in replica.handle(request):
            if isinstance(item, dict):
                status = item["status"]
        return status

    try:
        start = time.monotonic()
        statuses = await asyncio.gather(*(one(replicas[i % 2]) for i in range(240)))
        elapsed = time.monotonic() - start
    finally:
        for replica in replicas:
            await replica.shutdown()
    allowed = 60 + elapsed * 60 / 60  # the minute's budget and its refill while the burst ran
    ok = statuses.count(200)
    print(f"\nshared limit, 2 replicas: {ok} of 240 admitted in {elapsed:.1f} s (limit {allowed:.0f})")
    assert set(statuses) <= {200, 429}, statuses
    assert 60 * 0.9 <= ok <= allowed * 1.1, (ok, allowed)
