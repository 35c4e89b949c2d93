"""Paged attention over a block-table KV pool: one Triton kernel for prefill, chunked prefill over a cached
prefix, decode and speculative verify, with GQA packing, split-KV + log-sum-exp merge and int8/fp8 KV
dequantisation in the kernel; `paged_attention_ref` is the PyTorch reference with the same signature.

Layout (per layer): k_cache, v_cache [num_blocks, block_size, Hkv, D]; token `j` of sequence `b` lives at
page `block_tables[b, j // block_size]`, row `j % block_size`. Queries are one flattened varlen batch
q [T, Hq, D] with `query_start_loc` [B+1]; `context_lens` [B] counts every key of a sequence including the
new tokens, so query `i` of a sequence with `n` new tokens sits at position `context_len - n + i`.
KV quantisation follows the cache dtype: int8 takes per token-head scales k_scale/v_scale
[num_blocks, block_size, Hkv] (float32); float8_e4m3fn takes per-tensor scales (1-element float32 tensors).
`window` (a sliding window: query at position i sees keys i - window < j <= i, and the kernel reads only the
tiles a window reaches) and `softcap` (scores tanh-capped as c * tanh(s / c) before the mask, Gemma 2) follow
transformers' eager attention.
"""

from __future__ import annotations

import math

import torch

from kernels.launch import dot_precision, kernel, next_pow2, require_triton, sm_count, tl

KV_NONE, KV_INT8, KV_FP8 = 0, 1, 2
_LOG2E = 1.4426950408889634


def kv_quant_mode(cache: torch.Tensor) -> int:
    if cache.dtype == torch.int8:
        return KV_INT8
    if cache.dtype == torch.float8_e4m3fn:
        return KV_FP8
    return KV_NONE


