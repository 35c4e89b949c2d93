"""GGUF files (llama.cpp's format) through the `gguf` package: geometry, RoPE and tokenizer from the metadata,
tensors mapped onto the `Transformer`'s Hugging Face names. F32 / F16 / BF16 load as floats; Q4_0 goes onto the
int4 kernels exactly (groups of 32); Q8_0 onto the int8 kernels exactly, its int8 values and its scale per block
of 32 as stored (weight-only; w8a8, activations quantised per 32 too, when that quantization is asked for);
every other type the gguf package can dequantise (Q4_K, Q5_K, Q6_K, ...) is dequantised at load, and the log
says so.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engines.formats.gguf_tokenizer import field, tokenizer_from_gguf
from engines.formats.safetensors_io import assign_parameter
from engines.loader import GenerationDefaults, resolve_dtype
from engines.model import Transformer, rope_inv_freq
from engines.model_config import CheckpointError, ModelConfig

log = logging.getLogger("tandem.gguf")

# general.architecture -> (Hugging Face architecture, whether llama.cpp's converter permuted q/k rows)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False),
                 "qwen3": ("Qwen3ForCausalLM", False)}
FLOAT_TYPES = ("F32", "F16", "BF16")
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def read(path: Path) -> Any:
    """A GGUFReader over `path`; CheckpointError naming the file when it is not a readable GGUF."""
    import gguf

    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors... on a damaged file
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path}: not a readable GGUF file, truncated or damaged ({detail})") from None


def check(path: str | Path) -> None:
    """What load_gguf would refuse, found from the header alone (no tensor is read): a damaged or truncated
    file, an unsupported architecture or tokenizer, a tensor type tandem cannot load."""
    import gguf

    path = Path(path)
    reader = read(path)
    hf_config(reader, path)
    kind = field(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise CheckpointError(f"{path}: GGUF tokenizer model {kind!r} is not supported; supported: gpt2, llama")
    for t in reader.tensors:
        if t.tensor_type.name not in (*FLOAT_TYPES, "Q8_0", "Q4_0") and not _can_dequantize(gguf, t.tensor_type):
            raise CheckpointError(f"{path}: tensor {t.name!r} has quantisation type {t.tensor_type.name}, which "
                                  "tandem cannot load (no dequantisation for it in the gguf package)")


def _can_dequantize(gguf: Any, qtype: Any) -> bool:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    except Exception:  # a shape the probe got wrong: the real tensor decides
        return True
    return True


def hf_config(reader: Any, path: Path) -> dict[str, Any]:
    """The config.json a Hugging Face checkpoint of this file would have."""
    arch = field(reader, "general.architecture")
    parts = field(reader, "split.count")
    if parts is not None and int(parts) > 1:
        raise CheckpointError(f"{path}: one part of a GGUF split into {int(parts)} files; merge them into one first "
                              "(llama.cpp: llama-gguf-split --merge FIRST_PART OUT.gguf)")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                              f"{', '.join(ARCHITECTURES)}")

    def need(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"{path}: missing GGUF metadata {arch}.{key}")
        return value

    names = {t.name: t for t in reader.tensors}
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{path}: missing tensor 'token_embd.weight'")
    vocab = int(names["token_embd.weight"].shape[1])  # GGML order: [hidden, vocab]
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch][0]], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")), "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names and arch == "llama",
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
    }
    kind = field(reader, f"{arch}.rope.scaling.type")
    if kind in ("linear",):
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(field(reader, f"{arch}.rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise CheckpointError(f"{path}: GGUF rope scaling {kind!r} is not supported; supported: none, linear")
    types = Counter(t.tensor_type.name for t in reader.tensors if t.name.endswith(".weight"))
    cfg["torch_dtype"] = "bfloat16" if types.get("BF16") else ("float32" if set(types) == {"F32"} else "float16")
    return cfg


def load_gguf(path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
              quantization: str = "none", group_size: int = 64):
    """(Transformer, Tokenizer, GenerationDefaults, quantization text) from one GGUF file.

    `quantization` ("none" or a quantise-on-load mode) applies to the tensors that load as floats; Q4_0 goes
    onto int4 and Q8_0 onto int8 (w8a8 when it says so) whatever it says, exactly."""

    path = Path(path)
    reader = read(path)
    config = ModelConfig.from_dict(hf_config(reader, path), source=str(path))
    device = torch.device(device)
    target = resolve_dtype(dtype, config, device)
    with torch.device("meta"):
        model = Transformer(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    permute = ARCHITECTURES[field(reader, "general.architecture")][1]
    loaded: set[str] = set()
    kinds: Counter[str] = Counter()
    rope_freqs = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # llama3-style RoPE: per-frequency divisors
            rope_freqs = torch.from_numpy(_dequantize(t, path).reshape(-1).copy())
            continue
        name = _hf_name(t.name)
        if name is None or name not in expected:
            raise CheckpointError(f"{path}: unexpected tensor {t.name!r} for a {config.architecture} "
                                  f"of {config.num_layers} layers")
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        if shape != expected[name]:
            raise CheckpointError(f"{path}: tensor {t.name!r} has shape {list(shape)} but the metadata implies "
                                  f"{list(expected[name])}")
        rows = None
        if permute and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            rows = _unpermute_rows(shape[0], heads)
        qtype = t.tensor_type.name
        linear = name.endswith(".weight") and "embed_tokens" not in name and len(shape) == 2
        onto = {"Q4_0": "int4", "Q8_0": "w8a8" if quantization == "w8a8" else "int8"}.get(qtype)
        if linear and onto is not None:
            onto = _put_quantized(model, name, t, qtype, onto, rows, device)
            kinds[f"{qtype}->{onto}"] += 1
        else:
            w = torch.from_numpy(_dequantize(t, path).reshape(shape).copy())
            if rows is not None:
                w = w[rows]
            assign_parameter(model, name, w.to(device=device, dtype=target))
            if len(shape) == 2:
                kinds[qtype if qtype in FLOAT_TYPES else f"{qtype}->float (dequantised)"] += 1
        loaded.add(name)
    missing = [n for n in expected if n not in loaded]
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:5])} required by the metadata")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    inv_freq = rope_inv_freq(config)
    if rope_freqs is not None:
        inv_freq = inv_freq / rope_freqs.float()
    model.inv_freq = inv_freq.to(device)
    model.eval()
    dequantised = sorted(k for k in kinds if "dequantised" in k)
    if dequantised:
        log.info("gguf %s: %s dequantised at load to %s (no kernel fits these types)", path.name,
                 ", ".join(k.split("->")[0] for k in dequantised), str(target).removeprefix("torch."))
    if quantization != "none":
        from kernels.quant_matmul import quantize_model

        with torch.no_grad():  # the Linears that loaded as floats; the file's quantised ones stay as they are
            quantize_model(model, quantization, group_size)
    text = "gguf " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
    if quantization != "none":
        text += f"; floats quantised at load: {quantization}"
    generation = GenerationDefaults(eos_token_ids=tuple(config.eos_token_ids))
    return model, tokenizer_from_gguf(reader, path), generation, text


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.match(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute_rows(n_rows: int, heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q/k permutation (interleaved RoPE pairs back to halves)."""
    dim = n_rows // heads // 2
    return torch.arange(n_rows).reshape(heads, dim, 2).transpose(1, 2).reshape(-1)


