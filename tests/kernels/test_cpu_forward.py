"""kernels/cpu_forward: the one-call C decoder stack against the PyTorch forward, the way traffic arrives:
mixed batches of decodes, verify windows and chunks over shared pages, float32 and int8 weights, GQA, Qwen2's
q/k/v bias, Qwen3's q/k norm; and whole engines (prefix hits, n > 1, sampling with seeds, speculation) with it on and off."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kernels import cpu_kernels as ck

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not ck.available(), reason=f"CPU kernels unavailable: {ck.build_error}")]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tiny_checkpoints import build_checkpoint

    base = tmp_path_factory.mktemp("cpu_forward")
    return {"llama-gqa": build_checkpoint(base / "llama", "llama", hidden_size=64, num_layers=2, num_heads=4,
                                          num_kv_heads=2, seed=3),
            "qwen2-bias": build_checkpoint(base / "qwen2", "qwen2", hidden_size=64, num_layers=2, num_heads=4,
                                           num_kv_heads=1, seed=4),
            "qwen3-qk-norm": build_checkpoint(base / "qwen3", "qwen3", hidden_size=64, num_layers=2, num_heads=4,
                                              num_kv_heads=2, seed=5)}


def _engine(path, **opts):
    from engines import LLM

    return LLM(path, max_model_len=256, **opts)


def _requests(seed: int, n: int, vocab: int):
    from engines import SamplingParams

    rng = random.Random(seed)
    shared = [rng.randrange(4, vocab) for _ in range(40)]
    prompts, params = [], []
    for _ in range(n):
        own = [rng.randrange(4, vocab) for _ in range(rng.randrange(1, 60))]
        prompts.append((shared[:rng.choice([0, 16, 33, 40])] + own) or [5])
        if rng.random() < 0.5:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(1, 30), ignore_eos=True,
                                         logprobs=2))
        else:
            params.append(SamplingParams(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                                         seed=rng.randrange(1 << 30), n=rng.choice([1, 2]),
                                         max_tokens=rng.randrange(1, 30), ignore_eos=True, logprobs=2))
    return prompts, params


def _run(llm, prompts, params, fast: bool):
    runner = llm.engine.runner
    saved = runner.cpu_forward
    if not fast:
        runner.cpu_forward = None
    try:
        return llm.generate(prompts, params)
    finally:
        runner.cpu_forward = saved


def _compare(a, b, logprob_tol=2e-4):
    """Same tokens, and each chosen token's logprob to float tolerance."""
    for ra, rb in zip(a, b):
        for ca, cb in zip(ra.outputs, rb.outputs):
            assert ca.token_ids == cb.token_ids
            for la, lb, tok in zip(ca.logprobs, cb.logprobs, ca.token_ids):
                assert abs(la[tok].logprob - lb[tok].logprob) < logprob_tol


@pytest.mark.parametrize("name,quant,kv", [
    ("llama-gqa", "none", "auto"), ("qwen2-bias", "none", "auto"), ("qwen3-qk-norm", "none", "auto"),
    ("qwen3-qk-norm", "int8", "auto"), ("llama-gqa", "int8", "auto"), ("llama-gqa", "w8a8", "auto"),
    ("qwen2-bias", "w8a8", "auto"), ("llama-gqa", "int4", "auto"), ("llama-gqa", "bf16", "auto"),
    ("qwen2-bias", "bf16", "auto"),
    # a bfloat16 / float16 cache: the C stack writes and reads it as the torch forward does
    ("llama-gqa", "none", "bfloat16"), ("qwen3-qk-norm", "none", "float16"), ("qwen2-bias", "w8a8", "bfloat16")])
