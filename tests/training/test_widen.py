"""training/widen.py: the widened checkpoint computes its source's function. transformers' own Llama loader on
the widened folder is the reference (its logits equal the source's), and tandem's engine on it decodes the
source's greedy tokens on held-out prompts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.model_quality import heldout_prompts  # noqa: E402
from engines.generate_cli import generate_tokens  # noqa: E402
from engines.loader import load_checkpoint  # noqa: E402
from engines.tokenizer import Tokenizer  # noqa: E402
from training.widen import widen, widen_state  # noqa: E402

LARGE = ROOT / "models" / "tandem-tiny-l"

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def wide2(tmp_path_factory) -> Path:
    return widen(LARGE, tmp_path_factory.mktemp("widen") / "tiny-l-x2", 2)


def _hf_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_widened_config_and_size(wide2):
    src = json.loads((LARGE / "config.json").read_text())
    cfg = json.loads((wide2 / "config.json").read_text())
    assert cfg["hidden_size"] == 2 * src["hidden_size"]
    assert cfg["intermediate_size"] == 2 * src["intermediate_size"]
    assert cfg["num_attention_heads"] == 2 * src["num_attention_heads"]
    assert cfg["num_key_value_heads"] == 2 * src["num_key_value_heads"]
    assert cfg["head_dim"] == src["head_dim"] == 32
    meta = json.loads((wide2 / "widened_from.json").read_text())
    # matrices grow 4x, the (tied) embedding 2x: 5.48M -> ~19.8M parameters
    assert 19.0e6 < meta["parameters"] < 20.5e6, meta
    assert (wide2 / "tokenizer.json").read_bytes() == (LARGE / "tokenizer.json").read_bytes()


def test_transformers_logits_of_widened_folder_equal_the_sources(wide2):
    tok = Tokenizer.from_pretrained(LARGE)
    ids = heldout_prompts(tok, 1, context_tokens=48)[0]
    narrow, wide = _hf_logits(LARGE, ids), _hf_logits(wide2, ids)
    assert wide.shape == narrow.shape == (len(ids), 4096)
    assert torch.allclose(wide, narrow, atol=2e-4, rtol=1e-4), (wide - narrow).abs().max()
    assert torch.equal(wide.argmax(-1), narrow.argmax(-1))
    assert narrow.std() > 1.0  # real logits, not a constant that any two models would share


def test_engine_greedy_tokens_of_widened_model_equal_tiny_l_on_heldout_prompts(wide2):
    tok = Tokenizer.from_pretrained(LARGE)
    narrow, wide = load_checkpoint(LARGE).model, load_checkpoint(wide2).model
    for prompt in heldout_prompts(tok, 4, context_tokens=64):
        ours = generate_tokens(wide, prompt, 24)
        ref = generate_tokens(narrow, prompt, 24)
        assert ours == ref
        assert len(set(ref)) > 3


def test_untied_head_and_odd_factor_against_transformers(tmp_path):
    """A random Llama with its own lm_head, grouped KV heads, widened 3x (1/3 is not exact in floats)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   tie_word_embeddings=False, max_position_embeddings=64)
    src = tmp_path / "src"
    transformers.LlamaForCausalLM(cfg).save_pretrained(src, safe_serialization=True)
    out = widen(src, tmp_path / "wide", 3)
    ids = list(range(5, 25))
    narrow, wide = _hf_logits(src, ids), _hf_logits(out, ids)
    assert torch.allclose(wide, narrow, atol=1e-5, rtol=1e-4), (wide - narrow).abs().max()
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 6


def test_unknown_tensor_is_refused():
    cfg = {"num_attention_heads": 2, "hidden_size": 8, "intermediate_size": 8}
    with pytest.raises(ValueError, match="bias"):
        widen_state({}, {**cfg, "attention_bias": True}, 2)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.bias"):
        widen_state({"model.layers.0.self_attn.q_proj.bias": torch.zeros(8)}, cfg, 2)
