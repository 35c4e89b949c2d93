"""Speculative decoding on tiny random models: greedy output token-for-token equal to plain decoding (single
requests, a continuous batch of 32 with chunked prefill, preemption, stops, n > 1), sampled output distributed
as the target's (chi-square on a 16-token vocabulary, temperature 1 and top-p), supplied drafts, the pool
draining to zero, the vectorised rejection sampler against the kernel's reference, and adaptive k."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from scipy.stats import chisquare

from engines import LLM, EngineCore, EngineSpec, PoolSpec, SamplingParams
from engines.loader import load_checkpoint
from engines.sampler import apply_top_k_top_p_min_p
from engines.spec.adaptive import AdaptiveK
from engines.spec.rejection import rejection_sample_cpu, rejection_sample_one
from kernels.fused import rejection_sample_ref

BLOCK = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def noisy_copy(model: torch.nn.Module, scale: float, seed: int = 0) -> torch.nn.Module:
    """The model with Gaussian noise on every matrix: a draft that agrees often but not always."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * scale)
    return draft


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    """(checkpoint dir of the target, its Transformer, a noisy draft Transformer)."""
    path = tiny_checkpoint("llama", num_heads=4, num_kv_heads=2)
    target = load_checkpoint(path).model
    return path, target, noisy_copy(target, 0.004)


def spec_llm(pair, k: int = 3, fixed: bool = True, **options) -> LLM:
    _, target, draft = pair
    llm = LLM(target, draft_model=draft, num_speculative_tokens=k, block_size=BLOCK, **options)
    if fixed:
        llm.engine.speculator.adaptive.fixed = k
    return llm


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def drain(engine, max_steps: int = 20_000) -> None:
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < max_steps


# ---- the rejection sampler ------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_q", [True, False])
def test_vectorised_rejection_sampler_equals_the_reference(with_q):
    gen = torch.Generator().manual_seed(0)
    b, k, v = 12, 4, 10
    target = torch.rand(b, k + 1, v, generator=gen).pow(3)
    target /= target.sum(-1, keepdim=True)
    draft = torch.rand(b, k, v, generator=gen).pow(3)
    draft /= draft.sum(-1, keepdim=True)
    # drafts the target likes, sometimes not: all accept/reject paths occur
    ids = torch.where(torch.rand(b, k, generator=gen) < 0.6, target[:, :k].argmax(-1),
                      torch.randint(0, v, (b, k), generator=gen))
    for trial in range(20):
        u_acc, u_rec = torch.rand(b, k, generator=gen), torch.rand(b, generator=gen)
        q = draft if with_q else None
        got = rejection_sample_cpu(ids, q, target, u_acc, u_rec)
        want = rejection_sample_ref(ids, q, target, u_acc, u_rec)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), trial


@pytest.mark.parametrize("with_q", [True, False])
def test_the_batch_1_rejection_path_equals_the_reference_and_the_vectorised_sampler(with_q):
    gen = torch.Generator().manual_seed(1)
    b, k, v = 16, 4, 10
    target = torch.rand(b, k + 1, v, generator=gen).pow(3)
    target[:, :, 7] = 0.0  # a token no row can draw
    target /= target.sum(-1, keepdim=True)
    draft = torch.rand(b, k, v, generator=gen).pow(3)
    draft /= draft.sum(-1, keepdim=True)
    ids = torch.where(torch.rand(b, k, generator=gen) < 0.6, target[:, :k].argmax(-1),
                      torch.randint(0, v, (b, k), generator=gen))
    seen_acc = set()
    for trial in range(20):
        u = torch.rand(b, k + 1, generator=gen)
        q = draft if with_q else None
        tokens, num_acc = rejection_sample_cpu(ids, q, target, u[:, :k].contiguous(), u[:, k].contiguous())
        ref_tokens, ref_acc = rejection_sample_ref(ids, q, target, u[:, :k].contiguous(), u[:, k].contiguous())
        assert torch.equal(tokens, ref_tokens) and torch.equal(num_acc, ref_acc)
        for row in range(b):
            got = rejection_sample_one(ids[row], None if q is None else q[row:row + 1], target[row], u[row])
            acc = int(num_acc[row])
            assert got == (tokens[row, :acc + 1].tolist(), acc), (trial, row)
            assert 7 not in got[0][acc:]
            seen_acc.add(acc)
    assert {0, k} <= seen_acc  # rejections at the first draft and full acceptance (the bonus) both occur


# ---- greedy: exactly plain decoding ------------------------------------------------------------------------------

def test_greedy_single_requests_are_token_for_token_plain_greedy(pair):
    path, target, _ = pair
    plain = LLM(target, block_size=BLOCK)
    spec = spec_llm(pair, k=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for prompt in random_prompts(4, 1, 30, seed=1):
        want = plain.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        got = spec.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        assert got == want
    stats = spec.stats()
    assert stats["engine_spec_num_draft_tokens"] > 100
    assert 0.3 < stats["engine_spec_acceptance_rate"] < 1.0  # the noisy draft is right often, not always
    assert stats["used_pages"] == 0


def test_a_continuous_batch_of_32_mixed_requests_equals_plain_decoding(pair):
    """Staggered arrivals, chunked prefill, mixed max_tokens, stop token ids, stop strings, n = 2."""
    _, target, _ = pair
    prompts = random_prompts(32, 1, 40, seed=2)
    rng = random.Random(3)
    plain = LLM(target, block_size=BLOCK, max_num_batched_tokens=48)
    params = []
    for i, p in enumerate(prompts):
        m = rng.randint(1, 24)
        if i % 4 == 1:  # stop on whatever token the plain run produces 3rd (the draft must not overshoot it)
            third = plain.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=m + 3,
                                                                            ignore_eos=True))[0].outputs[0]
            params.append(SamplingParams(temperature=0, max_tokens=m + 3, ignore_eos=True,
                                         stop_token_ids=[third.token_ids[2]]))
        elif i % 4 == 2:
            params.append(SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, n=2, logprobs=2))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    spec = spec_llm(pair, k=3, max_num_batched_tokens=48)
    want = [plain.generate({"prompt_token_ids": p}, sp)[0] for p, sp in zip(prompts, params)]
    eng = spec.engine
    finals = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(p, sp, f"r{i}", emit=lambda o: finals.__setitem__(o.request_id, o) if o.finished else None)
        if i % 2:
            eng.step()
    while eng.has_work():
        eng.step()
        for s in eng.scheduler.running:  # the drafter's tokens never leave the sequence's own path
            ds = s.draft_state
            assert ds is None or ds.token_ids == s.token_ids[:len(ds.token_ids)]
    for i, w in enumerate(want):
        got = finals[f"r{i}"]
        for a, b in zip(got.outputs, w.outputs):
            assert a.token_ids == b.token_ids, f"request {i}"
            assert a.finish_reason == b.finish_reason and a.stop_reason == b.stop_reason
            if b.logprobs is not None:  # the target's logprobs, as plain decoding reports them
                for la, lb in zip(a.logprobs, b.logprobs):
                    assert la.keys() == lb.keys()
                    assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)
    stats = spec.stats()
    assert stats["engine_spec_num_accepted_tokens"] > 50
    assert stats["used_pages"] == 0


