"""The model runner: turns a scheduled step into one flattened varlen batch (token ids, positions, slot
mapping, block tables, query start offsets, context lengths), runs the model over the paged KV pool and
returns logits only for the rows that sample. Attention goes through `PagedAttention` (an AttentionContext):
`paged_attention_ref` here is the PyTorch path (the CPU default), `kernels.write_kv` + `kernels.paged_attention`
the Triton kernels with the same plain signature (the CUDA default); both read int8 / fp8 KV caches."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engines.sequence import Sequence


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


def plan_paged_attention(block_tables: torch.Tensor, seq_lens: Seq[int], query_start_loc: Seq[int],
                         block_size: int) -> PagedAttentionPlan:
    """block_tables [S, max_blocks] (padding entries must be pages the sequence owns, never foreign ones);
    seq_lens: context length per sequence including this step's tokens; query_start_loc: S + 1 offsets."""
    dec, pre = [], []
    for i in range(len(seq_lens)):
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


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
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
    cache), then attend (torch or Triton). `k_scales`/`v_scales`: per-layer KV scales, None for float."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], batch: StepBatch,
                 use_kernel: bool, k_scales: list[torch.Tensor] | None = None,
                 v_scales: list[torch.Tensor] | None = None, slot_mapping: torch.Tensor | None = None):
        self.k_caches, self.v_caches, self.b = k_caches, v_caches, batch
        self.use_kernel = use_kernel
        self.k_scales, self.v_scales = k_scales, v_scales
        if slot_mapping is None and (use_kernel or k_scales is not None):
            slot_mapping = batch.write_pages * k_caches[0].shape[1] + batch.write_offsets
        self.slot_mapping = slot_mapping  # -1 skips a token (CUDA-graph padding)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc, b = self.k_caches[layer], self.v_caches[layer], self.b
        ks = self.k_scales[layer] if self.k_scales is not None else None
        vs = self.v_scales[layer] if self.v_scales is not None else None
        if self.use_kernel:
            from kernels.kv_write import write_kv
            from kernels.paged_attention import paged_attention

            write_kv(k, v, kc, vc, self.slot_mapping, k_scale=ks, v_scale=vs)
            return paged_attention(q, kc, vc, b.block_tables, b.query_start_loc, b.context_lens,
                                   max_query_len=b.max_query_len, max_context_len=b.max_context_len,
                                   k_scale=ks, v_scale=vs)
        if ks is None:
            kc[b.write_pages, b.write_offsets] = k.to(kc.dtype)
            vc[b.write_pages, b.write_offsets] = v.to(vc.dtype)
        else:
            from kernels.kv_write import write_kv_ref

            write_kv_ref(k, v, kc, vc, self.slot_mapping, k_scale=ks, v_scale=vs)
        return paged_attention_ref(q, kc, vc, b.block_tables, b.query_start_loc, b.context_lens, plan=b.plan,
                                   k_scale=ks, v_scale=vs)


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_pages: torch.Tensor  # [T] page of each new token's K/V (slot mapping = page * block + offset)
    write_offsets: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [S, max_blocks]
    query_start_loc: torch.Tensor  # [S + 1]
    context_lens: torch.Tensor  # [S]
    max_query_len: int
    max_context_len: int
    plan: PagedAttentionPlan | None  # torch path only
    logits_indices: torch.Tensor  # rows of the hidden states that sample
    sample_seqs: list[Sequence]  # sequences that sample, in order
    rows_per_seq: list[int]  # logits rows of each sampling sequence: 1, or 1 + k when verifying k drafts


