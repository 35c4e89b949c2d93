"""Task-success labels for the default models: line prompts cut at line boundaries of unseen modules, the
greedy line completions through the engine (batched = one by one), CodeXGLUE-style scoring, split by module."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from router_model.labels import build, line_prompts, module_side
from router_model.scoring import answer_stats, edit_similarity, exact_match, normalize

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # engines run here
SMALL, LARGE = ROOT / "models" / "tandem-tiny-s", ROOT / "models" / "tandem-tiny-l"


def test_scoring_is_whitespace_normalised_exact_match_and_edit_similarity():
    assert normalize("  return  x +\t1 ") == "return x + 1"
    assert exact_match("return x  + 1", "return x + 1") == 1.0
    assert exact_match("return x + 2", "return x + 1") == 0.0
    assert edit_similarity("abcd", "abcd") == 1.0 and edit_similarity("", "") == 1.0
    assert edit_similarity("abcd", "abxd") == pytest.approx(0.75)  # difflib: 2 * 3 matches / 8 chars
    assert edit_similarity("", "abc") == 0.0


def test_answer_stats_from_top_logprobs():
    class LP:
        def __init__(self, v):
            self.logprob = v

    ids = [5, 7, 9]
    lps = [{5: LP(np.log(0.5)), 6: LP(np.log(0.5))}, {7: LP(np.log(0.25)), 8: LP(np.log(0.25))}, {9: LP(0.0)}]
    s = answer_stats(ids, lps, ["a", "b\n", "c"])
    assert s["answer_mean_logprob"] == pytest.approx((np.log(0.5) + np.log(0.25)) / 3)
    assert s["answer_min_logprob"] == pytest.approx(np.log(0.25))
    assert s["answer_first_line_logprob"] == pytest.approx((np.log(0.5) + np.log(0.25)) / 2)
    # entropies: ln 2; two 1/4 outcomes + 1/2 of remaining mass = 1.5 ln 2; 0
    assert s["answer_entropy"] == pytest.approx((np.log(2) + 1.5 * np.log(2)) / 3)
    assert s["answer_log_tokens"] == pytest.approx(np.log1p(3))
    assert answer_stats([], [])["answer_mean_logprob"] == -20.0


def test_line_prompts_stop_at_a_line_boundary_and_the_reference_is_the_rest_of_that_line():
    from engines.tokenizer import Tokenizer
    from router_model.labels import token_pieces

    tok = Tokenizer.from_pretrained(SMALL)
    text = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(60))
    ids = tok.encode(text)
    prompts = line_prompts([("m", ids)], token_pieces(tok), tok.decode, per_module_cap=1000, min_prompt=16,
                           max_prompt=64, max_line_tokens=20, seed=0)
    assert len(prompts) > 50
    for p in prompts:
        prompt = tok.decode(p.prompt_ids)
        assert "\n" in tok.decode(p.prompt_ids[-1:]) and p.reference.strip()
        assert (prompt + p.reference + "\n") in text  # the window, then exactly the rest of its line
        assert 16 <= len(p.prompt_ids) <= 64 or p.start == 0
    assert prompts == line_prompts([("m", ids)], token_pieces(tok), tok.decode, 1000, 16, 64, 20, seed=0)


def test_module_side_is_stable_and_roughly_the_requested_share():
    names = [f"pkg.mod{i}" for i in range(400)]
    sides = [module_side(n, 0.3) for n in names]
    assert sides == [module_side(n, 0.3) for n in names]
    assert 0.22 < sides.count("test") / len(sides) < 0.38


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("labels")
    summary = build(SMALL, LARGE, out, limit=40, max_modules=12, test_fraction=0.5, batch=16, log=lambda *_: None,
                    dtype="float32")
    rows = {}
    for side in ("train", "test"):
        with gzip.open(out / f"{side}.jsonl.gz", "rt") as f:
            rows[side] = [json.loads(line) for line in f]
    return summary, rows


def test_build_labels_held_out_lines_split_by_module(built):
    summary, rows = built
    assert len(rows["train"]) + len(rows["test"]) == summary["prompts"] == 40
    assert rows["train"] and rows["test"]
    assert not {r["group"] for r in rows["train"]} & {r["group"] for r in rows["test"]}
    from training.corpus import split_of

    for r in rows["train"] + rows["test"]:
        assert split_of(r["group"]) in ("heldout", "validation")
        assert r["small_score"] == r["small_exact"] == exact_match(r["small_answer"], r["reference"])
        assert r["large_edit"] == pytest.approx(edit_similarity(r["large_answer"], r["reference"]), abs=1e-4)
        assert "\n" not in r["small_answer"] and set(r["small_answer_stats"]) >= {"answer_mean_logprob",
                                                                                  "answer_entropy"}


def test_batched_label_answers_are_the_engines_own_greedy_answers(built):
    from engines import LLM, SamplingParams
    from engines.tokenizer import Tokenizer

    _, rows = built
    tok = Tokenizer.from_pretrained(SMALL)
    llm = LLM(model=str(LARGE), dtype="float32", memory_bytes=64 << 20)
    for r in (rows["train"] + rows["test"])[:4]:
        ids = tok.encode(r["prompt"])
        one = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=r["max_tokens"],
                                                                       stop=["\n"]))[0].outputs[0].text
        assert one == r["large_answer"]
