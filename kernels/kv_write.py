"""KV write: scatter new K/V rows into the paged pool by slot mapping, fused with RoPE (rotate_half) and
optional quantisation (int8 with per token-head scales, fp8 e4m3 with a per-tensor scale, clamped to
+-448); `write_kv_ref` is the PyTorch reference with the same signature.

Slot `s` means page `s // block_size`, row `s % block_size` of k_cache/v_cache [num_blocks, block_size,
Hkv, D]; a negative slot skips the token (padding). int8 rounds half away from zero (floor(x/s + 0.5)) so
the kernel and the reference agree bit for bit.
"""

from __future__ import annotations

import torch

from kernels.launch import kernel, next_pow2, require_triton, tl
from kernels.paged_attention import KV_FP8, KV_INT8, KV_NONE, kv_quant_mode, kv_scale_args

FP8_MAX = 448.0
INT8_EPS = 1e-6  # smallest amax used for a scale, so an all-zero row stores zeros instead of NaN


@kernel
def _kv_write_kernel(
    k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache, v_cache, k_scale, v_scale, q_ptr, q_out_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_sb, stride_ss,
    stride_qt, stride_qh, stride_qot, stride_qoh,
    num_kv_heads, num_q_heads, head_dim, half,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_D: tl.constexpr,
    ROPE: tl.constexpr, QUANT: tl.constexpr, HAS_Q: tl.constexpr,
):
    t = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    # rotate_half: out[d] = x[d] cos[d] - x[d+half] sin[d] (d < half); x[d] cos[d] + x[d-half] sin[d] (else)
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
    sign = tl.where(offs_d < half, -1.0, 1.0)
    if ROPE:
        cos = tl.load(cos_ptr + t * stride_ct + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * stride_st + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    if HAS_Q:
        offs_qh = tl.arange(0, BLOCK_QH)
        qm = (offs_qh < num_q_heads)[:, None] & d_ok[None, :]
        qrow = q_ptr + t * stride_qt + offs_qh[:, None] * stride_qh
        x = tl.load(qrow + offs_d[None, :], mask=qm, other=0.0).to(tl.float32)
        xp = tl.load(qrow + partner[None, :], mask=qm, other=0.0).to(tl.float32)
        xr = x * cos[None, :] + (xp * sign[None, :]) * sin[None, :]
        tl.store(q_out_ptr + t * stride_qot + offs_qh[:, None] * stride_qoh + offs_d[None, :],
                 xr.to(q_out_ptr.dtype.element_ty), mask=qm)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE
        row = slot % PAGE
        offs_h = tl.arange(0, BLOCK_H)
        h_ok = offs_h < num_kv_heads
        m = h_ok[:, None] & d_ok[None, :]
        krow = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh
        k = tl.load(krow + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
        if ROPE:
            kp = tl.load(krow + partner[None, :], mask=m, other=0.0).to(tl.float32)
            k = k * cos[None, :] + (kp * sign[None, :]) * sin[None, :]
        v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=m,
                    other=0.0).to(tl.float32)
        kdst = k_cache + page * stride_kcb + row * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
        vdst = v_cache + page * stride_vcb + row * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
        if QUANT == 1:
            # int8, one scale per token and head; div_rn keeps the division IEEE-exact on the GPU too
            k_amax = tl.maximum(tl.max(tl.where(m, tl.abs(k), 0.0), 1), 1e-6)
            v_amax = tl.maximum(tl.max(tl.where(m, tl.abs(v), 0.0), 1), 1e-6)
            ks = tl.math.div_rn(k_amax, tl.full([BLOCK_H], 127.0, tl.float32))
            vs = tl.math.div_rn(v_amax, tl.full([BLOCK_H], 127.0, tl.float32))
            kq = tl.floor(tl.math.div_rn(k, tl.broadcast_to(ks[:, None], (BLOCK_H, BLOCK_D))) + 0.5)
            vq = tl.floor(tl.math.div_rn(v, tl.broadcast_to(vs[:, None], (BLOCK_H, BLOCK_D))) + 0.5)
            kq = tl.minimum(tl.maximum(kq, -127.0), 127.0)
            vq = tl.minimum(tl.maximum(vq, -127.0), 127.0)
            tl.store(kdst, kq.to(tl.int8), mask=m)
            tl.store(vdst, vq.to(tl.int8), mask=m)
            tl.store(k_scale + page * stride_sb + row * stride_ss + offs_h, ks, mask=h_ok)
            tl.store(v_scale + page * stride_sb + row * stride_ss + offs_h, vs, mask=h_ok)
        elif QUANT == 2:
            kinv = tl.load(k_scale)
            vinv = tl.load(v_scale)
            kf = tl.math.div_rn(k, tl.full([BLOCK_H, BLOCK_D], 1.0, tl.float32) * kinv)
            vf = tl.math.div_rn(v, tl.full([BLOCK_H, BLOCK_D], 1.0, tl.float32) * vinv)
            kf = tl.minimum(tl.maximum(kf, -448.0), 448.0)
            vf = tl.minimum(tl.maximum(vf, -448.0), 448.0)
            tl.store(kdst, kf.to(k_cache.dtype.element_ty), mask=m)
            tl.store(vdst, vf.to(v_cache.dtype.element_ty), mask=m)
        else:
            tl.store(kdst, k.to(k_cache.dtype.element_ty), mask=m)
            tl.store(vdst, v.to(v_cache.dtype.element_ty), mask=m)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
             q: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Write k, v [T, Hkv, D] into the caches in place (Triton; the interpreter on CPU tensors).

    With cos/sin [T, D], RoPE is applied to k before the write, and to q [T, Hq, D] when given (returned as a
    new tensor; None otherwise). int8 caches fill k_scale/v_scale [num_blocks, block_size, Hkv]; fp8 caches
    divide by the per-tensor scales (1-element tensors, default 1.0).
    """
    require_triton()
    t, hkv, d = k.shape
    mode = kv_quant_mode(k_cache)
    k_scale, v_scale = kv_scale_args(mode, k_scale, v_scale, k.device)
    rope = cos is not None
    if q is not None and not rope:
        raise ValueError("q is only rotated here; pass cos/sin with it")
    q_out = torch.empty_like(q) if q is not None else None
    if t == 0:
        return q_out
    on_cuda = k.is_cuda
    dummy = k  # stands in for absent pointers; the kernel never reads them
    cs = cos.stride(0) if rope else 0
    ss = sin.stride(0) if rope else 0
    qx = q if q is not None else dummy
    qo = q_out if q_out is not None else dummy
    sc = k_scale.stride() if mode == KV_INT8 else (0, 0, 0)
    _kv_write_kernel[(t,)](
        k, v, cos if rope else dummy, sin if rope else dummy, slot_mapping, k_cache, v_cache, k_scale, v_scale,
        qx, qo,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cs, ss,
        *k_cache.stride()[:3], *v_cache.stride()[:3], sc[0], sc[1],
        qx.stride(0), qx.stride(1), qo.stride(0), qo.stride(1),
        hkv, q.shape[1] if q is not None else 0, d, d // 2,
        PAGE=k_cache.shape[1], BLOCK_H=next_pow2(hkv), BLOCK_QH=next_pow2(q.shape[1]) if q is not None else 1,
        BLOCK_D=next_pow2(d), ROPE=rope, QUANT=mode, HAS_Q=q is not None, on_cuda=on_cuda,
    )
    return q_out


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] float32, cos/sin [T, D]: the HF Llama convention, in the kernel's operation order."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.float()[:, None, :] + rotated * sin.float()[:, None, :]


def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (int8 [..., D], float32 scale [...]) with scale = max(amax, eps) / 127."""
    x = x.float()
    scale = x.abs().amax(-1).clamp_min(INT8_EPS) / 127.0
    q = torch.floor(x / scale[..., None] + 0.5).clamp(-127, 127).to(torch.int8)
    return q, scale


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, *, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                 q: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """PyTorch reference of `write_kv` (same arguments, same in-place effect)."""
    mode = kv_quant_mode(k_cache)
    k32 = k.float()
    q_out = None
    if cos is not None:
        k32 = rotate_half_rope(k32, cos, sin)
        if q is not None:
            q_out = rotate_half_rope(q.float(), cos, sin).to(q.dtype)
    v32 = v.float()
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k32, v32 = k32[keep], v32[keep]
    page_size = k_cache.shape[1]
    pages, rows = slots // page_size, slots % page_size
    if mode == KV_INT8:
        kq, ks = quantize_kv_int8(k32)
        vq, vs = quantize_kv_int8(v32)
        k_cache[pages, rows], v_cache[pages, rows] = kq, vq
        k_scale[pages, rows], v_scale[pages, rows] = ks, vs
    elif mode == KV_FP8:
        kinv = k_scale.float().reshape(()) if k_scale is not None else 1.0
        vinv = v_scale.float().reshape(()) if v_scale is not None else 1.0
        k_cache[pages, rows] = (k32 / kinv).clamp(-FP8_MAX, FP8_MAX).to(k_cache.dtype)
        v_cache[pages, rows] = (v32 / vinv).clamp(-FP8_MAX, FP8_MAX).to(v_cache.dtype)
    else:
        assert mode == KV_NONE
        k_cache[pages, rows] = k32.to(k_cache.dtype)
        v_cache[pages, rows] = v32.to(v_cache.dtype)
    return q_out