def test_engine_outputs_match_the_torch_forward(checkpoints, name, quant, kv):
    llm = _engine(checkpoints[name], quantization=quant, max_num_batched_tokens=96, kv_cache_dtype=kv)
    if kv != "auto" and ck.kv_kind(torch.empty(0, dtype=getattr(torch, kv))) is None:
        pytest.skip(f"this build reads no {kv} cache (float16 needs F16C)")
    assert llm.engine.runner.cpu_forward is not None
    assert llm.engine.runner.k_caches[0].dtype == (torch.float32 if kv == "auto" else getattr(torch, kv))
    # w8a8 (and int4, whose CPU kernel quantises the activations the same way) rounds every activation to 8 bits
    # (bf16: to bfloat16's 8 significant bits): the two paths' float-rounding differences (summation order) can
    # move an activation that sits on a rounding edge by one step (one step of the two paths agrees to 1e-6),
    # ~1e-2 in a logprob of these random 64-wide models; the tokens stay equal and nearly every output agrees
    # to float rounding
    worst = []
    for seed in range(3):
        prompts, params = _requests(seed, 12, 384)
        fast, slow = _run(llm, prompts, params, fast=True), _run(llm, prompts, params, fast=False)
        _compare(fast, slow, logprob_tol=5e-2 if quant in ("w8a8", "int4", "bf16") else 2e-4)
        worst += [max((abs(la[t].logprob - lb[t].logprob) for la, lb, t in zip(ca.logprobs, cb.logprobs,
                                                                                 ca.token_ids)), default=0.0)
                  for ra, rb in zip(fast, slow) for ca, cb in zip(ra.outputs, rb.outputs)]
    assert sum(w > 2e-4 for w in worst) <= len(worst) // 10, sorted(worst)[-5:]


