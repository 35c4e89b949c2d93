"""`ModelEngine`: one model's serving state, stepped synchronously on the thread that owns the device: the request
lifecycle (queue, abort, fail, finish) and the one step loop (DESIGN.md section 3). Requests come in through its
`InputProcessor` (engines/input_processor.py); outputs leave through `OutputProcessor`."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engines.errors import EngineError, ErrorCode, RequestRejected
from engines.input_processor import InputProcessor
from engines.kv_pool import KVPool
from engines.output_processor import OutputProcessor
from engines.outputs import RequestOutput
from engines.runner import ModelRunner
from engines.sampling_params import SamplingParams
from engines.scheduler import Scheduler, SchedulerOutput
from engines.sequence import Request, Sequence
from engines.spec.decoder import SpeculativeDecoder
from engines.spec.drafter import Drafter
from engines.step_model import BatchCapController, StepTimer, step_clock
from engines.step_plan import StepPolicy
from engines.structured import MaskPrefetch

if TYPE_CHECKING:
    from engines.config import EngineSpec
    from engines.loaded import LoadedModel

log = logging.getLogger("tandem.engine")


class ModelEngine:
    """`add_request` and `abort` are thread-safe (they only queue); `step` runs on the device thread."""

    def __init__(self, spec: EngineSpec, loaded: LoadedModel, pool: KVPool, model_id: int,
                 device: torch.device):
        self.spec = spec
        self.name = spec.name
        self.model = loaded.model
        self.config = loaded.model.config
        self.tokenizer = loaded.tokenizer
        self.generation_defaults = loaded.generation
        eos = loaded.eos_token_ids
        self.device = device
        self.pool = pool
        self.model_id = model_id
        limit = self.config.max_position_embeddings
        self.max_model_len = min(spec.max_model_len or limit, limit)
        self.cap_controller = BatchCapController(max_num_seqs=spec.max_num_seqs,
                                                 max_num_batched_tokens=spec.max_num_batched_tokens)
        self.scheduler = Scheduler(pool, model_id, max_num_seqs=spec.max_num_seqs,
                                   max_num_batched_tokens=spec.max_num_batched_tokens,
                                   slo_scheduling=spec.slo_scheduling, cap_controller=self.cap_controller,
                                   priority_aging_s=spec.priority_aging_s,
                                   drop_expired=spec.drop_expired_requests, eos_token_ids=eos)
        self.runner = ModelRunner(self.model, pool.view(model_id), pool.block_size, device,
                                  spec.attention_backend, pool.scales(model_id), pool.geometries[model_id].layout)
        if spec.cuda_graphs and device.type == "cuda" and self.runner.use_kernel:
            self.runner.enable_decode_graphs(spec.max_num_seqs, self.max_model_len)
        self.inputs = InputProcessor(self.name, self.tokenizer, self.config.vocab_size, self.max_model_len, pool,
                                     lambda: self.eos_token_ids, pool.geometries[model_id].num_groups)
        self.output = OutputProcessor(self.name, self.tokenizer)
        self.timer = StepTimer(step_clock(device))
        self.policy = StepPolicy(self.scheduler, self.runner, pool, self.config.vocab_size)
        self.speculator = self._speculator(None, 0)  # verifies supplied drafts; `use_drafter` adds a drafter
        self.requests: dict[str, Request] = {}
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._live_ids: set[str] = set()  # ids accepted and not yet finished (guarded by the GIL's atomic ops)
        self.num_steps = 0
        self.mask_prefetch = MaskPrefetch()

    def _speculator(self, drafter: Drafter | None, k_max: int) -> SpeculativeDecoder:
        return SpeculativeDecoder(drafter, k_max, self.eos_token_ids, self.timer.clock, self._fail)

    def use_drafter(self, draft: ModelEngine, k_max: int) -> None:
        """Speculate with `draft`'s model (its weights object and runner; its KV in the shared pool)."""
        self.speculator = self._speculator(Drafter(draft.model, draft.runner, draft.pool, draft.model_id), k_max)
        self.scheduler.on_free = self.speculator.release

    @property
    def eos_token_ids(self) -> set[int]:
        """The ids that end a sequence (the scheduler stops on them; sampler and drafter ban them before
        min_tokens)."""
        return self.scheduler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.scheduler.eos_token_ids = self.speculator.eos_token_ids = ids

    @property
    def num_generated_tokens(self) -> int:
        return self.scheduler.num_generated_tokens

    @property
    def busy_s(self) -> float:
        """Cumulative seconds spent in this engine's forward passes and sampling (device time, for cost)."""
        return self.timer.busy_s

    # ---- caller side (any thread) --------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, *,
                    priority: int = 0, draft_token_ids: list[int] | None = None,
                    emit: Callable[[RequestOutput], None] | None = None, stream: bool = True,
                    ttft_s: float | None = None, tpot_s: float | None = None) -> Request:
        """Validate and queue a request (`InputProcessor.process`, then `submit`); RequestRejected if it can never
        be served."""
        req = self.inputs.process(prompt, params, request_id, priority=priority, draft_token_ids=draft_token_ids,
                                  ttft_s=ttft_s, tpot_s=tpot_s)
        self.submit(req, emit, stream)
        return req

    def submit(self, req: Request, emit: Callable[[RequestOutput], None] | None, stream: bool = True) -> None:
        """Queue a request built by `self.inputs.process`; it joins the scheduler at the next step.
        RequestRejected if a live request has its id."""
        if req.request_id in self._live_ids:
            raise RequestRejected(f"request_id {req.request_id!r} is already in use")
        req.emit = emit
        req.stream = stream
        self._live_ids.add(req.request_id)
        self._inbox.append(("add", req))

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    # ---- engine side (the device thread) -------------------------------------------------------------------
    def step(self) -> int:
        """One scheduling step (DESIGN.md section 3); returns the number of tokens the model processed. The
        policy's plan (`engines.step_plan`) is booked by the scheduler and carried out by the runner; update,
        rollback, emit, timing and failure handling are the same for every plan."""
        self.timer.step_started()
        self._drain_inbox()
        plan = self.policy.choose(self.speculator, arriving=bool(self._inbox))
        sched = self.scheduler.schedule(plan.drafts, plan.lookahead)
        for req in _requests(sched.expired):
            self._fail(req, f"waited past its {req.ttft_s:g} s time-to-first-token target", ErrorCode.TTFT_EXPIRED)
        if not sched:
            return 0
        self._step_started(sched)
        masks = self.mask_prefetch.start(sched.seqs, sched.drafts)  # grammar masks while the forward runs
        try:
            done = self.runner.carry_out(plan, sched, masks, self.speculator, self.eos_token_ids)
        except Exception as e:  # the whole batch failed: fail exactly its requests, keep serving others
            log.exception("engine %s: batch forward failed", self.name)
            for req in _requests(sched.seqs):
                self._fail(req, f"engine error during forward: {type(e).__name__}: {e}")
            self.timer.forward_failed()
            if masks is not None:
                masks.exception()  # wait: the grammars are the engine thread's again
            return 0
        touched = self.scheduler.update(sched, done.sampled)
        self.speculator.rollback(sched.drafts, done.sampled)
        self._emit_many(touched)
        for req in _requests(done.failed):
            self._fail(req, done.error)
        if plan.kind == "forward":  # the step-time model of the SLO caps knows single steps only
            self.cap_controller.step_finished(sched.num_decode_seqs, sched.num_prefill_tokens)
        self.policy.observe(self.speculator, plan, sched, done.fast, *self.timer.step_finished())
        return sched.total_tokens

    def _step_started(self, sched: SchedulerOutput) -> None:
        self.timer.forward_started()
        self.cap_controller.step_started()
        self.num_steps += 1
        now = time.monotonic()
        for seq in sched.seqs:
            m = seq.request.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                m.num_cached_tokens = seq.num_cached_tokens

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                req = item
                self.requests[req.request_id] = req
                for seq in req.seqs:
                    self.scheduler.add(seq)
                    self.speculator.add(seq)
            else:
                req = self.requests.get(item)
                if req is not None and not req.finished:
                    self.scheduler.end(req, "abort")
                    self._emit(req, final=True)

    def _fail(self, req: Request, message: str, code: ErrorCode = ErrorCode.ENGINE_ERROR) -> None:
        self.scheduler.fail(req, EngineError(code, message))
        self._emit(req, final=True)

    def fail_all(self, message: str, code: ErrorCode = ErrorCode.ENGINE_ERROR) -> None:
        self._drain_inbox()
        for req in list(self.requests.values()):
            if not req.finished:
                self._fail(req, message, code)

    def _emit(self, req: Request, final: bool) -> None:
        self._emit_many([req], final)

    def _emit_many(self, reqs: list[Request], final: bool | None = None) -> None:
        """The requests' outputs now (`final`: None for each one's own finished state), handed to their
        consumers; a finished request leaves the engine's books, and its sequences let go of it."""
        outs = []
        for req in reqs:
            done = req.finished if final is None else final
            if done:
                req.metrics.finished_time = time.monotonic()
                self.requests.pop(req.request_id, None)
                self._live_ids.discard(req.request_id)
            if req.emit is not None and (done or req.stream):
                outs.append((req, self.output.build(req, done)))
            if done:  # its sequences' way back to it goes with it: no Request <-> Sequence cycle left to the GC
                for seq in req.seqs:
                    seq.request = None
        self.output.deliver(outs)

    def stats(self) -> dict:
        pool = self.pool.stats()
        pages = {p for s in self.scheduler.running for p in self.pool.holder_pages(s)}
        return {"name": self.name, "kv_usage": pool["kv_usage"], "num_running": self.scheduler.num_running,
                "num_waiting": self.scheduler.num_waiting,
                "prefix_cache_queries": self.scheduler.prefix_queries,
                "prefix_cache_hits": self.scheduler.prefix_hits, "num_preemptions": self.scheduler.num_preemptions,
                "num_expired": self.scheduler.num_expired,
                "used_blocks": pool["used_pages"], "engine_used_blocks": len(pages),
                "num_steps": self.num_steps, "num_generated_tokens": self.scheduler.num_generated_tokens,
                "max_model_len": self.max_model_len, "busy_s": self.busy_s, **self._cap_stats(),
                **self.speculator.stats()}

    def _cap_stats(self) -> dict:
        """The SLO batch caps as the next step would see them, and the fitted step-time model."""
        ctl = self.cap_controller
        if not self.spec.slo_scheduling:
            return {"slo_scheduling": False}
        a, b, c = ctl.model.coefficients()
        caps = ctl.caps(self.scheduler.num_running)
        return {"slo_scheduling": True, "batch_cap_decode_seqs": caps.max_decode_seqs,
                "batch_cap_prefill_tokens": caps.max_prefill_tokens, "batch_cap_limited_by": caps.limited_by,
                "tpot_target_s": caps.target_s, "step_model_s": [a, b, c]}


def _requests(seqs: list[Sequence]) -> list[Request]:
    """The distinct requests of `seqs`, in order."""
    return list({id(s.request): s.request for s in seqs}.values())
