"""Randomised differential test of the engine as traffic arrives: continuous batches mixing random sampling
parameters (greedy, temperature, top-k/p, min-p, penalties, logit_bias, grammars (some beside extreme
penalties and temperatures, where the grammar mask alone decides), seeds, stop strings and ids,
logprobs, n, max_tokens) and aborts at random steps, with and without speculation. Checked against references: nothing
fails, greedy and seeded outputs equal plain decoding of the request alone (seeded draws depend only on
seed and position, so speculation and batching change nothing), and the pool returns to zero pages. `TANDEM_DIFF_ROUNDS=N` runs more rounds."""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch

from engines import LLM, SamplingParams
from engines.loader import load_checkpoint
from engines.structured import StructuredOutput

BLOCK = 4
CONSTRAINTS = [StructuredOutput("regex", r"[a-z ]{1,30}"), StructuredOutput.choice(["def", "class", "import os"]),
               StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "string",
                                                                                  "maxLength": 8}}})]
ROUNDS = int(os.environ.get("TANDEM_DIFF_ROUNDS", "2"))

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """(target checkpoint dir with a tokenizer, a noisy copy of it as the draft Transformer)."""
    path = tiny_checkpoint("llama", num_heads=4, num_kv_heads=2)
    draft = copy.deepcopy(load_checkpoint(path).model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * 0.004)
    return path, draft


def random_params(rng: random.Random, stop_texts: list[str]) -> SamplingParams:
    greedy = rng.random() < 0.4
    kw: dict = dict(max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.8)
    if greedy:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = rng.choice([0.5, 0.8, 1.0, 1.3])
        if rng.random() < 0.3:
            kw["top_k"] = rng.choice([1, 5, 20])
        if rng.random() < 0.3:
            kw["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.2:
            kw["min_p"] = 0.1
        if rng.random() < 0.5:
            kw["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.2:
        kw["repetition_penalty"] = rng.choice([0.9, 1.3])
    if rng.random() < 0.2:
        kw["presence_penalty"] = rng.choice([-0.5, 0.5])
        kw["frequency_penalty"] = rng.choice([0.0, 0.4])
    if rng.random() < 0.15:
        kw["min_tokens"] = min(kw["max_tokens"], rng.randint(1, 4))
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(5, 384) for _ in range(3)]
    if rng.random() < 0.2:
        kw["stop"] = rng.sample(stop_texts, 2)
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.25:
        kw["logit_bias"] = {rng.randrange(5, 384): rng.choice([-100.0, -3.0, 2.5, 100.0]) for _ in range(2)}
    if rng.random() < 0.25:
        kw["n"] = rng.choice([2, 3])
    if rng.random() < 0.2:  # a grammar: masks on drafts and verify windows, state rolled back on rejection
        kw["structured"] = rng.choice(CONSTRAINTS)
        kw.pop("min_tokens", None)
        kw["ignore_eos"] = False
        if rng.random() < 0.4:  # extreme options beside the grammar: +inf / NaN logits, the mask must win
            kw["repetition_penalty"] = rng.choice([5e-324, 1e-30, 1e30])
            if not greedy and rng.random() < 0.5:
                kw["temperature"] = 1e-3
    return SamplingParams(**kw)


def make_llm(models, speculative: bool) -> LLM:
    path, draft = models
    if speculative:
        return LLM(path, draft_model=draft, num_speculative_tokens=3, block_size=BLOCK, max_num_batched_tokens=64)
    return LLM(path, block_size=BLOCK, max_num_batched_tokens=64)


def run_alone(llm: LLM, prompt: list[int], params: SamplingParams):
    return llm.generate({"prompt_token_ids": prompt}, params)[0]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("round_seed", range(ROUNDS))
def test_mixed_random_traffic_never_fails_and_matches_references(models, speculative, round_seed):
    rng = random.Random(1000 * round_seed + speculative)
    llm = make_llm(models, speculative)
    plain_ref = make_llm(models, False)
    eng = llm.engine
    stop_texts = [" ", "e", "(", "\n", "in", "se"]
    n_req = 24
    prompts = [[rng.randrange(5, 384) for _ in range(rng.randint(1, 40))] for _ in range(n_req)]
    params = [random_params(rng, stop_texts) for _ in range(n_req)]
    abort_at = {i: rng.randint(0, 30) for i in range(n_req) if rng.random() < 0.15}
    finals: dict[str, object] = {}

    def collect(out):
        if out.finished:
            finals[out.request_id] = out

    pending = list(range(n_req))
    step = 0
    while pending or eng.has_work():
        for _ in range(rng.randint(0, 3)):  # staggered arrivals: 0-3 new requests per step
            if pending:
                i = pending.pop(0)
                eng.add_request(prompts[i], params[i], f"r{i}", emit=collect)
        for i, s in abort_at.items():
            if s == step:
                eng.abort(f"r{i}")
        llm.core.step()
        step += 1
        assert step < 5000

    assert llm.stats()["used_pages"] == 0, "a finished or aborted request kept KV pages"
    checked_greedy = checked_seeded = 0
    for i in range(n_req):
        out = finals[f"r{i}"]
        assert out.error is None, f"request {i} ({params[i]}) failed: {out.error}"
        aborted = i in abort_at
        for c in out.outputs:
            assert c.finish_reason in (("stop", "length", "abort") if aborted else ("stop", "length")), (i, c)
            if params[i].logprobs is not None and not aborted:
                assert len(c.logprobs) == len(c.token_ids)
        if aborted:
            continue
        p = params[i]
        if p.temperature == 0.0:
            want = run_alone(plain_ref, prompts[i], p)
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs], f"greedy {i}: {p}"
            assert [c.text for c in out.outputs] == [c.text for c in want.outputs]
            checked_greedy += 1
        elif p.seed is not None:
            want = run_alone(plain_ref, prompts[i], p)
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs], f"seeded {i}: {p}"
            checked_seeded += 1
    assert checked_greedy and checked_seeded  # both references were exercised
    if speculative:
        assert llm.stats()["engine_spec_num_draft_tokens"] > 0


def test_greedy_and_sampled_requests_drafting_in_one_step_both_succeed(models):
    """The mixed-traffic crash: a greedy and a sampled sequence drafting in the same step made the drafter
    draw from the greedy row's empty distribution (IndexError), failing every request of the step."""
    llm = make_llm(models, speculative=True)
    llm.engine.speculator.adaptive.fixed = 3
    prompt = {"prompt_token_ids": [11, 12, 13, 14, 15]}
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    for _ in range(5):
        outs = llm.generate([prompt, prompt], [greedy, sampled])
        assert all(o.error is None and len(o.outputs[0].token_ids) == 20 for o in outs)
    want = make_llm(models, speculative=False).generate(prompt, greedy)[0].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == want
    assert llm.stats()["engine_spec_num_drafts"] > 0 and llm.stats()["used_pages"] == 0
