"""The model runner: turns a scheduled step into one flattened varlen batch (`StepBatch`: token ids, positions,
slot mapping, block tables, query start offsets, context lengths), runs the model over its view of the shared
KV pool through `engines.attention.PagedAttention` and returns logits only for the rows that sample.

The runner's contract, which the drafter's `LeanDraftRunner` keeps too: `execute(seqs, num_tokens, drafts)` ->
(fp32 logits of the sampling rows, the batch layout)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Seq

import torch

from engines.attention import PagedAttention, StepBatch, plan_paged_attention, resolve_backend
from engines.sequence import Sequence

# the longest query run (decode 1, a verify window 1 + k, a short prefill chunk) the CPU attention kernel takes
# inside the PyTorch forward, and a drafter's catch-up inside its one-call draft; longer prefill chunks go to
# torch's flash SDPA there
CPU_KERNEL_MAX_QUERY = 32


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
        self.use_kernel = resolve_backend(attention_backend, self.device) == "triton"
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
        # float32 on the CPU: decodes and verify windows attend over the pages in place (kernels/cpu_kernels.c)
        self.kernel_max_query = 0
        if not self.use_kernel and self.device.type == "cpu" and kv_scales is None:
            from kernels.cpu_kernels import attention_fits, available

            dtype = next(model.parameters()).dtype
            if dtype == torch.float32 and available() and attention_fits(torch.empty(1, 1, 1), self.k_caches[0]):
                self.kernel_max_query = CPU_KERNEL_MAX_QUERY
        # ... and such steps run the whole decoder stack in one C call (kernels/cpu_forward.py) where it covers
        # the model; TANDEM_CPU_FORWARD=0 keeps the PyTorch forward
        self.cpu_forward = None
        if self.kernel_max_query and os.environ.get("TANDEM_CPU_FORWARD", "1") != "0":
            from kernels.cpu_forward import CpuForward

            self.cpu_forward = CpuForward.build(model, self.k_caches, self.v_caches)

    def enable_decode_graphs(self, max_batch: int, max_model_len: int, capture: bool = True) -> None:
        """Replay decode-only steps of up to `max_batch` sequences from CUDA graphs (Triton attention only);
        `capture=False` runs the same padded static-buffer forward eagerly."""
        if not self.use_kernel:
            raise ValueError("CUDA graphs need the Triton attention backend")
        from engines.cuda_graphs import DecodeGraphs

        self.decode_graphs = DecodeGraphs(self, max_batch, max_model_len, capture)

    def prepare(self, seqs: Seq[Sequence], num_tokens: Seq[int], drafts: Mapping[int, list[int]] | None = None
                ) -> StepBatch:
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
            k = n - len(toks)  # scheduled draft tokens follow the last known token
            if k:
                toks = toks + drafts[seq.seq_id][:k]
            ids.extend(toks)
            starts.append(starts[-1] + n)
            seq_lens.append(c + n)
            computed.append(c)
            if c + n - k == seq.num_tokens:  # the last known token is in: its row samples the next one
                sample_rows.extend(range(starts[-1] - 1 - k, starts[-1]))
                sample_seqs.append(seq)
                rows_per_seq.append(1 + k)
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
        plan = None if self.use_kernel else plan_paged_attention(tables_dev, seq_lens, starts, bs,
                                                                         self.kernel_max_query)
        return StepBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev), positions=positions.to(dev),
            write_pages=pages.to(dev), write_offsets=(positions % bs).to(dev), block_tables=tables_dev,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=max(num_tokens), max_context_len=max(seq_lens), plan=plan,
            logits_indices=torch.tensor(sample_rows, dtype=torch.long, device=dev), sample_seqs=sample_seqs,
            rows_per_seq=rows_per_seq)

    @torch.inference_mode()
    def execute(self, seqs: Seq[Sequence], num_tokens: Seq[int], drafts: Mapping[int, list[int]] | None = None
                ) -> tuple[torch.Tensor, StepBatch]:
        """Forward the scheduled tokens (`drafts`: seq_id -> the draft tokens after its last known token);
        returns fp32 logits for the sequences that sample, in `batch.sample_seqs` order: one row each, or
        1 + k consecutive rows for a sequence verifying k drafts (`rows_per_seq`), the distributions after its
        last known token and after each draft."""
        # the one-call C decoder stack takes every step, prefill chunks of any length too (`takes_prefill`): its
        # linears (register tiles, or the SGEMM where `cpu_kernels.calibrate` found it faster) and in-place
        # attention beat the PyTorch forward's on prompts of 64-1024 tokens (docs/benchmarks.md)
        if self.cpu_forward is not None and (self.cpu_forward.takes_prefill
                                             or max(num_tokens) <= self.kernel_max_query):
            return self._execute_cpu_forward(seqs, num_tokens, drafts)
        batch = self.prepare(seqs, num_tokens, drafts)
        if self.decode_graphs is not None and self.decode_graphs.fits(batch):
            hidden = self.decode_graphs.run(batch)
        else:
            attn = PagedAttention(self.k_caches, self.v_caches, batch, self.use_kernel, self.k_scales,
                                  self.v_scales)
            hidden = self.model(batch.input_ids, batch.positions, attn)
        if not batch.sample_seqs:
            return hidden.new_empty((0, 0), dtype=torch.float32), batch
        return self.model.compute_logits(hidden[batch.logits_indices]), batch

    def _cpu_step_arrays(self, seqs: Seq[Sequence], num_tokens: Seq[int],
                         drafts: Mapping[int, list[int]] | None) -> tuple:
        """The C forward's inputs for a step, built in one pass: token ids, positions, block tables, the
        [4, S] (first row, query count, context length, table row) array, the longest context, and the
        sampling layout (rows, sequences, rows per sequence)."""
        ids: list[int] = []
        positions: list[int] = []
        meta: list[list[int]] = [[], [], [], []]
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        rows_per_seq: list[int] = []
        max_blocks = max(len(s.pages) for s in seqs)
        row = 0
        for i, (seq, n) in enumerate(zip(seqs, num_tokens)):
            c = seq.num_computed
            toks = seq.token_ids[c:c + n]
            k = n - len(toks)
            if k:
                toks = toks + drafts[seq.seq_id][:k]
            ids.extend(toks)
            positions.extend(range(c, c + n))
            meta[0].append(row)
            meta[1].append(n)
            meta[2].append(c + n)
            meta[3].append(i)
            row += n
            if c + n - k == seq.num_tokens:
                sample_rows.extend(range(row - 1 - k, row))
                sample_seqs.append(seq)
                rows_per_seq.append(1 + k)
        tables = torch.tensor([s.pages + [s.pages[0]] * (max_blocks - len(s.pages)) for s in seqs],
                              dtype=torch.long)
        return (torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), tables,
                torch.tensor(meta, dtype=torch.long), max(meta[2]), sample_rows, sample_seqs, rows_per_seq)

    def _execute_cpu_forward(self, seqs: Seq[Sequence], num_tokens: Seq[int],
                             drafts: Mapping[int, list[int]] | None) -> tuple[torch.Tensor, StepBatch]:
        """`execute` through `CpuForward`: the index arrays built in one pass, the stack in one call."""
        ids, positions, tables, meta, max_ctx, sample_rows, sample_seqs, rows_per_seq = self._cpu_step_arrays(
            seqs, num_tokens, drafts)
        hidden = self.cpu_forward.forward(ids, positions, tables, meta, max_ctx)
        batch = StepBatch(input_ids=None, positions=None, write_pages=None, write_offsets=None, block_tables=tables,
                          query_start_loc=None, context_lens=None, max_query_len=max(num_tokens),
                          max_context_len=max_ctx, plan=None, logits_indices=None, sample_seqs=sample_seqs,
                          rows_per_seq=rows_per_seq)
        if not sample_seqs:
            return hidden.new_empty((0, 0), dtype=torch.float32), batch
        rows = hidden if len(sample_rows) == len(ids) else hidden[torch.tensor(sample_rows, dtype=torch.long)]
        return self.cpu_forward.logits(rows), batch

    def can_draft_greedy(self, num_tokens: Seq[int]) -> bool:
        """Whether `draft_greedy` takes a draft of sequences computing `num_tokens` first."""
        return (self.cpu_forward is not None and self.cpu_forward.can_draft
                and max(num_tokens) <= self.kernel_max_query)

    @torch.inference_mode()
    def draft_greedy(self, seqs: Seq[Sequence], num_tokens: Seq[int], k: int,
                     bans: Seq[tuple[Iterable[int], int]] | None = None, temperatures: Seq[float] | None = None,
                     uniforms: torch.Tensor | None = None) -> list[list[int]]:
        """k greedy tokens for each sequence, whose first `num_tokens` uncomputed tokens end at its last known
        one (every sequence samples): k forwards, heads and argmaxes in one C call. Writes the K/V of the
        computed tokens and of the first k - 1 drafts; the caller appends the drafts and advances
        num_computed by sum(num_tokens) + k - 1 per sequence. `bans[i]` = (ids, n): sequence i may not pick
        those ids at its first n tokens (`greedy_bans`). A sequence with `temperatures[i]` > 0 draws from
        softmax(logits / temperature) at `uniforms[i]` ([S, k]) instead (`CpuForward.draft_greedy`)."""
        ids, positions, tables, meta, max_ctx, _, sample_seqs, _ = self._cpu_step_arrays(seqs, num_tokens, None)
        if len(sample_seqs) != len(seqs):
            raise ValueError("draft_greedy: every sequence must reach its last known token")
        return self.cpu_forward.draft_greedy(ids, positions, tables, meta, max_ctx, k, bans, temperatures,
                                             uniforms).tolist()
