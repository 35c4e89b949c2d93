"""Pre-quantised checkpoints made from a float folder of tests/tiny_checkpoints.py: compressed-tensors with the
library's own qparams and compressors; GPTQ (v1 zero points, optional desc_act order) and AWQ (GEMM) packed here
to their documented layouts, with `*_reference` dequantisations written from those layouts independently of
engines/formats/prequant.py's unpacking."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]  # AutoAWQ's unpacking order for its GEMM qweight / qzeros


def _linears(state: dict[str, torch.Tensor]) -> list[str]:
    return [n[:-len(".weight")] for n, t in state.items() if t.dim() == 2 and n.endswith("proj.weight")]


def _copy(src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name != "model.safetensors":
            shutil.copy(p, dst / p.name)
    return json.loads((src / "config.json").read_text())


def _save(dst: Path, cfg: dict, state: dict[str, torch.Tensor], qc: dict, in_config: bool = True) -> Path:
    if in_config:
        cfg["quantization_config"] = qc
    else:
        (dst / "quantize_config.json").write_text(json.dumps(qc))
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
    return dst


def compressed_tensors(src: Path, dst: Path, preset: str = "W4A16", activations: bool = True) -> Path:
    """`preset` (W4A16: int4 groups of 128 symmetric, pack-quantized; W4A16_ASYM; W8A8: int8 per channel,
    int-quantized, dynamic int8 activations per token; FP8: float8 e4m3 per tensor, float-quantized, static
    float8 activations) applied with compressed-tensors' calculate_qparams and compressors; `activations` False
    drops the preset's input activations from the config (weight-only)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if not activations:
        scheme.input_activations = None
    fmt = ("float-quantized" if scheme.weights.type == "float" else
           "int-quantized" if scheme.weights.num_bits == 8 else "pack-quantized")
    compressor = BaseCompressor.get_value_from_registry(fmt)
    cfg = _copy(src, dst)
    state = load_file(str(src / "model.safetensors"))
    for prefix in _linears(state):
        w = state.pop(f"{prefix}.weight")
        n, k = w.shape
        if scheme.weights.strategy == "tensor":
            scale, zp = calculate_qparams(w.amin().reshape(1), w.amax().reshape(1), scheme.weights)
        else:
            g = scheme.weights.group_size or k
            wg = w.reshape(n, k // g, g)
            scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), scheme.weights)
        out = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
        state.update({f"{prefix}.{name}": t for name, t in out.items()})
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
                            quantization_status="compressed").model_dump(mode="json")
    return _save(dst, cfg, state, qc)


