"""The attention seam and the contexts the serving code uses behind it: the model computes q/k/v and RoPE; an
`AttentionContext` stores K/V and attends, over one flattened variable-length batch (no padding).

`DenseCausal` needs no cache (training, dense logits); `PagedAttention` is the engine's context over the shared
paged pool for one `StepBatch` (the torch path `paged_attention_torch`, the CPU default, or the Triton
kernels). The contexts only tests and benchmarks use live in tests/attention_contexts.py.

A layer may pass `window=` (a sliding window: a query sees its last `window` keys) and `softcap=` (scores
tanh-capped, Gemma 2); the Triton kernel takes both, the other contexts then attend through `attend_masked`
(PyTorch, explicit scores), reading only the pages a window reaches. Without them (Llama) nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engines.sequence import Sequence


class AttentionContext(Protocol):
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] (RoPE applied). Returns [T, Hq, D]."""
        ...


def needs_mask(window: int | None, softcap: float | None, longest: int) -> bool:
    return softcap is not None or (window is not None and longest > window)


def attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos0: int, *, window: int | None = None,
                  softcap: float | None = None, scale: float | None = None) -> torch.Tensor:
    """q [Sq, Hq, D] at positions q_pos0.., k/v [Sk, Hkv, D] at 0..Sk-1 -> [Sq, Hq, D]: causal, key j seen by
    query i when i - window < j <= i, scores soft-capped as tanh(s / c) * c (transformers' eager order)."""
    sq, hq, d = q.shape
    rep = hq // k.shape[1]
    kk = k.transpose(0, 1).repeat_interleave(rep, dim=0)
    vv = v.transpose(0, 1).repeat_interleave(rep, dim=0)
    scores = torch.matmul(q.transpose(0, 1), kk.transpose(1, 2)) * (d ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    qpos = torch.arange(q_pos0, q_pos0 + sq, device=q.device)[:, None]
    kpos = torch.arange(k.shape[0], device=q.device)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(q.dtype), vv).transpose(0, 1)


