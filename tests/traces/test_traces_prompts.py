"""Prompt synthesis hits exact token counts for the served tokenizer and shares real prefixes."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_checkpoints import build_tokenizer
from tokenizers import Tokenizer

from traces.prompts import PromptSynthesisError, PromptSynthesizer, WordPrompts
from traces.workloads import RequestSpec, build_workload, fit_to_context


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return d


@pytest.mark.parametrize("n", [1, 2, 3, 17, 128, 1000, 4097])
def test_prompts_have_exact_token_counts(tok_dir, n):
    synth = PromptSynthesizer(tok_dir, seed=0)
    text = synth.prompt(RequestSpec(n, n, 4))
    # Checked with a separately loaded tokenizer, as the server would count it (without special tokens).
    assert len(Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids) == n


def test_equal_hash_ids_give_identical_prefixes_and_others_differ(tok_dir):
    synth = PromptSynthesizer(tok_dir / "tokenizer.json", seed=0)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    a = tok.encode(synth.prompt(RequestSpec(0, 70, 4, (0, 1, 2), 32)), add_special_tokens=False).ids
    b = tok.encode(synth.prompt(RequestSpec(1, 90, 4, (0, 1, 3), 32)), add_special_tokens=False).ids
    c = tok.encode(synth.prompt(RequestSpec(2, 70, 4, (5, 6, 7), 32)), add_special_tokens=False).ids
    assert (len(a), len(b), len(c)) == (70, 90, 70)
    assert a[:64] == b[:64] and a[64:70] != b[64:70]
    assert a[:32] != c[:32]


def test_scaled_workload_prompts_are_exact(tok_dir):
    synth = PromptSynthesizer(tok_dir, seed=1)
    specs, _ = fit_to_context(build_workload("long_context_multiturn", 30, seed=2), 256)
    for s in specs:
        assert synth.count(synth.prompt(s)) == s.input_tokens
        assert s.input_tokens + s.output_tokens <= 248


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(PromptSynthesisError, match="no tokenizer.json"):
        PromptSynthesizer(tmp_path)


def test_word_prompts_without_tokenizer_have_one_word_per_token():
    text = WordPrompts(seed=0).prompt(RequestSpec(0, 50, 4, (1,), 20))
    assert len(text.split()) == 50
    assert text.split()[:20] == WordPrompts(seed=0).prompt(RequestSpec(9, 30, 4, (1,), 20)).split()[:20]


def test_exact_counts_with_the_default_served_tokenizer():
    model = Path(__file__).resolve().parents[2] / "models" / "tandem-tiny-s"
    if not (model / "tokenizer.json").is_file():
        pytest.skip("models/tandem-tiny-s/tokenizer.json is not in this checkout")
    synth = PromptSynthesizer(model, seed=0)
    assert len(synth.words) > 500
    for n in (1, 64, 500):
        assert synth.count(synth.prompt(RequestSpec(n, n, 4, (0,), 16))) == n


def test_plans_share_shape_but_not_prompt_text_unless_the_prompt_seed_is_fixed(tok_dir, tmp_path):
    from traces.loadtest import LoadTestConfig, _prompt_seed, build_plan

    cfg = LoadTestConfig(url="http://x", out=tmp_path, workload="chat", rate=5, duration_s=4,
                         tokenizer=str(tok_dir), models=["a", "b"])
    p1, m1 = build_plan(cfg, 5, 256, _prompt_seed(cfg, 0))
    p2, m2 = build_plan(cfg, 5, 256, _prompt_seed(cfg, 0))
    # Same seed: same arrivals and lengths; fresh prompt seeds: no prompt repeats a previous run's text
    # (which would hit a warm prefix cache on the server).
    assert [(r.at_s, r.input_tokens, r.output_tokens) for r in p1] == [(r.at_s, r.input_tokens, r.output_tokens)
                                                                       for r in p2]
    assert m1["prompt_seed"] != m2["prompt_seed"]
    assert all(a.prompt[:40] != b.prompt[:40] for a, b in zip(p1, p2) if a.input_tokens >= 8)
    assert [r.model for r in p1[:4]] == ["a", "b", "a", "b"]
    fixed = LoadTestConfig(url="http://x", out=tmp_path, workload="chat", rate=5, duration_s=4,
                           tokenizer=str(tok_dir), prompt_seed=7)
    assert build_plan(fixed, 5, 256, _prompt_seed(fixed, 0))[0][0].prompt == build_plan(
        fixed, 5, 256, _prompt_seed(fixed, 0))[0][0].prompt


def test_mooncake_hash_ids_become_shared_prompt_prefixes_after_scaling(tok_dir):
    from traces.readers import read_mooncake

    specs, scaling = fit_to_context(read_mooncake(Path(__file__).parent / "fixtures/traces/mooncake_small.jsonl"), 256)
    synth = PromptSynthesizer(tok_dir, seed=3)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids = {s.hash_ids: tok.encode(synth.prompt(s), add_special_tokens=False).ids for s in specs}
    block = specs[0].block_tokens
    assert block == round(512 * scaling.factor) and block >= 2
    a, b, c = ids[(0, 1, 2)], ids[(0, 1, 3)], ids[(0, 4)]
    assert a[: 2 * block] == b[: 2 * block]  # hash ids 0, 1 shared
    assert a[2 * block: 3 * block] != b[2 * block: 3 * block]  # 2 vs 3 differ
    assert a[:block] == c[:block] and a[block: 2 * block] != c[block: 2 * block]
    assert [len(ids[s.hash_ids]) for s in specs] == [s.input_tokens for s in specs]
