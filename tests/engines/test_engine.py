"""The engine end to end on tiny random checkpoints: continuous batching with chunked prefill, preemption,
prefix caching and aborts give exactly the outputs of generating each request alone (the oracle is a plain
greedy loop over the model's dense forward), the pool drains to zero used pages, two models share one pool,
stop strings and sampling options behave, and a failure stays inside its request."""

from __future__ import annotations

import random

import pytest
import torch

from engines import LLM, EngineCore, EngineSpec, PoolSpec, RequestRejected, SamplingParams
from engines.engine import ModelEngine
from engines.errors import ErrorCode
from engines.sampler import Sampled

BLOCK = 4
LLAMA = dict(num_heads=4, num_kv_heads=2)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def page_bytes(num_layers: int = 2, kv_heads: int = 2, head_dim: int = 16) -> int:
    return 2 * num_layers * BLOCK * kv_heads * head_dim * 4


@torch.inference_mode()
def greedy_alone(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model.dense_logits(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 384) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


class Collector:
    def __init__(self):
        self.final = {}
        self.all = []

    def __call__(self, out):
        self.all.append(out)
        if out.finished:
            self.final[out.request_id] = out


def drain(engine: ModelEngine, max_steps: int = 10_000) -> int:
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < max_steps
    return steps


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return tiny_checkpoint("llama", **LLAMA)


def test_forty_staggered_requests_with_chunked_prefill_equal_generating_each_alone(llama):
    llm = LLM(llama, max_num_batched_tokens=24, max_num_seqs=16, block_size=BLOCK,
              memory_bytes=400 * page_bytes())
    eng = llm.engine
    prompts = random_prompts(40, 1, 60)
    lengths = [random.Random(i).randint(1, 12) for i in range(40)]
    sink = Collector()
    chunked = False
    for i, (p, m) in enumerate(zip(prompts, lengths)):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), f"r{i}", emit=sink)
        for _ in range(i % 3):  # arrivals spread over steps, joining a running batch
            sched_before = {s.seq_id: s.num_computed for s in eng.scheduler.running}
            eng.step()
            chunked |= any(0 < s.num_computed < s.prompt_len for s in eng.scheduler.running
                           if s.seq_id in sched_before)
    drain(eng)
    assert chunked, "the budget never split a prompt: the test would not exercise chunked prefill"
    for i, (p, m) in enumerate(zip(prompts, lengths)):
        out = sink.final[f"r{i}"]
        assert out.outputs[0].token_ids == greedy_alone(eng.model, p, m), f"request {i}"
        assert out.outputs[0].finish_reason == "length"
    assert llm.stats()["used_pages"] == 0


