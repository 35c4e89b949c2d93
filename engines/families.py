"""What sets each model family apart from Llama, read from its config.json into one typed `FamilyTraits`:
norm placement and offset, q/k norm shape, multipliers, soft-caps, per-layer sliding windows and RoPE tables,
the activation, and the mixture-of-experts geometry. engines/model.py and engines/moe.py build from it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


class FamilyError(ValueError):
    """A family's config field tandem does not implement (the message names it)."""


@dataclass(frozen=True)
class MoETraits:
    num_experts: int
    top_k: int
    expert_intermediate: int
    renormalize: bool  # top-k weights divided by their sum (Mixtral; Qwen MoE's `norm_topk_prob`)
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert (0: none), gated by sigmoid(shared_expert_gate)
    dense_layers: tuple[int, ...] = ()  # layers with a plain MLP (`mlp_only_layers`, `decoder_sparse_step`)


@dataclass(frozen=True)
class FamilyTraits:
    family: str = "llama"
    # "pre": x + f(norm(x)) (Llama); "post": x + norm(f(x)) (OLMo 2); "sandwich": x + norm(f(norm(x))) (Gemma)
    norm_layout: str = "pre"
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by (1 + w)
    qk_norm_full: bool = False  # OLMo 2 normalises all heads' q (and k) together, before the head split
    hidden_act: str = "silu"  # or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # Gemma sqrt(hidden), Granite embedding_multiplier
    residual_scale: float = 1.0  # Granite residual_multiplier
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma query_pre_attn_scalar, Granite multiplier)
    logits_divisor: float = 1.0  # Granite logits_scaling
    attn_softcap: float | None = None  # Gemma 2: tanh-capped attention scores
    final_softcap: float | None = None  # Gemma 2: tanh-capped logits
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window (keys) or None; () = all global
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base
    partial_rotary: float = 1.0  # Phi-3/4: the fraction of head_dim RoPE rotates
    moe: MoETraits | None = None

    @property
    def plain(self) -> bool:
        """True for a model the Llama-only fast paths (the C decoder stack, the lean drafter) compute exactly."""
        return self.family == "llama" and not any(self.layer_windows)

    @property
    def c_stack(self) -> bool:
        """True for a model the C decoder stack (kernels/cpu_forward.py) computes exactly: the Llama family, and
        the mixtures of experts whose layers are Llama's but for the MoE block (SiLU experts)."""
        return self.plain or (self.moe is not None and replace(self, family="llama", moe=None) == FamilyTraits())


_FAMILY = {"Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2", "GraniteForCausalLM": "granite",
           "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "MixtralForCausalLM": "mixtral",
           "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}


def family_traits(arch: str, cfg: dict[str, Any], *, num_layers: int, head_dim: int,
                  source: str = "config.json") -> FamilyTraits:
    family = _FAMILY.get(arch, "llama")
    windows = _layer_windows(family, cfg, num_layers)
    if family == "llama":
        return FamilyTraits(layer_windows=windows)
    act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        act = "gelu_tanh"
    elif act != "silu":
        raise FamilyError(f"{source}: hidden activation {act!r} is not supported; supported: silu, gelu_pytorch_tanh")
    common = dict(family=family, hidden_act=act, layer_windows=windows)
    if family == "phi3":
        rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        return FamilyTraits(**common, partial_rotary=float(rope.get("partial_rotary_factor",
                                                                    cfg.get("partial_rotary_factor", 1.0))))
    if family == "olmo2":
        return FamilyTraits(**common, norm_layout="post", qk_norm_full=True)
    if family == "granite":
        return FamilyTraits(**common, embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
                            residual_scale=float(cfg.get("residual_multiplier", 1.0)),
                            attn_scale=float(cfg.get("attention_multiplier", head_dim ** -0.5)),
                            logits_divisor=float(cfg.get("logits_scaling", 1.0)))
    if family in ("gemma2", "gemma3"):
        hidden = int(cfg["hidden_size"])
        local_theta = None
        if family == "gemma3":
            params = cfg.get("rope_parameters")
            if isinstance(params, dict) and "sliding_attention" in params:
                local_theta = float(params["sliding_attention"].get("rope_theta", 10000.0))
            else:
                local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
        return FamilyTraits(**common, norm_layout="sandwich", norm_offset=1.0, embed_scale=hidden ** 0.5,
                            attn_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
                            attn_softcap=_opt_float(cfg.get("attn_logit_softcapping")),
                            final_softcap=_opt_float(cfg.get("final_logit_softcapping")),
                            local_rope_theta=local_theta)
    return FamilyTraits(**common, moe=_moe_traits(family, cfg, num_layers))


def _moe_traits(family: str, cfg: dict[str, Any], num_layers: int) -> MoETraits:
    if family == "mixtral":
        return MoETraits(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]),
                         int(cfg["intermediate_size"]), renormalize=True)
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step != 0)
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts"))
    shared = int(cfg.get("shared_expert_intermediate_size", 0) or 0) if family == "qwen2_moe" else 0
    return MoETraits(experts, int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                     renormalize=bool(cfg.get("norm_topk_prob", False)), shared_intermediate=shared,
                     dense_layers=dense)


def _layer_windows(family: str, cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if not window:
        return ()
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        if family == "llama" and not cfg.get("use_sliding_window", "mistral" in str(cfg.get("model_type"))):
            return ()
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if family == "gemma2":  # configs before `layer_types`: even layers slide
        return tuple(int(window) if i % 2 == 0 else None for i in range(num_layers))
    if family == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        return tuple(int(window) if (i + 1) % pattern else None for i in range(num_layers))
    if family == "llama" and cfg.get("use_sliding_window", "mistral" in str(cfg.get("model_type"))):
        return (int(window),) * num_layers  # Mistral (and Qwen2 with use_sliding_window)
    return ()


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