@kernel
def _paged_attention_kernel(
    q_ptr, k_cache, v_cache, k_scale, v_scale, block_tables, query_start_loc, context_lens,
    out_ptr, lse_ptr,
    scale_log2, window, softcap,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss,
    stride_bt,
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt,
    num_kv_heads, head_dim,
    PAGE: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KV_QUANT: tl.constexpr, NUM_SPLITS: tl.constexpr,
    F32_DOT: tl.constexpr, DOT_PREC: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    # one program: BLOCK_Q query tokens x GROUP query heads of one KV head (GQA packed into the M rows)
    qb = tl.program_id(0)
    seq = tl.program_id(1) // num_kv_heads
    kvh = tl.program_id(1) % num_kv_heads
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    if qb * BLOCK_Q < q_len:
        ctx = tl.load(context_lens + seq)
        cached = ctx - q_len
        offs_m = tl.arange(0, BLOCK_M)
        tok = qb * BLOCK_Q + offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if F32_DOT:
            q = q.to(tl.float32)
        q_pos = cached + tok

        # keys this program needs (a window starts at its first query's oldest visible key), then this split's
        # share of them (rounded to whole tiles; may be empty)
        kv_end = tl.minimum(ctx, cached + (qb + 1) * BLOCK_Q)
        kv_start = 0
        if HAS_WINDOW:
            kv_start = tl.maximum(cached + qb * BLOCK_Q - window + 1, 0)
        split_len = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = kv_start + split * split_len
        kv_hi = tl.minimum(kv_end, kv_lo + split_len)

        s_log2 = scale_log2
        v_mul = 1.0
        if KV_QUANT == 2:
            s_log2 = scale_log2 * tl.load(k_scale)
            v_mul = tl.load(v_scale)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start in range(kv_lo, kv_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_hi
            page = tl.load(block_tables + seq * stride_bt + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            row = offs_n % PAGE
            kt = tl.load(k_cache + page[None, :] * stride_kb + row[None, :] * stride_ks + kvh * stride_kh
                         + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_cache + page[:, None] * stride_vb + row[:, None] * stride_vs + kvh * stride_vh
                        + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if F32_DOT:
                kt = kt.to(tl.float32)
                v = v.to(tl.float32)
            else:
                kt = kt.to(q.dtype)
                v = v.to(q.dtype)
            qk = tl.dot(q, kt, input_precision=DOT_PREC)
            if KV_QUANT == 1:
                # int8: per token-head scales fold into the scores (K) and the probabilities (V)
                ks = tl.load(k_scale + page * stride_sb + row * stride_ss + kvh, mask=n_ok, other=0.0)
                qk = qk * ks[None, :]
            causal = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                causal = causal & (offs_n[None, :] > q_pos[:, None] - window)
            s = qk * s_log2
            if HAS_SOFTCAP:
                # c * tanh(x / c) in natural-log units, tanh from one exp (sign-split: no overflow)
                x = s / (1.4426950408889634 * softcap)
                e = tl.exp(-2.0 * tl.abs(x))
                th = (1.0 - e) / (1.0 + e)
                s = tl.where(x < 0, -th, th) * (softcap * 1.4426950408889634)
            s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row with no visible key yet keeps m = -inf; subtract 0 instead to avoid inf - inf
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if KV_QUANT == 1:
                vs = tl.load(v_scale + page * stride_sb + row * stride_ss + kvh, mask=n_ok, other=0.0)
                p = p * vs[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new

        has_keys = l_i > 0.0
        o = tl.where(has_keys[:, None], acc * v_mul / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
        out_mask = row_ok[:, None] & d_ok[None, :]
        o_ptrs = (out_ptr + split * stride_os + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
                  + offs_d[None, :])
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=out_mask)
        if NUM_SPLITS > 1:
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + split * stride_ls + (q_start + tok) * stride_lt + head, lse, mask=row_ok)


@kernel
def _merge_splits_kernel(part_ptr, lse_ptr, out_ptr, num_heads, head_dim,
                         stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0) // num_heads
    h = tl.program_id(0) % num_heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + offs_s * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)  # split 0 always holds key 0, so m is finite for a real query
    w = tl.exp2(lse - m)
    part = tl.load(part_ptr + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph + offs_d[None, :],
                   mask=s_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


def _pick_splits(num_programs: int, max_context_len: int, max_query_len: int, on_cuda: bool) -> int:
    """Split the keys only for short query chunks whose programs would leave the GPU's SMs idle."""
    if not on_cuda or max_query_len > 16:
        return 1
    sms = sm_count(torch.cuda.current_device())
    want = -(-2 * sms // max(1, num_programs))
    return int(max(1, min(want, max_context_len // 256, 32)))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, context_lens: torch.Tensor, *,
                    max_query_len: int | None = None, max_context_len: int | None = None,
                    scale: float | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, num_splits: int | None = None,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Triton paged attention (compiled on CUDA tensors, the Triton interpreter on CPU tensors).

    Returns [T, Hq, D] in q's dtype. `max_query_len` / `max_context_len` avoid a device sync when given;
    `num_splits` forces the split-KV count (default: automatic on CUDA, 1 on the CPU). `window` / `softcap`:
    a sliding window of keys and tanh soft-capped scores (None: off).
    """
    if window is not None and window < 1:
        raise ValueError(f"window={window}: a sliding window holds at least one key")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap}: the soft-cap must be positive")
    require_triton()
    t, hq, d = q.shape
    num_blocks, page, hkv, d_k = k_cache.shape
    if d_k != d or hq % hkv:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}")
    mode = kv_quant_mode(k_cache)
    k_scale, v_scale = kv_scale_args(mode, k_scale, v_scale, q.device)
    on_cuda = q.is_cuda
    b = block_tables.shape[0]
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item()) if b else 0
    out = torch.empty_like(q)
    if t == 0 or max_query_len == 0:
        return out
    group = hq // hkv
    block_d = max(16, next_pow2(d))
    # M rows = query tokens x the GQA group of one KV head; tl.dot needs at least 16 of them
    block_m = max(16, min(64, next_pow2(group * max_query_len)), next_pow2(group))
    block_n = 64 if block_d <= 128 or not on_cuda else 32  # keep the K/V tiles within shared memory
    block_q = block_m // group
    n_qblocks = -(-max_query_len // block_q)
    if num_splits is None:
        if max_context_len is None and on_cuda and max_query_len <= 16:
            max_context_len = int(context_lens.max().item())
        reach = max_context_len or 0
        if window is not None:  # a decode reads at most its window
            reach = min(reach, window + max_query_len)
        num_splits = _pick_splits(n_qblocks * b * hkv, reach, max_query_len, on_cuda)
    if num_splits > 1:
        part = torch.empty((num_splits, t, hq, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, t, hq), dtype=torch.float32, device=q.device)
        dest, strides_o, strides_l = part, part.stride()[:3], lse.stride()[:2]
    else:
        lse = out  # unused by the kernel when there is one split
        dest, strides_o, strides_l = out, (0,) + out.stride()[:2], (0, 0)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    f32_dot = not on_cuda
    ss = k_scale.stride() if mode == KV_INT8 else (0, 0, 0)
    _paged_attention_kernel[(n_qblocks, b * hkv, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, query_start_loc, context_lens, dest, lse,
        scale * _LOG2E, window or 0, float(softcap or 0.0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ss[0], ss[1],
        block_tables.stride(0),
        *strides_o, *strides_l,
        hkv, d,
        PAGE=page, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        KV_QUANT=mode, NUM_SPLITS=num_splits, F32_DOT=f32_dot, DOT_PREC=dot_precision(q.dtype, on_cuda),
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, on_cuda=on_cuda,
    )
    if num_splits > 1:
        _merge_splits_kernel[(t * hq,)](
            part, lse, out, hq, d, *part.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(d), on_cuda=on_cuda)
    return out


def kv_scale_args(mode: int, k_scale, v_scale, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale tensors a kernel takes for a KV mode: int8 per token-head, fp8 per tensor (default 1), none."""
    if mode == KV_INT8:
        if k_scale is None or v_scale is None:
            raise ValueError("an int8 KV cache needs k_scale and v_scale [num_blocks, block_size, Hkv]")
        return k_scale, v_scale
    if mode == KV_FP8:
        one = torch.ones(1, dtype=torch.float32, device=device)
        return (one if k_scale is None else k_scale.float()), (one if v_scale is None else v_scale.float())
    dummy = torch.empty(1, dtype=torch.float32, device=device)
    return dummy, dummy


def dequantize_kv(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache pages [..., block_size, Hkv, D] -> float32 (int8 scales [..., block_size, Hkv]; fp8 per tensor)."""
    mode = kv_quant_mode(cache)
    x = cache.float()
    if mode == KV_INT8:
        return x * scale.float()[..., None]
    if mode == KV_FP8 and scale is not None:
        return x * scale.float().reshape(())
    return x


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor, *,
                        max_query_len: int | None = None, max_context_len: int | None = None,
                        scale: float | None = None, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, num_splits: int | None = None,
                        window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """PyTorch reference of `paged_attention` (float32 math, one sequence at a time)."""
    t, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    starts, ctxs = query_start_loc.tolist(), context_lens.tolist()
    mode = kv_quant_mode(k_cache)
    out = torch.zeros_like(q)
    for b, ctx in enumerate(ctxs):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        pages = block_tables[b, : -(-ctx // page)].long()
        ks = k_scale[pages] if mode == KV_INT8 else k_scale
        vs = v_scale[pages] if mode == KV_INT8 else v_scale
        k = dequantize_kv(k_cache[pages], ks).reshape(-1, hkv, d)[:ctx]
        v = dequantize_kv(v_cache[pages], vs).reshape(-1, hkv, d)[:ctx]
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        qs = q[lo:hi].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        visible = k_pos <= q_pos[:, None]
        if window is not None:
            visible &= k_pos > q_pos[:, None] - window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
