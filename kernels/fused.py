"""Small fused kernels and their PyTorch references: RMSNorm with the residual add, SiLU-mul, and the
rejection sampler of speculative decoding (accept a draft token with min(1, p/q), else draw from the
normalised max(0, p - q); a bonus token from the target when every draft is accepted).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.launch import kernel, next_pow2, require_triton, tl

# ----------------------------------------------------------------------------------------------------------
# RMSNorm (+ residual)


@kernel
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, eps,
                    stride_x, stride_r, stride_o, stride_ro,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        # round the sum to the activation dtype first, as the unfused model does (x = x + f(x))
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, s, mask=ok)
        x = s.to(tl.float32)
    var = tl.sum(x * x, 0) / hidden
    normed = (x * (1.0 / tl.sqrt(var + eps))).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def rmsnorm_residual(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for x [T, H]; residual None means plain RMSNorm.

    Matches engines.model.RMSNorm: statistics in float32, normalised value rounded to x's dtype, then scaled.
    """
    require_triton()
    t, h = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if t:
        r = residual if residual is not None else x
        _rmsnorm_kernel[(t,)](x, r, weight, out, res_out, h, eps, x.stride(0), r.stride(0), out.stride(0),
                              res_out.stride(0), HAS_RES=residual is not None, BLOCK=next_pow2(h),
                              on_cuda=x.is_cuda)
    return out, res_out


def rmsnorm_residual_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual if residual is not None else x
    s32 = s.float()
    normed = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype), s


# ----------------------------------------------------------------------------------------------------------
# SiLU-mul