def test_a_pool_too_small_for_the_batch_preempts_and_still_matches(llama):
    prompts = random_prompts(12, 10, 30, seed=1)
    llm = LLM(llama, max_num_batched_tokens=64, block_size=BLOCK, memory_bytes=24 * page_bytes(),
              enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stats = llm.stats()
    assert stats["engine_num_preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == greedy_alone(llm.engine.model, p, 20)
    assert stats["used_pages"] == 0


def test_prefix_cache_hits_give_identical_outputs_and_show_in_stats(llama):
    system = random_prompts(1, 30, 30, seed=2)[0]
    suffixes = random_prompts(6, 3, 9, seed=3)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(llama, block_size=BLOCK, memory_bytes=300 * page_bytes())
    first = llm.generate({"prompt_token_ids": system + suffixes[0]}, params)[0]
    rest = llm.generate([{"prompt_token_ids": system + s} for s in suffixes[1:]], params)
    stats = llm.stats()
    # every later request reuses the system prompt's 7 full blocks (28 tokens)
    assert stats["prefix_cache_hits"] >= 5 * 28
    assert stats["engine_prefix_cache_hits"] == stats["prefix_cache_hits"]  # one engine: its counts are the pool's
    assert stats["engine_prefix_cache_queries"] == stats["prefix_cache_queries"]
    assert all(o.metrics.num_cached_tokens == 28 for o in rest)
    # a prompt that extends a finished request (its prompt and its answer) hits those blocks too
    extended = system + suffixes[0] + first.outputs[0].token_ids + [7, 8, 9]
    ext = llm.generate({"prompt_token_ids": extended}, params)[0]
    # (the last sampled token of the first request never got K/V, so its block may be one short)
    assert ext.metrics.num_cached_tokens == (len(extended) - 4) // BLOCK * BLOCK
    cold = LLM(llama, block_size=BLOCK, memory_bytes=300 * page_bytes(), enable_prefix_caching=False)
    for o, s in zip([first, *rest], suffixes):
        assert o.outputs[0].token_ids == greedy_alone(llm.engine.model, system + s, 10)
    assert ext.outputs[0].token_ids == cold.generate({"prompt_token_ids": extended}, params)[0].outputs[0].token_ids
    assert cold.stats()["prefix_cache_hits"] == 0
    assert stats["used_pages"] == 0 and stats["cached_pages"] > 0


def test_a_repeated_block_aligned_prompt_computes_one_token_and_answers_as_alone(llama):
    """Every block of the prompt cached: the last block's page is copied and only the last token computed
    (its logits); the answers, sampled or greedy, equal the oracle's, alone and beside the first request."""
    prompts = [p[:len(p) // BLOCK * BLOCK] for p in random_prompts(4, 8, 30, seed=11)]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    llm = LLM(llama, block_size=BLOCK, memory_bytes=300 * page_bytes())
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts], params)  # twice in one batch too
    for p, o in zip(prompts + prompts + prompts, first + again):
        assert o.outputs[0].token_ids == greedy_alone(llm.engine.model, p, 9)
    assert [o.metrics.num_cached_tokens for o in again] == [len(p) - 1 for p in prompts + prompts]
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=9, ignore_eos=True)
    cold = LLM(llama, block_size=BLOCK, memory_bytes=300 * page_bytes(), enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in cold.generate([{"prompt_token_ids": p} for p in prompts], sampled)]
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sampled)]
    assert got == want
    assert llm.stats()["used_pages"] == 0


