"""Slowed engine steps for tests of a live in-process server (`gateway.server.ServerThread`): a generation then
outlasts a client's timeout by seconds however fast the engine is, so hang-ups and aborts are tested while the
request is surely still running, not raced against the engine's speed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


@contextlib.contextmanager
def slowed(server, *names: str, per_step_s: float = 0.01) -> Iterator[None]:
    """Each step of the named engines takes `per_step_s` longer (the device thread sleeps before it), and each
    step takes one token per sequence (no multi-step greedy tokens: the pacing is per token)."""
    import engines.step_plan as engine_module

    saved_multi = engine_module.MULTI_STEP_TOKENS
    engine_module.MULTI_STEP_TOKENS = 1
    engines = server.app.state.gateway.host.engines
    for name in names:
        step = engines[name].step

        def slow(step=step) -> int:
            time.sleep(per_step_s)
            return step()
        engines[name].step = slow
    try:
        yield
    finally:
        engine_module.MULTI_STEP_TOKENS = saved_multi
        for name in names:
            del engines[name].step
