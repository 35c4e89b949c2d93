"""Label building for the default models: chunking, teacher-forced scoring (padding-free) and the split by module."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from engines.loader import load_checkpoint
from engines.model import Transformer
from engines.model_config import ModelConfig
from router_model.labels import Chunk, build, make_chunks, module_side, score_chunks
from tests.tiny_checkpoints import build_tokenizer


def _random_checkpoint(folder, hidden: int, layers: int, seed: int):
    """A random Llama checkpoint written with safetensors directly (no transformers import: keeps this fast)."""
    from safetensors.torch import save_file

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 384, "hidden_size": hidden,
           "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "bos_token_id": 0,
           "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "float32"}
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_dict(cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() >= 2 else p.fill_(1.0)
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    small = _random_checkpoint(root / "s", hidden=32, layers=1, seed=1)
    large = _random_checkpoint(root / "l", hidden=64, layers=2, seed=2)
    build_tokenizer(small)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(small / name, large / name)
    return small, large


def test_chunks_are_prompt_then_true_continuation_within_bounds():
    modules = [("a", list(range(1000))), ("b", list(range(5000, 5300))), ("tiny", [1, 2, 3])]
    chunks = make_chunks(modules, num_prompts=50, continuation=8, min_prompt=4, max_prompt=40,
                         per_module_cap=30, seed=0)
    assert chunks == make_chunks(modules, 50, 8, 4, 40, 30, seed=0)
    assert 0 < len(chunks) <= 50 and {c.module for c in chunks} == {"a", "b"}
    assert sum(c.module == "a" for c in chunks) <= 30
    for c in chunks:
        assert 4 <= len(c.prompt_ids) <= 40 and len(c.continuation_ids) == 8
        full = c.prompt_ids + c.continuation_ids
        assert full == list(range(full[0], full[0] + len(full)))  # contiguous in the module
        assert c.prompt_ids[0] - (5000 if c.module == "b" else 0) == c.start


def test_module_side_is_stable_and_roughly_the_requested_share():
    names = [f"pkg.mod{i}" for i in range(400)]
    sides = [module_side(n, 0.3) for n in names]
    assert sides == [module_side(n, 0.3) for n in names]
    assert 0.22 < sides.count("test") / len(sides) < 0.38


def test_batched_scores_equal_direct_unpadded_log_likelihood(checkpoints):
    model = load_checkpoint(checkpoints[0], dtype="float32").model
    rng = np.random.default_rng(0)
    chunks = [Chunk("m", 0, rng.integers(5, 380, size=p).tolist(), rng.integers(5, 380, size=6).tolist())
              for p in (3, 17, 9, 30)]
    cont, prompt, acc = score_chunks(model, chunks, batch_size=3)
    for i, c in enumerate(chunks):
        ids = torch.tensor([c.prompt_ids + c.continuation_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model.dense_logits(ids).float()[0, :-1], -1)
        tok_lp = lp.gather(-1, ids[0, 1:, None]).squeeze(-1).numpy()
        p = len(c.prompt_ids)
        assert cont[i] == pytest.approx(tok_lp[p - 1:].mean(), abs=1e-5)
        assert prompt[i] == pytest.approx(tok_lp[:p - 1].mean(), abs=1e-5)
        assert acc[i] == pytest.approx((lp.argmax(-1) == ids[0, 1:]).numpy()[p - 1:].mean())


def test_build_writes_train_and_test_split_by_module(checkpoints, tmp_path):
    small, large = checkpoints
    summary = build(small, large, tmp_path, num_prompts=40, continuation=8, min_prompt=8, max_prompt=48,
                    per_module_cap=3, test_fraction=0.35, batch_size=16, seed=0, log=lambda *_: None)
    rows = {side: [json.loads(line) for line in (tmp_path / f"{side}.jsonl").read_text().splitlines()]
            for side in ("train", "test")}
    assert len(rows["train"]) + len(rows["test"]) == summary["prompts"] == 40
    assert rows["train"] and rows["test"]
    assert not {r["group"] for r in rows["train"]} & {r["group"] for r in rows["test"]}
    for r in rows["train"] + rows["test"]:
        assert r["prompt"] and r["small_score"] < 0 and r["large_score"] < 0
        assert "small_prompt_logprob" in r["extras"]
        assert r["small_score"] == r["small_logprob"] and 0 <= r["large_accuracy"] <= 1
