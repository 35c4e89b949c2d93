"""Model geometry read from a Hugging Face `config.json`: one typed place for every supported family (what
sets a family apart from Llama is `traits`, read by engines/families.py).

Handles explicit `head_dim`, `rope_scaling` (`type` or `rope_type`, incl. llama3) and transformers 5.x
`rope_parameters`, tied embeddings, `dtype`/`torch_dtype` and list-valued `eos_token_id`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.families import FamilyError, FamilyTraits, family_traits

SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    # the other families: their differences are read by engines/families.py
    "Phi3ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Olmo2ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "GraniteForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Gemma2ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Gemma3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "MixtralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2MoeForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3MoeForCausalLM": {"qkv_bias": False, "qk_norm": True},
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                "granite": "GraniteForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}

# architectures whose `attention_bias` also puts a bias on o_proj
_O_BIAS_ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM")


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and the problem."""


def _traits(arch: str, cfg: dict[str, Any], head_dim: int, source: str) -> FamilyTraits:
    try:
        return family_traits(arch, cfg, num_layers=int(cfg["num_hidden_layers"]), head_dim=head_dim, source=source)
    except (FamilyError, KeyError) as e:
        raise CheckpointError(f"{source}: {e}" if isinstance(e, KeyError) else str(e)) from None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    sliding_window: int | None = None
    # per-family differences (engines/families.py reads them; the defaults are Llama's)
    traits: FamilyTraits = field(default_factory=FamilyTraits)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        moe = self.traits.moe
        if moe is None:
            return self.num_layers * per_layer + emb + h
        sparse = self.num_layers - len(moe.dense_layers)
        experts = moe.num_experts * (3 * h * moe.expert_intermediate + h) + (3 * h * moe.shared_intermediate + h
                                                                           if moe.shared_intermediate else 0)
        return self.num_layers * per_layer + sparse * (experts - 3 * h * i) + emb + h

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch is None:
            mt = cfg.get("model_type")
            arch = _MODEL_TYPES.get(str(mt))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{source}: unknown architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        traits = SUPPORTED_ARCHITECTURES[arch]
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise CheckpointError(f"{source}: missing required field {key!r}")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")  # transformers 5.x
        if isinstance(params, dict) and "full_attention" in params:  # per layer type (Gemma 3): global first
            params = params["full_attention"]
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            kind = params.get("rope_type", params.get("type", "default"))
            if kind not in (None, "default"):
                rope_scaling = dict(params)
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling["rope_type"] = kind
            if kind == "default":
                rope_scaling = None
            elif kind == "su":
                rope_scaling["rope_type"] = "longrope"
            elif kind not in ("linear", "llama3", "dynamic", "longrope"):
                raise CheckpointError(f"{source}: unsupported rope_scaling type {kind!r}; "
                                      "supported: default, linear, dynamic, llama3, longrope (su)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", traits["qkv_bias"]))) or (
                traits["qkv_bias"] and cfg.get("qkv_bias", True)),
            o_bias=bool(cfg.get("attention_bias", False)) and arch in _O_BIAS_ARCHS,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=traits["qk_norm"],
            torch_dtype=str(dtype),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "MistralForCausalLM") else None,
            traits=_traits(arch, cfg, int(head_dim), source),
            raw=cfg,
        )

    @property
    def family(self) -> str:
        return self.traits.family

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise CheckpointError(f"{path}: missing file (a Hugging Face checkpoint folder needs config.json)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(cfg, source=str(path))