def test_preemption_drops_draft_state_and_still_matches(pair):
    _, target, _ = pair
    prompts = random_prompts(10, 10, 30, seed=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(target, block_size=BLOCK)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    page = 2 * 2 * BLOCK * 2 * 16 * 4  # both models: 2 layers, 2 KV heads, head_dim 16, float32
    spec = spec_llm(pair, k=3, memory_bytes=40 * page, enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": p} for p in prompts], params)]
    stats = spec.stats()
    assert stats["engine_num_preemptions"] > 0 and stats["engine_spec_num_drafts"] > 0
    assert got == want
    assert stats["used_pages"] == 0


def test_aborts_mid_speculation_free_target_and_draft_pages(pair):
    spec = spec_llm(pair, k=3)
    eng = spec.engine
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i, p in enumerate(random_prompts(6, 5, 20, seed=5)):
        eng.add_request(p, params, f"a{i}")
    for _ in range(4):
        eng.step()
    assert any(s.draft_state is not None and s.draft_state.pages for s in eng.scheduler.running)
    assert eng.stats()["spec_num_drafts"] > 0
    for i in range(6):
        eng.abort(f"a{i}")
    eng.step()
    assert not eng.has_work() and spec.core.pool.num_used == 0


def windows_steps(eng, record=lambda plan: plan.k) -> list:
    """`record(plan)` of every windows plan the engine's policy chooses from now on."""
    seen = []
    choose = eng.policy.choose

    def recording(*a, **kw):
        plan = choose(*a, **kw)
        if plan.kind == "windows":
            seen.append(record(plan))
        return plan

    eng.policy.choose = recording
    return seen


@pytest.mark.parametrize("round_seed", range(3))
def test_drafting_windows_looped_in_one_step_equal_one_window_per_step_and_plain_decoding(pair, monkeypatch,
                                                                                           round_seed):
    """A windows `StepPlan` (up to SPEC_WINDOWS greedy windows verified in one step) against one
    window per step and against plain decoding: random batches of 1-3 greedy requests, k 1-4, max_tokens that
    end mid-window, EOS and stop ids that end a sequence mid-loop, a new request arriving and aborts at random
    steps; the same tokens and finish reasons, the loop taken, and the pool back to zero pages."""
    import engines.step_plan as engine_mod

    path, target, _ = pair
    rng = random.Random(round_seed)
    plain = LLM(target, block_size=BLOCK)
    looped_steps = {1: 0, 4: 0}
    for trial in range(4):
        k = rng.randint(1, 4)
        prompts = random_prompts(rng.randint(1, 3), 1, 25, seed=100 * round_seed + trial)
        params = [SamplingParams(temperature=0, max_tokens=rng.randint(3, 60), ignore_eos=rng.random() < 0.5,
                                 stop_token_ids=rng.sample(range(5, 384), 3)) for _ in prompts]
        want = [o.outputs[0] for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
        for windows in (1, 4):
            monkeypatch.setattr(engine_mod, "SPEC_WINDOWS", windows)
            spec = spec_llm(pair, k=k)
            looped = windows_steps(spec.engine)
            got = [o.outputs[0] for o in spec.generate([{"prompt_token_ids": p} for p in prompts], params)]
            assert [(g.token_ids, g.finish_reason) for g in got] == [(w.token_ids, w.finish_reason) for w in want]
            looped_steps[windows] += len(looped)
            assert spec.stats()["used_pages"] == 0
    assert looped_steps[1] == 0 and looped_steps[4] > 0  # the loop ran (where nothing else kept it from it)
    # aborts and an arrival between looped steps
    monkeypatch.setattr(engine_mod, "SPEC_WINDOWS", 4)
    spec = spec_llm(pair, k=3)
    eng = spec.engine
    greedy = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    eng.add_request(random_prompts(1, 5, 20, seed=round_seed)[0], greedy, "first")
    for _ in range(rng.randint(2, 5)):
        eng.step()
    assert eng.stats()["spec_num_drafts"] > 0
    eng.add_request(random_prompts(1, 5, 20, seed=round_seed + 7)[0], greedy, "second")
    for _ in range(rng.randint(1, 4)):
        eng.step()
    eng.abort("first")
    eng.abort("second")
    eng.step()
    assert not eng.has_work() and spec.core.pool.num_used == 0


def test_the_windows_loop_takes_only_as_many_windows_as_the_token_budget_books(pair):
    """A step of drafting windows books every window's tokens at once: it takes as many as the step's token budget
    holds (at least two), else the step drafts one window the normal way, never a booking the budget trims."""
    path, target, _ = pair
    plain = LLM(target, block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for batch, budget, windows in ((1, 16, 3), (2, 16, None), (2, 24, 2)):
        prompts = random_prompts(batch, 5, 12, seed=batch + budget)
        want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
        spec = spec_llm(pair, k=4, max_num_batched_tokens=budget)
        eng = spec.engine
        looped = windows_steps(eng, lambda plan, eng=eng: (len(eng.scheduler.running), plan.windows))
        got = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": p} for p in prompts], params)]
        assert got == want and spec.stats()["used_pages"] == 0
        # 16 tokens hold 3 windows of k = 4 for one sequence, none for two; 24 hold 2 for two
        assert all(w == min(4, budget // (n * 5)) >= 2 for n, w in looped)
        assert [w for n, w in looped if n == batch] if windows else not [n for n, w in looped if n == batch]


def test_per_request_speculative_false_never_drafts(pair):
    spec = spec_llm(pair, k=3)
    out = spec.generate({"prompt_token_ids": [7, 8, 9]},
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False))[0]
    assert len(out.outputs[0].token_ids) == 20
    assert spec.stats()["engine_spec_num_drafts"] == 0


def test_seeded_sampling_with_speculation_reproduces_and_n_choices_differ(pair):
    spec = spec_llm(pair, k=3, fixed=False)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=5, n=2, max_tokens=25, ignore_eos=True)
    prompt = {"prompt_token_ids": [11, 12, 13, 14]}
    first = spec.generate(prompt, params)[0]
    others = spec.generate([prompt] * 3, [SamplingParams(temperature=1.0, max_tokens=25)] * 2 + [params])
    assert [c.token_ids for c in others[2].outputs] == [c.token_ids for c in first.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    assert spec.stats()["engine_spec_num_drafts"] > 0


def test_seeded_sampling_is_identical_with_and_without_speculation_whatever_k(pair):
    """A seeded row's token at each position is its own seeded draw from the target distribution, in a plain
    step or after a draft: any k (and any trimming of drafts) gives plain decoding's output."""
    _, target, _ = pair
    plain = LLM(target, block_size=BLOCK)
    prompts = random_prompts(3, 3, 20, seed=9)
    params = [SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.2, top_p=0.8, seed=12, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, presence_penalty=0.5, seed=13, max_tokens=30, ignore_eos=True)]
    want = [[c.token_ids for c in o.outputs] for o in plain.generate([{"prompt_token_ids": p} for p in prompts],
                                                                       params)]
    for k in (1, 2, 4):
        spec = spec_llm(pair, k=k)
        got = spec.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [[c.token_ids for c in o.outputs] for o in got] == want, f"k={k}"
        assert spec.stats()["engine_spec_num_accepted_tokens"] > 0  # drafts were verified, some accepted
    assert want[0][0] != want[0][1]  # the n choices differ


# ---- sampling: the target's distribution -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_vocab_pair(tiny_checkpoint):
    """A 16-token target and an unrelated 16-token draft (so rejections and recoveries are frequent)."""
    kw = dict(vocab_size=16, hidden_size=32, num_heads=2, num_kv_heads=1, with_tokenizer=False)
    target = load_checkpoint(tiny_checkpoint("llama", seed=1, **kw)).model
    draft = load_checkpoint(tiny_checkpoint("llama", seed=2, **kw)).model
    return target, draft


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_speculative_sampling_matches_the_target_distribution(tiny_vocab_pair, top_p):
    target, draft = tiny_vocab_pair
    torch.manual_seed(0)
    llm = LLM(target, draft_model=draft, num_speculative_tokens=2, block_size=BLOCK, max_num_seqs=256,
              max_num_batched_tokens=1024)
    llm.engine.speculator.adaptive.fixed = 2
    prompt = [3, 9, 4]
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=3, ignore_eos=True, n=16)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 250, params)
    samples = [tuple(c.token_ids) for o in outs for c in o.outputs]
    stats = llm.stats()
    assert 0.05 < stats["engine_spec_acceptance_rate"] < 0.9  # real accepts and real recoveries
    assert stats["engine_spec_num_draft_tokens"] > 3000

    def dist(prefixes: list[tuple[int, ...]]) -> torch.Tensor:
        """The sampler's distribution after each prefix: temperature 1, then top-p."""
        with torch.inference_mode():
            logits = target.dense_logits(torch.tensor([prompt + list(p) for p in prefixes]))[:, -1].float()
        tp = torch.full((len(prefixes),), top_p) if top_p < 1 else None
        return apply_top_k_top_p_min_p(logits, None, tp, None).softmax(-1)

    # exact joint of tokens 2 and 3 (both drafted and verified) given token 1, and the marginal of token 3
    p1 = dist([()])[0]
    pairs = list(itertools.product(range(16), repeat=2))
    p2 = dist([(a,) for a in range(16)])
    p3 = dist(list(itertools.product(range(16), repeat=2)))
    joint23 = torch.zeros(16, 16)
    for (a, b), row in zip(pairs, p3):
        joint23[b] += p1[a] * p2[a, b] * row
    n = len(samples)
    observed = torch.zeros(16, 16)
    for s in samples:
        observed[s[1], s[2]] += 1
    expected = joint23.flatten() * n
    obs = observed.flatten()
    keep = expected >= 5  # pool the rare cells so the chi-square approximation holds
    f_obs = torch.cat([obs[keep], obs[~keep].sum()[None]]).double()
    f_exp = torch.cat([expected[keep], expected[~keep].sum()[None]]).double()
    f_exp *= f_obs.sum() / f_exp.sum()
    assert int(keep.sum()) > 20
    assert chisquare(f_obs.numpy(), f_exp.numpy()).pvalue > 1e-3
    if top_p < 1:  # tokens outside the top-p set are never emitted
        assert all(expected.view(16, 16)[s[1], s[2]] > 0 for s in samples)


# ---- supplied drafts -------------------------------------------------------------------------------------------

def test_supplied_drafts_of_the_models_own_greedy_output_are_all_accepted(pair):
    _, target, _ = pair
    prompt = random_prompts(1, 12, 12, seed=6)[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(target, block_size=BLOCK)
    greedy = plain.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    verifier = LLM(target, block_size=BLOCK)  # no drafter: supplied drafts need only the verifier
    result = verifier.generate({"prompt_token_ids": prompt}, params, draft_token_ids=greedy)[0]
    out = result.outputs[0]
    assert out.token_ids == greedy
    # the request's own metrics count the verified drafts (the decode span and escalations read them)
    assert result.metrics.num_accepted_tokens == result.metrics.num_draft_tokens >= 37
    stats = verifier.stats()
    assert stats["engine_spec_acceptance_rate"] == 1.0
    # 40 tokens in 3 target passes (chunks of 16 drafts, each adds a bonus token); plain needs 40
    assert stats["engine_num_steps"] <= 3
    assert stats["used_pages"] == 0


def test_supplied_random_drafts_are_mostly_rejected_and_yield_the_greedy_output(pair):
    _, target, _ = pair
    prompt = random_prompts(1, 12, 12, seed=7)[0]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    greedy = LLM(target, block_size=BLOCK).generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    spec = spec_llm(pair, k=3)
    junk = [random.Random(8).randrange(5, 384) for _ in range(30)]
    out = spec.generate({"prompt_token_ids": prompt}, params, draft_token_ids=junk)[0].outputs[0]
    assert out.token_ids == greedy
    stats = spec.stats()
    supplied_accepted = sum(a == b for a, b in zip(junk, greedy))
    assert supplied_accepted <= 2
    assert stats["engine_spec_num_drafts"] > 1  # the drafter took over after the supplied path was rejected
    assert stats["used_pages"] == 0


def test_draft_kv_reuses_the_small_engines_cached_prompt(pair, tiny_checkpoint):
    path, _, _ = pair
    core = EngineCore([EngineSpec("small", path), EngineSpec("large", path, draft="small", num_speculative_tokens=2)],
                      PoolSpec(block_size=BLOCK))
    prompt = random_prompts(1, 21, 21, seed=9)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    small, large = core.engines["small"], core.engines["large"]
    assert large.speculator.drafter.model is small.model  # the same weights object
    small.add_request(prompt, params, "s")
    drain(small)
    large.speculator.adaptive.fixed = 2
    large.add_request(prompt, params, "l")
    drain(large)
    assert large.stats()["spec_draft_prefix_hit_tokens"] == 20  # 5 full blocks of the 21-token prompt
    assert core.pool.num_used == 0


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="needs a draft engine"):
        EngineCore([EngineSpec("a", "unused", num_speculative_tokens=3)])
    with pytest.raises(ValueError, match="must name another engine"):
        EngineCore([EngineSpec("a", "unused", draft="b")])


# ---- adaptive k --------------------------------------------------------------------------------------------------

def feed(ak: AdaptiveK, batch: int, plain: float, per_token: float, draft: float, a: float) -> None:
    for _ in range(30):  # sizes sharing a bucket alternate, so each bucket settles on their mean
        for k in range(ak.k_max + 1):
            ak.target.observe(batch * (k + 1), plain + per_token * batch * k)
        ak.draft.observe(batch, draft)
    for _ in range(50):  # windows of 20 drafts with one rejection each: a = accepted / (accepted + 1)
        ak.observe_window(20, round(a / (1 - a)))


def test_a_cost_models_first_observations_average_before_they_decay():
    from engines.spec.adaptive import CostModel

    m = CostModel(decay=0.9)
    m.observe(1, 0.010)  # a first step on cold caches
    for _ in range(3):
        m.observe(1, 0.002)
    assert m.estimate(1) == pytest.approx((0.010 + 3 * 0.002) / 4)  # not 0.9^3 of the outlier
    for _ in range(6):
        m.observe(1, 0.002)
    before = m.estimate(1)
    m.observe(1, 0.012)  # from the tenth on, an EMA with weight 0.1
    assert m.estimate(1) == pytest.approx(before + 0.1 * (0.012 - before))


def test_adaptive_k_drafts_when_it_pays_and_stops_when_it_does_not():
    ak = AdaptiveK(4)
    assert ak.choose(1) == 0  # nothing measured: a plain step first
    ak.target.observe(1, 0.010)
    assert ak.choose(1) == 2  # then a little drafting to measure acceptance and draft cost
    fast = AdaptiveK(4)
    feed(fast, 1, plain=0.010, per_token=0.0002, draft=0.0005, a=0.95)
    assert fast.choose(1) == 4  # cheap draft, high acceptance: the longest window
    slow = AdaptiveK(4)
    feed(slow, 32, plain=0.010, per_token=0.0001, draft=0.002, a=0.5)
    assert slow.choose(32) == 0  # the verify pass scales with the batch: at this acceptance speculation loses
    # exploration takes the other side once in a while; while plain decoding keeps winning, ever more rarely
    choices = [slow.choose(32) for _ in range(1000)]
    explored = [i + 2 for i, k in enumerate(choices) if k == 1]  # the step count of each exploration
    assert explored == [32, 96, 224, 480, 992] and choices.count(0) == 995
    # where drafting would lose even with every draft accepted, measuring acceptance cannot change the choice:
    # no exploration (each costs a few sequences' catch-up)
    hopeless = AdaptiveK(4)
    feed(hopeless, 32, plain=0.010, per_token=0.0003, draft=0.006, a=0.5)
    assert [hopeless.choose(32) for _ in range(1000)] == [0] * 1000
    # drafting that pays explores plain decoding every explore_every steps
    choices = [fast.choose(1) for _ in range(96)]
    assert choices.count(0) == 6 and choices.count(4) == 90  # two explorations, 3 plain steps each
    assert AdaptiveK.expected_tokens(0.5, 3) == pytest.approx(1.875)


def test_adaptive_k_prefers_measured_verify_steps_over_the_tokens_per_step_model():
    ak = AdaptiveK(4, explore_every=1000)
    feed(ak, 4, plain=0.010, per_token=0.0002, draft=0.0005, a=0.8)
    assert ak.choose(4) > 0  # from tokens per step, a 4 x 5-token verify looks as cheap as 20 decodes
    for _ in range(30):  # measured: plain steps of 4 sequences 10 ms, verify steps with any k 40 ms
        for k in range(5):
            ak.observe_step(4, k, 0.100)  # the first step after a switch of k pays for it: not counted
            ak.observe_step(4, k, 0.010 if k == 0 else 0.040)
    assert ak.step_seconds(4, 3, 0.0005) == pytest.approx(0.040) and ak.choose(4) == 0
    # unmeasured batch size: the target pass by tokens per step plus k draft passes
    assert ak.step_seconds(1, 3, 0.0005) == pytest.approx(ak.target.estimate(4) + 3 * 0.0005)


def test_one_measured_k_corrects_the_model_for_the_others_at_that_batch_size():
    ak = AdaptiveK(4, explore_every=1000)
    feed(ak, 8, plain=0.010, per_token=0.0002, draft=0.0005, a=0.8)
    modelled = {k: ak.step_seconds(8, k, 0.0005) for k in range(5)}
    ak.observe_step(8, 3, 0.050)
    ak.observe_step(8, 3, 0.050)  # steady: measured 50 ms where the model said modelled[3]
    assert ak.step_seconds(8, 3, 0.0005) == pytest.approx(0.050)
    ratio = 0.050 / modelled[3]
    assert ak.step_seconds(8, 2, 0.0005) == pytest.approx(modelled[2] * ratio)
    assert ak.step_seconds(8, 0, 0.0005) == pytest.approx(modelled[0])  # plain decoding is its own model
    assert ak.step_seconds(2, 2, 0.0005) == pytest.approx(ak.target.estimate(6) + 2 * 0.0005)  # other sizes


def test_leaving_plain_decoding_for_an_unmeasured_k_needs_a_clear_gain():
    ak = AdaptiveK(1, explore_every=1000)
    ak.target.observe(8, 0.010)  # 8 plain decodes: 10 ms; 16 tokens (8 x k = 1 verify): 11 ms
    ak.target.observe(16, 0.011)
    ak.draft.observe(8, 0.001)
    ak.observe_window(10, 9)  # a = 0.9: E(1) = 1.9 tokens per sequence
    ak.k = 0
    assert ak.choose(8) == 1  # predicted 8 x 1.9 / 12 ms = 1.27 tokens/ms vs 0.8: far over the margin
    slow = AdaptiveK(1, explore_every=1000)
    slow.target.observe(8, 0.010)
    slow.target.observe(16, 0.016)
    slow.draft.observe(8, 0.001)
    slow.observe_window(10, 9)
    slow.k = 0
    assert slow.choose(8) == 0  # predicted 8 x 1.9 / 17 ms = 0.89 tokens/ms: +12%, under the 20% margin
    slow.observe_step(8, 1, 0.017)
    slow.observe_step(8, 1, 0.017)  # measured at this batch size: the plain comparison decides
    slow.k = 0
    assert slow.choose(8) == 1


def test_adaptive_k_explores_drafting_at_a_small_batch_as_a_short_run_and_keeps_what_it_measured():
    ak = AdaptiveK(4, explore_every=8)
    feed(ak, 2, plain=0.004, per_token=0.001, draft=0.002, a=0.9)  # the model: drafting loses at batch 2
    ak.k = 0
    for _ in range(2):
        ak.observe_step(2, 0, 0.004)
    choices = []
    for _ in range(10):
        choices.append(ak.choose(2))
        ak.observe_step(2, choices[-1], 0.004 if choices[-1] == 0 else 0.006)  # measured: k > 0 costs 6 ms
    # the exploration (the 8th choice) drafts with the largest k not measured at this batch size (4: the model
    # rates it worst, and would never try it) for 3 steps, two of them steady, so the whole step is measured
    assert choices == [0] * 7 + [4] * 3
    assert ak.step_seconds(2, 4, 0.002) == pytest.approx(0.006)
    # 2 x E(4) / 6 ms = 1.37 tokens/ms beats 2 / 4 ms: it keeps drafting
    assert all(k > 0 for k in [ak.choose(2) for _ in range(4)])
    ak.unsteady()  # a step whose drafter caught up on a new prompt: not a measure of k = 4
    ak.observe_step(2, 4, 0.050)
    assert ak.step_seconds(2, 4, 0.002) == pytest.approx(0.006)
    ak.observe_step(2, 4, 0.007)  # the next one with the same k is
    # its first observations average plainly (two of 6 ms, this one of 7 ms), later ones decay as an EMA
    assert ak.step_seconds(2, 4, 0.002) == pytest.approx((2 * 0.006 + 0.007) / 3)
    # at a batch larger than explore_seqs an exploration is one step of k = 1 for a few sequences
    big = AdaptiveK(4, explore_every=8)
    feed(big, 16, plain=0.004, per_token=0.0001, draft=0.001, a=0.5)
    assert [big.choose(16) for _ in range(9)] == [0] * 7 + [1, 0]


def test_one_dear_measurement_of_a_small_k_does_not_keep_larger_ones_from_being_tried():
    """A k = 1 step measured dear at batch 1 (a cold first step) scales the model of every other k with it, so
    that drafting looks like a loss even with every draft accepted; the larger k were never measured, so an
    exploration and a lone sequence's probe try them, largest first, and a cheap measured k = 4 then drafts
    (on held-out prompts this stuck at plain decoding for whole runs: 0.99x where k = 4 gave 1.8x)."""
    ak = AdaptiveK(4, explore_every=8)
    ak.target.observe(1, 0.001)
    ak.target.observe(2, 0.0016)
    ak.target.observe(6, 0.0040)
    ak.draft.observe(1, 0.0003)
    ak.observe_window(20, 17)  # a = 0.85
    for _ in range(3):
        ak.observe_step(1, 0, 0.001)
    ak.observe_step(1, 1, 0.0024)
    ak.observe_step(1, 1, 0.0024)  # k = 1 measured: 2.4 ms against 1 ms plain
    ak.k = 0
    assert ak.choose(1) == 0
    assert ak.probe() == 4  # not measured at this batch size: a probe measures it
    choices = []
    for _ in range(9):  # the 8th choice explores
        choices.append(ak.choose(1))
        ak.observe_step(1, choices[-1], 0.001 if choices[-1] == 0 else 0.0027)
    assert choices[-3:] == [4, 4, 4]  # the exploration: k = 4, two steady steps of 2.7 ms
    # E(0.85, 4) = 3.8 tokens per 2.7 ms against 1 per 1 ms: it drafts (with the k that k = 4's measured cost,
    # scaling the model of the k not measured, rates best)
    assert ak.choose(1) > 0


def test_adaptive_k_starts_drafting_only_for_a_clear_gain_and_stops_at_once():
    ak = AdaptiveK(1, explore_every=10_000)
    ak.target.observe(4, 0.010)
    ak.draft.observe(4, 0.001)
    ak.observe_window(10, 9)  # a = 0.9: E(1) = 1.9 tokens per sequence and step

    def measured(k: int, seconds: float) -> None:
        for _ in range(80):
            ak.observe_step(4, k, seconds)

    measured(0, 0.010)  # plain decoding: 4 / 10 ms = 0.40 tokens/ms
    measured(1, 0.025)  # drafting: 4 x 1.9 / 25 ms = 0.30
    assert ak.choose(4) == 0
    measured(1, 0.018)  # 0.42, 5% faster: no reason to start drafting
    assert ak.choose(4) == 0
    measured(1, 0.016)  # 0.475, 19% faster: drafting
    assert ak.choose(4) == 1
    measured(1, 0.018)  # 5% faster still: it keeps drafting
    assert ak.choose(4) == 1
    measured(1, 0.020)  # 0.38: plain decoding 5% faster: back at once (that way costs no catch-up)
    assert ak.choose(4) == 0


def test_a_choice_that_changes_side_by_itself_is_checked_again_soon():
    ak = AdaptiveK(4, explore_every=8, explore_max=512)
    feed(ak, 1, plain=0.010, per_token=0.0002, draft=0.0005, a=0.95)
    assert [ak.choose(1) for _ in range(600)].count(4) > 550
    assert ak._interval == 512  # drafting kept winning: explorations of plain decoding became rare
    for _ in range(60):  # then a draft pass costs 50 ms: plain decoding wins from the next choice on
        ak.draft.observe(1, 0.050)
    choices = [ak.choose(1) for _ in range(9)]
    assert choices[:8] == [0] * 8 and choices[8] > 0  # drafting is tried again 8 steps later, not 512


def test_a_drafting_step_that_catches_up_on_a_prompt_is_not_measured(pair):
    spec = spec_llm(pair, k=2)
    eng, sp = spec.engine, spec.engine.speculator
    sp.adaptive.fixed = 2
    eng.add_request(list(range(5, 17)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), "r")
    seen = []
    while eng.has_work():
        eng.step()
        seen.append(sp.drafter.caught_up)
    # the prefill step drafts nothing; the first decode step's drafter computes the 13-token prompt first
    assert seen[:3] == [False, True, False] and not any(seen[2:])
    assert sp.adaptive.step_cost[2].points  # the steady steps after it were measured


def test_a_drafter_far_behind_drafts_only_where_its_catch_up_pays():
    ak = AdaptiveK(4, explore_every=10_000)
    feed(ak, 1, plain=0.010, per_token=0.0002, draft=0.0025, a=0.8)
    ak.target.observe(256, 0.100)  # a 256-token prefill pass of the target: 100 ms
    assert ak.catch_up_s(256) == pytest.approx(0.100 * 0.0025 / 0.010)  # the draft model's share: 25 ms
    assert ak.choose(1) > 0 and 0 < ak.saving_s < ak.plain_step_s
    # drafting saves saving_s per token: a 256-token catch-up pays back over 25 ms / saving_s tokens
    breakeven = ak.catch_up_s(256) / ak.saving_s
    assert ak.catch_up_pays([256], [int(breakeven) + 1]) and not ak.catch_up_pays([256], [int(breakeven) - 1])
    assert ak.catch_up_pays([2], [0])  # the last draft and the bonus token: no catch-up to speak of
    # every sequence of the step waits for every catch-up: one pass over all the missed tokens, paid back to
    # the sequence with the fewest tokens left
    assert not ak.catch_up_pays([2, 256], [10_000, int(breakeven) - 1])
    both = ak.catch_up_s(512) / ak.saving_s
    assert ak.catch_up_pays([256, 256], [int(both) + 1] * 2) and not ak.catch_up_pays([256, 256], [int(both) - 1] * 2)
    # a measuring choice stalls the step by at most 5% of the fewest remaining tokens' plain decoding time, at
    # least one plain step, whatever drafting is thought to save
    ak.exploring = True
    assert ak.plain_step_s == pytest.approx(0.010) and ak.catch_up_s(256) == pytest.approx(0.025)
    assert not ak.catch_up_pays([256], [10]) and ak.catch_up_pays([8], [0])  # 25 ms > one plain step
    assert not ak.catch_up_pays([256], [10_000, 49]) and ak.catch_up_pays([256], [10_000, 50])  # 50 x 5% x 10 ms
    ak.fixed, ak.exploring = 4, False  # k pinned: every sequence drafts
    assert ak.catch_up_pays([256], [0])
    plain = AdaptiveK(4)
    feed(plain, 32, plain=0.010, per_token=0.0001, draft=0.002, a=0.5)
    assert plain.choose(32) == 0 and plain.saving_s == 0 and not plain.catch_up_pays([64], [10_000])


def test_short_requests_on_long_prompts_decode_without_their_drafter(pair, monkeypatch):
    """Adaptive k picks drafting, but a new sequence whose remaining tokens cannot pay back its drafter's
    catch-up on the prompt decodes plainly (and, without drafts, as a multi-step step where it can); one with
    many tokens to go drafts. Outputs equal plain decoding either way."""
    spec = spec_llm(pair, k=3, fixed=False)
    eng, sp = spec.engine, spec.engine.speculator
    ad = sp.adaptive

    def choose(batch: int, accs=None) -> int:  # drafting pays: each token 5 ms sooner; a catch-up costs 100 ms
        ad.exploring, ad.saving_s, ad.plain_step_s = False, 0.005, 0.010
        return 3

    monkeypatch.setattr(ad, "choose", choose)
    monkeypatch.setattr(ad, "catch_up_s", lambda num_tokens: 0.100 if num_tokens > 2 else 0.0)
    prompt = random_prompts(1, 200, 200, seed=5)[0]
    short = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    long_ = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    eng.add_request(prompt, short, "short")
    eng.step()  # prefill
    assert sp.plan(eng.scheduler.running).picked == []  # k > 0, but no sequence would draft
    drain(eng)
    assert sp.num_drafts == 0
    ref = LLM(pair[1], block_size=BLOCK)
    assert (spec.generate([prompt], long_)[0].outputs[0].token_ids
            == ref.generate([prompt], long_)[0].outputs[0].token_ids)
    assert sp.num_drafts > 0  # 199 tokens to go x 5 ms pay for the catch-up
    assert spec.core.pool.stats()["used_pages"] == 0

    # together: the long request's drafter has caught up, the short one's has not; drafting for the long one
    # alone would hand the short one one token per (dearer) drafting step, so nobody drafts until it is done
    prompts = random_prompts(2, 200, 200, seed=6)
    eng.add_request(prompts[0], long_, "long2")
    while not any(s.draft_state is not None and sp.drafter.lag(s) <= 2 for s in eng.scheduler.running):
        eng.step()
    eng.add_request(prompts[1], short, "short2")
    eng.step()  # its prefill
    seqs = {s.request.request_id: s for s in eng.scheduler.running}
    drafts_before = sp.num_drafts
    while not seqs["short2"].finished:
        assert not sp.plan(eng.scheduler.running).k
        eng.step()
    assert sp.num_drafts == drafts_before  # the short request decoded beside it without a drafting step
    drain(eng)
    assert sp.num_drafts > drafts_before  # then the long one drafted again
    for rid, prompt, params in (("long2", prompts[0], long_), ("short2", prompts[1], short)):
        assert seqs[rid].output_token_ids == ref.generate([prompt], params)[0].outputs[0].token_ids
    assert spec.core.pool.stats()["used_pages"] == 0


def test_a_step_drafts_for_every_sequence_or_none_and_explorations_stall_it_little(pair, monkeypatch):
    from types import SimpleNamespace

    sp = spec_llm(pair, k=3, fixed=False).engine.speculator
    ad = sp.adaptive
    lags = {}
    monkeypatch.setattr(sp.drafter, "lag", lambda s: lags[s.seq_id])
    monkeypatch.setattr(ad, "catch_up_s", lambda n: 0.001 * n)  # 1 ms per missed token

    def seqs(*seq_lags, left=100):
        out = []
        for i, lag in enumerate(seq_lags):
            lags[i] = lag
            out.append(SimpleNamespace(seq_id=i, num_tokens=500, max_len=500 + left))
        return out

    def select(batch, exploring):
        ad.exploring, ad.plain_step_s, ad.saving_s = exploring, 0.010, 0.001  # drafting saves 1 ms a token
        return [s.seq_id for s, _ in sp._select(batch, 3)]

    # a 150-token catch-up pays back over 150 tokens of 1 ms saved; 100 left each: no drafting for anyone, not
    # drafting for the caught-up two alone
    assert select(seqs(1, 2, 60), False) == [0, 1, 2] and select(seqs(1, 2, 150), False) == []
    assert select(seqs(1, 2, 90, 50), False) == [] and select(seqs(1, 2, 50, 40), False) == [0, 1, 2, 3]
    # an exploration at a small batch: all, if the catch-ups fit in one plain step (10 ms; 10 tokens left
    # each, 5% of whose plain decoding is less), else none; with 400 left (counted as 256, REMAINING_CAP), in 5%
    # of 256 plain steps (128 ms)
    assert select(seqs(1, 9, left=10), True) == [0, 1] and select(seqs(1, 12, left=10), True) == []
    assert select(seqs(1, 120, left=400), True) == [0, 1] and select(seqs(1, 130, left=400), True) == []
    # at a larger batch: the least behind, as many as fit
    assert select(seqs(30, 1, 2, 40, 12, 15, 1, left=10), True) == [1, 6, 2]  # the fourth (12 behind) would not
    assert sorted(select(seqs(1, 2, 1, 2, 1, 2), True)) == [0, 1, 2, 4]  # at most EXPLORE_SEQS


def test_a_sequence_decoding_alone_probes_its_own_acceptance_when_new_and_after_32_64_128_plain_tokens(pair):
    from types import SimpleNamespace

    sp = spec_llm(pair, k=4, fixed=False).engine.speculator
    ad = sp.adaptive
    ad.explore_every = ad._next_explore = 10_000
    # the engine's acceptance 0.5: plain decoding wins on the mean, though drafting could pay at a higher one
    feed(ad, 1, plain=0.010, per_token=0.0002, draft=0.006, a=0.5)
    seq = SimpleNamespace(seq_id=1, num_tokens=100, max_len=400, draft_accepted=0.0, draft_rejected=0.0,
                          draft_seen_at=0, draft_probes=0, probe_idle_until=0)
    assert ad.choose(1) == 0
    k = sp._choose([seq])
    assert k > 0 and ad.exploring  # new: a probe, which counts as an exploration (catch-up, all or none)
    seq.draft_seen_at, seq.draft_rejected = 100, 1.0  # its window came back rejected
    for n in (101, 131):
        seq.num_tokens = n
        assert sp._choose([seq]) == 0  # measured within the last 32 tokens: plain decoding
    seq.num_tokens = 163
    assert sp._choose([seq]) == 0  # its first probe doubled the gap: 64 tokens
    seq.num_tokens = 164
    assert sp._choose([seq]) == k  # 64 tokens without drafting: measure again
    seq.draft_seen_at, seq.num_tokens = 164, 291
    assert sp._choose([seq]) == 0 and seq.draft_probes == 2  # then after 128
    seq.num_tokens = 292
    # k = 4 was probed twice (a probe's step pays a catch-up: never a measure of k): the next unmeasured k
    assert k == 4 and sp._choose([seq]) == 3
    pair_ = [SimpleNamespace(**{**vars(seq), "seq_id": i, "draft_seen_at": 0}) for i in range(2)]
    feed(ad, 2, plain=0.010, per_token=0.0002, draft=0.006, a=0.5)
    assert sp._choose(pair_) == 0  # in a batch nobody probes


def recorded_windows(a: float, n: int, seed: int) -> list[int]:
    """A recording of n verified windows' accepted drafts at per-token acceptance a (each draft accepted with
    probability a until the first rejection, at most 8)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        acc = 0
        while acc < 8 and rng.random() < a:
            acc += 1
        out.append(acc)
    return out


def replay(ak: AdaptiveK, batch: int, steps: int, plain: float, per_token: float, draft: float,
           windows: list[int]) -> tuple[float, list[int]]:
    """Adaptive k driving a simulated engine step after step: a step with k drafts costs plain + per_token x
    batch x k for the target and k draft passes, each sequence keeps the recorded window's accepted drafts (at
    most k) and one more token. Returns (tokens per simulated second, the k of every step)."""
    tokens = seconds = 0.0
    ks, recording = [], iter(windows)
    for _ in range(steps):
        k = ak.choose(batch)
        ks.append(k)
        target_s = plain + per_token * batch * k
        ak.target.observe(batch * (k + 1), target_s)
        if k:
            for _ in range(k):
                ak.draft.observe(batch, draft)
            for _ in range(batch):
                acc = min(next(recording), k)
                ak.observe_window(k, acc)
                tokens += acc + 1
        else:
            tokens += batch
        ak.observe_step(batch, k, target_s + k * draft)
        seconds += target_s + k * draft
    return tokens / seconds, ks


def fixed_k_rates(batch: int, plain: float, per_token: float, draft: float, a: float) -> dict[int, float]:
    """Tokens per second of every fixed k in the same simulation: batch x E(a, k) per step."""
    return {k: batch * (1 - a ** (k + 1)) / (1 - a) / (plain + per_token * batch * k + k * draft) for k in range(5)}


@pytest.mark.parametrize("batch, a, draft_s", [(1, 0.85, 0.0005), (8, 0.85, 0.0005), (1, 0.6, 0.0005)])
def test_adaptive_k_drafts_where_drafting_pays_on_recorded_windows(batch, a, draft_s):
    """Outcomes, not constants: with cheap drafts and good acceptance adaptive k drafts in nearly every step and
    gets most of the best fixed k's rate, far above plain decoding's."""
    ak = AdaptiveK(4)
    rate, ks = replay(ak, batch, 600, 0.010, 0.0001, draft_s, recorded_windows(a, 600 * batch, seed=batch))
    rates = fixed_k_rates(batch, 0.010, 0.0001, draft_s, a)
    assert sum(k > 0 for k in ks) >= 0.9 * len(ks)
    assert rate >= 1.4 * rates[0] and rate >= 0.7 * max(rates.values())


@pytest.mark.parametrize("batch, a, draft_s", [(1, 0.3, 0.004), (8, 0.5, 0.002), (4, 0.1, 0.0005)])
def test_adaptive_k_decodes_plainly_where_drafting_does_not_pay_on_recorded_windows(batch, a, draft_s):
    """Where no k beats plain decoding (low acceptance or dear drafts), adaptive k decodes plainly in nearly
    every step: its explorations cost at most a few percent of plain decoding's rate."""
    ak = AdaptiveK(4)
    rate, ks = replay(ak, batch, 600, 0.010, 0.0003, draft_s, recorded_windows(a, 600 * batch, seed=batch))
    rates = fixed_k_rates(batch, 0.010, 0.0003, draft_s, a)
    assert max(rates.values()) <= 1.05 * rates[0]  # the case: drafting gains (next to) nothing
    assert sum(k == 0 for k in ks) >= 0.9 * len(ks)
    assert rate >= 0.95 * rates[0]


def test_a_lone_sequence_where_drafting_never_pays_probes_its_acceptance_rarely(pair):
    """A lone sequence on which drafting would lose even with every draft accepted: its probes of its own
    acceptance (one drafting step each) are a small share of its steps, and none comes back k > 0 for
    good."""
    from types import SimpleNamespace

    sp = spec_llm(pair, k=4, fixed=False).engine.speculator
    ad = sp.adaptive
    feed(ad, 1, plain=0.010, per_token=0.003, draft=0.006, a=0.5)  # k = 4 at best 5 tokens per 46 ms
    for k in range(5):
        for _ in range(2):
            ad.observe_step(1, k, 0.010 + 0.009 * k)
    seq = SimpleNamespace(seq_id=1, num_tokens=100, max_len=1000, draft_accepted=0.0, draft_rejected=0.0,
                          draft_seen_at=0, draft_probes=0, probe_idle_until=0)
    ks = []
    for n in range(100, 600):
        seq.num_tokens = n
        ks.append(sp._choose([seq]))
    assert sum(k > 0 for k in ks) <= 0.05 * len(ks)


def test_adaptive_k_does_not_slow_the_sequence_that_gains_least_for_the_batchs_mean():
    ak = AdaptiveK(4, explore_every=10_000)
    # batch 4: a plain step 10 ms, a step with k drafts 10 + 1.3 k ms; the engine's acceptance 0.8
    feed(ak, 4, plain=0.010, per_token=0.0002, draft=0.0005, a=0.8)
    assert ak.choose(4) == 3 and ak.choose(4, [0.8] * 4) == 3  # the batch's best rate: 4 x 2.95 / 13.9 ms
    low = ak.seq_acceptance(1, 10)  # one accepted draft in 11 windows, shrunk toward the engine's 0.8
    assert low == pytest.approx((1 + 4 * 0.8) / (11 + 4))
    # k = 3 gives that sequence E(0.28, 3) = 1.38 tokens per 13.9 ms step: slower than plain decoding's 1 per
    # 10 ms, though the batch's mean would gain. The best k where it loses nothing is 2 (1.36 per 12.6 ms)
    assert ak.step_seconds(4, 3, 0.0005) == pytest.approx(0.0139)
    assert ak.choose(4, [0.8, 0.8, 0.8, low]) == 2
    assert ak.saving_s == pytest.approx(0.010 - 0.0126 / AdaptiveK.expected_tokens(low, 2))
    assert ak.choose(4, [0.8, 0.8, 0.8, ak.seq_acceptance(0, 40)]) == 0  # 0.07: no k gains it anything
    assert AdaptiveK(4).seq_acceptance(3, 1) is None  # nothing measured yet: no estimate


def test_each_sequence_counts_its_own_verified_windows(pair, monkeypatch):
    import engines.spec.decoder as decoder_mod

    monkeypatch.setattr(decoder_mod, "OWN_HALF_LIFE", 1e12)  # no forgetting: the counts add up to the engine's
    spec = spec_llm(pair, k=3)
    eng, sp = spec.engine, spec.engine.speculator
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(random_prompts(3, 5, 20, seed=7)):
        eng.add_request(p, params, f"c{i}")
    eng.step()
    seqs = list(eng.scheduler.running)
    drain(eng)
    assert sp.num_drafts > 0
    assert sum(s.draft_accepted for s in seqs) == pytest.approx(sp.num_accepted_tokens)
    # a window ends in a rejection unless all its drafts were accepted
    assert 0 < sum(s.draft_rejected for s in seqs) <= sp.num_drafts
    assert all(s.draft_seen_at > s.prompt_len for s in seqs)
    # with the real half-life, windows 32 tokens back weigh half, 64 back a quarter
    monkeypatch.setattr(decoder_mod, "OWN_HALF_LIFE", 32)
    s = seqs[0]
    for back, f in ((0, 1.0), (32, 0.5), (64, 0.25)):
        s.draft_seen_at = s.num_tokens - back
        assert sp.own_counts(s) == pytest.approx((s.draft_accepted * f, s.draft_rejected * f))


def test_stop_strings_with_speculation_stop_where_plain_decoding_stops(pair):
    path, _, draft = pair
    plain = LLM(path, block_size=BLOCK)
    spec = LLM(path, draft_model=draft, num_speculative_tokens=4, block_size=BLOCK)
    spec.engine.speculator.adaptive.fixed = 4
    prompt = "def read_config(path):\n"
    free = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]  # a piece from the middle of the output
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    want = plain.generate(prompt, params)[0].outputs[0]
    got = spec.generate(prompt, params)[0].outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert (got.text, got.token_ids) == (want.text, want.token_ids)
    assert spec.stats()["engine_spec_num_accepted_tokens"] > 0 and spec.stats()["used_pages"] == 0


