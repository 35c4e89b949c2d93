"""CUDA graphs for decode steps: the model's forward over a decode batch padded to a bucket size (1, 2, 4, 8,
16, 32, 64, ... up to max_num_seqs) is captured once over static input buffers and replayed whenever a step
is decode-only and fits a bucket. It needs the Triton attention path: `write_kv` skips the padded slots (-1)
and `paged_attention` skips the padded sequences (no query); windowed / soft-capped layers (Gemma) pass their
per-layer constants to the kernel. Models whose forward reads host values per step (MoE routing) are not
captured: their decodes run eagerly."""

from __future__ import annotations

import torch

from engines.attention import PagedAttention, StepBatch


def capturable(model: torch.nn.Module) -> bool:
    """False for a model with a layer the graph cannot hold: an MoE block (it sizes its work from host
    values). Sliding windows and soft-caps are kernel constants on this (Triton) path."""
    return not any(hasattr(getattr(layer, "mlp", None), "experts") for layer in model.model.layers)


def bucket_sizes(max_batch: int) -> list[int]:
    """Powers of two below max_batch, then max_batch itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class DecodeGraphs:
    """Static buffers for the largest bucket (each bucket runs on their leading slices) and one captured graph
    per bucket. With `capture=False` the same padded forward runs eagerly (how the CPU tests check it)."""

    def __init__(self, runner, max_batch: int, max_model_len: int, capture: bool = True):
        self.runner = runner
        self.sizes = bucket_sizes(max(1, max_batch))
        self.max_model_len = max_model_len
        n, dev = self.sizes[-1], runner.device
        self.max_blocks = -(-max_model_len // runner.block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.long, device=dev)
        # a model in several page groups (engines/kv_layout.py): the other groups' tables and slots
        extra = runner.kv_layout.num_groups - 1 if runner.kv_layout is not None else 0
        self.group_tables = [torch.zeros_like(self.block_tables) for _ in range(extra)]
        self.group_slots = [torch.full_like(self.slot_mapping, -1) for _ in range(extra)]
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.enabled = capturable(runner.model)
        if capture and self.enabled:
            self.capture()

    def _forward(self, b: int) -> torch.Tensor:
        r = self.runner
        # max_context_len = the longest allowed context: the split-KV count is fixed at capture, and a split
        # beyond a shorter context is empty (the kernel's merge ignores it)
        batch = StepBatch(ids=[], host_positions=[], meta=[], block_tables=self.block_tables[:b], max_query_len=1,
                          max_context_len=self.max_model_len, sample_rows=[], sample_seqs=[], rows_per_seq=[],
                          input_ids=self.input_ids[:b], positions=self.positions[:b],
                          query_start_loc=self.query_start_loc[:b + 1], context_lens=self.context_lens[:b],
                          group_tables=[t[:b] for t in self.group_tables] or None)
        attn = PagedAttention(r.k_caches, r.v_caches, batch, True, r.k_scales, r.v_scales,
                              slot_mapping=self.slot_mapping[:b],
                              layer_groups=r.kv_layout.layer_group if r.kv_layout is not None else None,
                              group_slot_mappings=[m[:b] for m in self.group_slots])
        return r.model(batch.input_ids, batch.positions, attn)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for b in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            self._forward(b)  # warm-up outside the capture: Triton compiles and autotunes here
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(b)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize(self.runner.device)

    def fits(self, batch: StepBatch) -> bool:
        return (self.enabled and batch.max_query_len == 1 and batch.input_ids.shape[0] <= self.sizes[-1]
                and batch.block_tables.shape[1] <= self.max_blocks and batch.max_context_len <= self.max_model_len)

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Hidden states [T, H] of a decode-only batch (one query per sequence), by replay when captured."""
        t = batch.input_ids.shape[0]
        b = next(s for s in self.sizes if s >= t)
        self.input_ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        self.slot_mapping[:t].copy_(batch.write_pages * self.runner.block_size + batch.write_offsets)
        self.slot_mapping[t:b].fill_(-1)
        self.block_tables[:t, :batch.block_tables.shape[1]].copy_(batch.block_tables)
        for tables, slots, src, pages in zip(self.group_tables, self.group_slots, batch.group_tables or (),
                                             batch.group_write_pages or ()):
            tables[:t, :src.shape[1]].copy_(src)
            slots[:t].copy_(pages * self.runner.block_size + batch.write_offsets)
            slots[t:b].fill_(-1)
        self.query_start_loc[:t + 1].copy_(batch.query_start_loc)
        self.query_start_loc[t + 1:b + 1].fill_(t)  # padded sequences have no query
        self.context_lens[:t].copy_(batch.context_lens)
        self.context_lens[t:b].fill_(0)
        if b in self.graphs:
            graph, out = self.graphs[b]
            graph.replay()
            return out[:t]
        return self._forward(b)[:t]
