"""The embedded default models (models/tandem-tiny-s, models/tandem-tiny-l): they load in tandem and in
transformers with the same greedy output, the large one is clearly better on held-out modules, and the small
one is a useful greedy draft for it. Also the corpus split they were trained on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.model_quality import greedy_acceptance, heldout_prompts, heldout_token_chunks, mean_loss  # noqa: E402
from engines.generate_cli import generate_tokens  # noqa: E402
from engines.loader import load_checkpoint  # noqa: E402
from engines.tokenizer import Tokenizer  # noqa: E402
from training.corpus import SPLITS, iter_modules, load_corpus_split, split_of  # noqa: E402

SMALL, LARGE = ROOT / "models" / "tandem-tiny-s", ROOT / "models" / "tandem-tiny-l"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def loaded():
    return {"s": load_checkpoint(SMALL), "l": load_checkpoint(LARGE)}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(SMALL)


def test_checkpoints_are_complete_llama_folders_sharing_one_tokenizer_under_40mb():
    total = 0
    for folder in (SMALL, LARGE):
        for name in FILES:
            assert (folder / name).is_file(), f"{folder / name} missing"
        total += sum(f.stat().st_size for f in folder.iterdir())
        assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert total <= 40 * 2**20
    assert (SMALL / "tokenizer.json").read_bytes() == (LARGE / "tokenizer.json").read_bytes()


def test_parameter_counts_are_in_the_promised_ranges(loaded):
    counts = {k: sum(p.numel() for p in v.model.parameters()) for k, v in loaded.items()}
    assert 1_000_000 <= counts["s"] <= 2_000_000
    assert 5_000_000 <= counts["l"] <= 10_000_000


def test_chat_template_is_chatml_and_im_end_stops_generation(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    im_end = tokenizer.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in tokenizer.eos_token_ids


@pytest.mark.parametrize("name", ["s", "l"])
def test_greedy_continuation_matches_transformers(loaded, tokenizer, name):
    import transformers

    folder = SMALL if name == "s" else LARGE
    prompt = tokenizer.encode("def read_config(path):")
    ours = generate_tokens(loaded[name].model, prompt, 16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    theirs = out[0, len(prompt):].tolist()
    assert ours == theirs
    assert len(set(ours)) > 3, "a greedy continuation stuck on one token means an untrained model"


def test_large_heldout_loss_is_at_least_0_3_nats_below_small(loaded, tokenizer):
    chunks = heldout_token_chunks(tokenizer, limit=24)
    small, large = mean_loss(loaded["s"].model, chunks), mean_loss(loaded["l"].model, chunks)
    assert large < 3.0, f"large held-out loss {large:.3f} is not a trained model's"
    assert small - large >= 0.3, f"small {small:.3f} vs large {large:.3f}"


def test_small_drafts_for_large_with_greedy_acceptance_above_half_on_8_heldout_prompts(loaded, tokenizer):
    # A fixed subset (0.576 for the 2,048-token pair); the full measurement, bench/model_quality.py over 32
    # prompts x 48 tokens, is 0.599 (0.634 over 64) against issue 4's target of 0.5 (see models/README.md).
    prompts = heldout_prompts(tokenizer, 8)
    stats = greedy_acceptance(loaded["s"].model, loaded["l"].model, prompts, k=4, max_tokens=32,
                              eos_ids=frozenset(tokenizer.eos_token_ids))
    assert stats["drafted"] >= 8 * 8
    assert stats["acceptance"] >= 0.55, stats


def test_corpus_split_is_disjoint_deterministic_and_holds_out_about_5_percent():
    names = [name for name, _ in iter_modules()]
    assert len(names) > 500 and "json.decoder" in names
    assert not any(".test." in n or n.startswith("test.") for n in names)
    by_split = {s: [n for n in names if split_of(n) == s] for s in SPLITS}
    assert 0.02 <= len(by_split["heldout"]) / len(names) <= 0.08
    assert sum(len(v) for v in by_split.values()) == len(names)
    heldout = load_corpus_split("heldout")
    assert [n for n, _ in heldout] == [n for n in by_split["heldout"] if n in dict(heldout)]
    assert all(text.strip() for _, text in heldout)
    with pytest.raises(ValueError, match="unknown split"):
        load_corpus_split("test")