def test_lean_draft_forward_equals_the_models_forward_over_the_pool(pair):
    from engines.spec.lean_runner import LeanDraftRunner
    from engines.spec.state import DraftState

    _, target, _ = pair
    llm = LLM(target, block_size=BLOCK)
    eng = llm.engine
    assert LeanDraftRunner.supported(eng.model, eng.runner)
    lean = LeanDraftRunner(eng.model, eng.runner.kv_view, BLOCK)
    a = DraftState(list(range(10, 33)), eng.pool.allocate(eng.model_id, 7), 0, [])
    b = DraftState(list(range(40, 49)), eng.pool.allocate(eng.model_id, 3), 0, [])
    eng.runner.execute([a, b], [21, 8])  # a prefix of each through the runner
    for dense in (0, 4):  # the pages path (gathered per layer), then the dense per-sequence copies
        lean.max_dense_seqs = dense
        a.num_computed, b.num_computed = 21, 8
        got, _ = lean.execute([a, b], [2, 1])  # two new tokens for a, one for b
        a.num_computed, b.num_computed = 21, 8
        want, _ = eng.runner.execute([a, b], [2, 1])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    full_a, full_b = a.token_ids + list(range(70, 77)), b.token_ids + list(range(80, 86))
    a.num_computed, b.num_computed = 23, 9
    for na, nb in ((1, 1), (2, 1), (1, 1)):  # the dense copies carry on from where the last call left them
        a.token_ids, b.token_ids = full_a[:a.num_computed + na], full_b[:b.num_computed + nb]
        base = (a.num_computed, b.num_computed)
        got, _ = lean.execute([a, b], [na, nb])
        assert (a.shadow_len, b.shadow_len) == (base[0] + na, base[1] + nb)
        want, _ = eng.runner.execute([a, b], [na, nb])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        a.num_computed, b.num_computed = base[0] + na, base[1] + nb
    a.token_ids = a.token_ids[:23]
    ids = a.token_ids + list(range(23, 28))
    for start, n in ((23, 1), (24, 2), (26, 2), (25, 3)):  # the batch-1 path (BLOCK = 4: page boundaries)
        a.token_ids = ids[:start + n]  # the runner returns logits of a sequence's last token only
        a.num_computed = start
        got, _ = lean.execute([a], [n])
        a.num_computed = start
        want, _ = eng.runner.execute([a], [n])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_penalties_and_min_tokens_see_each_draft_position_as_plain_decoding_would(pair):
    """Every verified position's distribution includes the drafts before it in its history."""
    _, target, _ = pair
    plain = LLM(target, block_size=BLOCK)
    spec = spec_llm(pair, k=4)
    params = [SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.5, frequency_penalty=0.5,
                             presence_penalty=0.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, min_tokens=12, stop_token_ids=[7, 9, 11])]
    for prompt in random_prompts(3, 4, 20, seed=10):
        for sp in params:
            want = plain.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0]
            got = spec.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0]
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert spec.stats()["engine_spec_num_accepted_tokens"] > 20


