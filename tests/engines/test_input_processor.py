"""`InputProcessor` without a model: each prompt check once for both paths (generation needs a position past the
prompt, scoring may fill the context), the field each refusal names, its typed code, and the sequences it builds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engines.errors import ErrorCode, RequestRejected
from engines.input_processor import InputProcessor
from engines.sampling_params import SamplingParams


def _inputs(ctx: int = 16, vocab: int = 100, pages: int = 8, block: int = 4) -> InputProcessor:
    return InputProcessor("m", None, vocab, ctx, SimpleNamespace(block_size=block, num_pages=pages), set)


def _refusal(fn, *args, **kwargs) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        fn(*args, **kwargs)
    return info.value


def test_an_empty_prompt_is_refused_on_both_paths_in_each_paths_words():
    inputs = _inputs()
    assert str(_refusal(inputs.check_prompt, [])) == "the prompt is empty: at least one token is needed"
    e = _refusal(inputs.check_prompt, [], scoring=True)
    assert (str(e), e.code, e.param) == ("The prompt is empty: at least one token is needed",
                                         ErrorCode.INVALID_REQUEST, None)


def test_scoring_may_fill_the_context_and_generation_needs_one_position_more():
    inputs = _inputs(ctx=16)
    inputs.check_prompt([1] * 16, scoring=True)
    e = _refusal(inputs.check_prompt, [1] * 16)
    assert (str(e), e.code) == ("the prompt has 16 tokens but 'm' has a context of 16: shorten the prompt to at most "
                                "15", ErrorCode.CONTEXT_LENGTH_EXCEEDED)
    e = _refusal(inputs.check_prompt, [1] * 17, scoring=True)
    assert (str(e), e.code) == ("The prompt has 17 tokens but 'm' has a context of 16",
                                ErrorCode.CONTEXT_LENGTH_EXCEEDED)
    req = inputs.process([1] * 15, SamplingParams(max_tokens=1))
    assert [(s.prompt_len, s.max_len) for s in req.seqs] == [(15, 16)]


@pytest.mark.parametrize("ids", [[-1], [100], [3, 250]])
def test_token_ids_outside_the_vocabulary_are_refused_on_both_paths(ids):
    inputs = _inputs(vocab=100)
    assert str(_refusal(inputs.check_prompt, ids)) == "prompt token ids must be in [0, 100) for model 'm'"
    assert str(_refusal(inputs.check_prompt, ids, scoring=True)) == "prompt token ids must be below 100 for model 'm'"


def test_max_tokens_past_the_context_names_max_tokens_and_the_pool_its_own_code():
    inputs = _inputs(ctx=16, pages=3, block=4)
    e = _refusal(inputs.process, [1] * 10, SamplingParams(max_tokens=7))
    assert (e.code, e.param) == (ErrorCode.CONTEXT_LENGTH_EXCEEDED, "max_tokens")
    assert str(e).endswith("lower max_tokens to at most 6")
    e = _refusal(inputs.process, [1] * 10, SamplingParams(max_tokens=6))  # 16 tokens need 4 pages of 4
    assert e.code is ErrorCode.KV_CAPACITY_EXCEEDED and e.param is None
    assert "needs 4 KV pages" in str(e) and "has 3" in str(e)


def test_options_outside_the_vocabulary_name_their_field():
    inputs = _inputs(vocab=100)
    assert _refusal(inputs.process, [1], SamplingParams(max_tokens=1, logit_bias={100: 1.0})).param == "logit_bias"
    assert _refusal(inputs.process, [1], SamplingParams(max_tokens=1, stop_token_ids=[100])).param == "stop_token_ids"
    e = _refusal(inputs.process, [1], SamplingParams(max_tokens=1), draft_token_ids=[100])
    assert str(e) == "draft_token_ids must be in [0, 100) for model 'm'"


def test_a_text_prompt_without_a_tokenizer_is_refused_and_ids_are_served():
    inputs = _inputs()
    assert "has no tokenizer" in str(_refusal(inputs.process, "hello", SamplingParams(max_tokens=1)))
    req = inputs.process([1, 2, 3], SamplingParams(max_tokens=2, n=2, seed=7, logprobs=1), "r",
                         draft_token_ids=[4, 5, 6])
    assert req.request_id == "r" and req.prompt is None and req.prompt_token_ids == [1, 2, 3]
    assert [s.seed for s in req.seqs] == [7, 8] and all(s.logprobs == [] for s in req.seqs)
    assert [s.supplied_draft_ids for s in req.seqs] == [[4, 5], [4, 5]]  # at most max_tokens of them
