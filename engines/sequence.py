"""Per-request state: a `Request` (what the user asked) fans out into `n` `Sequence`s (one per choice), each
holding its tokens, its KV pages, how much of it is computed, and its decoded text. Nothing else keeps
request state; the scheduler, runner and sampler read and advance these objects."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from engines.errors import EngineError
from engines.outputs import PositionLogprobs, RequestMetrics, RequestOutput
from engines.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    ttft_s: float | None = None  # the route's SLO targets (relative seconds): deadline order and batch caps
    tpot_s: float | None = None
    emit: Callable[[RequestOutput], None] | None = None  # called on the engine thread with each output
    stream: bool = True  # False: emit only the final output (offline use)
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    error: EngineError | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finished for s in self.seqs)


@dataclass(eq=False)
class Sequence:
    request: Request  # None once the request has finished and left the engine (`ModelEngine._emit_many`)
    index: int  # which choice of the request (0..n-1)
    token_ids: list[int]  # prompt followed by the generated tokens
    prompt_len: int
    max_len: int  # prompt_len + max_tokens, capped by the model's context
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the pool
    pages: list[int] = field(default_factory=list)  # page group 0's (all layers, or the global ones)
    # the window page groups' pages (engines/kv_layout.py), as long as `pages`; -1 where the window has passed
    group_pages: list[list[int]] = field(default_factory=list)
    supplied_draft_ids: list[int] = field(default_factory=list)  # a caller's candidate output to verify first
    draft_state: object | None = None  # the drafter's KV for this sequence (engines.spec.state.DraftState)
    # this sequence's verified drafter windows in the geometric model (accepted drafts, first rejections),
    # decayed by the tokens since (SpeculativeDecoder.own_counts), and its length at the latest: its own
    # acceptance, which adaptive k weighs beside the engine's (AdaptiveK.seq_acceptance)
    draft_accepted: float = 0.0
    draft_rejected: float = 0.0
    draft_seen_at: int = 0
    draft_probes: int = 0  # probes of its own acceptance so far (each doubles the gap to the next)
    probe_idle_until: int = 0  # a probe found nothing worth drafting: none weighed again before this length
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the committed full blocks
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the latest admission
    admit_order: int = -1
    seed: int | None = None  # a seeded choice's seed (the request's seed + index); draws by position
    detokenizer: object | None = None
    grammar: object | None = None  # the output constraint's state (engines.structured.Grammar)
    pooling: str | None = None  # an embedding request ("mean" | "last"): prefill only, its output a vector
    # an embedding request's pooled hidden states (engines/embedding.py `pool_step`): the running float32 sum
    # of its rows under mean pooling while its prompt is computed, then its unit vector once it is all in
    pool_sum: object | None = None
    embedding: object | None = None
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # how much has already been handed to the caller (for delta outputs)
    sent_tokens: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
