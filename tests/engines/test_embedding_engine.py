"""Embeddings served in the engine's one step loop (engines/embedding.py `pool_step`, `process_embedding`): each
input a prefill-only request, batched with generation in the same steps (that the vectors are transformers'
pooled last hidden states: test_embedding.py). They equal the one-forward reference `embed` on a random
checkpoint whatever the step loop does to them: chunked prefill, a step shared with decodes (whose tokens stay
those of generating alone), prefix-cache hits (last pooling only), preemption, a speculating engine; bad inputs
are refused before anything is queued; the asyncio face bounds what is in flight and aborts on cancel."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from engines import LLM, RequestRejected, SamplingParams
from engines.async_engine import AsyncEngine
from engines.embedding import EmbeddingBusy, embed
from engines.tokenizer import Tokenizer

SMALL = Path(__file__).resolve().parents[2] / "models" / "tandem-tiny-s"
TEXTS = ["The quick brown fox", "def read_config(path):", "Once upon a time there was a sea"]
BLOCK = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def page_bytes(num_layers: int = 2, kv_heads: int = 2, head_dim: int = 16) -> int:
    return 2 * num_layers * BLOCK * kv_heads * head_dim * 4


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 384) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama", num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_chunked_prefill_gives_the_one_forward_vectors(llama, pooling):
    inputs = prompts(5, 9, 40, seed=3)
    llm = LLM(llama, max_num_batched_tokens=8, max_num_seqs=3, block_size=BLOCK)  # every input in chunks
    steps = []
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda *a, **k: steps.append(1) or execute(*a, **k)
    got = llm.embed(inputs, pooling)
    assert len(steps) >= sum(len(p) for p in inputs) // 8  # one chunk of at most 8 tokens a step
    assert torch.allclose(got, embed(llm.engine.model, inputs, pooling), atol=1e-5)


def test_embeddings_share_steps_with_generation_and_change_none_of_its_tokens(llama):
    gen_prompts, inputs = prompts(4, 5, 20, seed=4), prompts(6, 5, 30, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = LLM(llama, block_size=BLOCK).generate([{"prompt_token_ids": p} for p in gen_prompts], params)

    llm = LLM(llama, max_num_batched_tokens=32, block_size=BLOCK)
    engine = llm.engine
    mixed = []  # steps whose batch held both an embedding chunk and a sampling sequence
    layout = engine.runner.layout

    def spy(*a, **k):
        batch = layout(*a, **k)
        mixed.append(bool(batch.pool_spans) and bool(batch.sample_seqs))
        return batch

    engine.runner.layout = spy
    finals = {}
    collect = lambda out: finals.__setitem__(out.request_id, out)  # noqa: E731
    gen = [engine.inputs.process(p, params, f"g{i}") for i, p in enumerate(gen_prompts)]
    emb = [engine.inputs.process_embedding(p, "mean", f"e{i}") for i, p in enumerate(inputs)]
    for g, e in zip(gen, emb):  # arriving interleaved
        engine.submit(g, collect, stream=False)
        engine.submit(e, collect, stream=False)
    for e in emb[len(gen):]:
        engine.submit(e, collect, stream=False)
    while engine.has_work():
        llm.core.step()
    assert any(mixed)
    for g, ref in zip(gen, alone):
        assert finals[g.request_id].outputs[0].token_ids == ref.outputs[0].token_ids
        assert finals[g.request_id].embedding is None
    vectors = torch.stack([finals[e.request_id].embedding for e in emb])
    assert torch.allclose(vectors, embed(engine.model, inputs, "mean"), atol=1e-5)
    for e in emb:
        out = finals[e.request_id]
        assert out.finished and out.error is None and out.outputs[0].token_ids == []
        assert out.outputs[0].finish_reason == "stop"
    assert llm.stats()["used_pages"] == 0


def test_last_pooling_takes_prefix_cache_hits_and_mean_pooling_none(llama):
    shared = prompts(1, 24, 24, seed=6)[0]
    inputs = [shared + tail for tail in prompts(3, 3, 9, seed=7)]
    llm = LLM(llama, block_size=BLOCK)
    llm.generate([{"prompt_token_ids": shared + [7]}], SamplingParams(temperature=0, max_tokens=2))
    hits = llm.engine.scheduler.prefix_hits
    mean = llm.embed(inputs, "mean")
    assert llm.engine.scheduler.prefix_hits == hits  # every row must be computed for a mean
    assert torch.allclose(mean, embed(llm.engine.model, inputs, "mean"), atol=1e-5)
    last = llm.embed(inputs, "last")
    assert llm.engine.scheduler.prefix_hits >= hits + len(inputs) * 24  # the shared blocks served from cache
    assert torch.allclose(last, embed(llm.engine.model, inputs, "last"), atol=1e-5)


def test_a_preempted_embedding_is_recomputed_whole(llama):
    inputs = prompts(8, 20, 40, seed=8)
    llm = LLM(llama, max_num_batched_tokens=16, block_size=BLOCK, memory_bytes=24 * page_bytes(),
              enable_prefix_caching=False)
    engine = llm.engine
    finals = {}
    gen = [engine.inputs.process(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), f"g{i}")
           for i, p in enumerate(prompts(3, 10, 20, seed=9))]
    for g in gen:
        engine.submit(g, lambda out: finals.__setitem__(out.request_id, out), stream=False)
    emb = [engine.inputs.process_embedding(p, "mean", f"e{i}") for i, p in enumerate(inputs)]
    for e in emb:
        engine.submit(e, lambda out: finals.__setitem__(out.request_id, out), stream=False)
    preempted_embeddings = 0
    preempt = engine.scheduler._preempt

    def count(seq):
        nonlocal preempted_embeddings
        preempted_embeddings += seq.pooling is not None and seq.num_computed > 0
        preempt(seq)

    engine.scheduler._preempt = count
    while engine.has_work():
        llm.core.step()
    assert preempted_embeddings > 0  # mid-prompt: the sum so far is dropped and started again
    vectors = torch.stack([finals[e.request_id].embedding for e in emb])
    assert torch.allclose(vectors, embed(engine.model, inputs, "mean"), atol=1e-5)
    assert llm.stats()["used_pages"] == 0


def test_bad_inputs_are_refused_before_anything_is_queued(llama):
    llm = LLM(llama, block_size=BLOCK, max_model_len=64)
    with pytest.raises(RequestRejected, match="pooling"):
        llm.embed([[1, 2]], "cls")
    with pytest.raises(RequestRejected, match="empty"):
        llm.engine.inputs.process_embedding([], "mean")
    with pytest.raises(RequestRejected, match="must be in"):
        llm.embed([[1, 2], [10_000]])
    with pytest.raises(RequestRejected, match="context of 64") as exc:
        llm.embed([[1] * 65])
    assert exc.value.code == "context_length_exceeded"
    assert llm.embed([[1] * 64]).shape == (1, llm.engine.config.hidden_size)  # an input may fill the context
    assert not llm.engine.has_work()


def test_the_async_engine_batches_concurrent_callers_bounds_them_and_aborts_on_cancel(llama, monkeypatch):
    llm = LLM(llama, block_size=BLOCK)
    engine, core = llm.engine, llm.core

    class StepOnWake:  # the engine core's thread, stepped by the test between awaits
        def check_alive(self):
            pass

        def wake(self):
            pass

    ae = AsyncEngine(StepOnWake(), engine)
    inputs = prompts(5, 4, 20, seed=10)

    async def stepper():
        while True:
            if engine.has_work():
                core.step()
            await asyncio.sleep(0)

    aborted = []
    abort = ae.abort
    ae.abort = lambda rid: aborted.append(rid) or abort(rid)

    async def main():
        task = asyncio.create_task(stepper())
        try:
            got = await asyncio.gather(*(ae.embed([one]) for one in inputs), ae.embed(inputs, "last"))
        finally:
            task.cancel()
        monkeypatch.setattr("engines.async_engine.MAX_PENDING", 3)
        with pytest.raises(EmbeddingBusy):
            await ae.embed(inputs)
        assert ae._embed_pending == 0 and not engine.has_work()  # refused whole: nothing queued
        monkeypatch.setattr("engines.async_engine.MAX_PENDING", 1024)
        waiting = asyncio.create_task(ae.embed(inputs))
        await asyncio.sleep(0)  # queued, never stepped
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert len(aborted) == len(inputs) and ae._embed_pending == 0
        return got

    *singles, last = asyncio.run(main())
    while engine.has_work():  # the aborts are carried out at the next step
        core.step()
    reference = embed(engine.model, inputs, "mean")
    for i, single in enumerate(singles):
        assert single.shape == (1, reference.shape[1]) and torch.allclose(single[0], reference[i], atol=1e-5)
    assert torch.allclose(last, embed(engine.model, inputs, "last"), atol=1e-5)
    assert not engine.has_work() and llm.stats()["used_pages"] == 0  # the cancelled ones aborted, pages freed


def test_a_speculating_engine_embeds_beside_its_drafted_decodes():
    """The large engine with the small one drafting: embedding requests never draft, and their steps leave the
    speculative decodes' greedy tokens those of the plain engine."""
    large = SMALL.parent / "tandem-tiny-l"
    tokenizer = Tokenizer.from_pretrained(large)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = tokenizer.encode("def parse_args(argv):\n    ")
    plain = LLM(large, dtype="float32").generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    llm = LLM(large, dtype="float32", draft_model=SMALL)
    engine = llm.engine
    finals = {}
    engine.submit(engine.inputs.process(prompt, params, "g"), lambda o: finals.__setitem__(o.request_id, o), False)
    ids = [tokenizer.encode(t) for t in TEXTS]
    for i, one in enumerate(ids):
        req = engine.inputs.process_embedding(one, "last", f"e{i}")
        engine.submit(req, lambda o: finals.__setitem__(o.request_id, o), False)
    while engine.has_work():
        llm.core.step()
    assert finals["g"].outputs[0].token_ids == plain
    assert engine.stats()["spec_num_draft_tokens"] > 0  # it did speculate
    got = torch.stack([finals[f"e{i}"].embedding for i in range(len(ids))])
    assert torch.allclose(got, embed(engine.model, ids, "last"), atol=1e-4)