def _dequantize(t: Any, path: Path) -> np.ndarray:
    import gguf

    qtype = t.tensor_type
    if qtype.name == "F32":
        return np.asarray(t.data, dtype=np.float32)
    if qtype.name == "F16":
        return np.asarray(t.data).astype(np.float32)
    try:
        return gguf.quants.dequantize(t.data, qtype)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {t.name!r} has quantisation type {qtype.name}, which tandem cannot "
                              "load (no dequantisation for it in the gguf package)") from None


def _blocks(t: Any, bytes_per_block: int) -> np.ndarray:
    data = np.asarray(t.data, dtype=np.uint8)
    return data.reshape(-1, bytes_per_block)


def _put_quantized(model: nn.Module, name: str, t: Any, qtype: str, mode: str, rows: torch.Tensor | None,
                   device: torch.device) -> str:
    """The file's quantised tensor as the Linear's QuantLinear, its values as stored; returns the mode it took."""
    from kernels.quant_matmul import QuantLinear

    module_path = name.rpartition(".")[0]
    parent_path, _, child = module_path.rpartition(".")
    old = model.get_submodule(module_path)
    n, k = old.out_features, old.in_features
    has_bias = old.bias is not None
    if qtype == "Q8_0":
        # w = d * q per block of 32 values: int8 q [N, K] and the fp16 d [N, K / 32], as stored (the file's bytes)
        blocks = _blocks(t, 34)
        d = torch.from_numpy(blocks[:, :2].copy().view(np.float16)).reshape(n, k // 32)
        q = torch.from_numpy(blocks[:, 2:].copy().view(np.int8)).reshape(n, k)
        if rows is not None:
            q, d = q[rows], d[rows]
        if mode == "w8a8" and bool((q == -128).any()):
            # the w8a8 dots take |x| against the weights' signs flipped, which -128 (never written by llama.cpp's
            # quantiser, but a valid byte) overflows: weight-only int8 is exact for it
            log.info("gguf %s: %s holds -128, which w8a8's dots cannot take; it runs int8 weight-only", t.name, name)
            mode = "int8"
        new = QuantLinear(k, n, has_bias, mode, device="meta", int8_group=32)
        new.weight, new.scale = q.contiguous().to(device), d.contiguous().to(device)
    else:  # Q4_0: w = d * (q - 8), 32 values per block, nibble j holds values j (low) and j + 16 (high)
        blocks = _blocks(t, 18)
        d = torch.from_numpy(blocks[:, :2].copy().view(np.float16))  # [N*K/32, 1]
        qs = torch.from_numpy(blocks[:, 2:].copy())
        q = torch.cat([qs & 0xF, qs >> 4], dim=1).reshape(n, k)  # block order: values 0..15 then 16..31
        scale = d.reshape(n, k // 32)
        if rows is not None:
            q, scale = q[rows], scale[rows]
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        new = QuantLinear(k, n, has_bias, "int4", group_size=32, device="meta")
        new.weight = packed.to(device)
        new.scale = scale.contiguous().to(device)
        new.set_zero_points(None)  # Q4_0 is symmetric: q - 8, no zero points stored
        mode = "int4"
    if has_bias:  # the file's bias, when it came before the weight; else a placeholder it overwrites later
        bias = old.bias if old.bias.device.type != "meta" else torch.zeros(n, device=device)
        new.bias = nn.Parameter(bias.detach(), requires_grad=False)
    setattr(model.get_submodule(parent_path), child, new)
    return mode
