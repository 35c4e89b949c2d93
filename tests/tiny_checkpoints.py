"""Build tiny random Hugging Face checkpoints (with transformers, the reference) and a small BPE tokenizer.

Shared by the tests: each checkpoint is saved in float32 to a folder that tandem then loads on its own.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>"]

_CORPUS = [
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n",
    "The quick brown fox jumps over the lazy dog. Hello world! 你好，世界。 Ünïcödé text 🙂🚀",
    "class Engine:\n    def step(self):\n        return self.scheduler.schedule()\n",
    "import os, sys\nfor i in range(10):\n    print(i * 2, 'even' if i % 2 == 0 else 'odd')\n",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
] * 20


def build_tokenizer(out_dir: Path, vocab_size: int = 384, chat_template: str | None = None) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def build_checkpoint(out_dir: Path, arch: str = "llama", *, vocab_size: int = 384, hidden_size: int = 64,
                     num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0,
                     with_tokenizer: bool = True, **overrides) -> Path:
    """Save a random `arch` model (llama | qwen2 | qwen3 | mistral) in HF format to `out_dir`."""
    import torch
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2 + 8,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
    common.update(overrides)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[arch]
    config = cls[0](**common)
    torch.manual_seed(seed)
    model = cls[1](config).to(torch.float32).eval()
    with torch.no_grad():  # larger-than-default init so logits are far from uniform and greedy is stable
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if with_tokenizer:
        build_tokenizer(out_dir, vocab_size=vocab_size)
    return out_dir


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_chat_template(src: Path, dst: Path, template: str = CHATML) -> Path:
    """A copy of checkpoint folder `src` at `dst` whose tokenizer_config.json carries `template`."""
    import shutil

    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return dst