def test_aborts_while_queued_mid_prefill_and_mid_decode_free_every_page(llama):
    llm = LLM(llama, max_num_batched_tokens=8, max_num_seqs=2, block_size=BLOCK, memory_bytes=64 * page_bytes())
    eng = llm.engine
    sink = Collector()
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    long_a, long_b, queued = random_prompts(3, 30, 30, seed=4)
    eng.add_request(long_a, params, "decoding", emit=sink)
    for _ in range(5):  # 30 prompt tokens at 8 per step, then decoding
        eng.step()
    eng.add_request(long_b, params, "prefilling", emit=sink)
    eng.add_request(queued, params, "queued", emit=sink)  # max_num_seqs=2 keeps it waiting
    eng.step()
    seqs = {r.request_id: r.seqs[0] for r in eng.requests.values()}
    assert seqs["decoding"].num_output_tokens > 0
    assert 0 < seqs["prefilling"].num_computed < len(long_b)
    assert seqs["queued"].status.value == "waiting"
    assert llm.core.pool.num_used > 0
    for rid in ("queued", "prefilling", "decoding"):
        eng.abort(rid)
    drain(eng)
    assert llm.core.pool.num_used == 0
    assert {rid: o.outputs[0].finish_reason for rid, o in sink.final.items()} == {
        "queued": "abort", "prefilling": "abort", "decoding": "abort"}
    # the engine keeps serving after the aborts
    out = llm.generate({"prompt_token_ids": long_a}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert out[0].outputs[0].token_ids == greedy_alone(eng.model, long_a, 3)
    assert llm.core.pool.num_used == 0


def test_two_models_of_different_geometry_share_one_pool(tiny_checkpoint):
    small = tiny_checkpoint("llama", **LLAMA)
    large = tiny_checkpoint("qwen3", num_layers=3, num_heads=4, num_kv_heads=1, head_dim=32, seed=1)
    per_page = 2 * 3 * BLOCK * 1 * 32 * 4  # the larger page: qwen3's 3 layers x 1 head x 32 dims
    core = EngineCore([EngineSpec("small", small, max_num_batched_tokens=64),
                       EngineSpec("large", large, max_num_batched_tokens=64)],
                      PoolSpec(memory_bytes=30 * per_page, block_size=BLOCK, enable_prefix_caching=False))
    assert core.pool.page_bytes == per_page and core.pool.num_pages == 30
    s_eng, l_eng = core.engines["small"], core.engines["large"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = random_prompts(1, 70, 70, seed=5)[0]
    sink = Collector()
    s_eng.add_request(prompt, params, "s", emit=sink)
    while "s" not in sink.final:
        core.step()
        if "s" not in sink.final:
            assert l_eng.has_work() is False
    small_pages = {p for p in range(30) if core.pool.owner[p] == 0}
    assert len(small_pages) == 28  # 110 tokens / 4 per page: nearly the whole pool went to the small model
    l_eng.add_request(prompt, params, "l", emit=sink)
    while core.has_work():
        core.step()
    reused = {p for p in small_pages if core.pool.owner[p] == 1}
    assert len(reused) >= 26  # the large model now lives in pages the small one freed
    assert sink.final["s"].outputs[0].token_ids == greedy_alone(s_eng.model, prompt, 40)
    assert sink.final["l"].outputs[0].token_ids == greedy_alone(l_eng.model, prompt, 40)
    assert core.pool.num_used == 0


def test_both_engines_run_in_the_same_steps_and_preempt_when_the_pool_is_shared(tiny_checkpoint):
    small = tiny_checkpoint("llama", **LLAMA)
    large = tiny_checkpoint("qwen3", num_layers=3, num_heads=4, num_kv_heads=1, head_dim=32, seed=1)
    core = EngineCore([EngineSpec("small", small), EngineSpec("large", large)],
                      PoolSpec(memory_bytes=40 * 2 * 3 * BLOCK * 32 * 4, block_size=BLOCK))
    prompts = random_prompts(6, 20, 40, seed=6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sink = Collector()
    for i, p in enumerate(prompts):
        core.engines["small" if i % 2 else "large"].add_request(p, params, f"r{i}", emit=sink)
    while core.has_work():
        core.step()
    for i, p in enumerate(prompts):
        eng = core.engines["small" if i % 2 else "large"]
        assert sink.final[f"r{i}"].outputs[0].token_ids == greedy_alone(eng.model, p, 24)
    assert core.pool.num_used == 0


def test_stop_string_spanning_two_tokens_stops_and_is_stripped(llama):
    llm = LLM(llama, block_size=BLOCK)
    tok = llm.tokenizer
    prompt = "The quick brown fox"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    pieces = [tok.decode(free.token_ids[:i]) for i in range(len(free.token_ids) + 1)]
    # a stop string made of the last character of one token and the first of the next
    for i in range(2, len(pieces) - 1):
        a, b = pieces[i - 1], pieces[i]
        if len(b) > len(a) and len(pieces[i + 1]) > len(b) and b[-1:].strip() and pieces[i + 1][len(b)].strip():
            stop = b[-1] + pieces[i + 1][len(b)]
            break
    else:
        pytest.fail("no two-token boundary with printable characters in the greedy text")
    cut = free.text.index(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                              stop=["never-appears", stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:cut]
    assert stop not in out.text
    assert free.token_ids[:len(out.token_ids)] == out.token_ids


def test_streamed_deltas_hold_back_a_possible_stop_string_and_add_up(llama):
    llm = LLM(llama, block_size=BLOCK)
    eng = llm.engine
    sink = Collector()
    eng.add_request("def read_config", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                      stop=["zzzzz"], logprobs=2), "s", emit=sink)
    drain(eng)
    final = sink.final["s"].outputs[0]
    assert "".join(o.outputs[0].delta_text for o in sink.all) == final.text
    assert sum((o.outputs[0].delta_token_ids for o in sink.all), []) == final.token_ids
    assert sum(len(o.outputs[0].delta_logprobs) for o in sink.all) == len(final.logprobs) == 20
    # until the end, the last 4 characters (a possible "zzzz" prefix) are held back
    assert all(len(o.outputs[0].text) <= len(final.text) - 4 for o in sink.all[:-1] if len(final.text) > 8)


def test_stop_token_ids_eos_min_tokens_and_max_tokens(llama):
    llm = LLM(llama, block_size=BLOCK)
    prompt = [5, 6, 7, 8, 9]
    free = llm.generate({"prompt_token_ids": prompt},
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    target = free.token_ids[3]
    first = free.token_ids.index(target)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12,
                                                                    stop_token_ids=[target]))[0].outputs[0]
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == target
    # the same id as EOS: ends with stop_reason None; with min_tokens it may not end before
    llm.engine.eos_token_ids = {target}
    eos = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert eos.token_ids == free.token_ids[:first + 1] and eos.stop_reason is None
    later = llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2))[0].outputs[0]
    assert target not in later.token_ids[:first + 2]
    assert len(later.token_ids) >= first + 2
    ignored = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_seeded_sampling_reproduces_regardless_of_batch_and_n_shares_the_prompt(llama):
    llm = LLM(llama, block_size=BLOCK, max_num_batched_tokens=32)
    prompt = {"prompt_token_ids": random_prompts(1, 21, 21, seed=7)[0]}
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=12, ignore_eos=True, n=3)
    alone = llm.generate(prompt, seeded)[0]
    others = [{"prompt_token_ids": p} for p in random_prompts(7, 5, 40, seed=8)]
    before = llm.stats()["prefix_cache_hits"]
    crowd = llm.generate(others[:3] + [prompt] + others[3:],
                         [SamplingParams(temperature=1.0, max_tokens=12)] * 3 + [seeded]
                         + [SamplingParams(temperature=1.0, max_tokens=12)] * 4)[3]
    assert [c.token_ids for c in crowd.outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) == 3  # the n choices differ
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    # choices 1 and 2 found choice 0's prompt blocks (and the earlier run's) in the cache
    assert llm.stats()["prefix_cache_hits"] - before >= 3 * 20
    assert llm.stats()["used_pages"] == 0


