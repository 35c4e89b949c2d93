"""The asyncio face: the EngineCore thread serves concurrent `generate` streams from two engines, outputs
arrive incrementally and add up, a cancelled stream aborts and frees its pages, rejections raise before the
first output, and an idle core sleeps instead of spinning."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engines import EngineCore, EngineSpec, PoolSpec, RequestRejected, SamplingParams
from engines.errors import EngineDeadError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def core(tiny_checkpoint):
    small = tiny_checkpoint("llama", num_heads=4, num_kv_heads=2)
    large = tiny_checkpoint("qwen3", num_layers=3, num_heads=4, num_kv_heads=1, head_dim=32, seed=1)
    core = EngineCore([EngineSpec("small", small, max_num_batched_tokens=32),
                       EngineSpec("large", large, max_num_batched_tokens=32)],
                      PoolSpec(memory_bytes=4 << 20, block_size=4))
    core.start()
    yield core
    core.shutdown()


async def collect(engine, prompt, params, rid=None):
    outs = []
    async for out in engine.generate(prompt, params, rid):
        outs.append(out)
    return outs


async def test_concurrent_streams_on_two_engines_match_offline_greedy(core):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Hello world", "def step(self):", "The quick brown fox", "import os, sys"]
    jobs = [collect(core.engine("small" if i % 2 else "large"), p, params, f"c{i}") for i, p in enumerate(prompts)]
    results = await asyncio.gather(*jobs)
    for i, (p, outs) in enumerate(zip(prompts, results)):
        eng = core.engines["small" if i % 2 else "large"]
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        assert len(outs) > 1, "outputs should stream, not arrive all at once"
        ids = eng.tokenizer.encode(p)
        with torch.inference_mode():
            seq = list(ids)
            for _ in range(12):
                seq.append(int(eng.model.dense_logits(torch.tensor([seq]))[0, -1].argmax()))
        assert final.outputs[0].token_ids == seq[len(ids):]
        assert "".join(o.outputs[0].delta_text for o in outs) == final.outputs[0].text
        assert sum((o.outputs[0].delta_token_ids for o in outs), []) == final.outputs[0].token_ids
        assert final.model == eng.name and final.metrics.first_token_time is not None
    assert core.pool.num_used == 0


async def test_cancelling_a_stream_aborts_it_and_frees_its_pages(core):
    engine = core.engine("small")
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    got = 0
    async for _ in engine.generate([5, 6, 7, 8, 9], params, "cancel-me"):
        got += 1
        if got == 3:
            break  # the generator's finally aborts the request
    deadline = time.monotonic() + 5
    while core.pool.num_used and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert core.pool.num_used == 0
    assert engine.stats()["num_running"] == 0


async def test_explicit_abort_ends_the_stream_with_finish_reason_abort(core):
    engine = core.engine("large")
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outs = []
    async for out in engine.generate("Hello", params, "to-abort"):
        outs.append(out)
        if len(outs) == 2:
            engine.abort("to-abort")
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 200


async def test_rejections_raise_before_the_first_output(core):
    engine = core.engine("small")
    with pytest.raises(RequestRejected, match="context"):
        await collect(engine, [5] * engine.max_model_len, SamplingParams())
    with pytest.raises(RequestRejected, match="draft_token_ids must be in"):
        async for _ in engine.generate("hi", SamplingParams(), draft_token_ids=[10**9]):
            pass


async def test_stats_and_idle_core_does_not_spin(core):
    s = core.engine("small").stats()
    for key in ("kv_usage", "num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits",
                "num_preemptions", "used_blocks"):
        assert key in s
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    steps = sum(e.num_steps for e in core.engines.values())
    cpu = time.thread_time()
    await asyncio.sleep(0.3)
    assert sum(e.num_steps for e in core.engines.values()) == steps
    assert core._thread.is_alive()
    assert time.thread_time() - cpu < 0.1


async def test_a_shut_down_core_refuses_new_requests(tiny_checkpoint):
    folder = tiny_checkpoint("llama", num_heads=4, num_kv_heads=2)
    core = EngineCore([EngineSpec("only", folder)], PoolSpec(memory_bytes=1 << 20, block_size=4)).start()
    out = await collect(core.engine("only"), "Hi", SamplingParams(temperature=0, max_tokens=2))
    assert out[-1].finished
    core.shutdown()
    with pytest.raises(EngineDeadError):
        await collect(core.engine("only"), "Hi", SamplingParams(max_tokens=2))