def paged_masked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                  context_lens: torch.Tensor, window: int | None, softcap: float | None) -> torch.Tensor:
    """`attend_masked` per sequence over its pages; a window reads only the pages it reaches."""
    bs = k_cache.shape[1]
    out = torch.empty_like(q)
    starts, ctxs = query_start_loc.tolist(), context_lens.tolist()
    for i, ctx in enumerate(ctxs):
        start, q_len = starts[i], starts[i + 1] - starts[i]
        if q_len == 0:
            continue
        first = 0 if window is None else max(0, ctx - q_len - window + 1) // bs
        pages = block_tables[i, first:-(-ctx // bs)]
        n = ctx - first * bs
        k = _gather_pages(k_cache, k_scale, pages, q.dtype)[:n]
        v = _gather_pages(v_cache, v_scale, pages, q.dtype)[:n]
        out[start:start + q_len] = attend_masked(q[start:start + q_len], k, v, n - q_len, window=window,
                                                 softcap=softcap)
    return out


class DenseCausal:
    """A dense [B, S] batch of equal-length sequences (training): tokens flattened as B*S."""

    def __init__(self, batch: int, seqlen: int):
        self.batch, self.seqlen = batch, seqlen

    def forward(self, layer: int, q, k, v, *, window: int | None = None, softcap: float | None = None):
        b, s = self.batch, self.seqlen
        if needs_mask(window, softcap, s):
            return torch.cat([attend_masked(q[i * s:(i + 1) * s], k[i * s:(i + 1) * s], v[i * s:(i + 1) * s], 0,
                                            window=window, softcap=softcap) for i in range(b)])
        q = q.view(b, s, q.shape[1], q.shape[2]).transpose(1, 2)
        k = k.view(b, s, k.shape[1], k.shape[2]).transpose(1, 2)
        v = v.view(b, s, v.shape[1], v.shape[2]).transpose(1, 2)
        if q.shape[1] != k.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b * s, q.shape[1], q.shape[3])


# ---- paged attention over the engine's pool ----------------------------------------------------------------


@dataclass
class StepBatch:
    """One step's flattened batch. The host layout (`ModelRunner.layout`) is what both forwards read; the device
    tensors of the PyTorch forward are filled by `ModelRunner.prepare` (None in a step the C forward ran)."""
    ids: list[int]  # [T] token ids
    host_positions: list[int]  # [T]
    meta: list[list[int]]  # [4, S]: first row, query count, context length (after this step), table row
    block_tables: torch.Tensor  # [S, max_blocks] (on the device once prepared)
    max_query_len: int
    max_context_len: int
    sample_rows: list[int]  # rows of the hidden states that sample
    sample_seqs: list[Sequence]  # sequences that sample, in order
    rows_per_seq: list[int]  # logits rows of each sampling sequence: 1, or 1 + k when verifying k drafts
    input_ids: torch.Tensor | None = None  # [T]
    positions: torch.Tensor | None = None  # [T]
    write_pages: torch.Tensor | None = None  # [T] page of each new token's K/V (slot = page * block + offset)
    write_offsets: torch.Tensor | None = None  # [T]
    query_start_loc: torch.Tensor | None = None  # [S + 1]
    context_lens: torch.Tensor | None = None  # [S]
    plan: PagedAttentionPlan | None = None  # torch path only
    logits_indices: torch.Tensor | None = None  # sample_rows on the device
    # a model in several page groups (engines/kv_layout.py): groups 1..'s block tables [S, max_blocks] and the
    # page of each new token's K/V in them ([T] each, on the device once prepared); None for one group
    group_tables: list[torch.Tensor] | None = None
    group_write_pages: list[torch.Tensor] | None = None
    # embedding requests' chunks in this step: (sequence, first row, rows, first position); pooled from the
    # hidden states instead of sampling (engines/embedding.py `pool_step`)
    pool_spans: list[tuple[Sequence, int, int, int]] = field(default_factory=list)


def resolve_backend(name: str, device: torch.device | str) -> str:
    """"auto" -> "triton" on CUDA (when Triton is installed), "torch" elsewhere; "triton" on the CPU means the
    Triton interpreter."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"attention_backend={name!r} is invalid: use auto, torch or triton")
    if name == "auto":
        if torch.device(device).type != "cuda":
            return "torch"
        from kernels.launch import HAVE_TRITON

        return "triton" if HAVE_TRITON else "torch"
    return name


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [Sd] row of q for each decode sequence
    tables: torch.Tensor  # [Sd, max_blocks] their block tables
    mask: torch.Tensor  # [Sd, 1, 1, max_blocks * block_size], True = attend


@dataclass
class PagedAttentionPlan:
    """Per-step layout shared by every layer: decodes (one query each) run batched in a few groups of similar
    context length (so a short context is not padded to the longest), longer query runs (prefill chunks,
    verify windows) one by one, so nobody pads to the longest query."""

    decode_groups: list[DecodeGroup]
    # (q_start, q_len, context_len, pages, causal mask [q_len, context_len] when the queries are the last
    # q_len of context_len positions, else None: built once per step, not per layer)
    prefills: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]]
    # the sequences `kernels.cpu_kernels.paged_attention` attends over the pages in place (no gather):
    # [4, n] int64 (first query row, query count, context length, block-table row), their longest context,
    # and the block tables as int64; None when every sequence takes the torch path
    kernel_seqs: torch.Tensor | None = None
    kernel_max_ctx: int = 0
    kernel_tables: torch.Tensor | None = None


def plan_paged_attention(block_tables: torch.Tensor, seq_lens: Seq[int], query_start_loc: Seq[int],
                         block_size: int, kernel_max_query: int = 0) -> PagedAttentionPlan:
    """block_tables [S, max_blocks] (padding entries must be pages the sequence owns, never foreign ones);
    seq_lens: context length per sequence including this step's tokens; query_start_loc: S + 1 offsets.
    kernel_max_query > 0: sequences of at most that many queries (decodes, verify windows) go to the CPU
    kernel (`kernel_seqs`), the rest to the torch path."""
    if kernel_max_query > 0:
        kq = [[], [], [], []]
        for i in range(len(seq_lens)):
            q_len = query_start_loc[i + 1] - query_start_loc[i]
            if q_len <= kernel_max_query:
                kq[0].append(query_start_loc[i])
                kq[1].append(q_len)
                kq[2].append(seq_lens[i])
                kq[3].append(i)
        if kq[0]:
            plan = _plan_torch(block_tables, seq_lens, query_start_loc, block_size, set(kq[3]))
            plan.kernel_seqs = torch.tensor(kq, dtype=torch.int64)
            plan.kernel_max_ctx = max(kq[2])
            plan.kernel_tables = block_tables.to(torch.int64).contiguous()
            return plan
    return _plan_torch(block_tables, seq_lens, query_start_loc, block_size, set())


def _plan_torch(block_tables: torch.Tensor, seq_lens: Seq[int], query_start_loc: Seq[int], block_size: int,
                skip: set[int]) -> PagedAttentionPlan:
    dec, pre = [], []
    for i in range(len(seq_lens)):
        if i in skip:
            continue
        q_len = query_start_loc[i + 1] - query_start_loc[i]
        if q_len == 1:
            dec.append(i)
        else:
            nb = -(-seq_lens[i] // block_size)
            ctx = seq_lens[i]
            mask = None
            if q_len != ctx:
                qpos = torch.arange(ctx - q_len, ctx, device=block_tables.device)[:, None]
                mask = torch.arange(ctx, device=block_tables.device)[None, :] <= qpos
            pre.append((query_start_loc[i], q_len, ctx, block_tables[i, :nb], mask))
    dev = block_tables.device
    groups: list[DecodeGroup] = []
    dec.sort(key=lambda i: seq_lens[i])
    start = 0
    while start < len(dec):
        # a group holds contexts within 2x of its shortest: padding costs at most as much as the real work
        end = start + 1
        while end < len(dec) and seq_lens[dec[end]] <= 2 * seq_lens[dec[start]] + block_size:
            end += 1
        members = dec[start:end]
        nb = -(-seq_lens[members[-1]] // block_size)
        lens_t = torch.tensor([seq_lens[i] for i in members], device=dev)
        mask = torch.arange(nb * block_size, device=dev)[None, :] < lens_t[:, None]
        groups.append(DecodeGroup(torch.tensor([query_start_loc[i] for i in members], device=dev),
                                  block_tables[torch.tensor(members, device=dev), :nb], mask[:, None, None, :]))
        start = end
    return PagedAttentionPlan(groups, pre)


def _gather_pages(cache: torch.Tensor, kv_scale: torch.Tensor | None, pages: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """Rows of whole pages [len(pages) * block_size, Hkv, D] in `dtype`, dequantised when the cache is int8
    (per token-head scales [num_pages, block_size, Hkv]) or fp8 (a 1-element scale)."""
    _, bs, h, d = cache.shape
    # pages as rows: index_select copies whole contiguous pages (~2-3x faster than 4-D advanced indexing)
    rows = cache.flatten(1).index_select(0, pages).view(-1, h, d)
    if cache.dtype == torch.int8:
        return (rows.float() * kv_scale.flatten(1).index_select(0, pages).view(-1, h, 1)).to(dtype)
    if cache.dtype == torch.float8_e4m3fn:
        return (rows.float() * kv_scale.float()).to(dtype)
    return rows if rows.dtype == dtype else rows.to(dtype)  # e.g. a bfloat16 cache under a float32 model


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor, *,
                        scale: float | None = None, plan: PagedAttentionPlan | None = None,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        **_unused: object) -> torch.Tensor:
    """q: [T, Hq, D]; k_cache, v_cache: [num_pages, block_size, Hkv, D] (one layer, K/V of this step already
    written); block_tables [S, max_blocks]; query_start_loc [S + 1]; context_lens [S] (keys per sequence,
    new tokens included). Each query attends causally to its sequence's context (cached prefix included);
    GQA maps query head h to KV head h // (Hq / Hkv). Returns [T, Hq, D]. `plan` (from
    `plan_paged_attention`) saves re-deriving the layout in every layer; other keywords of the kernel's
    signature (max_query_len, ...) are accepted and unused. int8 / fp8 caches take k_scale/v_scale as the
    kernel does; pages are dequantised to q's dtype as they are gathered."""
    if plan is None:
        plan = plan_paged_attention(block_tables, context_lens.tolist(), query_start_loc.tolist(),
                                    k_cache.shape[1])
    out = torch.empty_like(q)
    if plan.kernel_seqs is not None:
        from kernels.cpu_kernels import paged_attention as paged_attention_cpu

        paged_attention_cpu(q, k_cache, v_cache, plan.kernel_tables, plan.kernel_seqs, plan.kernel_max_ctx, scale,
                            out=out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k_cache.shape[2]
    for g in plan.decode_groups:
        sd = g.tables.shape[0]
        flat = g.tables.reshape(-1)
        k = _gather_pages(k_cache, k_scale, flat, q.dtype).view(sd, -1, num_kv, head_dim).transpose(1, 2)
        v = _gather_pages(v_cache, v_scale, flat, q.dtype).view(sd, -1, num_kv, head_dim).transpose(1, 2)
        # GQA without copying K/V: the query heads of one KV head become that head's query rows
        qd = q[g.rows].view(sd, num_kv, num_heads // num_kv, head_dim)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=g.mask, scale=scale)
        out[g.rows] = o.reshape(sd, num_heads, head_dim)
    for start, q_len, ctx_len, pages, mask in plan.prefills:
        k = _gather_pages(k_cache, k_scale, pages, q.dtype)[:ctx_len].transpose(0, 1)
        v = _gather_pages(v_cache, v_scale, pages, q.dtype)[:ctx_len].transpose(0, 1)
        # 4-D inputs: torch's CPU flash kernel takes them (3-D ones fall back to the ~4x slower math path)
        qs, k, v = q[start:start + q_len].transpose(0, 1)[None], k[None], v[None]
        if mask is None:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # the queries are the last q_len of ctx_len positions
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + q_len] = o[0].transpose(0, 1)
    return out


class PagedAttention:
    """`AttentionContext` over the pool: write this step's K/V at their slots (quantising for an int8 / fp8
    cache), then attend (torch or Triton). `k_scales`/`v_scales`: per-layer KV scales, None for float.
    `layer_groups`: each layer's page group where the model's layers live in several (engines/kv_layout.py);
    group g > 0 reads `batch.group_tables[g - 1]` (its slots: `group_slot_mappings[g - 1]` when given)."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], batch: StepBatch,
                 use_kernel: bool, k_scales: list[torch.Tensor] | None = None,
                 v_scales: list[torch.Tensor] | None = None, slot_mapping: torch.Tensor | None = None,
                 layer_groups: Seq[int] | None = None, group_slot_mappings: list[torch.Tensor] | None = None):
        self.k_caches, self.v_caches, self.b = k_caches, v_caches, batch
        self.use_kernel = use_kernel
        self.k_scales, self.v_scales = k_scales, v_scales
        self.layer_groups = layer_groups
        self.block_size = k_caches[0].shape[1]
        self._slots: dict[int, torch.Tensor | None] = {0: slot_mapping}  # -1 skips a token (CUDA-graph padding)
        for g, m in enumerate(group_slot_mappings or (), start=1):
            self._slots[g] = m

    def _slot_mapping(self, group: int, write_pages: torch.Tensor) -> torch.Tensor:
        m = self._slots.get(group)
        if m is None:
            m = self._slots[group] = write_pages * self.block_size + self.b.write_offsets
        return m

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        kc, vc, b = self.k_caches[layer], self.v_caches[layer], self.b
        ks = self.k_scales[layer] if self.k_scales is not None else None
        vs = self.v_scales[layer] if self.v_scales is not None else None
        group = self.layer_groups[layer] if self.layer_groups is not None else 0
        tables, write_pages = b.block_tables, b.write_pages
        if group:
            tables = b.group_tables[group - 1]
            write_pages = b.group_write_pages[group - 1] if b.group_write_pages is not None else None
        if self.use_kernel:
            from kernels.kv_write import write_kv
            from kernels.paged_attention import paged_attention

            write_kv(k, v, kc, vc, self._slot_mapping(group, write_pages), k_scale=ks, v_scale=vs)
            # the kernel applies the window (reading only the tiles it reaches) and the soft-cap itself
            return paged_attention(q, kc, vc, tables, b.query_start_loc, b.context_lens,
                                   max_query_len=b.max_query_len, max_context_len=b.max_context_len,
                                   k_scale=ks, v_scale=vs, window=window, softcap=softcap)
        if ks is None and b.plan.kernel_seqs is not None:  # the kernels' own write (float32, float16, bfloat16)
            from kernels.cpu_kernels import write_kv

            write_kv(k, v, kc, vc, write_pages, b.write_offsets)
        elif ks is None:
            kc[write_pages, b.write_offsets] = k.to(kc.dtype)
            vc[write_pages, b.write_offsets] = v.to(vc.dtype)
        else:
            from kernels.kv_write import write_kv_ref

            write_kv_ref(k, v, kc, vc, self._slot_mapping(group, write_pages), k_scale=ks, v_scale=vs)
        # the step's plan is built over group 0's table: another group's layers attend over their own pages
        if group or needs_mask(window, softcap, b.max_context_len):
            return paged_masked(q, kc, vc, ks, vs, tables, b.query_start_loc, b.context_lens, window, softcap)
        return paged_attention_torch(q, kc, vc, b.block_tables, b.query_start_loc, b.context_lens, plan=b.plan,
                                   k_scale=ks, v_scale=vs)
