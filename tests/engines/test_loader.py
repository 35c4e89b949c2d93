"""Checkpoint loading: tandem's logits equal transformers' for each supported family, and every broken
checkpoint fails with a message that names the file and the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from attention_contexts import VarlenCausal  # conftest puts tests/ on the path
from safetensors.torch import load_file, save_file

from engines.loader import GenerationDefaults, load_checkpoint, resolve_dtype
from engines.model_config import CheckpointError, ModelConfig

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# One checkpoint per family, each exercising the config variant it is known for.
VARIANTS = {
    "llama-gqa-llama3-rope": ("llama", {"num_heads": 4, "num_kv_heads": 2, "rope_scaling": LLAMA3_ROPE}),
    "qwen2-bias-tied": ("qwen2", {"num_kv_heads": 2, "tie_word_embeddings": True}),
    "qwen3-qknorm-head-dim": ("qwen3", {"num_kv_heads": 1, "head_dim": 32}),
    "mistral": ("mistral", {"num_kv_heads": 2}),
}
SEQ_LENS = [7, 13, 4]


def reference_logits(folder: Path, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [ref(s[None]).logits[0] for s in seqs]


def tandem_varlen_logits(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, VarlenCausal([len(s) for s in seqs])))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_varlen_batch_logits_match_transformers(tiny_checkpoint, variant):
    arch, kwargs = VARIANTS[variant]
    folder = tiny_checkpoint(arch, **kwargs)
    ckpt = load_checkpoint(folder)
    assert ckpt.model.lm_head.weight.dtype == torch.float32 and not ckpt.model.training
    if kwargs.get("tie_word_embeddings"):
        assert ckpt.model.lm_head.weight is ckpt.model.model.embed_tokens.weight
    if "head_dim" in kwargs:
        assert ckpt.config.head_dim == 32 != ckpt.config.hidden_size // ckpt.config.num_heads
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, ckpt.config.vocab_size, (n,), generator=gen) for n in SEQ_LENS]
    ours = tandem_varlen_logits(ckpt.model, seqs)
    theirs = torch.cat(reference_logits(folder, seqs))
    assert ours.shape == theirs.shape == (sum(SEQ_LENS), ckpt.config.vocab_size)
    assert (ours - theirs).abs().max().item() < 1e-4


def test_llama3_rope_scaling_changes_the_frequencies(tiny_checkpoint):
    # Guards the parity test above against a rope_scaling that was silently dropped.
    ckpt = load_checkpoint(tiny_checkpoint("llama", num_heads=4, num_kv_heads=2, rope_scaling=LLAMA3_ROPE))
    assert ckpt.config.rope_scaling["rope_type"] == "llama3"
    plain = 1.0 / (ckpt.config.rope_theta ** (torch.arange(0, ckpt.config.head_dim, 2).float() / ckpt.config.head_dim))
    assert not torch.allclose(ckpt.model.inv_freq, plain)
    assert ckpt.model.inv_freq.dtype == torch.float32


def test_sharded_checkpoint_loads_and_matches_transformers(tiny_checkpoint, tmp_path):
    import transformers

    src = tiny_checkpoint("llama", num_heads=4, num_kv_heads=2)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").exists() and len(shards) > 2
    sharded, single = load_checkpoint(tmp_path), load_checkpoint(src)
    seqs = [torch.arange(5), torch.arange(10, 19)]
    assert torch.equal(tandem_varlen_logits(sharded.model, seqs), tandem_varlen_logits(single.model, seqs))


def test_rope_parameters_and_legacy_rope_scaling_parse_the_same():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4}
    v5 = ModelConfig.from_dict({**base, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}})
    legacy_type = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"} | {"type": "llama3"}
    v4 = ModelConfig.from_dict({**base, "rope_theta": 500000.0, "rope_scaling": legacy_type})
    assert v5.rope_theta == v4.rope_theta == 500000.0
    for key in ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert v5.rope_scaling[key] == v4.rope_scaling[key]
    from engines.model import rope_inv_freq
    assert torch.equal(rope_inv_freq(v5), rope_inv_freq(v4))


def test_generation_config_defaults_and_eos_ids(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint("llama", num_heads=4, num_kv_heads=2), tmp_path)
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 77,
         "repetition_penalty": 1.1, "eos_token_id": [1, 4]}))
    ckpt = load_checkpoint(folder)
    assert ckpt.generation == GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1,
                                                 max_new_tokens=77, do_sample=True, eos_token_ids=(1, 4))
    assert ckpt.eos_token_ids == (1, 4)


def test_explicit_dtype_is_honoured(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint("qwen2", num_kv_heads=2, tie_word_embeddings=True), dtype="bfloat16")
    assert {p.dtype for p in ckpt.model.parameters()} == {torch.bfloat16}
    assert ckpt.model.inv_freq.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype='int3' is not supported"):
        load_checkpoint(tiny_checkpoint("qwen2", num_kv_heads=2, tie_word_embeddings=True), dtype="int3")


# ---- broken checkpoints


def copy_checkpoint(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


@pytest.fixture
def llama_copy(tiny_checkpoint, tmp_path) -> Path:
    return copy_checkpoint(tiny_checkpoint("llama", num_heads=4, num_kv_heads=2), tmp_path)


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope: checkpoint folder does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_missing_config_json_is_named(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"ckpt/config\.json: missing file"):
        load_checkpoint(llama_copy)


def test_missing_weights_is_named(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"ckpt: missing weights file \(expected model\.safetensors or "
                                              r"model\.safetensors\.index\.json\)"):
        load_checkpoint(llama_copy)


def test_missing_shard_is_named(llama_copy):
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: missing shard file"):
        load_checkpoint(llama_copy)


def test_unknown_architecture_lists_supported_ones(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(llama_copy)
    message = str(err.value)
    assert "config.json: unknown architecture 'GPT2LMHeadModel'" in message
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in message


def test_shape_mismatch_names_tensor_and_shapes(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg["intermediate_size"] = 100  # the weights were saved with 136
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(llama_copy)
    assert str(err.value) == (f"{llama_copy / 'model.safetensors'}: tensor 'model.layers.0.mlp.down_proj.weight' "
                              "has shape [64, 136] but config.json implies [64, 100]")


def test_missing_tensor_is_named(llama_copy):
    weights = load_file(llama_copy / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, llama_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing tensor\(s\) "
                                              r"model\.layers\.1\.self_attn\.k_proj\.weight required by config\.json"):
        load_checkpoint(llama_copy)


def test_unexpected_tensor_is_an_error_but_rotary_tables_are_ignored(llama_copy):
    weights = load_file(llama_copy / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, llama_copy / "model.safetensors")
    load_checkpoint(llama_copy)  # a stored rotary table is recomputed, not an error
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(weights, llama_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_checkpoint(llama_copy)


def test_truncated_weights_file_is_named(llama_copy):
    weights = llama_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"ckpt/model\.safetensors: cannot be read as safetensors"):
        load_checkpoint(llama_copy)


def test_auto_dtype_is_float32_on_cpu_and_the_checkpoint_dtype_on_gpu(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    ckpt = load_checkpoint(llama_copy)  # the stored tensors are float32; the config claims bfloat16
    assert ckpt.model.lm_head.weight.dtype == torch.float32
    assert resolve_dtype("auto", ckpt.config, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("fp16", ckpt.config, torch.device("cpu")) == torch.float16
