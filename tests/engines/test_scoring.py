"""Prompt logprobs (engines/scoring.py): each prompt token's logprob after the tokens before it, checked against
what the engine's own step loop (paged KV cache, chunked prefill) reports for the tokens it samples; the offline
API's `SamplingParams(prompt_logprobs=k)`; and `score_async`, which runs on its own thread and refuses when too
many scorings wait."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engines import LLM, SamplingParams, scoring
from engines.scoring import ScoringBusy, prompt_logprobs, score_async

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), block_size=4, max_num_batched_tokens=4)  # the prompt prefills in chunks


def test_prompt_logprobs_equal_the_engines_sampled_token_logprobs(llm):
    """Generate greedily with logprobs (the engine's KV-cache path), then score prompt + output densely: every
    generated token's logprob agrees, and each is rank 1 (greedy picks the argmax)."""
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True))[0].outputs[0]
    ids = PROMPT + out.token_ids
    scored = prompt_logprobs(llm.engine.model, ids, top_k=3)
    assert len(scored) == len(ids) and scored[0] is None
    for i, (token, position) in enumerate(zip(out.token_ids, out.logprobs)):
        mine = scored[len(PROMPT) + i]
        assert mine[token].logprob == pytest.approx(position[token].logprob, abs=1e-4)
        assert mine[token].rank == 1
    for token, position in zip(ids[1:], scored[1:]):
        ranks = sorted(lp.rank for t, lp in position.items() if t != token)
        assert token in position and position[token].rank >= 1
        top = sorted((lp.rank, lp.logprob) for lp in position.values() if lp.rank <= 3)
        assert [r for r, _ in top] == [1, 2, 3] and [lp for _, lp in top] == sorted([lp for _, lp in top],
                                                                                    reverse=True)
        assert all(r <= 3 for r in ranks)  # beside the prompt's own token: only the top 3


def test_a_prompt_of_one_token_has_no_logprob_and_top_k_is_bounded(llm):
    assert prompt_logprobs(llm.engine.model, [5], top_k=2) == [None]
    with pytest.raises(ValueError, match="between 0 and 20"):
        prompt_logprobs(llm.engine.model, PROMPT, top_k=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_the_offline_api_fills_prompt_logprobs_when_asked(llm):
    asked, plain = llm.generate([{"prompt_token_ids": PROMPT}] * 2, [
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1), SamplingParams(temperature=0, max_tokens=2)])
    assert plain.prompt_logprobs is None
    expected = prompt_logprobs(llm.engine.model, PROMPT, top_k=1, tokenizer=llm.tokenizer)
    assert [None if p is None else {t: (lp.logprob, lp.rank) for t, lp in p.items()}
            for p in asked.prompt_logprobs] == [None if p is None else {t: (lp.logprob, lp.rank) for t, lp in p.items()}
                                                for p in expected]
    assert asked.prompt_logprobs[1][PROMPT[1]].decoded_token == llm.tokenizer.token_text(PROMPT[1])


def test_score_async_runs_off_the_event_loop_and_refuses_when_too_many_wait(llm, monkeypatch):
    model = llm.engine.model
    threads: list[str] = []
    dense = model.dense_logits

    def recording(ids):
        threads.append(threading.current_thread().name)
        return dense(ids)

    monkeypatch.setattr(model, "dense_logits", recording)

    async def main() -> list:
        loop_thread = threading.current_thread().name
        results = await asyncio.gather(*(score_async(model, PROMPT, 2) for _ in range(3)))
        return [loop_thread, results]

    loop_thread, results = asyncio.run(main())
    assert threads and all(name.startswith("tandem-scoring") and name != loop_thread for name in threads)
    reference = prompt_logprobs(model, PROMPT, 2)
    assert all([p and {t: lp.logprob for t, lp in p.items()} for p in r] ==
               [p and {t: lp.logprob for t, lp in p.items()} for p in reference] for r in results)
    monkeypatch.setattr(scoring, "MAX_PENDING", 0)
    with pytest.raises(ScoringBusy):
        asyncio.run(score_async(model, PROMPT, 0))


def test_scoring_in_chunks_of_positions_changes_nothing(llm, monkeypatch):
    whole = prompt_logprobs(llm.engine.model, PROMPT * 3, top_k=2)
    monkeypatch.setattr(scoring, "CHUNK", 5)  # 23 positions: four full chunks and a partial one
    chunked = prompt_logprobs(llm.engine.model, PROMPT * 3, top_k=2)
    assert [p and {t: (lp.logprob, lp.rank) for t, lp in p.items()} for p in chunked] == \
        [p and {t: (lp.logprob, lp.rank) for t, lp in p.items()} for p in whole]
