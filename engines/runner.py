"""The model runner carries out a step's plan (`carry_out`: forward and sample, verify drafts, the multi-token C
loop, drafting windows) and returns the tokens each sequence appends. Under it, `execute(seqs, num_tokens,
drafts)` turns scheduled tokens into one flattened varlen batch (`StepBatch`, one host layout for the C and the
PyTorch forward), runs the model over its view of the shared KV pool and returns (fp32 logits of the sampling
rows, the batch layout); the drafter's `LeanDraftRunner` keeps that contract too."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Set
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engines.attention import PagedAttention, StepBatch, plan_paged_attention, resolve_backend
from engines.embedding import pool_step
from engines.kv_layout import KVLayout
from engines.model import Attention, Transformer
from engines.sampler import Sampled, greedy_bans, min_tokens_ban, sample_sequences
from engines.sequence import Sequence
from engines.spec.verify import verify
from engines.spec.windows import run_windows

if TYPE_CHECKING:
    from concurrent.futures import Future

    from engines.scheduler import SchedulerOutput
    from engines.spec.decoder import SpeculativeDecoder
    from engines.step_plan import StepPlan

log = logging.getLogger("tandem.engine")

# the longest query run (decode 1, a verify window 1 + k, a short prefill chunk) the CPU attention kernel takes
# inside the PyTorch forward, and a drafter's catch-up inside its one-call draft; longer prefill chunks go to
# torch's flash SDPA there
CPU_KERNEL_MAX_QUERY = 32


@dataclass
class StepOutcome:
    """What a step computed: the tokens each sequence appends (`Scheduler.update` takes them), how far the plan's
    fast path ran (tokens per sequence of a multi-token step, windows run; 0: a plain forward ran instead), and a
    sampling error with the sequences it fails."""
    sampled: list[Sampled]
    fast: int = 0
    error: str | None = None
    failed: list[Sequence] = field(default_factory=list)


class ModelRunner:
    """Runs one model over its view of the shared pool ([pages, 2, layers, block, kv_heads, head_dim])."""

    def __init__(self, model: torch.nn.Module, kv_view: torch.Tensor, block_size: int,
                 device: torch.device | str = "cpu", attention_backend: str = "auto",
                 kv_scales: torch.Tensor | None = None, layout: KVLayout | None = None):
        """kv_scales: `KVPool.scales(model_id)` for an int8 ([pages, 2, layers, block, kv_heads]) or fp8
        ([2, layers]) cache; None for a float one. layout: the model's page groups (`KVGeometry.layout`;
        None: every layer in each page)."""
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.use_kernel = resolve_backend(attention_backend, self.device) == "triton"
        self.kv_layout = layout if layout is not None and layout.grouped else None
        slots = self.kv_layout.layer_slot if self.kv_layout is not None else range(kv_view.shape[2])
        self.kv_view = kv_view
        self.k_caches = [kv_view[:, 0, i] for i in slots]
        self.v_caches = [kv_view[:, 1, i] for i in slots]
        self.k_scales = self.v_scales = None
        if kv_scales is not None and kv_scales.dim() == 2:  # fp8: one scale per layer, as 1-element tensors
            # (per layer slot of a page: the layers of one slot in different page groups share it)
            self.k_scales = [kv_scales[0, i:i + 1] for i in slots]
            self.v_scales = [kv_scales[1, i:i + 1] for i in slots]
        elif kv_scales is not None:
            self.k_scales = [kv_scales[:, 0, i] for i in slots]
            self.v_scales = [kv_scales[:, 1, i] for i in slots]
        self.decode_graphs = None  # engines.cuda_graphs.DecodeGraphs once enabled
        # a float32 model on the CPU (its cache float32, float16 or bfloat16): decodes and verify windows attend over
        # the pages in place (kernels/cpu_kernels.c)
        self.kernel_max_query = 0
        if not self.use_kernel and self.device.type == "cpu" and kv_scales is None:
            from kernels.cpu_kernels import attention_fits, available

            dtype = next(model.parameters()).dtype
            if dtype == torch.float32 and available() and attention_fits(torch.empty(1, 1, 1), self.k_caches[0]):
                self.kernel_max_query = CPU_KERNEL_MAX_QUERY
        # ... and such steps run the whole decoder stack in one C call (kernels/cpu_forward.py) where it covers
        # the model; TANDEM_CPU_FORWARD=0 keeps the PyTorch forward
        self.cpu_forward = None
        if (self.kernel_max_query and os.environ.get("TANDEM_CPU_FORWARD", "1") != "0" and isinstance(model, Transformer)
                and all(isinstance(lay.self_attn, Attention) for lay in model.model.layers)):
            from kernels import hugepages
            from kernels.cpu_forward import CpuForward

            with hugepages.arena():  # the stack's weights end to end on huge pages, in the order a pass reads them
                self.cpu_forward = CpuForward.build(model, self.k_caches, self.v_caches)

    def enable_decode_graphs(self, max_batch: int, max_model_len: int, capture: bool = True) -> None:
        """Replay decode-only steps of up to `max_batch` sequences from CUDA graphs (Triton attention only);
        `capture=False` runs the same padded static-buffer forward eagerly."""
        if not self.use_kernel:
            raise ValueError("CUDA graphs need the Triton attention backend")
        from engines.cuda_graphs import DecodeGraphs

        self.decode_graphs = DecodeGraphs(self, max_batch, max_model_len, capture)

    def layout(self, seqs: Seq[Sequence], num_tokens: Seq[int], drafts: Mapping[int, list[int]] | None = None
               ) -> StepBatch:
        """The step's batch layout, built in one pass on the host, as both forwards read it: token ids,
        positions, block tables, `meta` ([4, S]: first row, query count, context length, table row), and the
        sampling layout (rows, sequences, rows per sequence). `prepare` adds the device tensors of the PyTorch
        forward."""
        ids: list[int] = []
        positions: list[int] = []
        meta: list[list[int]] = [[], [], [], []]
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        rows_per_seq: list[int] = []
        pool_spans: list[tuple[Sequence, int, int, int]] = []
        max_blocks = max(len(s.pages) for s in seqs)
        row = 0
        for i, (seq, n) in enumerate(zip(seqs, num_tokens)):
            c = seq.num_computed
            toks = seq.token_ids[c:c + n]
            k = n - len(toks)  # scheduled draft tokens follow the last known token
            if k:
                toks = toks + drafts[seq.seq_id][:k]
            ids.extend(toks)
            positions.extend(range(c, c + n))
            meta[0].append(row)
            meta[1].append(n)
            meta[2].append(c + n)
            meta[3].append(i)
            row += n
            if getattr(seq, "pooling", None) is not None:  # an embedding request: rows pooled, nothing sampled
                pool_spans.append((seq, row - n, n, c))
            elif c + n - k == seq.num_tokens:  # the last known token is in: its row samples the next one
                sample_rows.extend(range(row - 1 - k, row))
                sample_seqs.append(seq)
                rows_per_seq.append(1 + k)
        # padding repeats the sequence's own first page: never another model's bytes (see KVPool.allocate)
        tables = torch.tensor([s.pages + [s.pages[0]] * (max_blocks - len(s.pages)) for s in seqs],
                              dtype=torch.long)
        return StepBatch(ids=ids, host_positions=positions, meta=meta, block_tables=tables,
                         max_query_len=max(num_tokens), max_context_len=max(meta[2]), sample_rows=sample_rows,
                         sample_seqs=sample_seqs, rows_per_seq=rows_per_seq, pool_spans=pool_spans,
                         group_tables=self._group_tables(seqs, max_blocks) if self.kv_layout is not None else None)

    def _group_tables(self, seqs: Seq[Sequence], max_blocks: int) -> list[torch.Tensor]:
        """The window page groups' block tables: a block its window has passed (-1) and the padding point at the
        group's newest page, which the sequence holds (attention over a window never reads them)."""
        out = []
        for g in range(self.kv_layout.num_groups - 1):
            rows = []
            for s in seqs:
                pages = s.group_pages[g]
                last = pages[-1]
                rows.append([p if p >= 0 else last for p in pages] + [last] * (max_blocks - len(pages)))
            out.append(torch.tensor(rows, dtype=torch.long))
        return out

    def prepare(self, seqs: Seq[Sequence], num_tokens: Seq[int], drafts: Mapping[int, list[int]] | None = None
                ) -> StepBatch:
        """`layout` plus the PyTorch forward's device tensors (slot mapping, offsets, the attention plan)."""
        batch = self.layout(seqs, num_tokens, drafts)
        bs, dev = self.block_size, self.device
        starts = batch.meta[0] + [len(batch.ids)]
        q_lens = torch.tensor(batch.meta[1], dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
        positions = torch.tensor(batch.host_positions, dtype=torch.long)
        pages = batch.block_tables[seq_index, positions // bs]
        if batch.group_tables is not None:
            batch.group_write_pages = [t[seq_index, positions // bs].to(dev) for t in batch.group_tables]
            batch.group_tables = [t.to(dev) for t in batch.group_tables]
        tables_dev = batch.block_tables.to(dev)
        batch.plan = None if self.use_kernel else plan_paged_attention(tables_dev, batch.meta[2], starts, bs,
                                                                       self.kernel_max_query)
        batch.input_ids = torch.tensor(batch.ids, dtype=torch.long, device=dev)
        batch.positions = positions.to(dev)
        batch.write_pages = pages.to(dev)
        batch.write_offsets = (positions % bs).to(dev)
        batch.block_tables = tables_dev
        batch.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=dev)
        batch.context_lens = torch.tensor(batch.meta[2], dtype=torch.int32, device=dev)
        batch.logits_indices = torch.tensor(batch.sample_rows, dtype=torch.long, device=dev)
        return batch

    def carry_out(self, plan: StepPlan, sched: SchedulerOutput, masks: Future | None, sp: SpeculativeDecoder,
                  eos_token_ids: Set[int]) -> StepOutcome:
        """Run the step as `plan` says and the scheduler booked it. A multi-token or windows plan whose booking
        came back short (not expected: the policy checked the budget and the pages) runs as a plain forward
        over the booked tokens without their lookahead. Raises where the forward fails (the whole batch)."""
        full = plan.lookahead and not sched.preempted and sched.lookahead == plan.lookahead
        if full and plan.tokens_per_seq > 1:
            return self._multi_token(sched.seqs, plan.tokens_per_seq, eos_token_ids)
        if full and plan.windows:
            room = {sid: n + 1 for sid, n in sched.lookahead.items()}
            sampled, windows = run_windows(self, sp, sched.seqs, plan.k, room, eos_token_ids)
            if windows:
                return StepOutcome(sampled, windows)
        num_tokens = sched.num_tokens
        if sched.lookahead:
            num_tokens = [n - sched.lookahead.get(s.seq_id, 0) for s, n in zip(sched.seqs, num_tokens)]
        logits, batch = self.execute(sched.seqs, num_tokens, sched.drafts)
        try:
            ahead = masks.result() if masks is not None else None  # grammar masks computed beside the forward
            if not batch.sample_seqs:
                return StepOutcome([])
            if sched.drafts:
                return StepOutcome(verify(logits, batch, sched.drafts, sp.draft_probs, eos_token_ids, ahead))
            return StepOutcome(sample_sequences(logits, batch.sample_seqs, eos_token_ids, ahead))
        except Exception as e:
            log.exception("sampling failed")
            return StepOutcome([], error=f"engine error during sampling: {type(e).__name__}: {e}",
                               failed=batch.sample_seqs)

    def _multi_token(self, seqs: list[Sequence], n: int, eos_token_ids: Set[int]) -> StepOutcome:
        """`n` tokens for every sequence in one C call (`draft_greedy`: forward, head and argmax, or a draw from
        softmax(logits / temperature) at a uniform from torch's generator as the sampler's inverse CDF takes
        it, n times), handed to `Scheduler.update` as n - 1 accepted drafts and a bonus token, so EOS, stop ids,
        stop strings and max length end a sequence mid-way exactly as in single steps."""
        bans = greedy_bans(seqs, [min_tokens_ban(s.request.params, eos_token_ids) for s in seqs])
        temps = [0.0 if s.request.params.greedy else s.request.params.temperature for s in seqs]
        uniforms = torch.rand(len(temps), n) if any(temps) else None
        tokens = self.draft_greedy(seqs, [1] * len(seqs), n, bans, temps, uniforms)
        return StepOutcome([Sampled(seq, toks, num_accepted=n - 1) for seq, toks in zip(seqs, tokens)], n)

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
                                  self.v_scales, layer_groups=self.kv_layout.layer_group if self.kv_layout else None)
            hidden = self.model(batch.input_ids, batch.positions, attn)
        if batch.pool_spans:
            pool_step(hidden, batch.pool_spans)
        if not batch.sample_seqs:
            return hidden.new_empty((0, 0), dtype=torch.float32), batch
        return self.model.compute_logits(hidden[batch.logits_indices]), batch

    def _execute_cpu_forward(self, seqs: Seq[Sequence], num_tokens: Seq[int],
                             drafts: Mapping[int, list[int]] | None) -> tuple[torch.Tensor, StepBatch]:
        """`execute` through `CpuForward`: the host layout, the stack in one call."""
        batch = self.layout(seqs, num_tokens, drafts)
        hidden = self.cpu_forward.forward(*self._cpu_inputs(batch))
        if batch.pool_spans:
            pool_step(hidden, batch.pool_spans)
        if not batch.sample_seqs:
            return hidden.new_empty((0, 0), dtype=torch.float32), batch
        rows = batch.sample_rows
        rows = hidden if len(rows) == len(batch.ids) else hidden[torch.tensor(rows, dtype=torch.long)]
        return self.cpu_forward.logits(rows), batch

    @staticmethod
    def _cpu_inputs(batch: StepBatch) -> tuple:
        return (torch.tensor(batch.ids, dtype=torch.long), torch.tensor(batch.host_positions, dtype=torch.long),
                batch.block_tables, torch.tensor(batch.meta, dtype=torch.long), batch.max_context_len)

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
        batch = self.layout(seqs, num_tokens, None)
        if len(batch.sample_seqs) != len(seqs):
            raise ValueError("draft_greedy: every sequence must reach its last known token")
        return self.cpu_forward.draft_greedy(*self._cpu_inputs(batch), k, bans, temperatures, uniforms).tolist()

