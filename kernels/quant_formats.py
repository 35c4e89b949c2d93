"""The quantised weight and activation formats of tandem's int8 / w8a8 / int4 layers and their PyTorch
quantise / dequantise functions, which the Triton matmul (kernels/quant_matmul.py) and the C kernels'
references (kernels/cpu_kernels.py) both use.

Formats (weights are nn.Linear's [N, K]):
- int8: w ~= q[n, k] * scale[n]; q int8 in [-127, 127], scale float32 [N] (symmetric, per output channel);
  or grouped (GGUF Q8_0's blocks): w ~= q[n, k] * scale[n, k // 32], scale float32 [N, K / 32].
- int8 with per-token activations (compressed-tensors W8A8): int8's weights; each activation row quantised to
  int8 by `quantize_act_token` (scale = amax / 127.5, the library's rounding) before the matmul.
- w8a8 (CPU): int8's weights, and the activations quantised at run time per block of 32 values
  (`quantize_act_q8`, llama.cpp's q8_0 rounding), so the dots are integer dots; the head is quantised too.
- int4: w ~= (q[n, k] - zero[n, g]) * scale[n, g], g = k // group; q in [0, 15] packed two per byte
  (even k in the low nibble, odd k in the high one) as uint8 [N, K/2]; scale float16 (or a checkpoint's
  bfloat16 / float32) [N, K/group]; zero per group of 32, 64 or 128 (or K). `quantize_int4` returns the zeros
  one byte per group; the kernels and QuantLinear take them packed (`pack_zero`): two nibbles per byte, uint8
  [N, ceil(G/2)] (even g low), zero = nibble + an offset of 0 or 1 (GPTQ v1 stores zero - 1: its nibbles
  as they are, with offset 1), or None where every zero is 8 (symmetric: nothing stored).
"""

from __future__ import annotations

import torch

INT4_GROUPS = (32, 64, 128)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weight [N, K] -> (int8 [N, K], float32 scale [N])."""
    w = w.detach().float()
    scale = w.abs().amax(1).clamp_min(1e-8) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_act_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w8a8's activations: x [M, K] (K % 32 == 0) -> (int8 [M, K], float32 scale [M, K / 32]), per block of 32
    d = amax / 127 and q = round-half-even(x * (1 / d)) (0 where d is 0): llama.cpp's q8_0 rounding, and
    bit for bit what kernels/cpu_kernels.c quantises."""
    m, k = x.shape
    if k % 32:
        raise ValueError(f"w8a8 needs in_features divisible by 32, got {k}")
    g = x.detach().float().reshape(m, k // 32, 32)
    d = g.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    q = torch.round(g * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(m, k), d


def quantize_act_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per row, as compressed-tensors quantises a W8A8 checkpoint's input activations:
    x [M, K] -> (int8 [M, K], float32 scale [M]) with scale = amax / 127.5 (its bit range 255 over 2; float32's
    eps where a row is all zeros) and q = clamp(round-half-even(x / scale), -128, 127)."""
    xf = x.detach().float()
    scale = xf.abs().amax(-1) / 127.5
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    q = torch.round(xf / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per channel (scale [N]) or per group (scale [N, K / group])."""
    if scale.dim() == 1:
        return q.float() * scale.float()[:, None]
    n, k = q.shape
    return (q.float().view(n, scale.shape[1], -1) * scale.float()[..., None]).view(n, k)


def quantize_int4(w: torch.Tensor, group: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weight [N, K] -> (packed uint8 [N, K/2], float16 scale [N, K/group], uint8 zero [N, K/group])."""
    if group not in INT4_GROUPS:
        raise ValueError(f"int4 group size must be one of {INT4_GROUPS}, got {group}")
    n, k = w.shape
    if k % group:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group}")
    g = w.detach().float().reshape(n, k // group, group)
    lo = g.amin(-1).clamp_max(0.0)  # keep 0 representable so zero rows stay exact
    hi = g.amax(-1).clamp_min(0.0)
    scale = ((hi - lo).clamp_min(1e-6) / 15.0).half().float()  # round the scale first: q uses what is stored
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scale.half(), zero.to(torch.uint8)


def pack_zero(zero: torch.Tensor, offset: int = 0) -> torch.Tensor | None:
    """Zero points [N, G] (each `offset` .. `offset` + 15) -> uint8 [N, ceil(G/2)] nibbles of zero - offset (even
    g in the low nibble); None where every zero is 8 (the kernels' default: nothing stored)."""
    z = zero.to(torch.int16) - offset
    if bool((z < 0).any()) or bool((z > 15).any()):
        raise ValueError(f"int4 zero points must lie in {offset}..{offset + 15}")
    if bool((z + offset == 8).all()):
        return None
    if z.shape[1] % 2:
        z = torch.cat([z, torch.zeros_like(z[:, :1])], 1)
    z = z.to(torch.uint8)
    return (z[:, 0::2] | (z[:, 1::2] << 4)).contiguous()


def unpack_zero(zero: torch.Tensor | None, groups: int, offset: int = 0, rows: int | None = None) -> torch.Tensor:
    """`pack_zero`'s inverse: uint8 [N, G] (None: 8 everywhere, `rows` of them)."""
    if zero is None:
        return torch.full((rows, groups), 8, dtype=torch.uint8)
    out = torch.empty(zero.shape[0], zero.shape[1] * 2, dtype=torch.uint8, device=zero.device)
    out[:, 0::2] = zero & 0xF
    out[:, 1::2] = zero >> 4
    return out[:, :groups] + offset


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] of values 0..15 (low nibble = even k)."""
    n, half = packed.shape
    out = torch.empty(n, half * 2, dtype=torch.uint8, device=packed.device)
    out[:, 0::2] = packed & 0xF
    out[:, 1::2] = packed >> 4
    return out


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """zero: one byte per group [N, G] (None: 8)."""
    if zero is None:
        zero = torch.full(scale.shape, 8, dtype=torch.uint8, device=scale.device)
    q = unpack_int4(packed).float()
    n, k = q.shape
    group = k // scale.shape[1]
    q = q.view(n, k // group, group)
    return ((q - zero.float()[..., None]) * scale.float()[..., None]).view(n, k)
