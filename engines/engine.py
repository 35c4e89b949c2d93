"""`ModelEngine`: one model's serving state, stepped synchronously on the thread that owns the device. Its step
is DESIGN.md section 3: inbox, drafts, schedule, forward, sample or verify, `Scheduler.update`, rollback,
emit. Outputs leave through per-request callbacks."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import os
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
from engines.sampler import Sampled, min_tokens_ban, sample_sequences
from engines.sampling_params import SamplingParams
from engines.scheduler import Scheduler, SchedulerOutput
from engines.sequence import Request, Sequence
from engines.spec.decoder import SpeculativeDecoder
from engines.spec.drafter import Drafter, greedy_bans, plain_params
from engines.spec.verify import verify
from engines.step_model import BatchCapController, StepTimer, step_clock
from engines.structured import GrammarCompiler, InvalidConstraint, MaskPrefetch, StructuredOutput

if TYPE_CHECKING:
    from concurrent.futures import Future

    from engines.attention import StepBatch
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
            raise RequestRejected(f"logit_bias token ids must be in [0, {vocab}) for model {self.name!r}")
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
                text = grammars.info.serialize_json()
                self._info = (hashlib.sha256(text.encode()).hexdigest(), text)
            proof, abandon = pool.prove(self._info, so)
            try:
                await asyncio.wrap_future(proof)
            except asyncio.CancelledError:
                abandon.set()  # the client left: its worker is killed
                raise
        except InvalidConstraint as e:
            raise RequestRejected(str(e), param=e.param) from None
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
            raise RequestRejected(str(e), param=e.param) from None

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    # ---- engine side (the device thread) -------------------------------------------------------------------
    def step(self) -> int:
        """One scheduling step; returns the number of tokens the model processed."""
        self.timer.step_started()
        self._drain_inbox()
        n = self._multi_step_tokens()
        if n:
            return self._multi_step(n)
        k, windows = self._spec_windows()
        if k:
            return self._spec_windows_step(k, windows)
        drafts = self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule(drafts)
        for req in _requests(sched.expired):
            self._fail(req, f"waited past its {req.ttft_s:g} s time-to-first-token target", ErrorCode.TTFT_EXPIRED)
        if not sched:
            return 0
        self._step_started(sched)
        masks = self.mask_prefetch.start(sched.seqs, sched.drafts)  # grammar masks while the forward runs
        try:
            logits, batch = self.runner.execute(sched.seqs, sched.num_tokens, sched.drafts)
        except Exception as e:  # the whole batch failed: fail exactly its requests, keep serving others
            log.exception("engine %s: batch forward failed", self.name)
            for req in _requests(sched.seqs):
                self._fail(req, f"engine error during forward: {type(e).__name__}: {e}")
            self.timer.forward_failed()
            if masks is not None:
                masks.exception()  # wait: the grammars are the engine thread's again
            return 0
        sampled, error = self._sample(logits, batch, sched, masks)
        touched = self.scheduler.update(sched, sampled)
        self.speculator.rollback(sched.drafts, sampled)
        self._emit_many(touched)
        if error is not None:
            for req in _requests(batch.sample_seqs):
                self._fail(req, error)
        self.cap_controller.step_finished(sched.num_decode_seqs, sched.num_prefill_tokens)
        self.speculator.observe_step(sched, *self.timer.step_finished())
        return sched.total_tokens

    def _multi_step_tokens(self) -> int:
        """How many tokens every running sequence takes this step in one C call (`_multi_step`), or 0 for a normal
        step. Only where nothing could differ from `n` single steps: the CPU forward can take it, no drafts this
        step (no drafter, or adaptive k picks plain decoding), nobody waiting (a newcomer waits at most `n`
        tokens' time), every sequence decoding with raw-logit greedy or temperature alone without a seed (a
        seeded draw stays on the sampler's path, which its reproducibility is defined by; min_tokens' ban of
        EOS and stop ids is applied in the C loop) and no logprobs or grammar, `n` tokens within each one's max
        length, the token budget and the free pages (no preemption)."""
        n = MULTI_STEP_TOKENS
        sch = self.scheduler
        running = sch.running
        if (n < 2 or not running or sch.num_waiting or self._inbox
                or self.speculator.supplied or len(running) * n > sch.max_num_batched_tokens
                or not self.runner.can_draft_greedy([1])):
            return 0
        vocab = self.config.vocab_size
        for seq in running:
            p = seq.request.params
            if (seq.num_tokens - seq.num_computed != 1 or (not p.greedy and seq.seed is not None)
                    or p.logprobs is not None or seq.grammar is not None
                    or not plain_params(p, vocab, min_tokens_ok=True)):
                return 0
            n = min(n, seq.max_len - seq.num_tokens)
        if n < 2 or sum(sch.pages_needed(seq, n) for seq in running) > self.pool.num_free:
            return 0
        # with a drafter: only when adaptive k picks plain decoding for this step (its choice is kept for
        # `propose` otherwise); the multi-step steps then measure plain decoding for it
        if self.speculator.drafter is not None and self.speculator.plan(running):
            return 0
        return n

    def _multi_step(self, n: int) -> int:
        """`n` tokens for every running sequence: the scheduler books them as one token and n - 1 drafts (pages,
        budget), the runner computes them in one call (`ModelRunner.draft_greedy`: forward, head and argmax, or
        a draw from softmax(logits / temperature) at a uniform from torch's generator as the sampler's inverse
        CDF takes it, n times), and `Scheduler.update` takes them as n - 1 accepted drafts and a bonus token,
        so EOS, stop ids, stop strings and max length end a sequence mid-way exactly as in single steps."""
        running = list(self.scheduler.running)
        self.speculator.skip_step()
        sched = self.scheduler.schedule({seq.seq_id: [0] * (n - 1) for seq in running})
        if not sched:
            return 0
        clean = (not sched.preempted and len(sched.seqs) == len(running)
                 and all(k == n and len(sched.drafts.get(seq.seq_id, ())) == n - 1
                         for seq, k in zip(sched.seqs, sched.num_tokens)))
        self.timer.forward_started()
        self.num_steps += 1
        try:
            if not clean:  # not expected (the checks above rule it out): verify the placeholders instead, which
                # rejects them and samples the true next token
                logits, batch = self.runner.execute(sched.seqs, sched.num_tokens, sched.drafts)
                sampled = verify(logits, batch, sched.drafts, {}, self.eos_token_ids, None)
            else:
                bans = greedy_bans(sched.seqs, [min_tokens_ban(s.request.params, self.eos_token_ids)
                                                for s in sched.seqs])
                temps = [0.0 if s.request.params.greedy else s.request.params.temperature for s in sched.seqs]
                uniforms = torch.rand(len(temps), n) if any(temps) else None
                tokens = self.runner.draft_greedy(sched.seqs, [1] * len(sched.seqs), n, bans, temps, uniforms)
                sampled = [Sampled(seq, toks, num_accepted=n - 1) for seq, toks in zip(sched.seqs, tokens)]
        except Exception as e:  # the whole batch failed: fail exactly its requests, keep serving others
            log.exception("engine %s: multi-step forward failed", self.name)
            for req in _requests(sched.seqs):
                self._fail(req, f"engine error during forward: {type(e).__name__}: {e}")
            self.timer.forward_failed()
            return 0
        self._emit_many(self.scheduler.update(sched, sampled))
        # not fed to the step-time model: this step is n decode steps; adaptive k sees it as n plain steps
        forward_s, step_s = self.timer.step_finished()
        if clean:
            self.speculator.observe_plain_steps(len(sched.seqs), n, forward_s, step_s)
        return sched.total_tokens

    def _spec_windows(self) -> tuple[int, int]:
        """(k, windows) of a step of drafting windows in a loop (`_spec_windows_step`), or (0, 0) for a normal
        step. Only where `_multi_step_tokens` found every sequence on raw logits with nobody waiting and adaptive
        k then drafted for all of them with one k, every one is greedy, no min_tokens ban is left, every drafter is at most
        its last draft and bonus token behind (no catch-up: that step goes the normal way) and drafts in one C
        call, and the token budget and the pool take at least two whole windows of every sequence (up to
        SPEC_WINDOWS)."""
        sp = self.speculator
        dr = sp.drafter
        sch = self.scheduler
        running = sch.running
        if dr is None or SPEC_WINDOWS < 2 or dr.lean is not None:
            return 0, 0
        k = sp.planned_for_all(running)
        windows = min(SPEC_WINDOWS, sch.max_num_batched_tokens // (len(running) * (k + 1))) if k else 0
        if windows < 2 or not dr.runner.can_draft_greedy([1]):
            return 0, 0
        pages = 0
        for seq in running:
            p = seq.request.params
            if (not p.greedy or p.min_tokens > seq.num_output_tokens or dr.lag(seq) > 2
                    or seq.max_len - seq.num_tokens < k):  # room for one whole window
                return 0, 0
            pages += sch.pages_needed(seq, min(windows * (k + 1), seq.max_len - seq.num_tokens + 1))
            pages += -(-(seq.num_tokens + windows * (k + 1)) // self.pool.block_size)  # the draft's, at most
        if pages + len(running) + 1 > self.pool.num_free:
            return 0, 0
        sp.drop_plan()
        return k, windows

    def _spec_windows_step(self, k: int, max_windows: int) -> int:
        """Up to `max_windows` drafting windows of k greedy drafts for every running sequence, verified one after
        another in one step: the scheduler books each sequence's tokens as one token and placeholder drafts
        (pages, budget, as `_multi_step` does), each window drafts in one C call and verifies through the
        runner, and `Scheduler.update` takes the tokens the windows kept as accepted drafts and a bonus token
        (stops and max length apply there). What the loop saves is the per-window work of an engine step:
        scheduling, the sampler's bookkeeping, updates and emits. Between windows adaptive k weighs the choice
        again, and the loop ends where it no longer drafts k for every sequence, at a sequence's stop token,
        or where a window would not fit in what was booked."""
        sch = self.scheduler
        sp = self.speculator
        running = list(sch.running)
        room = {seq.seq_id: min(max_windows * (k + 1), seq.max_len - seq.num_tokens + 1) for seq in running}
        sched = sch.schedule({seq.seq_id: [0] * (room[seq.seq_id] - 1) for seq in running})
        if not sched:
            return 0
        self.timer.forward_started()
        self.num_steps += 1
        clean = (not sched.preempted and len(sched.seqs) == len(running)
                 and all(n == room[seq.seq_id] and len(sched.drafts.get(seq.seq_id, ())) == n - 1
                         for seq, n in zip(sched.seqs, sched.num_tokens)))
        saved = [(seq, len(seq.token_ids), seq.num_computed) for seq in sched.seqs]
        out: dict[int, list[int]] = {seq.seq_id: [] for seq in sched.seqs}
        windows = 0
        try:
            if clean:
                windows = self._verify_windows(sched.seqs, k, room, out)
            if not windows:  # not expected (the checks above rule it out): verify the placeholders instead,
                # which rejects them and samples the true next token
                logits, batch = self.runner.execute(sched.seqs, sched.num_tokens, sched.drafts)
                sampled = verify(logits, batch, sched.drafts, {}, self.eos_token_ids, None)
        except Exception as e:  # the whole batch failed: fail exactly its requests, keep serving others
            log.exception("engine %s: speculative windows failed", self.name)
            for seq, length, computed in saved:
                del seq.token_ids[length:]
                seq.num_computed = computed
            for req in _requests(sched.seqs):
                self._fail(req, f"engine error during forward: {type(e).__name__}: {e}")
            self.timer.forward_failed()
            return 0
        if windows:
            for seq, length, computed in saved:  # `Scheduler.update` appends them again, with stops and text
                del seq.token_ids[length:]
                seq.num_computed = computed
            sampled = [Sampled(seq, toks, num_accepted=len(toks) - 1) for seq in sched.seqs
                       if (toks := out[seq.seq_id])]
        self._emit_many(sch.update(sched, sampled))
        forward_s, step_s = self.timer.step_finished()
        if windows:  # every window drafted for the whole batch: a measure of a step at k
            sp.adaptive.observe_step(len(sched.seqs), k, step_s / windows)
        return sched.total_tokens

    def _verify_windows(self, seqs: list[Sequence], k: int, room: dict[int, int], out: dict[int, list[int]]
                        ) -> int:
        """`_spec_windows_step`'s loop: each sequence's kept tokens into `out`, the sequence itself advanced
        past them for the drafter and the runner (the caller restores it for `Scheduler.update`); returns the
        windows run (0: none, nothing changed), each for all of `seqs`: where one of them stops, the loop ends
        (the next step weighs the smaller batch, whose windows measure that batch size)."""
        sp = self.speculator
        dr = sp.drafter
        spare = len(seqs) + 1
        active = list(seqs)
        windows = 0
        while active:  # every sequence in it has room for a whole window of k (`_spec_windows`, `still`)
            if windows:  # adaptive k weighs this window as it would a step's (the plan is this loop's alone)
                sp.plan(active)
                again = sp.planned_for_all(active) == k
                sp.drop_plan()
                if not again:
                    break
            states = [dr.reserve(seq, k, spare) for seq in active]
            if any(st is None for st in states):
                break
            drafts, _ = dr.draft(active, states, [k] * len(active), [set()] * len(active), sp.adaptive.draft)
            logits, _ = self.runner.execute(active, [k + 1] * len(active),
                                            {seq.seq_id: d for seq, d in zip(active, drafts)})
            targets = logits.argmax(dim=-1).tolist()
            still = []
            for i, (seq, d) in enumerate(zip(active, drafts)):
                t = targets[i * (k + 1):(i + 1) * (k + 1)]
                a = 0
                while a < k and d[a] == t[a]:
                    a += 1
                kept = d[:a] + [t[a]]
                seq.token_ids.extend(kept)
                seq.num_computed += a + 1
                out[seq.seq_id].extend(kept)
                dr.rollback(seq, seq.num_tokens - 1)
                sp.count_window(seq, k, a)
                p = seq.request.params
                stops = p.stop_token_ids if p.ignore_eos else (*self.eos_token_ids, *p.stop_token_ids)
                if not any(tok in stops for tok in kept) and room[seq.seq_id] - len(out[seq.seq_id]) > k:
                    still.append(seq)
            windows += 1
            if len(still) < len(seqs):
                break
            active = still
        return windows

    def _sample(self, logits: torch.Tensor, batch: StepBatch, sched: SchedulerOutput, masks: Future | None
                ) -> tuple[list[Sampled], str | None]:
        """Sample (or verify the drafts of) every sequence whose chunk reached its last token."""
        try:
            ahead = masks.result() if masks is not None else None
            if not batch.sample_seqs:
                return [], None
            if sched.drafts:
                return verify(logits, batch, sched.drafts, self.speculator.draft_probs, self.eos_token_ids,
                              ahead), None
            return sample_sequences(logits, batch.sample_seqs, self.eos_token_ids, ahead), None
        except Exception as e:
            log.exception("engine %s: sampling failed", self.name)
            return [], f"engine error during sampling: {type(e).__name__}: {e}"

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
        out = self._output(req, final)
        if out is not None:
            self._deliver(req, out)

    def _output(self, req: Request, final: bool) -> RequestOutput | None:
        if final:
            req.metrics.finished_time = time.monotonic()
            self.requests.pop(req.request_id, None)
            self._live_ids.discard(req.request_id)
        if req.emit is None or not (final or req.stream):
            return None
        return self.output.build(req, final)

    def _deliver(self, req: Request, out: RequestOutput) -> None:
        try:
            req.emit(out)
        except Exception:  # a consumer that went away must not take the engine down
            log.exception("engine %s: delivering output of %s failed", self.name, req.request_id)

    def _emit_many(self, reqs: list[Request]) -> None:
        """A step's outputs: those for an asyncio consumer (an `emit` with `loop` and `put`, as AsyncEngine
        makes) handed to each event loop in one `call_soon_threadsafe` (one wake-up per step, not one per
        request), the rest delivered one by one."""
        by_loop: dict[int, tuple[object, list]] = {}
        for req in reqs:
            out = self._output(req, req.finished)
            if out is None:
                continue
            loop = getattr(req.emit, "loop", None)
            if loop is None:
                self._deliver(req, out)
            else:
                by_loop.setdefault(id(loop), (loop, []))[1].append((req.emit.put, out))
        for loop, items in by_loop.values():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass

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


# greedy tokens a step may take per sequence in one C call when nothing else could differ (`_multi_step`);
# TANDEM_MULTI_STEP=1 turns it off
MULTI_STEP_TOKENS = int(os.environ.get("TANDEM_MULTI_STEP", "4"))
# drafting windows a step may verify one after another where every sequence drafts greedily (`_spec_windows_step`);
# TANDEM_SPEC_WINDOWS=1 turns it off
SPEC_WINDOWS = int(os.environ.get("TANDEM_SPEC_WINDOWS", "4"))


def _put_all(items: list) -> None:
    for put, out in items:
        put(out)


def _requests(seqs: list[Sequence]) -> list[Request]:
    """The distinct requests of `seqs`, in order."""
    return list({id(s.request): s.request for s in seqs}.values())