def compressed_tensors_reference(folder: Path, prefix: str) -> torch.Tensor:
    """The library's own decompression of one Linear."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    state = load_file(str(folder / "model.safetensors"))
    local = {n[len(prefix) + 1:]: t for n, t in state.items() if n.rsplit(".", 1)[0] == prefix}
    return BaseCompressor.get_value_from_registry(qc.format).decompress(local, scheme)["weight"].float()


def _int4_groups(w: torch.Tensor, group: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] in 0..15, zero [N, G], scale fp16 [N, G] with w ~= (q - zero) * scale per group."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    if sym:
        scale = (wg.abs().amax(-1) / 7.5).clamp_min(1e-6).half()
        zero = torch.full_like(scale, 8, dtype=torch.int32)
    else:
        lo, hi = wg.amin(-1).clamp_max(0), wg.amax(-1).clamp_min(0)
        scale = ((hi - lo) / 15).clamp_min(1e-6).half()
        zero = torch.round(-lo / scale.float()).clamp(1, 15).int()  # >= 1: GPTQ v1 stores zero - 1
    q = (torch.round(wg / scale.float()[..., None]) + zero[..., None]).clamp(0, 15).int().reshape(n, k)
    return q, zero, scale


def _pack(vals: torch.Tensor, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """int values 0..15 -> int32 with 8 per word along `dim` (nibble p = element order[p] of the 8)."""
    v = vals.int().movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    if order is not None:
        v = v[..., order]
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for p in range(8):
        word |= v[..., p].long() << (4 * p)
    return word.to(torch.int64).where(word < 2**31, word - 2**32).int().movedim(-1, dim)


def gptq(src: Path, dst: Path, group: int = 64, sym: bool = True, desc_act: bool = False, bits: int = 4) -> Path:
    cfg = _copy(src, dst)
    state = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for prefix in _linears(state):
        w = state.pop(f"{prefix}.weight")
        n, k = w.shape
        g_idx = torch.arange(k) // group
        if desc_act:  # rows assigned to groups in a shuffled order, as act-order GPTQ leaves them
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        order = torch.argsort(g_idx, stable=True)
        q_sorted, zero, scale = _int4_groups(w[:, order], group, sym)
        q = torch.empty_like(q_sorted)
        q[:, order] = q_sorted
        state[f"{prefix}.qweight"] = _pack(q.t(), 0)  # [K / 8, N]
        state[f"{prefix}.qzeros"] = _pack((zero - 1).t(), 1)  # [G, N / 8], v1: zero - 1
        state[f"{prefix}.scales"] = scale.t().contiguous()  # [G, N]
        state[f"{prefix}.g_idx"] = g_idx.int()
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
          "checkpoint_format": "gptq"}
    return _save(dst, cfg, state, qc)


def gptq_reference(folder: Path, prefix: str) -> torch.Tensor:
    """w[n, k] = scales[g_idx[k], n] * (q[k, n] - (qzeros[g_idx[k], n] + 1)), read bit by bit."""
    s = load_file(str(folder / "model.safetensors"))
    qw, qz, sc, gi = (s[f"{prefix}.{x}"] for x in ("qweight", "qzeros", "scales", "g_idx"))
    k, n = qw.shape[0] * 8, qw.shape[1]
    q = torch.stack([(qw >> (4 * j)) & 15 for j in range(8)], 1).reshape(k, n)
    z = torch.stack([(qz >> (4 * j)) & 15 for j in range(8)], 2).reshape(qz.shape[0], n) + 1
    gi = gi.long()
    return ((q - z[gi]).float() * sc.float()[gi]).t()


def awq(src: Path, dst: Path, group: int = 64) -> Path:
    cfg = _copy(src, dst)
    state = load_file(str(src / "model.safetensors"))
    forward = [AWQ_REVERSE.index(i) for i in range(8)]  # the packing order whose unpacking is AWQ_REVERSE
    for prefix in _linears(state):
        w = state.pop(f"{prefix}.weight")
        q, zero, scale = _int4_groups(w, group, sym=False)
        state[f"{prefix}.qweight"] = _pack(q.t(), 1, forward)  # [K, N / 8]
        state[f"{prefix}.qzeros"] = _pack(zero.t(), 1, forward)  # [G, N / 8]
        state[f"{prefix}.scales"] = scale.t().contiguous()  # [G, N]
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return _save(dst, cfg, state, qc)


def awq_reference(folder: Path, prefix: str) -> torch.Tensor:
    """AutoAWQ's unpacking: nibbles at shifts 0, 4, ..., 28, then columns reordered by AWQ_REVERSE."""
    s = load_file(str(folder / "model.safetensors"))
    qw, qz, sc = (s[f"{prefix}.{x}"] for x in ("qweight", "qzeros", "scales"))

    def unpack(t):
        v = torch.stack([(t >> (4 * j)) & 15 for j in range(8)], -1)  # [R, C/8, 8]
        return v[..., AWQ_REVERSE].reshape(t.shape[0], -1)
    q, z = unpack(qw), unpack(qz)
    group = q.shape[0] // z.shape[0]
    return ((q - z.repeat_interleave(group, 0)).float() * sc.float().repeat_interleave(group, 0)).t()
