"""The small model's prompt statistics as router extras (router_model/prompt_stats.py over
engines.scoring.prompt_profile): the profile equals transformers' own LlamaForCausalLM on the same checkpoint,
the summary is what its definition says, the offline cache is not asked twice, and `tandem router adapt` refits a
router that reads them (traffic and prior rows both get them)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from engines import LLM
from engines.scoring import profile_async, prompt_profile
from router_model.adapt_cli import main as adapt_main
from router_model.data import read_rows
from router_model.features import FeatureConfig, HashBlock
from router_model.prompt_stats import PROMPT_EXTRAS, TAIL, PromptStats, summarize
from router_model.router import NUM_QUANTILES, Calibration, Router

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[2]
SMALL, LARGE = ROOT / "models" / "tandem-tiny-s", ROOT / "models" / "tandem-tiny-l"
FIXTURE = Path(__file__).parent / "fixtures" / "line_prompts.jsonl"
PRIOR = ROOT / "models" / "router" / "labels" / "train.jsonl.gz"


@pytest.fixture(scope="module")
def small():
    return LLM(model=str(SMALL), memory_bytes=32 << 20)


def test_profile_equals_transformers_logprobs_and_entropies(small):
    import torch
    from transformers import AutoModelForCausalLM

    ids = small.tokenizer.encode("def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self")
    chosen, entropy = prompt_profile(small.engine.model, ids)
    ref = AutoModelForCausalLM.from_pretrained(SMALL, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
    want_chosen = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    want_entropy = -(lp.exp() * lp).sum(-1)
    assert len(chosen) == len(ids) - 1 and len(entropy) == len(ids)
    np.testing.assert_allclose(chosen, want_chosen.numpy(), atol=2e-4)
    np.testing.assert_allclose(entropy, want_entropy.numpy(), atol=2e-4)
    assert 0.0 < entropy[-1] <= math.log(small.tokenizer.vocab_size)
    # the async form runs the same forward on the scoring thread
    assert asyncio.run(profile_async(small.engine.model, ids)) == (chosen, entropy)


def test_summary_follows_its_definitions():
    chosen = [-float(i) for i in range(1, 21)]  # 20 token logprobs: -1 .. -20
    entropy = [0.5 * i for i in range(21)]  # 21 positions, the last one after the prompt
    s = summarize(chosen, entropy)
    assert set(s) == set(PROMPT_EXTRAS)
    assert s["small_prompt_logprob"] == pytest.approx(-10.5)
    assert s["small_prompt_min_logprob"] == -20.0
    assert s["small_prompt_tail_logprob"] == pytest.approx(np.mean(chosen[-TAIL:]))
    assert s["small_prompt_last_logprob"] == -20.0
    assert s["small_prompt_tail_entropy"] == pytest.approx(np.mean(entropy[-TAIL - 1:-1]))
    assert s["small_next_entropy"] == 10.0
    one = summarize([], [2.0])  # a one-token prompt: no token logprob, the next-token entropy still there
    assert one["small_next_entropy"] == 2.0 and one["small_prompt_logprob"] == 0.0


def test_offline_stats_are_the_engines_and_cached(tmp_path, small, monkeypatch):
    prompts = ["import os\n", "x = [1, 2,", "import os\n"]
    cache = tmp_path / "stats.jsonl"
    got = PromptStats(SMALL, cache)(prompts, log=lambda *_: None)
    assert got[0] == got[2] and got[0] != got[1]
    want = summarize(*prompt_profile(small.engine.model, small.tokenizer.encode("x = [1, 2,")))
    assert got[1] == {k: round(v, 5) for k, v in want.items()}
    assert len(cache.read_text().splitlines()) == 2  # one line per distinct prompt

    def no_engine(*a, **k):
        raise AssertionError("a cached prompt was scored again")

    monkeypatch.setattr("router_model.user_labels.labelling_engine", no_engine)
    assert PromptStats(SMALL, cache)(prompts, log=lambda *_: None) == got


def _template(dest: Path) -> Path:
    """An untrained router over the text statistics, one small hashed block and the prompt statistics."""
    cfg = FeatureConfig(blocks=(HashBlock("tail", 60, (1, 3), 1 << 6),), extras=tuple(PROMPT_EXTRAS))
    t = Router(feature_config=cfg, dense_mean=np.zeros(cfg.num_dense), dense_scale=np.ones(cfg.num_dense),
               coef=np.zeros((1, cfg.num_dense + cfg.num_hashed)), intercept=np.zeros(1),
               calibration=Calibration("sigmoid", a=np.array([-1.0]), b=np.array([0.0])),
               score_quantiles=np.linspace(0, 1, NUM_QUANTILES), metadata={"C": 1.0, "trained_at": "template"})
    return t.save(dest)


def test_adapt_refits_a_router_that_reads_the_small_models_prefill(tmp_path, capsys):
    prior = tmp_path / "prior.jsonl"
    prior.write_text("".join(json.dumps(r) + "\n" for r in read_rows(PRIOR)[:300]))
    data = tmp_path / "traffic.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "group": f"g{i % 8}"}) + "\n"
                            for i, r in enumerate(read_rows(FIXTURE)[:40])))
    stats_cache, out = tmp_path / "stats.jsonl", tmp_path / "adapted"
    assert adapt_main(["--data", str(data), "--router", str(_template(tmp_path / "router")), "--out", str(out),
                       "--small", str(SMALL), "--large", str(LARGE), "--stop", "\\n", "--max-tokens", "16",
                       "--prior-data", str(prior), "--prompt-stats-cache", str(stats_cache), "--min-gain", "-1",
                       "--folds", "2"]) == 0
    assert "small-model prompt statistics for 40 traffic prompts and 300 prior rows" in capsys.readouterr().out
    assert len(stats_cache.read_text().splitlines()) == len({r["prompt"] for r in read_rows(data)} |
                                                            {r["prompt"] for r in read_rows(prior)})
    new = Router.load(out)
    assert new.required_extras == tuple(PROMPT_EXTRAS)
    # the refit learnt weights for the prefill's numbers (standardised on real values: not the template's 0/1)
    k = len(new.feature_config.stats)
    assert np.all(new.dense_scale[k:] != 1.0) and np.any(new.coef[:, k:k + len(PROMPT_EXTRAS)] != 0.0)
    row = read_rows(data)[0]
    stats = PromptStats(SMALL, stats_cache)([row["prompt"]], log=lambda *_: None)[0]
    assert 0.0 < new.score(row["prompt"], stats) < 1.0