@pytest.mark.parametrize("kv", ["auto", "bfloat16"])
def test_step_logits_match_on_mixed_batches(checkpoints, kv):
    """Random steps straight through the runner: decodes, verify windows (drafts) and chunks of up to 119
    queries (the C stack takes whole prefill chunks) in one batch, each against the torch forward on a copy of
    the same pages (float32 or bfloat16)."""

    llm = _engine(checkpoints["llama-gqa"], kv_cache_dtype=kv)
    runner = llm.engine.runner
    fast = runner.cpu_forward
    rng = random.Random(7)
    pool = llm.core.pool

    class S:  # the few Sequence fields the runner reads
        def __init__(self, sid, toks, pages, computed):
            self.seq_id, self.token_ids, self.pages, self.num_computed = sid, toks, pages, computed

        @property
        def num_tokens(self):
            return len(self.token_ids)

    bs = runner.block_size
    for _ in range(30):
        seqs, num, drafts = [], [], {}
        for i in range(rng.randrange(1, 7)):
            length = rng.randrange(1, 120)
            toks = [rng.randrange(4, 384) for _ in range(length)]
            n = rng.choice([1, 1, 2, 5, 17, 32, 70, 119])
            k = min(rng.choice([0, 0, 3]), n - 1)
            computed = max(0, length - (n - k))
            n = length - computed + k
            pages = pool.allocate(runner_model_id(llm), -(-(length + k) // bs))
            seqs.append(S(i, toks, pages, computed))
            num.append(n)
            if k:
                drafts[i] = [rng.randrange(4, 384) for _ in range(k)]
        if not seqs:
            continue
        # the cached prefix of each sequence: written by the torch forward (both paths read the same bytes)
        for s in seqs:
            if s.num_computed:
                c = s.num_computed
                s.num_computed = 0
                runner.cpu_forward = None
                runner.execute([s], [c], None)
                runner.cpu_forward = fast
                s.num_computed = c
        snapshot = runner.kv_view.clone()
        runner.cpu_forward = None
        ref, ref_batch = runner.execute(seqs, num, drafts)
        after_ref = runner.kv_view.clone()
        runner.kv_view.copy_(snapshot)
        runner.cpu_forward = fast
        got, batch = runner.execute(seqs, num, drafts)
        assert [s.seq_id for s in batch.sample_seqs] == [s.seq_id for s in ref_batch.sample_seqs]
        assert batch.rows_per_seq == ref_batch.rows_per_seq
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        # the same K/V written (bfloat16: a value the two paths' projections put on either side of a rounding
        # edge lands one step, 2^-8 relative, apart)
        tol = 1e-5 if kv == "auto" else 2 ** -8
        torch.testing.assert_close(runner.kv_view.float(), after_ref.float(), rtol=tol, atol=tol)
        for s in seqs:
            pool.release(s.pages)


def runner_model_id(llm) -> int:
    return llm.engine.model_id


@pytest.mark.parametrize("kv", ["auto", "bfloat16"])
def test_speculative_engine_matches_with_and_without(checkpoints, kv):
    """tandem-tiny-l drafting with tandem-tiny-s: greedy and seeded sampling, the C forward in both the
    target and the draft against the torch forward in both (over a float32 or a bfloat16 cache)."""
    from engines import SamplingParams

    llm = _engine(ROOT / "models" / "tandem-tiny-l", draft_model=ROOT / "models" / "tandem-tiny-s",
                  kv_cache_dtype=kv)
    llm.engine.speculator.adaptive.fixed = 3  # every step drafts, whatever this machine's timings make of k
    draft_runner = llm.core.engines["default-draft"].runner
    assert llm.engine.runner.cpu_forward is not None and draft_runner.cpu_forward is not None
    prompts = ["def add(a, b):\n    return", "import os\n\ndef main():\n", "class Stack:\n    def push(self, x):"]
    plain = llm.generate(prompts[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    banned = plain[0].outputs[0].token_ids[5]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.8, seed=11, max_tokens=40, ignore_eos=True, logprobs=1),
              # min_tokens bans a stop id its greedy path takes: the one-call drafts ban it too
              SamplingParams(temperature=0, max_tokens=25, min_tokens=20, stop_token_ids=[banned], logprobs=1)]
    calls = []
    one_call = draft_runner.draft_greedy
    draft_runner.draft_greedy = lambda *a: calls.append(a[3]) or one_call(*a)
    fast = llm.generate(prompts, params)
    assert calls  # the greedy requests' drafts ran in one C call each (tk_draft_greedy_f32)
    assert any(bans is not None and any(banned in ids for ids, _ in bans) for bans in calls)
    assert banned not in fast[2].outputs[0].token_ids[:20]
    del draft_runner.draft_greedy
    saved = (llm.engine.runner.cpu_forward, draft_runner.cpu_forward)
    llm.engine.runner.cpu_forward = draft_runner.cpu_forward = None
    try:
        slow = llm.generate(prompts, params)
    finally:
        llm.engine.runner.cpu_forward, draft_runner.cpu_forward = saved
    _compare(fast, slow, logprob_tol=1e-3)


def test_models_it_does_not_cover_keep_the_torch_forward(tmp_path):
    from tiny_checkpoints import build_checkpoint

    path = build_checkpoint(tmp_path / "mistral", "mistral", hidden_size=64, num_layers=1, num_heads=4,
                            num_kv_heads=2, sliding_window=8)
    assert _engine(path).engine.runner.cpu_forward is None  # a sliding window
    assert _engine(ROOT / "models" / "tandem-tiny-s", quantization="int4",  # int4 in groups of 32
                   quantization_group_size=32).engine.runner.cpu_forward is None
    assert _engine(ROOT / "models" / "tandem-tiny-s", quantization="int4").engine.runner.cpu_forward is not None


@pytest.mark.parametrize("quant", ["none", "w8a8", "bf16"])
def test_multi_step_greedy_equals_single_steps(monkeypatch, quant):
    """Greedy batches take 4 tokens per step in one C call (a multi-token `StepPlan`): the same tokens, finish
    reasons and texts as one token per step, with EOS, stop ids, stop strings and max lengths ending sequences
    inside a step, staggered arrivals (a newcomer turns it off until it decodes) and n = 2; float32, w8a8 (its
    head in int8: the C call's head goes through the same int8 dots) and bf16 (bfloat16 weights, head included,
    and activations)."""
    import engines.step_plan
    from engines import SamplingParams

    llm = _engine(ROOT / "models" / "tandem-tiny-l", quantization=quant)
    prompts = ["def add(a, b):\n    return", "import os\n\n", "class Stack:\n", "for i in range(10):\n",
               "x = [", "# a comment\n", "# a comment\n"]
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2))
    # the ban's test token: the greedy path's clearest choice (the widest top-2 gap) among its tokens 2-6 that
    # it has not taken before, so that banning it must change the output in every path
    ref = plain[6].outputs[0]
    tops = [sorted((lp.logprob for lp in pos.values()), reverse=True) for pos in ref.logprobs]
    gaps = {j: tops[j][0] - tops[j][1] for j in range(1, 6) if ref.token_ids[j] not in ref.token_ids[:j]}
    first = max(gaps, key=gaps.get)
    banned = ref.token_ids[first]
    assert gaps[first] > 1.0
    params = [SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[plain[1].outputs[0].token_ids[9]]),
              SamplingParams(temperature=0, max_tokens=40, stop=[plain[2].outputs[0].text[12:16]]),
              SamplingParams(temperature=0, max_tokens=5),
              SamplingParams(temperature=0, max_tokens=23, n=2),
              SamplingParams(temperature=0, max_tokens=33, min_tokens=33, ignore_eos=True),  # as the load tester
              # min_tokens bans a stop id the greedy path takes in its first 6 tokens: the C loop must ban it too
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[banned], min_tokens=14)]
    runner = llm.engine.runner
    calls = []
    one_call = runner.draft_greedy
    monkeypatch.setattr(runner, "draft_greedy", lambda *a: calls.append(a[2]) or one_call(*a))
    multi = llm.generate(prompts, params)
    assert calls and set(calls) <= {2, 3, 4}
    monkeypatch.setattr(engines.step_plan, "MULTI_STEP_TOKENS", 1)
    calls.clear()
    single = llm.generate(prompts, params)
    assert not calls
    for a, b in zip(multi, single):
        assert [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in a.outputs] == [
            (c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in b.outputs]
    assert multi[1].outputs[0].finish_reason == "stop" and len(multi[1].outputs[0].token_ids) <= 10
    banned_run = multi[6].outputs[0].token_ids
    assert banned not in banned_run[:14] and len(banned_run) >= 14
    assert banned_run[:first] == ref.token_ids[:first]  # up to there the ban changes nothing
    assert llm.core.pool.stats()["used_pages"] == 0


def test_a_multi_token_step_booked_short_runs_as_a_plain_step(monkeypatch):
    """Where the scheduler books less lookahead than the plan asked (not expected: the policy checks budget and
    pages), the runner runs a plain forward over the booked tokens instead: the same tokens as plain
    decoding, no C multi-token call, the pool back to zero pages."""
    from engines import SamplingParams

    llm = _engine(ROOT / "models" / "tandem-tiny-l")
    prompts = ["def add(a, b):\n    return", "import os\n\n"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    eng = llm.engine
    schedule, calls, short = eng.scheduler.schedule, [], []
    monkeypatch.setattr(eng.runner, "draft_greedy", lambda *a: calls.append(a) or [])  # must not run
    def trimmed(drafts=None, lookahead=None):
        if lookahead:
            short.append(1)
            lookahead = {sid: n - 1 for sid, n in lookahead.items()}
        return schedule(drafts, lookahead)
    monkeypatch.setattr(eng.scheduler, "schedule", trimmed)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert short and not calls and llm.core.pool.stats()["used_pages"] == 0


def test_multi_step_takes_min_tokens_requests(monkeypatch):
    """A batch of load-tester requests (min_tokens = max_tokens, ignore_eos) decodes by multi-step steps: the
    only option they add over plain greedy is min_tokens' ban, which the C loop applies."""
    from engines import SamplingParams

    llm = _engine(ROOT / "models" / "tandem-tiny-l")
    runner = llm.engine.runner
    calls = []
    one_call = runner.draft_greedy
    monkeypatch.setattr(runner, "draft_greedy", lambda *a: calls.append((a[2], a[3])) or one_call(*a))
    out = llm.generate(["def f(x):\n", "import sys\n"],
                       [SamplingParams(temperature=0, max_tokens=m, min_tokens=m, ignore_eos=True) for m in (30, 21)])
    assert [len(o.outputs[0].token_ids) for o in out] == [30, 21]
    assert len(calls) >= 5 and all(n == 4 for n, _ in calls[:4])
    eos = llm.engine.eos_token_ids
    assert all(bans is not None and all(eos <= ids and left > 0 for ids, left in bans) for _, bans in calls)


def test_speculative_engine_takes_multi_step_when_adaptive_k_picks_plain(monkeypatch):
    """With a drafter, a step where adaptive k picks 0 is a multi-step greedy step (plain decoding, n tokens per
    C call); k > 0 drafts as before, and the drafter catches up on the tokens it missed. Outputs equal plain
    decoding whatever k does, and adaptive k sees the multi-step steps as plain steps."""
    import itertools

    from engines import SamplingParams

    prompts = ["def add(a, b):\n    return", "import os\n\ndef main():\n", "class Stack:\n    def push(self, x):"]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (41, 30, 37)]
    plain = _engine(ROOT / "models" / "tandem-tiny-l").generate(prompts, params)
    llm = _engine(ROOT / "models" / "tandem-tiny-l", draft_model=ROOT / "models" / "tandem-tiny-s")
    eng, spec = llm.engine, llm.engine.speculator
    multi, drafted, plain_steps = [], [], []
    one_call = eng.runner.draft_greedy
    monkeypatch.setattr(eng.runner, "draft_greedy", lambda *a: multi.append(a[2]) or one_call(*a))
    observe = spec.adaptive.observe_step
    monkeypatch.setattr(spec.adaptive, "observe_step",
                        lambda b, k, s: (plain_steps.append(b) if k == 0 else None) or observe(b, k, s))
    propose = spec.propose
    monkeypatch.setattr(spec, "propose", lambda *a: drafted.append(d := propose(*a)) or d)
    # every drafter catches up whatever it costs (here k is scripted, not weighed against its savings)
    monkeypatch.setattr(spec.adaptive, "catch_up_pays", lambda lag, remaining: True)
    for ks in ([0], [3], [0, 0, 3, 0, 4, 4, 0, 2]):
        cycle = itertools.cycle(ks)
        monkeypatch.setattr(spec.adaptive, "choose", lambda batch, accs=None, c=cycle: next(c))
        multi.clear(), drafted.clear()
        out = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
        assert bool(multi) == (0 in ks) and set(multi) <= {2, 3, 4}
        assert any(drafted) == (ks != [0])
    assert plain_steps  # the multi-step steps reached adaptive k as plain steps
    assert llm.core.pool.stats()["used_pages"] == 0


def test_a_draft_after_a_long_catch_up_still_runs_in_one_call(monkeypatch):
    """A drafter more than the C call's query limit behind (a prompt) computes the missed tokens by the varlen
    prefill first, then drafts all k tokens in one C call, which measures the draft passes; outputs equal
    plain decoding."""
    from engines import SamplingParams
    from engines.runner import CPU_KERNEL_MAX_QUERY

    prompt = "import os\nimport sys\n\n\ndef main(argv):\n    " * 6
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _engine(ROOT / "models" / "tandem-tiny-l").generate([prompt], params)[0].outputs[0].token_ids
    llm = _engine(ROOT / "models" / "tandem-tiny-l", draft_model=ROOT / "models" / "tandem-tiny-s")
    sp = llm.engine.speculator
    sp.adaptive.fixed = 3
    runner = sp.drafter.runner
    calls, prefills = [], []
    one_call, execute = runner.draft_greedy, runner.execute
    monkeypatch.setattr(runner, "draft_greedy", lambda seqs, num, *a: calls.append(list(num)) or one_call(seqs, num, *a))
    monkeypatch.setattr(runner, "execute", lambda seqs, num, *a: prefills.append(list(num)) or execute(seqs, num, *a))
    out = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert out == want
    assert len(llm.engine.tokenizer.encode(prompt)) > CPU_KERNEL_MAX_QUERY + 1
    # the prompt's catch-up: one prefill of all but its last token, then the first draft in one call of 1 + 3
    assert prefills and prefills[0][0] > CPU_KERNEL_MAX_QUERY and calls[0] == [1]
    assert len(calls) == sp.num_drafts > 0  # every drafting step (one sequence) drafted in one call, the first too
    assert sp.adaptive.draft.points  # the one-call drafts measured the draft passes
    assert llm.core.pool.stats()["used_pages"] == 0


def test_the_c_loops_temperature_draw_is_the_samplers_inverse_cdf():
    """`CpuForward.draft_greedy` with a temperature draws what the sampler draws from the same logits at the same
    uniform (softmax(logits / T), the first token whose cumulative mass exceeds u times the total): the same
    token at every uniform not within float rounding of a boundary between two tokens' mass."""
    from engines.sampler import _inverse_cdf

    llm = _engine(ROOT / "models" / "tandem-tiny-l")
    runner = llm.engine.runner
    fast = runner.cpu_forward
    g = torch.Generator().manual_seed(0)
    runner.kv_view.copy_(torch.randn(runner.kv_view.shape, generator=g))
    tables = torch.randperm(runner.kv_view.shape[0], generator=g)[:8].view(1, 8).contiguous()
    ctx = 30
    ids, pos = torch.tensor([17]), torch.tensor([ctx - 1])
    seqs = torch.tensor([[0], [1], [ctx], [0]], dtype=torch.long)
    logits = fast.logits(fast.forward(ids, pos, tables, seqs.clone(), ctx))[0]
    checked = 0
    for temp in (0.5, 0.8, 1.3):
        probs = torch.softmax(logits / temp, -1)
        cdf = probs.double().cumsum(0)
        for u in torch.rand(150, generator=g).tolist():
            cut = u * float(cdf[-1])
            if float((cdf - cut).abs().min()) < 1e-5:  # a boundary: float32 sums may fall either side of it
                continue
            want = int(_inverse_cdf(probs[None], torch.tensor([[u]]))[0])
            got = fast.draft_greedy(ids, pos, tables, seqs.clone(), ctx, 1, None, [temp], torch.tensor([[u]]))
            assert int(got[0, 0]) == want, (temp, u)
            checked += 1
    assert checked >= 400
    # greedy rows of the same call keep the argmax
    got = fast.draft_greedy(ids, pos, tables, seqs.clone(), ctx, 1, None, [0.0], torch.tensor([[0.99]]))
    assert int(got[0, 0]) == int(logits.argmax())


def test_multi_step_takes_unseeded_temperature_requests_and_leaves_the_rest_to_the_sampler(monkeypatch):
    """Temperature-only requests without a seed decode by multi-step steps too (their uniforms from torch's
    generator, as the sampler's); a seeded one stays on the sampler's path (its draws are defined there), as
    do top-p and a greedy batch mixed with a seeded one."""
    from engines import SamplingParams

    llm = _engine(ROOT / "models" / "tandem-tiny-l")
    runner = llm.engine.runner
    calls = []
    one_call = runner.draft_greedy
    monkeypatch.setattr(runner, "draft_greedy", lambda *a: calls.append(a[4]) or one_call(*a))
    prompts = ["def f(x):\n", "import sys\n"]
    sampled = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    out = llm.generate(prompts, [sampled, greedy])
    assert [len(o.outputs[0].token_ids) for o in out] == [30, 30]
    assert len(calls) >= 5 and all(t == [0.8, 0.0] for t in calls)
    for params in ([SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True), greedy],
                   [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True)] * 2):
        calls.clear()
        assert all(len(o.outputs[0].token_ids) == 30 for o in llm.generate(prompts, params))
        assert not calls
    assert llm.core.pool.stats()["used_pages"] == 0
