"""Rejection sampling of draft tokens (Leviathan et al.): accept draft j while u_j * q(x_j) < p(x_j), then draw
the next token from max(0, p - q) at the first rejection (from p after all k: the bonus token).

`kernels.fused.rejection_sample_ref` is the one reference; these are its fast paths, tested against it: the
Triton kernel on CUDA, `rejection_sample_cpu` (vectorised over rows) and `rejection_sample_one` (one row in a
few ops, the batch-1 CPU case speculation is for)."""

from __future__ import annotations

import torch


def rejection_sample_cpu(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                         target_probs: torch.Tensor, uniform_accept: torch.Tensor,
                         uniform_recover: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.fused.rejection_sample_ref` vectorised over rows (same arguments, same results). A row with
    fewer real drafts pads with uniform_accept = inf and a zero draft-probability row, so its first padded
    position recovers from p itself, which is the bonus token."""
    b, k = draft_token_ids.shape
    dev = target_probs.device
    p_d = target_probs[:, :k].gather(2, draft_token_ids[..., None])[..., 0]
    if draft_probs is not None:
        q_d = draft_probs.gather(2, draft_token_ids[..., None])[..., 0]
    else:
        q_d = torch.ones_like(p_d)
    rejected = ~(uniform_accept * q_d < p_d)
    pos = torch.where(rejected.any(1), rejected.to(torch.int8).argmax(1), torch.full((b,), k, device=dev))
    rows = torch.arange(b, device=dev)
    p = target_probs[rows, pos]
    safe = pos.clamp(max=k - 1)
    if draft_probs is not None:
        q = draft_probs[rows, safe]
    else:
        q = torch.nn.functional.one_hot(draft_token_ids[rows, safe], p.shape[-1]).to(p.dtype)
    r = torch.where((pos == k)[:, None], p, (p - q).clamp_min(0.0))
    live = r > 0
    hits = (r.cumsum(1) > (uniform_recover * r.sum(1))[:, None]) & live
    vocab_idx = torch.arange(r.shape[1], device=dev)
    last_live = torch.where(live, vocab_idx, -1).max(1).values.clamp_min(0)
    token = torch.where(hits.any(1), hits.to(torch.int8).argmax(1), last_live)
    out = torch.where(torch.arange(k, device=dev)[None, :] < pos[:, None], draft_token_ids, -1)
    out = torch.cat([out, torch.full((b, 1), -1, dtype=out.dtype, device=dev)], 1)
    out[rows, pos] = token
    return out, pos


def rejection_sample_one(draft_ids: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, u: torch.Tensor
                         ) -> tuple[list[int], int]:
    """One row (draft_ids [k], q [1, k, V] or None, p [k + 1, V], u [k + 1]): (tokens to append, number of
    accepted drafts), as `rejection_sample_ref` gives them; the recovery draw is an inverse CDF with u[k]."""
    k = draft_ids.shape[0]
    pos = torch.arange(k, device=p.device)
    p_d = p[pos, draft_ids].tolist()
    q_d = q[0, pos, draft_ids].tolist() if q is not None else [1.0] * k
    u_l = u.tolist()
    drafts = draft_ids.tolist()
    acc = 0
    while acc < k and u_l[acc] * q_d[acc] < p_d[acc]:
        acc += 1
    if acc == k:
        r = p[k]
    elif q is not None:
        r = (p[acc] - q[0, acc]).clamp_min_(0.0)
    else:
        r = p[acc].clone()
        r[drafts[acc]] = 0.0
    cdf = r.cumsum(0)
    token = int(torch.searchsorted(cdf, cdf[-1:] * u_l[k], right=True))
    if token >= r.shape[0] or not r[token] > 0:  # rounding at the top end: the last live token
        live = (r > 0).nonzero()  # not torch.nonzero(r): a NaN is nonzero, and may sit where p is 0
        token = int(live[-1]) if len(live) else 0
    return drafts[:acc] + [token], acc


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     uniform_accept: torch.Tensor, uniform_recover: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on CUDA, the vectorised path elsewhere."""
    if target_probs.is_cuda:
        from kernels.fused import rejection_sample as kernel

        return kernel(draft_token_ids, draft_probs, target_probs, uniform_accept, uniform_recover)
    return rejection_sample_cpu(draft_token_ids, draft_probs, target_probs, uniform_accept, uniform_recover)