def test_logprobs_match_the_models_distribution(llama):
    llm = LLM(llama, block_size=BLOCK)
    prompt = [5, 6, 7, 8, 9, 10]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True))[0].outputs[0]
    ids = prompt + out.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(llm.engine.model.dense_logits(torch.tensor([ids]))[0].float(), -1)
    total = 0.0
    for i, (tok, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert lps[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert lps[tok].rank == 1
        top = row.topk(5).indices.tolist()
        assert set(lps) == set(top)
        assert lps[tok].decoded_token == llm.tokenizer.token_text(tok)
        total += row[tok].item()
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_invalid_requests_are_rejected_before_any_work(llama):
    llm = LLM(llama, block_size=BLOCK, max_model_len=64, memory_bytes=8 * page_bytes())
    with pytest.raises(RequestRejected, match="context of 64"):
        llm.generate({"prompt_token_ids": [5] * 64})
    with pytest.raises(RequestRejected, match="max_tokens=40"):
        llm.generate({"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=40))
    with pytest.raises(RequestRejected, match="whole pool has 8"):
        llm.generate({"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="draft_token_ids must be in"):
        llm.engine.add_request([5, 6], SamplingParams(), draft_token_ids=[1, 384])
    with pytest.raises(RequestRejected, match="empty"):
        llm.generate({"prompt_token_ids": []})
    assert not llm.engine.has_work() and llm.core.pool.num_used == 0


def test_an_error_in_one_request_fails_only_that_request(llama, monkeypatch):
    llm = LLM(llama, block_size=BLOCK)
    eng = llm.engine
    real = eng.scheduler.append_token

    def flaky(seq, token, logprob, pos_logprobs):
        if seq.request.request_id == "bad" and seq.num_output_tokens == 2:
            raise RuntimeError("injected failure")
        return real(seq, token, logprob, pos_logprobs)

    monkeypatch.setattr(eng.scheduler, "append_token", flaky)
    sink = Collector()
    prompts = random_prompts(4, 5, 15, seed=9)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(p, params, "bad" if i == 1 else f"ok{i}", emit=sink)
    drain(eng)
    bad = sink.final["bad"]
    assert bad.finished and "injected failure" in bad.error.message and bad.outputs[0].finish_reason == "error"
    assert bad.error.code is ErrorCode.ENGINE_ERROR
    for i, p in enumerate(prompts):
        if i != 1:
            out = sink.final[f"ok{i}"]
            assert out.error is None and out.outputs[0].token_ids == greedy_alone(eng.model, p, 8)
    assert llm.core.pool.num_used == 0


def test_a_failed_forward_fails_that_batch_only_and_the_engine_recovers(llama, monkeypatch):
    llm = LLM(llama, block_size=BLOCK)
    eng = llm.engine
    calls = {"n": 0}

    def broken_once(real):  # the second forward fails, whichever entry (a step, or greedy tokens in one call)
        def call(*args):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("device fell over")
            return real(*args)
        return call

    monkeypatch.setattr(eng.runner, "execute", broken_once(eng.runner.execute))
    monkeypatch.setattr(eng.runner, "draft_greedy", broken_once(eng.runner.draft_greedy))
    sink = Collector()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eng.add_request([5, 6, 7], params, "a", emit=sink)
    eng.step()
    eng.step()  # fails: "a" was in the batch
    eng.add_request([8, 9, 10], params, "b", emit=sink)
    drain(eng)
    assert "device fell over" in sink.final["a"].error.message
    assert sink.final["a"].error.code is ErrorCode.ENGINE_ERROR and sink.final["a"].outputs[0].finish_reason == "error"
    assert sink.final["b"].error is None and sink.final["b"].outputs[0].token_ids == greedy_alone(
        eng.model, [8, 9, 10], 5)
    assert llm.core.pool.num_used == 0


def test_text_prompts_and_outputs_in_input_order(llama):
    llm = LLM(llama, block_size=BLOCK)
    prompts = ["Hello world", "def step(self):", "The quick brown fox jumps"]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 6, 9)])
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 6, 9]
    for o in outs:
        assert o.prompt_token_ids == llm.tokenizer.encode(o.prompt)
        assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids)


def test_the_triton_kernel_behind_the_same_seam_gives_the_same_tokens(llama):
    """attention_backend="triton" runs kernels.paged_attention (the Triton interpreter on CPU tensors)."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 3, 14, seed=10)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = LLM(llama, block_size=BLOCK, max_num_batched_tokens=12)
    tri = LLM(llama, block_size=BLOCK, max_num_batched_tokens=12, attention_backend="triton")
    assert tri.engine.runner.use_kernel and not ref.engine.runner.use_kernel
    assert ([o.outputs[0].token_ids for o in tri.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in ref.generate(prompts, params)])


def test_runner_verifies_draft_tokens_with_one_logits_row_per_position(llama):
    """The speculative seam: drafts scheduled with a decode get K/V slots and a logits row each."""
    llm = LLM(llama, block_size=BLOCK)
    eng = llm.engine
    prompt = random_prompts(1, 9, 9, seed=11)[0]
    expected = greedy_alone(eng.model, prompt, 12)
    sink = Collector()
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), "spec", emit=sink)
    eng.step()  # prefill + first token
    (seq,) = eng.scheduler.running
    sched = eng.scheduler.schedule({seq.seq_id: expected[1:5]})  # four correct drafts
    assert sched.num_draft_tokens == {seq.seq_id: 4} and sched.num_tokens == [5]
    logits, batch = eng.runner.execute(sched.seqs, sched.num_tokens, sched.drafts)
    assert batch.rows_per_seq == [5] and logits.shape[0] == 5
    with torch.inference_mode():
        dense = eng.model.dense_logits(torch.tensor([prompt + expected[:5]]))[0, len(prompt):]
    torch.testing.assert_close(logits, dense.float(), atol=1e-4, rtol=1e-4)
    assert logits.argmax(-1).tolist() == expected[1:6]
    # a verifier accepting all four appends them plus the bonus token and commits their K/V
    eng.scheduler.update(sched, [Sampled(seq, expected[1:6], num_accepted=4)])
    assert seq.num_computed == len(prompt) + 5 and seq.output_token_ids == expected[:6]
    drain(eng)
    assert sink.final["spec"].outputs[0].token_ids == expected
    assert llm.core.pool.num_used == 0


def test_priority_decides_admission_when_the_batch_is_full(llama):
    llm = LLM(llama, block_size=BLOCK, max_num_seqs=1)
    eng = llm.engine
    sink = Collector()
    order = []
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    def emit(o):
        sink(o)
        if o.finished:
            order.append(o.request_id)

    eng.add_request([5, 6, 7], params, "first", emit=emit)
    eng.step()  # "first" holds the only slot; the rest queue behind it
    for rid, prio in (("low", 5), ("urgent", -1), ("normal", 0)):
        eng.add_request([5, 6, 7], params, rid, priority=prio, emit=emit)
    drain(eng)
    assert order == ["first", "urgent", "normal", "low"]


def test_n_choices_without_prefix_caching_and_max_tokens_none_runs_to_the_context(llama):
    llm = LLM(llama, block_size=BLOCK, max_model_len=40, enable_prefix_caching=False)
    prompt = {"prompt_token_ids": random_prompts(1, 10, 10, seed=12)[0]}
    out = llm.generate(prompt, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=None, ignore_eos=True))[0]
    assert [len(c.token_ids) for c in out.outputs] == [30, 30]
    assert all(c.finish_reason == "length" for c in out.outputs)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    assert llm.stats()["prefix_cache_hits"] == 0 and llm.stats()["used_pages"] == 0


def test_a_failed_sampling_pass_fails_its_requests_with_the_engine_error_code(llama, monkeypatch):
    import engines.runner
    import engines.step_plan

    llm = LLM(llama, block_size=BLOCK)
    eng = llm.engine
    real = engines.runner.sample_sequences
    calls = {"n": 0}

    def broken_once(logits, seqs, eos, *rest):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("sampler fell over")
        return real(logits, seqs, eos, *rest)

    monkeypatch.setattr(engines.runner, "sample_sequences", broken_once)
    monkeypatch.setattr(engines.step_plan, "MULTI_STEP_TOKENS", 1)  # greedy steps through the sampler, one token each
    sink = Collector()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eng.add_request([5, 6, 7], params, "a", emit=sink)
    eng.step()
    eng.step()  # its sampling fails
    eng.add_request([8, 9, 10], params, "b", emit=sink)
    drain(eng)
    a = sink.final["a"]
    assert a.error.code is ErrorCode.ENGINE_ERROR and "sampler fell over" in a.error.message
    assert a.outputs[0].finish_reason == "error" and len(a.outputs[0].token_ids) == 1
    assert sink.final["b"].error is None and sink.final["b"].outputs[0].token_ids == greedy_alone(
        eng.model, [8, 9, 10], 5)
    assert llm.core.pool.num_used == 0


def test_each_streamed_output_holds_what_its_deltas_add_up_to_when_it_was_built(llama):
    """Outputs carry deltas; their cumulative text, tokens and logprobs are views read later, and still equal
    the sum of the deltas up to each output (not what the sequence grew to since), with sampled logprobs and
    a held-back stop string."""
    llm = LLM(llama, block_size=BLOCK)
    eng = llm.engine
    sink = Collector()
    params = [SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["never-appears"], n=2)]
    for i, p in enumerate(params):
        eng.add_request("The quick brown fox", p, f"r{i}", emit=sink)
    drain(eng)
    assert len(sink.final) == 2
    for rid in ("r0", "r1"):
        outs = [o for o in sink.all if o.request_id == rid]
        assert len(outs) > 10  # streamed step by step
        for index in range(len(outs[0].outputs)):
            text, toks, lps = "", [], []
            for o in outs:
                c = o.outputs[index]
                text, toks = text + c.delta_text, toks + c.delta_token_ids
                lps += c.delta_logprobs or []
                assert (c.text, c.token_ids) == (text, toks)
                assert c.logprobs == (lps if rid == "r0" else None)
            assert len(toks) == 40 and text == llm.tokenizer.decode(toks)
