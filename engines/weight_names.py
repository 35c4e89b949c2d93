"""Checkpoint tensor names that differ from the model's: Phi-3's fused `qkv_proj` / `gate_up_proj` (split by
rows into q/k/v and gate/up) and Mixtral's `block_sparse_moe.experts.N.w1/w2/w3` (renamed to the MoE block's
`mlp.experts.N.gate_proj/down_proj/up_proj`). Every other name maps to itself."""

from __future__ import annotations

import re

from engines.model_config import ModelConfig

# (model name, (first row, end row) of the checkpoint tensor, or None for all of it)
Target = tuple[str, tuple[int, int] | None]

_MIXTRAL = re.compile(r"^(.*)\.block_sparse_moe\.(gate\.weight|experts\.\d+\.(w[123])\.weight)$")
_MIXTRAL_W = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def weight_targets(config: ModelConfig, name: str) -> list[Target]:
    """Where checkpoint tensor `name` goes in the model: one or more (name, rows) targets."""
    if config.family == "phi3":
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".qkv_proj"):
            base = prefix[: -len("qkv_proj")]
            q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            return [(f"{base}q_proj.{leaf}", (0, q)), (f"{base}k_proj.{leaf}", (q, q + kv)),
                    (f"{base}v_proj.{leaf}", (q + kv, q + 2 * kv))]
        if prefix.endswith(".gate_up_proj"):
            base, i = prefix[: -len("gate_up_proj")], config.intermediate_size
            return [(f"{base}gate_proj.{leaf}", (0, i)), (f"{base}up_proj.{leaf}", (i, 2 * i))]
    elif config.family == "mixtral":
        m = _MIXTRAL.match(name)
        if m:
            rest = m.group(2) if m.group(3) is None else m.group(2).replace(m.group(3), _MIXTRAL_W[m.group(3)])
            return [(f"{m.group(1)}.mlp.{rest}", None)]
    return [(name, None)]