def test_a_failed_draft_pass_fails_the_drafted_requests_with_the_engine_error_code_only(pair):
    from engines.errors import ErrorCode

    _, target, _ = pair
    spec = spec_llm(pair, k=3)
    eng = spec.engine
    drafter = eng.speculator.drafter
    real = drafter.draft
    calls = {"n": 0}

    def broken_once(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("drafter fell over")
        return real(*args)

    drafter.draft = broken_once
    finals = {}
    emit = lambda o: finals.__setitem__(o.request_id, o) if o.finished else None  # noqa: E731
    prompt = random_prompts(1, 6, 6, seed=12)[0]
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), "drafted", emit=emit)
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, speculative=False),
                    "plain", emit=emit)
    drain(eng)
    bad, ok = finals["drafted"], finals["plain"]
    assert bad.error.code is ErrorCode.ENGINE_ERROR and "while drafting" in bad.error.message
    assert bad.outputs[0].finish_reason == "error"
    want = LLM(target, block_size=BLOCK).generate({"prompt_token_ids": prompt},
                                                  SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert ok.error is None and ok.outputs[0].token_ids == want[0].outputs[0].token_ids
    assert spec.stats()["used_pages"] == 0


def test_verify_is_a_function_of_logits_layout_and_drafts():
    """Greedy rows keep drafts while they equal the argmax, then take the argmax; a row without drafts samples."""
    from types import SimpleNamespace

    from engines.sequence import Request, Sequence
    from engines.spec.verify import verify

    def seq(rid: str) -> Sequence:
        req = Request(rid, None, [1, 2], SamplingParams(temperature=0))
        s = Sequence(req, 0, [1, 2, 3], 2, 20)
        req.seqs.append(s)
        return s

    a, b, c = seq("a"), seq("b"), seq("c")
    argmax = [5, 6, 7, 8, 9, 4, 3]  # rows: a's 3 (2 drafts), b's 1 (plain), c's 3 (2 drafts)
    logits = torch.full((len(argmax), 12), -5.0)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    batch = SimpleNamespace(sample_seqs=[a, b, c], rows_per_seq=[3, 1, 3])
    drafts = {a.seq_id: [5, 6], c.seq_id: [4, 11]}
    out = verify(logits, batch, drafts, {}, set())
    got = {s.seq.request.request_id: (s.token_ids, s.num_accepted) for s in out}
    assert got == {"a": ([5, 6, 7], 2), "b": ([8], 0), "c": ([9], 0)}
    assert drafts == {a.seq_id: [5, 6], c.seq_id: [4, 11]} and a.token_ids == [1, 2, 3]  # inputs untouched


def test_plain_greedy_windows_take_the_argmax_with_min_tokens_ban_as_the_general_path_does():
    """The verifier's shortcut for raw-logit greedy windows (the load tester's min_tokens requests) gives at
    every position the token the general path (a sampler row per position) gives, bans included."""
    from engines.sampler import min_tokens_ban, sampler_row
    from engines.sequence import Request, Sequence
    from engines.spec.verify import plain_greedy_targets, processed_distributions

    gen = torch.Generator().manual_seed(3)
    eos = {0}
    for trial in range(20):
        spec, rows, stops, start = [], [], [], 0
        for i in range(4):
            params = SamplingParams(temperature=0, max_tokens=40, min_tokens=[0, 3, 5, 12][(trial + i) % 4],
                                    stop_token_ids=[[], [7], [2, 9]][i % 3])
            req = Request(f"r{i}", None, [1, 2], params)
            s = Sequence(req, 0, [1, 2] + [5] * (trial % 6), 2, 60)
            k = 1 + (trial + i) % 4
            spec.append((s, start, k))
            drafts = [int(t) for t in torch.randint(0, 12, (k,), generator=gen)]
            for j in range(k + 1):
                rows.append(sampler_row(s, drafts[:j]))
                stops.append(min_tokens_ban(params, eos))
            start += k + 1
        # the banned ids among the largest logits, so the ban decides the argmax where it applies
        logits = torch.randn(start, 12, generator=gen)
        logits[:, [0, 7, 2, 9]] += 3.0
        want, _ = processed_distributions(logits, rows, stops)
        assert plain_greedy_targets(logits, spec, eos) == want.tolist()
    s = spec[0][0]
    s.request.params = SamplingParams(temperature=0, repetition_penalty=1.2)
    assert plain_greedy_targets(logits, spec, eos) is None  # a penalty needs the general path


def _replay_traces(match, n_prompts: int = 6, n_out: int = 96, k_max: int = 4, seed: int = 0) -> list[dict]:
    """Synthetic greedy traces for bench/spec_policy.py's replay: `match(prompt, t)` says whether the draft's
    window at output position t agrees with the target (a window agrees token by token up to the first
    position that does not)."""
    rng = random.Random(seed)
    traces = []
    for i in range(n_prompts):
        prompt = [rng.randrange(10, 4000) for _ in range(32)]
        out = [rng.randrange(10, 4000) for _ in range(n_out)]
        windows = [[out[t + j] if t + j < n_out and match(i, t + j) else -1 for j in range(k_max)]
                   for t in range(1, n_out)]
        traces.append({"prompt": prompt, "output": out, "windows": windows})
    return traces


def _replay_costs(draft_step_per_plain: list[float]) -> dict:
    plain = 0.0005
    return {"step": [plain] + [plain * r for r in draft_step_per_plain],
            "target": {1: plain * 0.8, 5: plain * 1.6, 64: plain * 12}, "draft": plain * 0.1}


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_adaptive_k_in_replay_drafts_where_the_draft_agrees_and_decodes_plain_where_it_does_not(noise):
    """bench/spec_policy.py's replay (the real SpeculativeDecoder / AdaptiveK choices on recorded windows, step
    costs with drift and jitter): adaptive k gets most of the best pinned k's speedup on a draft that agrees
    everywhere, stays close to plain decoding on one that never agrees, and on a mix of both kinds of prompts
    beats both plain decoding and every pinned k."""
    from bench.spec_policy import _Noise, replay

    costs = _replay_costs([1.6, 1.9, 2.2, 2.5])  # a drafting step at k = 1..4 against a plain token
    geo = lambda r: float(torch.tensor(r).log().mean().exp())  # noqa: E731
    always = _replay_traces(lambda i, t: True)
    best_fixed = max(geo(replay(always, costs, 4, k, _Noise(noise, 1))) for k in range(1, 5))
    adaptive = geo(replay(always, costs, 4, None, _Noise(noise, 1)))
    assert best_fixed == pytest.approx(5 / 2.5, rel=0.1) and adaptive >= 0.85 * best_fixed
    never = _replay_traces(lambda i, t: False)
    assert geo(replay(never, costs, 4, 4, _Noise(noise, 1))) < 0.5  # pinned drafting loses 2.5x
    assert geo(replay(never, costs, 4, None, _Noise(noise, 1))) >= 0.85  # adaptive pays only its probes
    mixed = _replay_traces(lambda i, t: i % 2 == 0)  # alternate prompts: the draft agrees on every other one
    adaptive = geo(replay(mixed, costs, 4, None, _Noise(noise, 1)))
    assert adaptive > 1.1 and adaptive > max(geo(replay(mixed, costs, 4, k, _Noise(noise, 1))) for k in range(1, 5))
