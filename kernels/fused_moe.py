"""The fused mixture-of-experts kernel and its PyTorch reference: each (token, chosen expert) pair becomes a row,
rows are sorted by expert and padded to whole tiles (`moe_align`), and one grouped GEMM per projection
(`_grouped_gemm_kernel`) multiplies each tile by its expert's weight: gate/up, the activation, then down with
the routing weight folded in; a token's k rows are summed at the end (the shape of vLLM's fused_moe).

Weights are stacked: w_gate_up [E, 2I, H] (gate rows first), w_down [E, H, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.launch import dot_precision, kernel, next_pow2, require_triton, tl


def _act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


def fused_moe_ref(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """x [T, H]; weights, ids [T, k] -> sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), [T, H]."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        h = _act_mul(x[tok] @ w_gate_up[e].t(), activation) @ w_down[e].t()
        out.index_add_(0, tok, h * weights[tok, slot, None].to(h.dtype))
    return out


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (t * k + j) sorted by expert, each expert's run padded to a multiple of block_m with the sentinel
    T * k; and the expert of each block_m tile. Returns (rows [P] int32, tile_experts [P / block_m] int32)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum())
    rows = torch.full((total,), flat.numel(), dtype=torch.int32, device=ids.device)
    starts = torch.cumsum(padded, 0) - padded  # where each expert's padded run begins
    sorted_experts = flat[order]
    rank = torch.arange(flat.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    rows[starts[sorted_experts] + rank] = order.to(torch.int32)
    tile_experts = torch.repeat_interleave(torch.arange(num_experts, device=ids.device, dtype=torch.int32),
                                           padded // block_m)
    return rows, tile_experts


@kernel
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, rows_ptr, tile_expert_ptr, scale_ptr, num_rows, n, k, a_div,
                         stride_am, stride_we, stride_wn, stride_wk, stride_cm,
                         MUL_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """c[row] = a[row // a_div] @ w[expert].T (* scale[row]) for the BLOCK_M rows of one tile, BLOCK_N columns."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = rows < num_rows
    a_rows = rows // a_div
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & (ks[None, :] < k),
                    other=0.0)
        w = tl.load(w_ptr + e * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=(cols[None, :] < n) & (ks[:, None] < k), other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PREC)
    if MUL_SCALE:
        acc = acc * tl.load(scale_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < n))


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, tile_experts: torch.Tensor,
                  num_rows: int, a_div: int, scale: torch.Tensor | None, block_m: int) -> torch.Tensor:
    e, n, k = w.shape
    out = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    block_n, block_k = min(64, max(16, next_pow2(n))), min(64, max(16, next_pow2(k)))
    grid = (tile_experts.numel(), -(-n // block_n))
    _grouped_gemm_kernel[grid](a, w, out, rows, tile_experts, scale if scale is not None else out, num_rows, n, k,
                               a_div, a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
                               MUL_SCALE=scale is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                               DOT_PREC=dot_precision(a.dtype, a.is_cuda), on_cuda=a.is_cuda)
    return out


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, activation: str = "silu", block_m: int = 16) -> torch.Tensor:
    """`fused_moe_ref` by two grouped GEMMs over the rows sorted by expert (contiguous x and weights)."""
    require_triton()
    t, top_k = ids.shape
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    rows, tile_experts = moe_align(ids, w_gate_up.shape[0], block_m)
    gate_up = _grouped_gemm(x, w_gate_up, rows, tile_experts, t * top_k, top_k, None, block_m)
    hidden = _act_mul(gate_up, activation).contiguous()
    scale = weights.reshape(-1).to(torch.float32).contiguous()
    down = _grouped_gemm(hidden, w_down, rows, tile_experts, t * top_k, 1, scale, block_m)
    return down.view(t, top_k, -1).sum(dim=1)
