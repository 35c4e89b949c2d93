"""`tandem serve` leaves one CPU to its event loop when the engine threads are automatic."""

from __future__ import annotations

import os

import torch


def test_the_server_leaves_one_cpu_to_its_event_loop(monkeypatch):
    """The gateway's engine core reserves one CPU: automatic threads are the CPUs less one (at least one).
    On 2 cores, 2 engine threads made the event loop wait for the kernels (docs/configuration.md)."""
    import engines
    from engines.core import cpu_threads
    from gateway import engine_setup as gateway_app
    from gateway.config import load_config

    seen = {}

    class Core:
        def __init__(self, specs, pool, device="cpu", reserve_cpus=0, compile_limits=None):
            seen["reserve"] = reserve_cpus

    monkeypatch.setattr(engines, "EngineCore", Core)
    gateway_app.default_host_factory(load_config())()
    assert seen["reserve"] == gateway_app.SERVER_RESERVED_CPUS == 1
    cpus = len(os.sched_getaffinity(0))
    assert cpu_threads(0, reserve=1) == max(1, min(torch.get_num_threads(), cpus - 1))
