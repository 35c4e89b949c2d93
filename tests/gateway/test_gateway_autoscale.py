"""`/v1/autoscale` over HTTP with a fake engine host whose load the test sets: a GET is safe (it previews and
changes no hysteresis, whatever `replicas` it names), `replicas` is bounded by [autoscale] max_replicas, the
gateway's own periodic evaluation advances the hysteresis, and POST reports the replica count and evaluates.
Plus the policy's preview without HTTP.
"""

from __future__ import annotations

import time

import httpx
import pytest

from gateway.autoscale import Autoscaler, Hysteresis, ScaleSignals
from gateway.config import AutoscaleConfig, config_from_dict
from gateway.server import ServerThread


class _Engine:
    name = "e"
    max_model_len = 512

    def __init__(self) -> None:
        self.load = {"num_waiting": 0, "kv_usage": 0.0}

    def stats(self) -> dict:
        return dict(self.load)


class _Host:
    def __init__(self, engine: _Engine):
        self.e = engine

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def engine(self, name: str) -> _Engine:
        return self.e

    def stats(self) -> dict:
        return {"engines": {"e": self.e.stats()}, "pool": {"used_pages": 0}}


def _serve(interval_s: float) -> tuple[ServerThread, _Engine]:
    engine = _Engine()
    cfg = config_from_dict({"engines": {"e": {"checkpoint": "/unused"}},
                            "autoscale": {"max_replicas": 8, "evaluation_interval_s": interval_s}})
    return ServerThread(cfg, host_factory=lambda: _Host(engine)), engine


@pytest.fixture(scope="module")
def idle_server():
    """Periodic evaluations far apart: only the test's own calls could move the hysteresis."""
    srv, _ = _serve(3600.0)
    with srv:
        yield srv


def test_a_get_naming_the_maximum_does_not_pin_the_recommendation(idle_server):
    url = idle_server.url + "/v1/autoscale"
    for _ in range(5):
        pinned = httpx.get(url, params={"replicas": 8}).json()
        assert pinned["current_replicas"] == 8 and pinned["desired_replicas"] == 7  # idle: down one at a time
    after = httpx.get(url, params={"replicas": 1}).json()
    assert (after["desired_replicas"], after["action"]) == (1, "hold")
    assert idle_server.app.state.gateway.autoscaler.state == Hysteresis()  # nothing remembered


@pytest.mark.parametrize("replicas", ["0", "9", "-1", "1000000000000", "two"])
def test_replicas_outside_one_to_max_replicas_is_a_400_naming_it(idle_server, replicas):
    for method in ("GET", "POST"):
        r = httpx.request(method, idle_server.url + "/v1/autoscale", params={"replicas": replicas})
        assert r.status_code == 400, (method, r.text)
        assert r.json()["error"]["param"] == "replicas"


def test_the_gateways_own_periodic_evaluation_advances_the_hysteresis():
    srv, engine = _serve(0.05)
    with srv:
        scaler = srv.app.state.gateway.autoscaler
        engine.load["num_waiting"] = 40  # five times the target of 8 per replica
        deadline = time.monotonic() + 10
        while scaler.desired != 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert scaler.desired == 5  # scaled up with no caller at all
        engine.load["num_waiting"] = 0
        time.sleep(0.3)  # several idle evaluations: the stabilisation window keeps the high mark
        held = httpx.get(srv.url + "/v1/autoscale").json()
        assert (held["desired_replicas"], held["recommended_replicas"]) == (5, 1)
        assert any("hold 5" in r for r in held["reasons"])


def test_post_reports_the_replica_count_and_evaluates_at_once(idle_server):
    scaler = idle_server.app.state.gateway.autoscaler
    before = scaler.state
    r = httpx.post(idle_server.url + "/v1/autoscale", params={"replicas": 3}).json()
    assert (r["current_replicas"], r["desired_replicas"], r["action"]) == (3, 2, "scale_down")  # idle: one down
    assert scaler.replicas == 3 and scaler.desired == 2 and scaler.state != before
    plain = httpx.get(idle_server.url + "/v1/autoscale").json()  # without replicas: the reported count
    assert (plain["current_replicas"], plain["desired_replicas"], plain["action"]) == (3, 2, "hold")
    assert any("cool-down" in reason for reason in plain["reasons"])  # the POST's change is remembered
    with pytest.raises(httpx.HTTPStatusError):  # POST must name the count
        httpx.post(idle_server.url + "/v1/autoscale").raise_for_status()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_preview_decides_as_evaluate_would_and_remembers_nothing():
    clock = _Clock()
    scaler = Autoscaler(AutoscaleConfig(max_replicas=8), clock=clock)
    busy = ScaleSignals(current_replicas=2, waiting_per_replica=32, kv_usage=0.1)
    idle = ScaleSignals(current_replicas=2, waiting_per_replica=0, kv_usage=0.0)
    for _ in range(3):
        assert scaler.preview(busy).desired_replicas == 6  # 2 + max(4, 2): up at once, by the step limit
    assert scaler.state == Hysteresis()
    assert scaler.preview(busy) == scaler.evaluate(busy)  # the same decision; only evaluate remembers it
    assert scaler.desired == 6
    clock.now += 15
    assert scaler.preview(idle).desired_replicas == 6  # the high mark of the window holds
    window = scaler.state.window
    scaler.preview(ScaleSignals(current_replicas=8, waiting_per_replica=1000, kv_usage=1.0))
    assert scaler.state.window == window and scaler.desired == 6
