"""A served request leaves no reference cycle for Python's cyclic GC: its Request, Sequences, detokenizers, outputs
and the consumer's closures go when the engine and the caller drop them, not at a collector pass. Offline
(`LLM`: greedy, n=2, an abort, a failure, an embedding, with preemption and with a drafter), through `AsyncEngine`
on the EngineCore thread (streams, one cancelled) and through the gateway, on the shipped tiny checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import pytest

from engines import LLM, EngineCore, EngineSpec, PoolSpec, SamplingParams
from engines.async_engine import AsyncEngine
from tests.gc_probe import http_roundtrip, left_for_the_collector

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

TINY = Path(__file__).resolve().parents[2] / "models" / "tandem-tiny-s"
PROMPTS = ["def parse(line):", "import os", "class Node:", "for i in range(10):"]
# what the engine makes for each request (a Request fans out into Sequences, each with its detokenizer)
PER_REQUEST = {"Request", "Sequence", "IncrementalDetokenizer", "RequestMetrics", "RequestOutput",
               "CompletionOutput", "Logprob", "SamplingParams", "EngineError"}


def serve_offline(llm: LLM) -> dict[str, object]:
    """Greedy and n=2 (seeded, logprobs, a stop string) batches, a request aborted mid-decode, one whose
    processing fails, and an embedding; what each ended with."""
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    pairs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.8, n=2, seed=1, max_tokens=6, logprobs=2,
                                                     stop=["\n"]))
    eng, finals = llm.engine, {}

    def keep(out):
        finals[out.request_id] = out

    real_append = eng.scheduler.append_token

    def failing_append(seq, token, logprob, pos_logprobs):
        if seq.request.request_id == "failed" and seq.num_output_tokens == 2:
            raise RuntimeError("injected failure")
        return real_append(seq, token, logprob, pos_logprobs)

    eng.scheduler.append_token = failing_append
    try:
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        eng.add_request(PROMPTS[2], params, "aborted", emit=keep)
        eng.add_request(PROMPTS[3], params, "failed", emit=keep, stream=False)
        for _ in range(4):
            llm.core.step()
        eng.abort("aborted")
        while eng.has_work():
            llm.core.step()
    finally:
        del eng.scheduler.append_token
    vectors = llm.embed(PROMPTS[:2])
    return {"greedy": [o.outputs[0].token_ids for o in greedy],
            "pairs": [[c.finish_reason is not None for c in o.outputs] for o in pairs],
            "ends": {rid: o.outputs[0].finish_reason for rid, o in finals.items()},
            "embedding": tuple(vectors.shape)}


@pytest.mark.parametrize("case", ["plain", "preempting", "speculative"])
def test_finished_offline_requests_leave_no_reference_cycle_for_the_gc(case):
    options = {"plain": {}, "speculative": {"draft_model": TINY, "num_speculative_tokens": 3},
               # 10 float32 pages of 4 tokens (K and V, 4 layers, 4 heads of 32): the 4 greedy choices need 14
               "preempting": {"dtype": "float32", "block_size": 4, "memory_bytes": 10 * 2 * 4 * 4 * 4 * 32 * 4}}[case]
    llm = LLM(TINY, max_num_batched_tokens=64, **options)
    first = serve_offline(llm)  # warms the caches (a first request fills some for good)
    with left_for_the_collector() as left:
        again = serve_offline(llm)
    assert again == first
    assert first["ends"] == {"aborted": "abort", "failed": "error"} and first["embedding"] == (2, 128)
    assert sorted(t for t in left if t in PER_REQUEST) == []
    assert len(left) < 8  # nothing a request
    stats = llm.stats()
    assert stats["used_pages"] == 0
    if case == "preempting":
        assert stats["engine_num_preemptions"] > 0
    if case == "speculative":
        assert stats["engine_spec_num_drafts"] > 0


def test_finished_async_streams_leave_no_reference_cycle_for_the_gc():
    core = EngineCore([EngineSpec("tiny", TINY, max_num_batched_tokens=64)], PoolSpec(memory_bytes=16 << 20))
    core.start()
    engine = AsyncEngine(core, core.engines["tiny"])

    async def stream(prompt: str, params: SamplingParams, leave_after: int | None = None) -> list[str | None]:
        outs = []
        async for out in engine.generate(prompt, params):
            outs.append(out)
            if len(outs) == leave_after:
                break  # the consumer goes away: the request is aborted
        return [c.finish_reason for c in outs[-1].outputs]

    async def serve() -> list:
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        ends = await asyncio.gather(*[stream(p, greedy) for p in PROMPTS[:3]],
                                    stream(PROMPTS[3], SamplingParams(temperature=0.7, n=2, seed=3, max_tokens=6)),
                                    stream(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True), 2))
        vectors = await engine.embed(PROMPTS[:2])
        return [*ends, tuple(vectors.shape)]

    def served() -> list:
        ends = asyncio.run(serve())
        deadline = time.monotonic() + 10
        while core.engines["tiny"].requests and time.monotonic() < deadline:  # the abort lands at a step
            time.sleep(0.01)
        return ends

    try:
        first = served()
        with left_for_the_collector() as left:
            again = served()
    finally:
        core.shutdown()
    assert again == first
    assert first[:3] == [["length"]] * 3 and first[4] == [None] and first[5] == (2, 128)
    assert sorted(t for t in left if t in PER_REQUEST) == []
    assert len(left) < 8


def test_requests_served_by_the_gateway_leave_no_reference_cycle_for_the_gc():
    from gateway.config import config_from_dict
    from gateway.server import ServerThread

    cfg = config_from_dict({"engines": {"tiny": {"checkpoint": str(TINY)}}, "kv_pool": {"memory_bytes": 16 << 20}})
    calls = [(b"/v1/completions", {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}),
             (b"/v1/completions", {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 6, "stream": True}),
             (b"/v1/completions", {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 5, "n": 2, "seed": 1}),
             (b"/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[3]}],
                                        "max_tokens": 5, "stream": True}),
             (b"/v1/embeddings", {"model": "tiny", "input": PROMPTS[:2]})]
    with ServerThread(cfg) as server, socket.create_connection(("127.0.0.1", server.port)) as conn:
        for _ in range(3):  # first requests fill caches
            for path, body in calls:
                http_roundtrip(conn, json.dumps(body).encode(), path)
        with left_for_the_collector() as left:
            answers = [http_roundtrip(conn, json.dumps(body).encode(), path) for _ in range(4) for path, body in calls]
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers)
    assert sorted(t for t in left if t in PER_REQUEST | {"StrictJSONRequest", "RequestResponseCycle"}) == []
    assert len(left) < 20  # nothing a request (a timer's stray object aside)