@kernel
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # F.silu rounds here too
    tl.store(out_ptr + row * stride_o + offs, (act * u).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, I] tensors (the Llama MLP's activation)."""
    require_triton()
    t, n = gate.shape
    out = torch.empty_like(gate)
    block = min(1024, next_pow2(n))
    if t:
        _silu_mul_kernel[(t, -(-n // block))](gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0),
                                              BLOCK=block, on_cuda=gate.is_cuda)
    return out


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# ----------------------------------------------------------------------------------------------------------
# rejection sampling


@kernel
def _rejection_kernel(draft_ptr, q_ptr, p_ptr, u_acc_ptr, u_rec_ptr, out_ptr, num_acc_ptr,
                      k, vocab, stride_db, stride_qb, stride_qk, stride_pb, stride_pk, stride_ub, stride_ob,
                      HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_V)
    done = tl.zeros([], dtype=tl.int32)
    pos = tl.zeros([], dtype=tl.int32) + k  # the position that draws from a distribution: first rejection, or k for the bonus token
    for i in range(0, k):
        if done == 0:
            d = tl.load(draft_ptr + b * stride_db + i)
            p_d = tl.load(p_ptr + b * stride_pb + i * stride_pk + d)
            if HAS_Q:
                q_d = tl.load(q_ptr + b * stride_qb + i * stride_qk + d)
            else:
                q_d = 1.0
            u = tl.load(u_acc_ptr + b * stride_ub + i)
            if u * q_d < p_d:  # u < p/q without dividing; p = 0 is never accepted
                tl.store(out_ptr + b * stride_ob + i, d.to(tl.int64))
            else:
                done = done + 1
                pos = i + tl.zeros([], dtype=tl.int32)
    # draw at `pos` from residual max(0, p - q) (or p itself for the bonus) by inverse CDF in vocab chunks
    is_bonus = pos == k
    pos_q = tl.minimum(pos, k - 1)  # the bonus position has no draft row; read a valid one and ignore it
    d_pos = tl.where(is_bonus, -1, tl.load(draft_ptr + b * stride_db + pos_q))
    total = tl.zeros([], dtype=tl.float32)
    last = tl.full([], -1, dtype=tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        idx = v0 + offs
        ok = idx < vocab
        p = tl.load(p_ptr + b * stride_pb + pos * stride_pk + idx, mask=ok, other=0.0)
        if HAS_Q:
            q = tl.load(q_ptr + b * stride_qb + pos_q * stride_qk + idx, mask=ok, other=0.0)
        else:
            q = tl.where(idx == d_pos, 1.0, 0.0)
        r = tl.where(is_bonus, p, tl.maximum(p - q, 0.0))
        r = tl.where(ok, r, 0.0)
        total += tl.sum(r, 0)
        last = tl.maximum(last, tl.max(tl.where(r > 0.0, idx, -1), 0))
    target = tl.load(u_rec_ptr + b) * total
    running = tl.zeros([], dtype=tl.float32)
    first = tl.zeros([], dtype=tl.int32) + vocab
    for v0 in range(0, vocab, BLOCK_V):
        idx = v0 + offs
        ok = idx < vocab
        p = tl.load(p_ptr + b * stride_pb + pos * stride_pk + idx, mask=ok, other=0.0)
        if HAS_Q:
            q = tl.load(q_ptr + b * stride_qb + pos_q * stride_qk + idx, mask=ok, other=0.0)
        else:
            q = tl.where(idx == d_pos, 1.0, 0.0)
        r = tl.where(is_bonus, p, tl.maximum(p - q, 0.0))
        r = tl.where(ok, r, 0.0)
        c = running + tl.cumsum(r, 0)
        first = tl.minimum(first, tl.min(tl.where((c > target) & (r > 0.0), idx, vocab), 0))
        running += tl.sum(r, 0)
    token = tl.minimum(first, tl.maximum(last, 0))  # rounding can leave target >= total: take the last live id
    tl.store(out_ptr + b * stride_ob + pos, token.to(tl.int64))
    tl.store(num_acc_ptr + b, pos.to(tl.int64))


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     uniform_accept: torch.Tensor, uniform_recover: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-decoding rejection sampler (Leviathan et al.), one program per sequence.

    draft_token_ids [B, k] int64; draft_probs [B, k, V] float32 (None: drafts were greedy/deterministic,
    q = one-hot); target_probs [B, k+1, V] float32; uniform_accept [B, k] and uniform_recover [B] in [0, 1)
    (drawn by the caller, so a per-request generator keeps sampling reproducible).
    Returns (tokens [B, k+1] int64, -1 after the last emitted token; num_accepted [B] int64). Each row
    emits num_accepted + 1 tokens: the accepted drafts, then the recovered or the bonus token.
    With one-hot target probabilities (greedy) this is exactly "keep drafts while they equal the argmax".
    """
    require_triton()
    b, k = draft_token_ids.shape
    if k == 0:
        raise ValueError("rejection_sample needs at least one draft token per row")
    vocab = target_probs.shape[-1]
    out = torch.full((b, k + 1), -1, dtype=torch.int64, device=target_probs.device)
    num_acc = torch.empty(b, dtype=torch.int64, device=target_probs.device)
    if b == 0:
        return out, num_acc
    q = draft_probs if draft_probs is not None else target_probs
    _rejection_kernel[(b,)](
        draft_token_ids, q, target_probs, uniform_accept, uniform_recover, out, num_acc,
        k, vocab, draft_token_ids.stride(0), q.stride(0), q.stride(1), target_probs.stride(0),
        target_probs.stride(1), uniform_accept.stride(0), out.stride(0),
        HAS_Q=draft_probs is not None, BLOCK_V=min(4096, next_pow2(vocab)), on_cuda=target_probs.is_cuda)
    return out, num_acc


def rejection_sample_ref(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                         target_probs: torch.Tensor, uniform_accept: torch.Tensor,
                         uniform_recover: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of `rejection_sample` (same arguments, same outputs): the one rejection-sampling
    reference; the kernel and the engine's CPU paths (engines/spec/rejection.py) are tested against it."""
    b, k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    out = torch.full((b, k + 1), -1, dtype=torch.int64, device=target_probs.device)
    num_acc = torch.empty(b, dtype=torch.int64, device=target_probs.device)
    for row in range(b):
        pos = k
        for i in range(k):
            d = int(draft_token_ids[row, i])
            p_d = target_probs[row, i, d]
            q_d = draft_probs[row, i, d] if draft_probs is not None else torch.tensor(1.0)
            if uniform_accept[row, i] * q_d < p_d:
                out[row, i] = d
            else:
                pos = i
                break
        p = target_probs[row, pos].float()
        if pos == k:
            r = p
        else:
            if draft_probs is not None:
                q = draft_probs[row, pos].float()
            else:
                q = F.one_hot(draft_token_ids[row, pos], vocab).float()
            r = (p - q).clamp_min(0.0)
        live = torch.nonzero(r > 0).flatten()
        target = uniform_recover[row] * r.sum()
        hits = torch.nonzero((r.cumsum(0) > target) & (r > 0)).flatten()
        token = int(hits[0]) if len(hits) else (int(live[-1]) if len(live) else 0)
        out[row, pos] = token
        num_acc[row] = pos
    return out, num_acc
