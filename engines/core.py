"""The engine loop. `ModelEngine` serves one model (scheduler + runner + sampler + output processing, stepped
synchronously); `EngineCore` loads every model, carves the one KV pool they share, and runs all engines in
one background thread that owns the device. Outputs leave through per-request callbacks."""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engines.errors import EngineDeadError, EngineError, ErrorCode, RequestRejected
from engines.kv_pool import KVGeometry, KVPool
from engines.model import Transformer, cpu_weight_layout
from engines.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engines.runner import ModelRunner
from engines.sampler import SamplerRow, sample
from engines.sampling_params import SamplingParams
from engines.scheduler import Scheduler
from engines.sequence import Request, SeqStatus, Sequence
from engines.speculative import Drafter, SpeculativeDecoder
from engines.step_model import BatchCapController

if TYPE_CHECKING:
    from engines.async_engine import AsyncEngine

log = logging.getLogger("tandem.engine")

DEFAULT_NUM_SPECULATIVE_TOKENS = 4  # max k when a spec names a draft engine but no num_speculative_tokens
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV storage: a float dtype, int8 (per token-head scales) or fp8 e4m3 (per-tensor scales)
_KV_DTYPES = {**_DTYPES, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


@dataclass
class EngineSpec:
    name: str
    model: str | Path | Transformer  # a checkpoint folder, or a built Transformer (token-id prompts only)
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    draft: str | None = None
    num_speculative_tokens: int = 0
    quantization: str = "none"  # none | int8 | int4: weight-only, applied at load (lm_head, embeddings stay float)
    attention_backend: str = "auto"
    quantization_group_size: int = 64  # int4 only: 32, 64 or 128
    cuda_graphs: bool = True  # CUDA + Triton attention: decode steps replay graphs captured per batch bucket
    # waiting requests by priority then TTFT deadline, batch caps from the running TPOT targets; False: plain
    # (priority, arrival) order under the configured limits only
    slo_scheduling: bool = True
    # seconds of TTFT deadline one priority class is worth (waiting_queue.py): small is close to earliest-
    # deadline-first, which meets the most deadlines when admission keeps them feasible; large starves lower
    # classes for that long under sustained load
    priority_aging_s: float = 30.0
    # a waiting request past its TTFT deadline (before any token) ends with ErrorCode.TTFT_EXPIRED instead of being
    # served late: it can no longer count as goodput, and serving it delays requests that still can
    drop_expired_requests: bool = False


@dataclass
class PoolSpec:
    memory_bytes: int | None = None  # None: memory_fraction of free device memory (CUDA) or a sized default (CPU)
    memory_fraction: float = 0.9
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto: each model's own dtype; float32 | bfloat16 | float16 | int8 | fp8


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object | None
    eos_token_ids: set[int]
    generation: object | None


def load_model(spec: EngineSpec, device: torch.device) -> LoadedModel:
    if isinstance(spec.model, Transformer):
        # quantising swaps modules in place: never do that to the caller's model
        model = copy.deepcopy(spec.model) if spec.quantization != "none" else spec.model
        model = cpu_weight_layout(_quantize(model.to(device).eval(), spec))
        return LoadedModel(model, None, set(model.config.eos_token_ids), None)
    from engines.loader import load_checkpoint
    from engines.tokenizer import Tokenizer

    ckpt = load_checkpoint(spec.model, dtype=spec.dtype, device=device)
    tokenizer = Tokenizer.from_pretrained(spec.model)
    eos = set(ckpt.eos_token_ids) | set(tokenizer.eos_token_ids)
    return LoadedModel(cpu_weight_layout(_quantize(ckpt.model, spec)), tokenizer, eos, ckpt.generation)


def _quantize(model: Transformer, spec: EngineSpec) -> Transformer:
    """Quantise-on-load: nn.Linear -> kernels' QuantLinear (int8 per channel, int4 per group)."""
    if spec.quantization == "none":
        return model
    from kernels.quant_matmul import quantize_model

    with torch.no_grad():
        quantize_model(model, spec.quantization, spec.quantization_group_size)
    return model


class ModelEngine:
    """One model's serving state. `add_request` and `abort` are thread-safe (they only queue); `step` runs
    on the thread that owns the device: it schedules, runs the model, samples and emits outputs."""

    def __init__(self, spec: EngineSpec, loaded: LoadedModel, pool: KVPool, model_id: int,
                 device: torch.device):
        self.spec = spec
        self.name = spec.name
        self.model = loaded.model
        self.config = loaded.model.config
        self.tokenizer = loaded.tokenizer
        self.generation_defaults = loaded.generation
        self.eos_token_ids = loaded.eos_token_ids
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
                                   drop_expired=spec.drop_expired_requests)
        self.busy_s = 0.0  # cumulative seconds spent stepping this engine (device time, for cost accounting)
        self.runner = ModelRunner(self.model, pool.view(model_id), pool.block_size, device,
                                  spec.attention_backend, pool.scales(model_id))
        if spec.cuda_graphs and device.type == "cuda" and self.runner.use_kernel:
            self.runner.enable_decode_graphs(spec.max_num_seqs, self.max_model_len)
        # verifies supplied drafts always; EngineCore gives it a drafter when the spec names a draft engine
        self.speculator = SpeculativeDecoder(self, None, 0)
        self.requests: dict[str, Request] = {}
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._live_ids: set[str] = set()  # ids accepted and not yet finished (guarded by the GIL's atomic ops)
        self.num_steps = 0
        self._last_step_end: float | None = None  # adaptive k's clock at the end of the last step
        self.num_generated_tokens = 0

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
                seq.generator = torch.Generator(self.device).manual_seed(params.seed + i)
            if self.tokenizer is not None:
                seq.detokenizer = self.tokenizer.detokenizer(params.skip_special_tokens, prompt_ids=ids)
            if params.logprobs is not None:
                seq.logprobs = []
            if draft_token_ids:  # verified first, at most max_tokens of them
                seq.supplied_draft_ids = draft_token_ids[:max_tokens]
            req.seqs.append(seq)
        return req

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    # ---- engine side (the device thread) -------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                req = item
                self.requests[req.request_id] = req
                for seq in req.seqs:
                    self.scheduler.add(seq)
                    if seq.supplied_draft_ids:
                        self.speculator.supplied.add(seq)
            else:
                req = self.requests.get(item)
                if req is not None and not req.finished:
                    for seq in req.seqs:
                        if not seq.finished:
                            seq.finish_reason = "abort"
                            self.scheduler.finish(seq)
                    self._emit(req, final=True)

    def step(self) -> int:
        """One scheduling step; returns the number of tokens the model processed."""
        clock = self.speculator.adaptive.target.clock
        step0 = clock()
        # a whole step's cost: drafting included, and the time since the previous step ended when steps run
        # back to back (the loop around step(), the inbox): what the choice of k really trades
        if self._last_step_end is not None and step0 - self._last_step_end < 0.005:
            step0 = self._last_step_end
        self._last_step_end = None
        self._drain_inbox()
        self.speculator.propose()  # sets Sequence.spec_token_ids (supplied drafts, the drafter's k)
        sched = self.scheduler.schedule()
        for req in {id(s.request): s.request for s in sched.expired}.values():
            self._fail(req, f"waited past its {req.ttft_s:g} s time-to-first-token target", ErrorCode.TTFT_EXPIRED)
        if not sched:
            return 0
        t0 = self.speculator.adaptive.target.clock()
        busy0 = time.perf_counter()
        self.cap_controller.step_started()
        self.num_steps += 1
        now = time.monotonic()
        for seq in sched.seqs:
            m = seq.request.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                m.num_cached_tokens = seq.num_cached_tokens
        drafts = sched.num_draft_tokens
        try:
            if drafts:  # the verifier needs the layout: 1 + k logits rows per verifying sequence
                logits, batch = self.runner.execute_batch(sched.seqs, sched.num_tokens)
                sample_seqs = batch.sample_seqs
            else:
                logits, sample_seqs = self.runner.execute(sched.seqs, sched.num_tokens)
            for seq, n in zip(sched.seqs, sched.num_tokens):  # drafts' K/V: only the verifier commits them
                self.scheduler.commit_computed(seq, n - drafts.get(seq.seq_id, 0) if drafts else n)
        except Exception as e:  # the whole batch failed: fail exactly its requests, keep serving others
            log.exception("engine %s: batch forward failed", self.name)
            for req in {id(s.request): s.request for s in sched.seqs}.values():
                self._fail(req, f"engine error during forward: {type(e).__name__}: {e}")
            self.busy_s += time.perf_counter() - busy0
            return 0
        if drafts:
            self.speculator.verify(logits, batch, drafts)
        elif sample_seqs:
            self._sample_and_append(logits, sample_seqs)
        self.cap_controller.step_finished(sched.num_decode_seqs, sched.num_prefill_tokens)
        self.busy_s += time.perf_counter() - busy0
        seconds = self.speculator.adaptive.target.clock() - t0
        self.speculator.adaptive.target.observe(sched.total_tokens, seconds)
        if sched.num_prefill_tokens == 0 and sched.num_decode_seqs and self.speculator.drafter is not None:
            ks = set(drafts.values()) if drafts else {0}
            if len(ks) == 1 and (not drafts or len(drafts) == sched.num_decode_seqs):  # every sequence alike
                self.speculator.adaptive.observe_step(sched.num_decode_seqs, ks.pop(), clock() - step0)
        self._last_step_end = clock()
        return sched.total_tokens

    def _sample_and_append(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows = [self._sampler_row(s) for s in seqs]
        stop_ids = [self.eos_token_ids | set(s.request.params.stop_token_ids) if s.request.params.min_tokens
                    else set() for s in seqs]
        try:
            result = sample(logits, rows, stop_ids)
        except Exception as e:
            log.exception("engine %s: sampling failed", self.name)
            for req in {id(s.request): s.request for s in seqs}.values():
                self._fail(req, f"engine error during sampling: {type(e).__name__}: {e}")
            return
        touched: dict[int, Request] = {}
        now = time.monotonic()
        for i, seq in enumerate(seqs):
            req = seq.request
            if req.error is not None or seq.finished:
                continue
            try:
                self._append_token(seq, result.token_ids[i], result.sampled_logprobs[i], result.logprobs[i])
            except Exception as e:  # one request's processing failed: fail it alone
                log.exception("engine %s: request %s failed", self.name, req.request_id)
                self._fail(req, f"engine error: {type(e).__name__}: {e}")
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            touched[id(req)] = req
        self.num_generated_tokens += len(seqs)
        for req in touched.values():
            if req.error is None:
                self._emit(req, final=req.finished)

    @staticmethod
    def _sampler_row(seq: Sequence) -> SamplerRow:
        # the token history is copied only for the rows whose options read it (penalties, min_tokens)
        p = seq.request.params
        history = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        prompt = seq.token_ids[:seq.prompt_len] if history else ()
        output = seq.token_ids[seq.prompt_len:] if history or p.min_tokens else ()
        return SamplerRow(p, prompt, output, seq.generator)

    def _append_token(self, seq: Sequence, token: int, logprob: float | None, pos_logprobs: dict | None) -> None:
        params = seq.request.params
        seq.token_ids.append(token)
        if pos_logprobs is not None:
            if self.tokenizer is not None:
                for t, lp in pos_logprobs.items():
                    lp.decoded_token = self.tokenizer.token_text(t)
            seq.logprobs.append(pos_logprobs)
            seq.cumulative_logprob += logprob
        n_out = seq.num_output_tokens
        can_stop = n_out >= params.min_tokens
        if can_stop and not params.ignore_eos and token in self.eos_token_ids:
            return self._finish(seq, "stop", None)
        if can_stop and token in params.stop_token_ids:
            return self._finish(seq, "stop", token)
        if seq.detokenizer is not None:
            before = len(seq.text)
            seq.text += seq.detokenizer.step(token)
            if params.stop and can_stop and self._check_stop_strings(seq, before):
                return None
        if seq.num_tokens >= seq.max_len:
            return self._finish(seq, "length", None, flush=True)
        return None

    def _check_stop_strings(self, seq: Sequence, before: int) -> bool:
        """Find a stop string completed by the new text (it may start in earlier text); cut the text there."""
        stops = seq.request.params.stop
        start = max(0, before - max(len(s) for s in stops) + 1)
        best, which = -1, None
        for s in stops:
            i = seq.text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best, which = i, s
        if which is None:
            return False
        seq.text = seq.text[:best]
        self._finish(seq, "stop", which)
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None, flush: bool = False) -> None:
        if flush and seq.detokenizer is not None and hasattr(seq.detokenizer, "finish"):
            seq.text += seq.detokenizer.finish()
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq)

    def _fail(self, req: Request, message: str, code: ErrorCode = ErrorCode.ENGINE_ERROR) -> None:
        req.error = EngineError(code, message)
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "error"
                self.scheduler.finish(seq)
        self._emit(req, final=True)

    def fail_all(self, message: str, code: ErrorCode = ErrorCode.ENGINE_ERROR) -> None:
        self._drain_inbox()
        for req in list(self.requests.values()):
            if not req.finished:
                self._fail(req, message, code)

    def _emit(self, req: Request, final: bool) -> None:
        if final:
            req.metrics.finished_time = time.monotonic()
            self.requests.pop(req.request_id, None)
            self._live_ids.discard(req.request_id)
        if req.emit is None or not (final or req.stream):
            return
        outs = []
        for seq in req.seqs:
            params = seq.request.params
            text_end = len(seq.text)
            if params.stop and not seq.finished:  # hold back what could be the start of a stop string
                text_end = max(seq.sent_text, text_end - max(len(s) for s in params.stop) + 1)
            toks = seq.output_token_ids
            lps = seq.logprobs
            outs.append(CompletionOutput(
                index=seq.index, text=seq.text[:text_end] if not seq.finished else seq.text,
                token_ids=toks, logprobs=list(lps) if lps is not None else None,
                cumulative_logprob=seq.cumulative_logprob if lps is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                delta_text=(seq.text if seq.finished else seq.text[:text_end])[seq.sent_text:],
                delta_token_ids=toks[seq.sent_tokens:],
                delta_logprobs=lps[seq.sent_logprobs:] if lps is not None else None))
            seq.sent_tokens = len(toks)
            seq.sent_text = len(seq.text) if seq.finished else text_end
            seq.sent_logprobs = len(lps) if lps is not None else 0
        out = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished=final,
                            error=req.error, metrics=req.metrics, model=self.name)
        try:
            req.emit(out)
        except Exception:  # a consumer that went away must not take the engine down
            log.exception("engine %s: delivering output of %s failed", self.name, req.request_id)

    def stats(self) -> dict:
        pool = self.pool.stats()
        pages = {p for s in self.scheduler.running for p in s.pages}
        return {"name": self.name, "kv_usage": pool["kv_usage"], "num_running": self.scheduler.num_running,
                "num_waiting": self.scheduler.num_waiting,
                "prefix_cache_queries": self.scheduler.prefix_queries,
                "prefix_cache_hits": self.scheduler.prefix_hits, "num_preemptions": self.scheduler.num_preemptions,
                "num_expired": self.scheduler.num_expired,
                "used_blocks": pool["used_pages"], "engine_used_blocks": len(pages),
                "num_steps": self.num_steps, "num_generated_tokens": self.num_generated_tokens,
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


def _pool_bytes(pool: PoolSpec, engines_: list[tuple[EngineSpec, LoadedModel]], page_bytes: int,
                device: torch.device) -> int:
    if pool.memory_bytes is not None:
        return int(pool.memory_bytes)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * pool.memory_fraction)
    # CPU: room for every engine's full batch at full context, capped at 1 GiB (calloc'd, touched lazily)
    tokens = 0
    for spec, loaded in engines_:
        ctx = min(spec.max_model_len or loaded.model.config.max_position_embeddings,
                  loaded.model.config.max_position_embeddings)
        tokens += spec.max_num_seqs * ctx
    return min(1 << 30, -(-tokens // pool.block_size) * page_bytes)


class EngineCore:
    """Loads every model, carves ONE KV pool shared by all of them, and steps every engine with work in one
    background thread (`start()` / `shutdown()`). Idle, the thread sleeps on a condition variable."""

    def __init__(self, specs: list[EngineSpec], pool: PoolSpec | None = None, device: str | torch.device = "cpu"):
        if not specs:
            raise ValueError("EngineCore needs at least one EngineSpec")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        for s in specs:
            if s.num_speculative_tokens < 0 or (s.num_speculative_tokens and s.draft is None):
                raise ValueError(f"engine {s.name!r}: num_speculative_tokens={s.num_speculative_tokens} needs a "
                                 "draft engine: set draft to another engine's name, or num_speculative_tokens=0")
            if s.draft is not None and (s.draft == s.name or s.draft not in names):
                raise ValueError(f"engine {s.name!r}: draft={s.draft!r} must name another engine of this core "
                                 f"(have {names})")
            if s.quantization not in ("none", "int8", "int4"):
                raise ValueError(f"engine {s.name!r}: quantization={s.quantization!r} is invalid: use none, int8 "
                                 "or int4")
            if s.quantization == "int4" and s.quantization_group_size not in (32, 64, 128):
                raise ValueError(f"engine {s.name!r}: quantization_group_size={s.quantization_group_size} is "
                                 "invalid for int4: use 32, 64 or 128")
        pool = pool or PoolSpec()
        if pool.kv_cache_dtype not in ("auto", *_KV_DTYPES):
            raise ValueError(f"kv_cache_dtype={pool.kv_cache_dtype!r} is not supported: use auto, "
                             "float32, bfloat16, float16, int8 or fp8")
        self.device = torch.device(device)
        loaded = [(s, load_model(s, self.device)) for s in specs]
        geoms = []
        for _, lm in loaded:
            cfg = lm.model.config
            dtype = (next(lm.model.parameters()).dtype if pool.kv_cache_dtype == "auto"
                     else _KV_DTYPES[pool.kv_cache_dtype])
            geoms.append(KVGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype))
        page_bytes = max(g.page_bytes(pool.block_size) for g in geoms)
        self.pool_spec = pool
        self.pool = KVPool(geoms, _pool_bytes(pool, loaded, page_bytes, self.device), pool.block_size,
                           self.device, pool.enable_prefix_caching)
        self.engines: dict[str, ModelEngine] = {
            s.name: ModelEngine(s, lm, self.pool, i, self.device) for i, (s, lm) in enumerate(loaded)}
        for s in specs:
            if s.draft is not None:
                target, draft = self.engines[s.name], self.engines[s.draft]
                if draft.config.vocab_size != target.config.vocab_size:
                    raise ValueError(f"engine {s.name!r}: draft {s.draft!r} has vocabulary "
                                     f"{draft.config.vocab_size}, the engine {target.config.vocab_size}: a draft "
                                     "model must share the engine's tokenizer")
                k_max = s.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS
                target.speculator = SpeculativeDecoder(target, Drafter(draft), k_max)
        self._async: dict[str, AsyncEngine] = {}
        self._cv = threading.Condition()
        self._stop = False
        self._dead: str | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> EngineCore:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tandem-engine-core", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._dead = self._dead or "engine shut down"
        for e in self.engines.values():
            e.fail_all("engine shut down", ErrorCode.ENGINE_DEAD)

    def __enter__(self) -> EngineCore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def engine(self, name: str) -> AsyncEngine:
        from engines.async_engine import AsyncEngine

        if name not in self.engines:
            raise KeyError(f"no engine named {name!r}; have {sorted(self.engines)}")
        if name not in self._async:
            self._async[name] = AsyncEngine(self, self.engines[name])
        return self._async[name]

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._thread is None:
            raise EngineDeadError("EngineCore is not running: call start() before generate()")

    def has_work(self) -> bool:
        return any(e.has_work() for e in self.engines.values())

    def step(self) -> int:
        """Step every engine that has work once (the loop body; `LLM` calls it directly, without a thread)."""
        done = 0
        for e in self.engines.values():
            if e.has_work():
                try:
                    done += e.step()
                except Exception as exc:  # a scheduler-level bug: this engine's requests fail, the loop lives
                    log.exception("engine %s: step failed", e.name)
                    e.fail_all(f"engine error: {type(exc).__name__}: {exc}")
        return done

    def _loop(self) -> None:
        try:
            while not self._stop:
                if not self.has_work():
                    with self._cv:
                        self._cv.wait_for(lambda: self._stop or self.has_work())
                    continue
                self.step()
        except BaseException as exc:  # never expected: make the failure visible to every caller
            self._dead = f"engine loop crashed: {type(exc).__name__}: {exc}"
            log.exception("engine core loop crashed")
            for e in self.engines.values():
                e.fail_all(self._dead, ErrorCode.ENGINE_DEAD)

    def stats(self) -> dict:
        return {"pool": self.pool.stats(), "engines": {n: e.stats() for n, e in self.engines.items()}}


def spec_kwargs(options: dict) -> tuple[dict, dict]:
    """Split flat keyword options (as `LLM(**options)` takes them) into EngineSpec and PoolSpec fields."""
    engine_fields = {f.name for f in dataclasses.fields(EngineSpec)}
    pool_fields = {f.name for f in dataclasses.fields(PoolSpec)}
    unknown = set(options) - engine_fields - pool_fields - {"device"}
    if unknown:
        raise TypeError(f"unknown engine option(s) {sorted(unknown)}; known: "
                        f"{sorted(engine_fields | pool_fields | {'device'})}")
    return ({k: v for k, v in options.items() if k in engine_fields},
            {k: v for k, v in options.items() if k in pool_fields})


__all__ = ["EngineCore", "EngineSpec", "ModelEngine", "PoolSpec", "SeqStatus"]
