"""What an engine serves: its model (moved to the device, quantised on load), tokenizer and EOS ids."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from engines.config import EngineSpec
from engines.model import Transformer, cpu_weight_layout


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object | None
    eos_token_ids: set[int]
    generation: object | None


def load_model(spec: EngineSpec, device: torch.device) -> LoadedModel:
    if isinstance(spec.model, Transformer):
        # quantising swaps modules in place: never do that to the caller's model
        model = copy.deepcopy(spec.model) if spec.quantization != "none" else spec.model
        model = cpu_weight_layout(_quantize(model.to(device).eval(), spec))
        return LoadedModel(model, None, set(model.config.eos_token_ids), None)
    from engines.loader import load_checkpoint
    from engines.tokenizer import Tokenizer

    ckpt = load_checkpoint(spec.model, dtype=spec.dtype, device=device)
    tokenizer = Tokenizer.from_pretrained(spec.model)
    eos = set(ckpt.eos_token_ids) | set(tokenizer.eos_token_ids)
    return LoadedModel(cpu_weight_layout(_quantize(ckpt.model, spec)), tokenizer, eos, ckpt.generation)


def _quantize(model: Transformer, spec: EngineSpec) -> Transformer:
    """Quantise-on-load: nn.Linear -> kernels' QuantLinear (int8 per channel, int4 per group)."""
    if spec.quantization == "none":
        return model
    from kernels.quant_matmul import quantize_model

    with torch.no_grad():
        quantize_model(model, spec.quantization, spec.quantization_group_size)
    return model
