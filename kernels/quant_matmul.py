"""Weight-only int8 / int4 quantised linear layers: quantise-on-load from float weights, a Triton matmul
that dequantises weight tiles in the loop (split-K for skinny decode shapes, one pass over K for large M),
the PyTorch references, and `QuantLinear` / `quantize_model`, a module swap in the style of gpt-fast.

The formats (int8, w8a8, int4) and their quantise / dequantise functions: kernels/quant_formats.py.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.launch import HAVE_TRITON, dot_precision, kernel, require_triton, sm_count, tl
from kernels.quant_formats import (  # noqa: F401 - the formats' functions, re-exported where they always were
    INT4_GROUPS,
    dequantize_int4,
    dequantize_int8,
    pack_zero,
    quantize_act_q8,
    quantize_act_token,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    unpack_zero,
)

W4A8_GROUPS = (64, 128)  # the groups kernels/cpu_kernels.c's int4 GEMV (w4a8) takes


# ----------------------------------------------------------------------------------------------------------
# Triton matmul: out[m, n] = sum_k x[m, k] * dequant(w)[n, k]


@kernel
def _wq_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr,
    M, N, K, k_per_split, zero_offset,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_os, stride_om,
    HAS_ZERO: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if BITS == 8:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_hi
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                        other=0)
            if GROUP > 1:  # a scale per GROUP weights (GGUF Q8_0): the tile dequantised here
                s = tl.load(scale_ptr + offs_n[None, :] * stride_sn + (offs_k // GROUP)[:, None],
                            mask=n_ok[None, :] & k_ok[:, None], other=0.0).to(tl.float32)
                w = w.to(tl.float32) * s
            if F32_DOT:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            else:
                w = w.to(x.dtype)
            acc += tl.dot(x, w, input_precision=DOT_PREC)
        else:
            # int4: bytes hold (even k, odd k); dot the low nibbles with even x columns, high with odd
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            offs_even = 2 * offs_b
            b_ok = offs_even < k_hi
            wb = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_b[:, None], mask=n_ok[None, :] & b_ok[:, None],
                         other=0)
            grp = offs_even // GROUP
            sm = n_ok[None, :] & b_ok[:, None]
            s = tl.load(scale_ptr + offs_n[None, :] * stride_sn + grp[:, None], mask=sm, other=0.0).to(tl.float32)
            if HAS_ZERO:  # packed two per byte (even groups in the low nibble), + zero_offset
                zb = tl.load(zero_ptr + offs_n[None, :] * stride_zn + (grp // 2)[:, None], mask=sm, other=0)
                z = ((zb.to(tl.int32) >> ((grp % 2) * 4)[:, None]) & 0xF).to(tl.float32) + zero_offset
            else:
                z = 8.0
            w_lo = ((wb & 0xF).to(tl.float32) - z) * s
            w_hi = ((wb >> 4).to(tl.float32) - z) * s
            xm = m_ok[:, None] & b_ok[None, :]
            x_even = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_even[None, :], mask=xm, other=0.0)
            x_odd = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_even[None, :] + 1, mask=xm, other=0.0)
            if F32_DOT:
                x_even = x_even.to(tl.float32)
                x_odd = x_odd.to(tl.float32)
            else:
                w_lo = w_lo.to(x_even.dtype)
                w_hi = w_hi.to(x_even.dtype)
            acc += tl.dot(x_even, w_lo, input_precision=DOT_PREC)
            acc += tl.dot(x_odd, w_hi, input_precision=DOT_PREC)
    if BITS == 8 and GROUP == 1:
        acc = acc * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch_config(m: int, n: int, k: int, bits: int, group: int, on_cuda: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, split_k): skinny M splits K to fill the SMs; large M takes bigger tiles."""
    if not on_cuda:  # interpreter: few, large tiles
        block_k = 64 if bits == 8 else max(64, group)
        return 16, 32, block_k, 2 if k >= 4 * block_k else 1
    if m <= 16:
        block_m, block_n, block_k = 16, 64, 256 if bits == 8 else 128
        sms = sm_count(torch.cuda.current_device())
        tiles = -(-n // block_n)
        split = max(1, min(k // (4 * block_k), -(-2 * sms // tiles)))
        return block_m, block_n, block_k, split
    if m <= 64:
        return 64, 64, 64, 1
    return 128, 128, 64, 1


def wq_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None, *,
              split_k: int | None = None, zero_offset: int = 0) -> torch.Tensor:
    """x [M, K] @ dequant(w).T -> [M, N] in x's dtype (Triton; interpreter on CPU tensors).

    int8 when w is int8 [N, K] (scale [N], or [N, K / group] with a group of at least 16, e.g. Q8_0's 32);
    int4 when w is packed uint8 [N, K/2] (scale [N, K/group]; zero packed by `pack_zero`, uint8
    [N, ceil(G/2)] + zero_offset, or None for 8).
    """
    require_triton()
    bits = 8 if w.dtype == torch.int8 else 4
    m, k = x.shape
    n = w.shape[0]
    group = k // scale.shape[1] if scale.dim() == 2 else 0
    x = x.contiguous()
    on_cuda = x.is_cuda
    bm, bn, bk, split = _launch_config(m, n, k, bits, group, on_cuda)
    split = split if split_k is None else split_k
    per_split = -(-k // split)
    k_per_split = -(-per_split // bk) * bk  # whole BLOCK_K tiles per split (even, so nibbles pair up)
    split = -(-k // k_per_split)
    if split > 1:
        out = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((1, m, n), dtype=x.dtype, device=x.device)
    f32 = not on_cuda
    _wq_matmul_kernel[(-(-m // bm), -(-n // bn), split)](
        x, w, scale, zero if zero is not None else scale, out, m, n, k, k_per_split, zero_offset,
        x.stride(0), w.stride(0), scale.stride(0), zero.stride(0) if zero is not None else 0, out.stride(0),
        out.stride(1), HAS_ZERO=zero is not None, BITS=bits, GROUP=max(group, 1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, F32_DOT=f32,
        DOT_PREC=dot_precision(x.dtype, on_cuda), on_cuda=on_cuda, num_warps=8 if bm * bn >= 128 * 128 else 4,
    )
    return out.sum(0).to(x.dtype) if split > 1 else out[0]


def wq_matmul_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None, *,
                  split_k: int | None = None, zero_offset: int = 0) -> torch.Tensor:
    """PyTorch reference of `wq_matmul`: dequantise the whole weight in float32, then one matmul."""
    if w.dtype == torch.int8:
        wf = dequantize_int8(w, scale)
    else:
        wf = dequantize_int4(w, scale, unpack_zero(zero, scale.shape[1], zero_offset, rows=w.shape[0]))
    return (x.float() @ wf.T).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# module swap


def _cpu_int4_pack(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """Our int4 format -> torch's CPU packed format (w = (q - 8) * s + z' with z' = (8 - zero) * s)."""
    q = unpack_int4(packed).to(torch.int32)
    wp = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    s = scale.float()
    sz = torch.stack([s, (8.0 - zero.float()) * s], dim=-1).transpose(0, 1).contiguous()  # [K/group, N, 2]
    return wp, sz


def _has_cpu_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def cpu_packed_op_fits(mode: str, out_features: int, in_features: int) -> bool:
    """Whether torch's CPU packed op serves this layer's shape (measured on torch 2.13, see the tests).

    `_weight_int8pack_mm` reads K in blocks of 16 with no tail check: with K % 16 != 0 it returns garbage
    or segfaults for M > 1 (K = 136, the tiny test models' intermediate size, crashed the engine).
    `_convert_weight_to_int4pack_for_cpu` refuses N % 16 != 0. Other shapes take the reference.
    """
    if mode == "int8":
        return in_features % 16 == 0 and _has_cpu_op("_weight_int8pack_mm")
    return (out_features % 16 == 0 and _has_cpu_op("_weight_int4pack_mm_for_cpu")
            and _has_cpu_op("_convert_weight_to_int4pack_for_cpu"))


# up to this many rows take kernels/cpu_kernels.c's int8 path (float32 activations, exact to float rounding
# against the dequantised weight: the AVX2 GEMV up to 12 rows, the weight widened once for the MKL SGEMM from
# 13; bench/gemv_cpu.py compares it with the packed op per shape); more rows the packed op
CPU_KERNEL_MAX_ROWS = 1024


class QuantLinear(nn.Module):
    """Weight-only int8/int4 replacement for nn.Linear (same in/out features, same bias).

    CUDA: the Triton kernel (w8a8: CPU only). CPU, at up to `CPU_KERNEL_MAX_ROWS` rows, the AVX2 kernels of
    kernels/cpu_kernels.c: int8 with float32 activations; w8a8, and int4 in groups of 64 or 128, with the
    activations quantised per 32 (`quantize_act_q8`); else torch's packed ops (`_weight_int8pack_mm`,
    `_weight_int4pack_mm_for_cpu`) fed bf16 activations, their fast path, where the build has them and the
    shape fits (`cpu_packed_op_fits`); else the reference. int8 with a scale per 32 weights (`int8_group`,
    GGUF Q8_0) or per-token int8 activations (`act_quant`, compressed-tensors W8A8) take the C kernels at every
    row count (no packed op takes block scales; bf16 would round the quantised activations), else the reference.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, mode: str, group_size: int = 64,
                 device: torch.device | str | None = None, bias_dtype: torch.dtype = torch.float32,
                 int8_group: int = 0):
        super().__init__()
        if mode not in ("int8", "int4", "w8a8"):
            raise ValueError(f"quantization mode must be 'int8', 'int4' or 'w8a8', got {mode!r}")
        if mode == "w8a8" and in_features % 32:
            raise ValueError(f"w8a8 needs in_features divisible by 32, got {in_features}")
        if int8_group and (mode == "int4" or int8_group != 32 or in_features % 32):
            raise ValueError(f"grouped int8 scales come in blocks of 32 of in_features, got {int8_group} for "
                             f"{in_features} ({mode})")
        self.in_features, self.out_features, self.mode, self.group_size = in_features, out_features, mode, group_size
        # int8 / w8a8: 0 = a scale per output channel; 32 = a scale per 32 weights of a row (GGUF Q8_0)
        self.int8_group = int8_group
        # int8: "token" quantises each activation row to int8 first (compressed-tensors W8A8's dynamic per-token
        # input activations, `quantize_act_token`); None keeps the activations float
        self.act_quant: str | None = None
        if mode in ("int8", "w8a8"):
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
            # a scale per channel float32; per 32 weights float16, as GGUF Q8_0 stores it (every path reads that)
            shape = (out_features, in_features // int8_group) if int8_group else (out_features,)
            self.register_buffer("scale", torch.ones(shape, dtype=torch.float16 if int8_group else torch.float32,
                                                     device=device))
            self.zero = None
        else:
            groups = in_features // group_size
            self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
            self.register_buffer("scale", torch.ones(out_features, groups, dtype=torch.float16, device=device))
            # packed two per byte, + zero_offset (`set_zero_points`); None: 8 everywhere (symmetric), none stored
            self.register_buffer("zero", None)
        self.zero_offset = 0
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device),
                                 requires_grad=False) if bias else None
        self._cpu_cache: tuple | None = None
        # act-order checkpoints (GPTQ desc_act): the weight's in_features stored sorted by group; the
        # activations are gathered in that order first (an index [K]); None: the natural order
        self.register_buffer("input_perm", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str, group_size: int = 64) -> QuantLinear:
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, mode, group_size,
                device=w.device, bias_dtype=w.dtype)
        if mode in ("int8", "w8a8"):
            q, s = quantize_int8(w)
            m.weight.copy_(q)
            m.scale.copy_(s)
        else:
            packed, s, z = quantize_int4(w, group_size)
            m.weight.copy_(packed)
            m.scale.copy_(s)
            m.set_zero_points(z)
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias.detach())
        return m

    def set_zero_points(self, zero: torch.Tensor | None, offset: int = 0, packed: bool = False) -> None:
        """int4: the zero points [N, G] (each offset .. offset + 15), stored packed two per byte (None where all are
        8); `packed`: `zero` already is (nibbles [N, ceil(G/2)])."""
        if not packed:
            zero = None if zero is None else pack_zero(zero.cpu(), offset)
        dev = self.weight.device if self.weight.device.type != "meta" else None
        self.zero = None if zero is None else (zero.to(dev) if dev is not None else zero)
        self.zero_offset = offset if zero is not None else 0

    def zero_points(self) -> torch.Tensor:
        """int4: the zero points one byte per group [N, G], unpacked."""
        return unpack_zero(self.zero, self.scale.shape[1], self.zero_offset, rows=self.out_features).to(
            self.scale.device)

    def dequantized_weight(self) -> torch.Tensor:
        """The float weight [N, K] in the input's order (an input_perm undone)."""
        if self.mode in ("int8", "w8a8"):
            w = dequantize_int8(self.weight, self.scale)
        else:
            w = dequantize_int4(self.weight, self.scale, self.zero_points())
        if self.input_perm is not None:
            w = w[:, torch.argsort(self.input_perm)]
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.input_perm is not None:
            x2 = x2.index_select(1, self.input_perm)
        if self.act_quant == "token":  # the activations as the checkpoint's config quantises them, exactly
            xq, xs = quantize_act_token(x2)
            x2 = xq.float() * xs[:, None]
        if self.mode == "w8a8":
            if x2.is_cuda:
                raise ValueError("w8a8 quantization runs on the CPU; use int8 on CUDA")
            y = self._w8a8(x2)
        elif x2.is_cuda and HAVE_TRITON:
            y = wq_matmul(x2, self.weight, self.scale, self.zero, zero_offset=self.zero_offset)
        else:
            y = self._cpu_forward(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        from kernels import cpu_kernels

        fn = cpu_kernels.linear_w8a8 if cpu_kernels.available() else cpu_kernels.linear_w8a8_ref
        if x.shape[0] <= CPU_KERNEL_MAX_ROWS:
            return fn(x.float(), self.weight, self.scale).to(x.dtype)
        out = [fn(x[i:i + CPU_KERNEL_MAX_ROWS].float(), self.weight, self.scale)
               for i in range(0, x.shape[0], CPU_KERNEL_MAX_ROWS)]
        return torch.cat(out).to(x.dtype) if out else x.new_empty((0, self.out_features))

    def _cpu_forward(self, x: torch.Tensor) -> torch.Tensor:
        exact = self.int8_group or self.act_quant  # no packed op takes group scales; bf16 would round x
        if self.mode == "int8" and (exact or (x.shape[0] <= CPU_KERNEL_MAX_ROWS and x.dtype == torch.float32)):
            from kernels import cpu_kernels

            if cpu_kernels.available():  # (then at any row count)
                return cpu_kernels.linear_int8(x.float(), self.weight, self.scale).to(x.dtype)
        if exact:
            return wq_matmul_ref(x, self.weight, self.scale)
        if (self.mode == "int4" and self.group_size in W4A8_GROUPS and x.shape[0] <= CPU_KERNEL_MAX_ROWS
                and x.dtype == torch.float32):
            from kernels import cpu_kernels

            if cpu_kernels.available():  # activations quantised per 32 (as w8a8): 2-3x the packed op at 1-4 rows
                return cpu_kernels.linear_w4a8(x, self.weight, self.scale, self.zero, self.group_size,
                                               zero_offset=self.zero_offset)
        if not cpu_packed_op_fits(self.mode, self.out_features, self.in_features):
            return wq_matmul_ref(x, self.weight, self.scale, self.zero, zero_offset=self.zero_offset)
        # bf16 activations are the packed ops' fast path (fp32 ~7x, int4 fp32/fp16 ~13x slower on this CPU);
        # the ops also insist on a contiguous last dimension, which a strided bf16 input would not have
        xb = x.to(torch.bfloat16).contiguous()
        if self.mode == "int8":
            if self._cpu_cache is None:
                self._cpu_cache = (self.scale.to(torch.bfloat16),)
            return torch.ops.aten._weight_int8pack_mm(xb, self.weight, self._cpu_cache[0]).to(x.dtype)
        if self._cpu_cache is None:
            wp, sz = _cpu_int4_pack(self.weight, self.scale, self.zero_points())
            self._cpu_cache = (wp, sz.to(torch.bfloat16))
        wp, sz = self._cpu_cache
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, wp, self.group_size, sz).to(x.dtype)

    def _apply(self, fn, recurse=True):
        self._cpu_cache = None  # device/dtype moves invalidate the CPU packing
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.mode == "int4" else (
            f", scale per {self.int8_group}" if self.int8_group else "")
        g += ", activations int8 per token" if self.act_quant == "token" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}{g}"


class Bf16Linear(nn.Module):
    """bfloat16 weights with bfloat16 activations in place of an nn.Linear (`quantization = "bf16"`, llama.cpp's
    BF16 numerics): the weight rounded to bfloat16 and kept once, packed in pair panels
    (`cpu_kernels.pack_bf16_pairs`, 2 bytes a weight); each input rounded to bfloat16; every product exact and
    the sums float32, the output float32. On the CPU `cpu_kernels.linear_bf16` (vdpbf16ps where the CPU has
    AVX512-BF16: at 32 rows 2x the float32 tiles on a Zen 4 core), elsewhere its reference (the same products,
    summed by torch)."""

    mode = "bf16"

    def __init__(self, packed: torch.Tensor, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", packed)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Module) -> Bf16Linear:
        from kernels.cpu_kernels import pack_bf16_pairs

        w = linear.weight.detach()
        packed = pack_bf16_pairs(w.cpu()).to(w.device)
        return cls(packed, linear.in_features, linear.out_features, linear.bias)

    @property
    def weight(self) -> torch.Tensor:
        """The bfloat16 weight [N, K] widened to float32 (a copy, for whatever reads an nn.Linear's weight)."""
        from kernels.cpu_kernels import unpack_bf16_pairs

        return unpack_bf16_pairs(self.packed, self.out_features, self.in_features).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kernels import cpu_kernels

        x2 = x.reshape(-1, self.in_features)
        fn = cpu_kernels.linear_bf16 if self.packed.device.type == "cpu" else cpu_kernels.linear_bf16_ref
        y = fn(x2.float(), self.packed, self.out_features, self.bias)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode=bf16 (bf16 activations)"


def quantize_model(model: nn.Module, mode: str, group_size: int = 64,
                   skip: tuple[str, ...] | None = None) -> nn.Module:
    """Swap every nn.Linear whose qualified name contains none of `skip` for a QuantLinear, in place.

    `skip` defaults to the head and the embeddings for int8/int4 and to the embeddings for w8a8, which
    quantises the head as q8_0 does (a tied head gets its own int8 copy; the embedding table stays float), and
    for bf16 (`Bf16Linear`: bfloat16 weights and activations, as llama.cpp's BF16 files run; the head too).
    mode "none" returns the model untouched. Layers whose in_features the int4 group (w8a8: 32) does not
    divide stay in float (and are counted in the returned model's `quantized_layers` attribute as skipped).
    """
    if mode == "none":
        return model
    if mode not in ("int8", "int4", "w8a8", "bf16"):
        raise ValueError(f"quantization must be 'none', 'int8', 'int4', 'w8a8' or 'bf16', got {mode!r}")
    if skip is None:
        skip = ("embed",) if mode in ("w8a8", "bf16") else ("lm_head", "embed")
    swapped, kept = 0, []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not isinstance(child, nn.Linear) or any(s in full for s in skip):
                continue
            if (mode == "int4" and child.in_features % group_size) or (mode == "w8a8" and child.in_features % 32):
                kept.append(full)
                continue
            setattr(module, child_name, Bf16Linear.from_linear(child) if mode == "bf16"
                    else QuantLinear.from_linear(child, mode, group_size))
            swapped += 1
    model.quantized_layers = {"mode": mode, "swapped": swapped, "kept_float": kept}
    return model
