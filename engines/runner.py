"""The model runner: turns a scheduled step into one flattened varlen batch (token ids, positions, slot
mapping, block tables, query start offsets, context lengths), runs the model over the paged KV pool and
returns logits only for the rows that sample. `paged_attention_ref` is the PyTorch reference (and CPU path)
that the Triton kernel later replaces behind the same `AttentionContext`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engines.sequence import Sequence


@dataclass
class PagedAttentionPlan:
    """Per-step layout shared by every layer: decodes (one query each) run as one batch, longer query
    runs (prefill chunks, verify windows) one by one, so nobody pads to the longest query."""

    write_pages: torch.Tensor  # [T] page of each new token
    write_offsets: torch.Tensor  # [T] slot inside that page
    decode_rows: torch.Tensor | None  # [Sd] row of q for each decode sequence
    decode_tables: torch.Tensor | None  # [Sd, max_blocks]
    decode_mask: torch.Tensor | None  # [Sd, 1, 1, max_blocks * block_size], True = attend
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (q_start, q_len, context_len, pages)


def plan_paged_attention(block_tables: torch.Tensor, seq_lens: Seq[int], query_start_loc: Seq[int],
                         slot_mapping: torch.Tensor, block_size: int) -> PagedAttentionPlan:
    """block_tables [S, max_blocks] (padding entries must be pages the sequence owns, never foreign ones);
    seq_lens: context length per sequence including this step's tokens; query_start_loc: S + 1 offsets."""
    dec, pre = [], []
    for i in range(len(seq_lens)):
        q_len = query_start_loc[i + 1] - query_start_loc[i]
        if q_len == 1:
            dec.append(i)
        else:
            nb = -(-seq_lens[i] // block_size)
            pre.append((query_start_loc[i], q_len, seq_lens[i], block_tables[i, :nb]))
    decode_rows = decode_tables = decode_mask = None
    if dec:
        lens = [seq_lens[i] for i in dec]
        nb = -(-max(lens) // block_size)
        idx = torch.tensor(dec, device=block_tables.device)
        decode_rows = torch.tensor([query_start_loc[i] for i in dec], device=block_tables.device)
        decode_tables = block_tables[idx, :nb]
        lens_t = torch.tensor(lens, device=block_tables.device)
        decode_mask = (torch.arange(nb * block_size, device=block_tables.device)[None, :] < lens_t[:, None])
        decode_mask = decode_mask[:, None, None, :]
    return PagedAttentionPlan(slot_mapping // block_size, slot_mapping % block_size, decode_rows,
                              decode_tables, decode_mask, pre)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        plan: PagedAttentionPlan, scale: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k_cache, v_cache: [num_pages, block_size, Hkv, D] (one layer, K/V of this step
    already written). Each query attends causally to its sequence's context (cached prefix included);
    GQA maps query head h to KV head h // (Hq / Hkv). Returns [T, Hq, D]."""
    out = torch.empty_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k_cache.shape[2]
    if plan.decode_rows is not None:
        sd, nb = plan.decode_tables.shape
        k = k_cache[plan.decode_tables].view(sd, -1, num_kv, head_dim).transpose(1, 2)
        v = v_cache[plan.decode_tables].view(sd, -1, num_kv, head_dim).transpose(1, 2)
        # GQA without copying K/V: the query heads of one KV head become that head's query rows
        qd = q[plan.decode_rows].view(sd, num_kv, num_heads // num_kv, head_dim)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=plan.decode_mask, scale=scale)
        out[plan.decode_rows] = o.reshape(sd, num_heads, head_dim)
    for start, q_len, ctx_len, pages in plan.prefills:
        k = k_cache[pages].reshape(-1, num_kv, head_dim)[:ctx_len].transpose(0, 1)
        v = v_cache[pages].reshape(-1, num_kv, head_dim)[:ctx_len].transpose(0, 1)
        qs = q[start:start + q_len].transpose(0, 1)
        if q_len == ctx_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # the queries are the last q_len of ctx_len positions
            qpos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + q_len] = o.transpose(0, 1)
    return out


class PagedAttention:
    """`AttentionContext` over the pool: write this step's K/V by slot, then attend with the reference."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], plan: PagedAttentionPlan):
        self.k_caches, self.v_caches, self.plan = k_caches, v_caches, plan

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.k_caches[layer], self.v_caches[layer]
        kc[self.plan.write_pages, self.plan.write_offsets] = k
        vc[self.plan.write_pages, self.plan.write_offsets] = v
        return paged_attention_ref(q, kc, vc, self.plan)


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    plan: PagedAttentionPlan
    logits_indices: torch.Tensor
    sample_seqs: list[Sequence]  # rows of the logits, in order


class ModelRunner:
    """Runs one model over its view of the shared pool ([pages, 2, layers, block, kv_heads, head_dim])."""

    def __init__(self, model: torch.nn.Module, kv_view: torch.Tensor, block_size: int,
                 device: torch.device | str = "cpu"):
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        layers = kv_view.shape[2]
        self.k_caches = [kv_view[:, 0, i] for i in range(layers)]
        self.v_caches = [kv_view[:, 1, i] for i in range(layers)]

    def prepare(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> StepBatch:
        bs = self.block_size
        ids: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        computed: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        max_blocks = 0
        for i, (seq, n) in enumerate(zip(seqs, num_tokens)):
            c = seq.num_computed
            ids.extend(seq.token_ids[c:c + n])
            starts.append(starts[-1] + n)
            seq_lens.append(c + n)
            computed.append(c)
            if c + n == seq.num_tokens:  # the last known token is in: this row samples the next one
                sample_rows.append(starts[-1] - 1)
                sample_seqs.append(seq)
            max_blocks = max(max_blocks, len(seq.pages))
        # padding repeats the sequence's own first page: never another model's bytes (see KVPool.allocate)
        tables = [s.pages + [s.pages[0]] * (max_blocks - len(s.pages)) for s in seqs]
        block_tables = torch.tensor(tables, dtype=torch.long)
        q_lens = torch.tensor(num_tokens, dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        offset = torch.tensor(computed, dtype=torch.long) - torch.tensor(starts[:-1], dtype=torch.long)
        positions = torch.arange(len(ids)) + offset[seq_index]
        slots = block_tables[seq_index, positions // bs] * bs + positions % bs
        dev = self.device
        block_tables = block_tables.to(dev)
        plan = plan_paged_attention(block_tables, seq_lens, starts, slots.to(dev), bs)
        return StepBatch(torch.tensor(ids, dtype=torch.long, device=dev), positions.to(dev), plan,
                         torch.tensor(sample_rows, dtype=torch.long, device=dev), sample_seqs)

    @torch.inference_mode()
    def execute(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> tuple[torch.Tensor, list[Sequence]]:
        """Forward the scheduled tokens; returns fp32 logits [R, V] for the R sequences that sample."""
        batch = self.prepare(seqs, num_tokens)
        attn = PagedAttention(self.k_caches, self.v_caches, batch.plan)
        hidden = self.model(batch.input_ids, batch.positions, attn)
        if not batch.sample_seqs:
            return hidden.new_empty((0, 0), dtype=torch.float32), []
        return self.model.compute_logits(hidden[batch.logits_indices]), batch.sample_seqs
