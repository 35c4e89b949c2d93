"""`ModelEngine`: one model's serving state, stepped synchronously on the thread that owns the device. Its step
is DESIGN.md section 3: inbox, drafts, schedule, forward, sample or verify, `Scheduler.update`, rollback,
emit. Outputs leave through per-request callbacks."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engines.compile_pool import CompileBusy, CompileLimits, CompilePool, check_budget
from engines.errors import EngineError, ErrorCode, RequestRejected
from engines.grammar_check import require_finite_derivation
from engines.kv_pool import KVPool
from engines.output_processor import OutputProcessor
from engines.outputs import RequestMetrics, RequestOutput
from engines.runner import ModelRunner
from engines.sampling_params import SamplingParams
from engines.scheduler import Scheduler, SchedulerOutput
from engines.sequence import Request, Sequence
from engines.spec.decoder import SpeculativeDecoder
from engines.spec.drafter import Drafter
from engines.step_model import BatchCapController, StepTimer, step_clock
from engines.step_plan import StepPolicy
from engines.structured import GrammarCompiler, InvalidConstraint, MaskPrefetch, StructuredOutput

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
                                  spec.attention_backend, pool.scales(model_id))
        if spec.cuda_graphs and device.type == "cuda" and self.runner.use_kernel:
            self.runner.enable_decode_graphs(spec.max_num_seqs, self.max_model_len)
        self.output = OutputProcessor(self.name, self.tokenizer)
        self.timer = StepTimer(step_clock(device))
        self.policy = StepPolicy(self.scheduler, self.runner, pool, self.config.vocab_size)
        self.speculator = self._speculator(None, 0)  # verifies supplied drafts; `use_drafter` adds a drafter
        self.requests: dict[str, Request] = {}
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._live_ids: set[str] = set()  # ids accepted and not yet finished (guarded by the GIL's atomic ops)
        self.num_steps = 0
        self.grammars: GrammarCompiler | None = None  # built with the first constrained request
        self._grammars_lock = threading.Lock()
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
        """Validate and queue a request; raises RequestRejected if it can never be served."""
        req = self.make_request(prompt, params, request_id, priority=priority, draft_token_ids=draft_token_ids,
                                ttft_s=ttft_s, tpot_s=tpot_s)
        self.submit(req, emit, stream)
        return req

    def submit(self, req: Request, emit: Callable[[RequestOutput], None] | None, stream: bool = True) -> None:
        """Queue a request built by `make_request`; it joins the scheduler at the next step."""
        req.emit = emit
        req.stream = stream
        self._live_ids.add(req.request_id)
        self._inbox.append(("add", req))

    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, *,
                     priority: int = 0, draft_token_ids: list[int] | None = None, ttft_s: float | None = None,
                     tpot_s: float | None = None) -> Request:
        """Validate a request (RequestRejected if it can never be served); ttft_s/tpot_s are its SLO targets."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected(f"engine {self.name!r} has no tokenizer: pass the prompt as token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise RequestRejected("the prompt is empty: at least one token is needed")
        vocab = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab}) for model {self.name!r}")
        if draft_token_ids is not None:
            draft_token_ids = [int(t) for t in draft_token_ids]
            if draft_token_ids and (min(draft_token_ids) < 0 or max(draft_token_ids) >= vocab):
                raise RequestRejected(f"draft_token_ids must be in [0, {vocab}) for model {self.name!r}")
        if len(ids) >= self.max_model_len:
            raise RequestRejected(f"the prompt has {len(ids)} tokens but {self.name!r} has a context of "
                                  f"{self.max_model_len}: shorten the prompt to at most {self.max_model_len - 1}",
                                  ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise RequestRejected(f"max_tokens={max_tokens} plus the prompt's {len(ids)} tokens exceeds the "
                                  f"context of {self.max_model_len} tokens: lower max_tokens to at most "
                                  f"{self.max_model_len - len(ids)}", ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestRejected(f"logit_bias token ids must be in [0, {vocab}) for model {self.name!r}",
                                  param="logit_bias")
        if params.stop_token_ids and not all(0 <= t < vocab for t in params.stop_token_ids):
            raise RequestRejected(f"stop_token_ids must be in [0, {vocab}) for model {self.name!r}",
                                  param="stop_token_ids")
        compiled = self._compile(params.structured) if params.structured is not None else None
        pages = -(-(len(ids) + max_tokens) // self.pool.block_size)
        if pages > self.pool.num_pages:
            raise RequestRejected(f"the request needs {pages} KV pages (prompt + max_tokens) but the whole pool "
                                  f"has {self.pool.num_pages}: lower max_tokens or enlarge the KV pool",
                                  ErrorCode.KV_CAPACITY_EXCEEDED)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if rid in self._live_ids:
            raise RequestRejected(f"request_id {rid!r} is already in use")
        req = Request(rid, text, ids, params, priority=priority, ttft_s=ttft_s, tpot_s=tpot_s)
        req.metrics = RequestMetrics(arrival_time=req.arrival_time)
        for i in range(params.n):
            seq = Sequence(req, i, list(ids), len(ids), len(ids) + max_tokens)
            if params.seed is not None:  # choice i gets seed + i so the n choices differ but reproduce
                seq.seed = params.seed + i
            if self.tokenizer is not None:
                seq.detokenizer = self.tokenizer.detokenizer(params.skip_special_tokens, prompt_ids=ids)
            if params.logprobs is not None:
                seq.logprobs = []
            if compiled is not None:
                seq.grammar = self.grammars.matcher(compiled)
            if draft_token_ids:  # verified first, at most max_tokens of them
                seq.supplied_draft_ids = draft_token_ids[:max_tokens]
            req.seqs.append(seq)
        return req

    # set by EngineCore: constraints are proven to compile within budget in killable worker processes
    compile_pool: CompilePool | None = None
    compile_limits: CompileLimits = CompileLimits()

    def needs_compile(self, so: StructuredOutput) -> bool:
        """Whether validating a request with `so` would compile it (not cached yet): callers on an event loop
        await `precompile_async` first."""
        return self.tokenizer is not None and (self.grammars is None or not self.grammars.cached(so))

    def precompile(self, so: StructuredOutput) -> None:
        """Compile `so` into the cache (any thread); RequestRejected naming its field if it cannot be."""
        self._compile(so)

    async def precompile_async(self, so: StructuredOutput) -> None:
        """Compile `so` into the cache without holding anything shared: proven within the compile budget in a
        worker process (killed when over it or when the caller is cancelled), then compiled on the pool's own
        threads. RequestRejected naming its field (400) or COMPILE_BUSY (503) when it cannot be."""
        pool = self.compile_pool
        if pool is None:
            await asyncio.to_thread(self._compile, so)
            return
        grammars = self.grammars or await asyncio.wrap_future(pool.run_compile(self._grammar_compiler, so))
        try:
            if self._info is None:
                text = grammars.worker_info()
                self._info = (hashlib.sha256(text.encode()).hexdigest(), text)
            proof, abandon = pool.prove(self._info, so)
            try:
                await asyncio.wrap_future(proof)
            except asyncio.CancelledError:
                abandon.set()  # the client left: its worker is killed
                raise
        except InvalidConstraint as e:
            raise RequestRejected(str(e), param=e.where) from None
        except CompileBusy as e:
            raise RequestRejected(str(e), ErrorCode.COMPILE_BUSY) from None
        await asyncio.wrap_future(pool.run_compile(self._compile, so))

    _info: tuple[str, str] | None = None  # (key, JSON) of the vocabulary as xgrammar sees it, for the workers

    def _grammar_compiler(self, so: StructuredOutput) -> GrammarCompiler:
        if self.tokenizer is None:
            raise RequestRejected(f"{so.param}: engine {self.name!r} has no tokenizer to constrain the output with",
                                  param=so.param)
        with self._grammars_lock:  # built once, by whichever caller thread comes first
            if self.grammars is None:
                self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
                self.grammars.max_cached_bytes = self.compile_limits.cache_bytes
        return self.grammars

    def _compile(self, so: StructuredOutput) -> object:
        """The constraint compiled for this engine's vocabulary (cached), within the size budgets;
        RequestRejected naming its field."""
        grammars = self._grammar_compiler(so)
        try:
            if not grammars.cached(so):
                check_budget(so, self.compile_pool.limits if self.compile_pool else self.compile_limits)
                require_finite_derivation(so)
            return grammars.compile(so)
        except InvalidConstraint as e:
            raise RequestRejected(str(e), param=e.where) from None

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
        consumers; a finished request leaves the engine's books."""
        outs = []
        for req in reqs:
            done = req.finished if final is None else final
            if done:
                req.metrics.finished_time = time.monotonic()
                self.requests.pop(req.request_id, None)
                self._live_ids.discard(req.request_id)
            if req.emit is not None and (done or req.stream):
                outs.append((req, self.output.build(req, done)))
        self.output.deliver(outs)

    def stats(self) -> dict:
        pool = self.pool.stats()
        pages = {p for s in self.scheduler.running for p in s.pages}
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