def resolve_attention_backend(backend: str, device: torch.device) -> bool:
    """True when the Triton kernel runs attention: "auto" picks it on CUDA, the torch path elsewhere."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"attention_backend={backend!r} is invalid: use auto, torch or triton")
    if backend == "auto":
        if device.type != "cuda":
            return False
        from kernels.launch import HAVE_TRITON

        return HAVE_TRITON
    return backend == "triton"


class ModelRunner:
    """Runs one model over its view of the shared pool ([pages, 2, layers, block, kv_heads, head_dim])."""

    def __init__(self, model: torch.nn.Module, kv_view: torch.Tensor, block_size: int,
                 device: torch.device | str = "cpu", attention_backend: str = "auto",
                 kv_scales: torch.Tensor | None = None):
        """kv_scales: `KVPool.scales(model_id)` for an int8 ([pages, 2, layers, block, kv_heads]) or fp8
        ([2, layers]) cache; None for a float one."""
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.use_kernel = resolve_attention_backend(attention_backend, self.device)
        layers = kv_view.shape[2]
        self.kv_view = kv_view
        self.k_caches = [kv_view[:, 0, i] for i in range(layers)]
        self.v_caches = [kv_view[:, 1, i] for i in range(layers)]
        self.k_scales = self.v_scales = None
        if kv_scales is not None and kv_scales.dim() == 2:  # fp8: one scale per layer, as 1-element tensors
            self.k_scales = [kv_scales[0, i:i + 1] for i in range(layers)]
            self.v_scales = [kv_scales[1, i:i + 1] for i in range(layers)]
        elif kv_scales is not None:
            self.k_scales = [kv_scales[:, 0, i] for i in range(layers)]
            self.v_scales = [kv_scales[:, 1, i] for i in range(layers)]
        self.decode_graphs = None  # engines.cuda_graphs.DecodeGraphs once enabled

    def enable_decode_graphs(self, max_batch: int, max_model_len: int, capture: bool = True) -> None:
        """Replay decode-only steps of up to `max_batch` sequences from CUDA graphs (Triton attention only);
        `capture=False` runs the same padded static-buffer forward eagerly."""
        if not self.use_kernel:
            raise ValueError("CUDA graphs need the Triton attention backend")
        from engines.cuda_graphs import DecodeGraphs

        self.decode_graphs = DecodeGraphs(self, max_batch, max_model_len, capture)

    def prepare(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> StepBatch:
        bs = self.block_size
        ids: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        computed: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        rows_per_seq: list[int] = []
        max_blocks = 0
        for seq, n in zip(seqs, num_tokens):
            c = seq.num_computed
            toks = seq.token_ids[c:c + n]
            drafts = n - len(toks)  # scheduled draft tokens follow the last known token
            if drafts:
                toks = toks + seq.spec_token_ids[:drafts]
            ids.extend(toks)
            starts.append(starts[-1] + n)
            seq_lens.append(c + n)
            computed.append(c)
            if c + n - drafts == seq.num_tokens:  # the last known token is in: its row samples the next one
                sample_rows.extend(range(starts[-1] - 1 - drafts, starts[-1]))
                sample_seqs.append(seq)
                rows_per_seq.append(1 + drafts)
            max_blocks = max(max_blocks, len(seq.pages))
        # padding repeats the sequence's own first page: never another model's bytes (see KVPool.allocate)
        tables = [s.pages + [s.pages[0]] * (max_blocks - len(s.pages)) for s in seqs]
        block_tables = torch.tensor(tables, dtype=torch.long)
        q_lens = torch.tensor(num_tokens, dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        offset = torch.tensor(computed, dtype=torch.long) - torch.tensor(starts[:-1], dtype=torch.long)
        positions = torch.arange(len(ids)) + offset[seq_index]
        pages = block_tables[seq_index, positions // bs]
        dev = self.device
        tables_dev = block_tables.to(dev)
        plan = None if self.use_kernel else plan_paged_attention(tables_dev, seq_lens, starts, bs)
        return StepBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev), positions=positions.to(dev),
            write_pages=pages.to(dev), write_offsets=(positions % bs).to(dev), block_tables=tables_dev,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=max(num_tokens), max_context_len=max(seq_lens), plan=plan,
            logits_indices=torch.tensor(sample_rows, dtype=torch.long, device=dev), sample_seqs=sample_seqs,
            rows_per_seq=rows_per_seq)

    @torch.inference_mode()
    def execute(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> tuple[torch.Tensor, list[Sequence]]:
        """Forward the scheduled tokens; returns fp32 logits [R, V] for the R sequences that sample."""
        logits, batch = self.execute_batch(seqs, num_tokens)
        return logits, batch.sample_seqs

    @torch.inference_mode()
    def execute_batch(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> tuple[torch.Tensor, StepBatch]:
        """Like `execute`, with the batch layout: a sequence verifying k drafts has 1 + k consecutive logits
        rows (`rows_per_seq`), the distributions after its last known token and after each draft."""
        batch = self.prepare(seqs, num_tokens)
        if self.decode_graphs is not None and self.decode_graphs.fits(batch):
            hidden = self.decode_graphs.run(batch)
        else:
            attn = PagedAttention(self.k_caches, self.v_caches, batch, self.use_kernel, self.k_scales,
                                  self.v_scales)
            hidden = self.model(batch.input_ids, batch.positions, attn)
        if not batch.sample_seqs:
            return hidden.new_empty((0, 0), dtype=torch.float32), batch
        return self.model.compute_logits(hidden[batch.logits_indices]), batch
