"""What an engine serves: its model (moved to the device, quantised on load), tokenizer and EOS ids, and what
was loaded (`LoadedModel.info`: source, format, quantisation, weight bytes, context length), which is logged."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch

from engines.config import EngineSpec
from engines.model import Transformer, cpu_weight_layout

log = logging.getLogger("tandem.load")


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object | None
    eos_token_ids: set[int]
    generation: object | None
    info: dict = field(default_factory=dict)


def load_model(spec: EngineSpec, device: torch.device) -> LoadedModel:
    if isinstance(spec.model, Transformer):
        # quantising swaps modules in place: never do that to the caller's model
        model = copy.deepcopy(spec.model) if spec.quantization != "none" else spec.model
        model = cpu_weight_layout(_quantize(model.to(device).eval(), spec))
        info = describe(model, "in-memory Transformer", "torch", spec.quantization)
        return LoadedModel(model, None, set(model.config.eos_token_ids), None, info)
    from engines.formats import resolve

    source = resolve(spec.model, getattr(spec, "revision", None))
    if source.format == "gguf":
        from engines.formats.gguf import load_gguf

        model, tokenizer, generation, quant = load_gguf(source.path, dtype=spec.dtype, device=device,
                                                        quantization=spec.quantization,
                                                        group_size=spec.quantization_group_size)
        eos = set(model.config.eos_token_ids) | set(tokenizer.eos_token_ids)
        model = cpu_weight_layout(model)
    else:
        from engines.loader import load_checkpoint
        from engines.tokenizer import Tokenizer

        ckpt = load_checkpoint(source.path, dtype=spec.dtype, device=device)
        tokenizer = Tokenizer.from_pretrained(source.path)
        eos = set(ckpt.eos_token_ids) | set(tokenizer.eos_token_ids)
        generation = ckpt.generation
        quant = ckpt.quantization or spec.quantization  # a pre-quantised checkpoint says what it loaded as
        if ckpt.quantization and spec.quantization != "none":
            quant += f"; floats quantised at load: {spec.quantization}"
        model = cpu_weight_layout(_quantize(ckpt.model, spec))
    info = describe(model, source.describe(), source.format, quant)
    info["path"] = str(source.path)
    log.info("engine %s: loaded %s (%s, quantization %s): %s weight bytes, context %d tokens", spec.name,
             info["source"], info["format"], info["quantization"], f"{info['weight_bytes']:,}",
             info["context_length"])
    model.load_info = info
    return LoadedModel(model, tokenizer, eos, generation, info)


def describe(model: Transformer, source: str, fmt: str, quantization: str) -> dict:
    """What `/v1/models` and the start-up log say about a loaded model."""
    seen: set[int] = set()
    nbytes = 0
    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if not n.endswith("inv_freq"))]
    for m in model.modules():  # the CPU layout's fused q/k/v and gate/up weights, which the Linears view
        fused = getattr(m, "fused", None)
        if fused is not None:
            tensors.append(fused[0])
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        nbytes += storage.nbytes()
    return {"source": source, "format": fmt, "quantization": quantization, "weight_bytes": nbytes,
            "context_length": model.config.max_position_embeddings}


def _quantize(model: Transformer, spec: EngineSpec) -> Transformer:
    """Quantise-on-load: nn.Linear -> kernels' QuantLinear (int8 per channel, int4 per group)."""
    if spec.quantization == "none":
        return model
    from kernels.quant_matmul import quantize_model

    with torch.no_grad():
        quantize_model(model, spec.quantization, spec.quantization_group_size)
    return model
