"""`InputProcessor`: one engine's way in. A raw request (prompt text or token ids, `SamplingParams`, options) becomes
a validated, tokenised, constraint-prepared `Request` with its `Sequence`s, or a `RequestRejected` with its typed
code and the field at fault. Its prompt checks also serve the gateway's prompt-only path (scoring, echo)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engines.compile_pool import CompileBusy, CompileLimits, CompilePool, check_budget
from engines.embedding import POOLING
from engines.errors import ErrorCode, RequestRejected
from engines.grammar_check import require_finite_derivation
from engines.outputs import RequestMetrics
from engines.sampling_params import SamplingParams
from engines.sequence import Request, Sequence
from engines.structured import GrammarCompiler, InvalidConstraint, StructuredOutput

if TYPE_CHECKING:
    from engines.kv_pool import KVPool


class InputProcessor:
    """raw request -> validated, tokenised, constraint-prepared `Request` (or RequestRejected naming the field).

    Any thread may call it: it reads the engine's fixed limits, and the grammar cache is built under a lock."""

    # set by EngineCore: constraints are proven to compile within budget in killable worker processes
    compile_pool: CompilePool | None = None
    compile_limits: CompileLimits = CompileLimits()

    def __init__(self, name: str, tokenizer: Any, vocab_size: int, max_model_len: int, pool: KVPool,
                 eos_token_ids: Callable[[], set[int]], pages_per_block: int = 1):
        self.name = name
        self.pages_per_block = pages_per_block  # the model's page groups (engines/kv_layout.py)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: what it can embed and sample
        self.max_model_len = max_model_len
        self.pool = pool
        self._eos_token_ids = eos_token_ids  # read when the grammar compiler is built (the engine may set them)
        self.grammars: GrammarCompiler | None = None  # built with the first constrained request
        self._grammars_lock = threading.Lock()
        self._info: tuple[str, str] | None = None  # (key, JSON) of the vocabulary as xgrammar sees it, for workers

    # ---- the request ----------------------------------------------------------------------------------------
    def process(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, *,
                priority: int = 0, draft_token_ids: list[int] | None = None, ttft_s: float | None = None,
                tpot_s: float | None = None) -> Request:
        """The request and its n sequences, ready to queue; ttft_s/tpot_s are its SLO targets. RequestRejected
        if it can never be served (a structured output's compile runs here unless `precompile_async` ran)."""
        text, ids = self.tokenize(prompt)
        self.check_prompt(ids)
        drafts = self._check_ids("draft_token_ids", draft_token_ids) if draft_token_ids is not None else None
        max_tokens = self._check_length(len(ids), params.max_tokens)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise RequestRejected(f"logit_bias token ids must be in [0, {self.vocab_size}) for model "
                                  f"{self.name!r}", param="logit_bias")
        if params.stop_token_ids and not all(0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise RequestRejected(f"stop_token_ids must be in [0, {self.vocab_size}) for model {self.name!r}",
                                  param="stop_token_ids")
        compiled = self.compile(params.structured) if params.structured is not None else None
        # a page per page group and block (an upper bound where window groups free pages on the way)
        pages = -(-(len(ids) + max_tokens) // self.pool.block_size) * self.pages_per_block
        if pages > self.pool.num_pages:
            raise RequestRejected(f"the request needs {pages} KV pages (prompt + max_tokens) but the whole pool "
                                  f"has {self.pool.num_pages}: lower max_tokens or enlarge the KV pool",
                                  ErrorCode.KV_CAPACITY_EXCEEDED)
        rid = request_id if request_id is not None else uuid.uuid4().hex
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
            if drafts:  # verified first, at most max_tokens of them
                seq.supplied_draft_ids = drafts[:max_tokens]
            req.seqs.append(seq)
        return req

    def process_embedding(self, prompt: str | list[int], pooling: str, request_id: str | None = None, *,
                          priority: int = 0, ttft_s: float | None = None) -> Request:
        """An embedding request: one sequence that computes its prompt and nothing after it (its length is its
        max length, so nothing drafts, samples or looks ahead for it), then finishes with the pooled vector
        (`RequestOutput.embedding`, engines/embedding.py). The prompt may fill the context."""
        if pooling not in POOLING:
            raise RequestRejected(f"pooling={pooling!r} is invalid: use one of {', '.join(POOLING)}")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise RequestRejected("the input is empty: at least one token is needed")
        self._check_ids("input token ids", ids)
        if len(ids) > self.max_model_len:
            raise RequestRejected(f"the input has {len(ids)} tokens but {self.name!r} has a context of "
                                  f"{self.max_model_len}", ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        pages = -(-len(ids) // self.pool.block_size) * self.pages_per_block  # as `process` counts them
        if pages > self.pool.num_pages:
            raise RequestRejected(f"the input needs {pages} KV pages but the whole pool has {self.pool.num_pages}",
                                  ErrorCode.KV_CAPACITY_EXCEEDED)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        req = Request(rid, text, ids, SamplingParams(max_tokens=1), priority=priority, ttft_s=ttft_s)
        req.metrics = RequestMetrics(arrival_time=req.arrival_time)
        seq = Sequence(req, 0, list(ids), len(ids), len(ids))
        seq.pooling = pooling
        req.seqs.append(seq)
        return req

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestRejected(f"engine {self.name!r} has no tokenizer: pass the prompt as token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def check_prompt(self, ids: list[int], *, scoring: bool = False) -> None:
        """The prompt's own checks, for both paths: at least one token, every id in the vocabulary, within the
        context. Generating needs a position past the prompt for its first token; scoring (the gateway's
        prompt-only path: nothing generated) may fill the context, and its ids, echoed as text, must be the
        tokenizer's as well as the model's. Each path keeps the wording its clients have always seen."""
        if not ids:
            raise RequestRejected(f"{'The' if scoring else 'the'} prompt is empty: at least one token is needed")
        if scoring:
            vocab = self.vocab_size if self.tokenizer is None else min(self.vocab_size, self.tokenizer.vocab_size)
            if min(ids) < 0 or max(ids) >= vocab:
                raise RequestRejected(f"prompt token ids must be below {vocab} for model {self.name!r}")
        else:
            self._check_ids("prompt token ids", ids)
        limit = self.max_model_len - (0 if scoring else 1)
        if len(ids) > limit:
            said = f"prompt has {len(ids)} tokens but {self.name!r} has a context of {self.max_model_len}"
            raise RequestRejected(f"The {said}" if scoring else f"the {said}: shorten the prompt to at most {limit}",
                                  ErrorCode.CONTEXT_LENGTH_EXCEEDED)

    def _check_ids(self, what: str, ids: list[int]) -> list[int]:
        ids = [int(t) for t in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise RequestRejected(f"{what} must be in [0, {self.vocab_size}) for model {self.name!r}")
        return ids

    def _check_length(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """The request's max_tokens (by default what the context leaves): a prompt that fits with max_tokens on
        top that does not is max_tokens' fault."""
        left = self.max_model_len - prompt_tokens
        max_tokens = max_tokens if max_tokens is not None else left
        if max_tokens > left:
            raise RequestRejected(f"max_tokens={max_tokens} plus the prompt's {prompt_tokens} tokens exceeds the "
                                  f"context of {self.max_model_len} tokens: lower max_tokens to at most {left}",
                                  ErrorCode.CONTEXT_LENGTH_EXCEEDED, param="max_tokens")
        return max_tokens

    # ---- the constraint -------------------------------------------------------------------------------------
    def needs_compile(self, so: StructuredOutput) -> bool:
        """Whether processing a request with `so` would compile it (not cached yet): callers on an event loop
        await `precompile_async` first."""
        return self.tokenizer is not None and (self.grammars is None or not self.grammars.cached(so))

    async def precompile_async(self, so: StructuredOutput) -> None:
        """Compile `so` into the cache without holding anything shared: proven within the compile budget in a
        worker process (killed when over it or when the caller is cancelled), then compiled on the pool's own
        threads. RequestRejected naming its field (400) or COMPILE_BUSY (503) when it cannot be."""
        pool = self.compile_pool
        if pool is None:
            await asyncio.to_thread(self.compile, so)
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
        await asyncio.wrap_future(pool.run_compile(self.compile, so))

    def compile(self, so: StructuredOutput) -> object:
        """The constraint compiled for this engine's vocabulary (cached, any thread), within the size budgets;
        RequestRejected naming its field."""
        grammars = self._grammar_compiler(so)
        try:
            if not grammars.cached(so):
                check_budget(so, self.compile_pool.limits if self.compile_pool else self.compile_limits)
                require_finite_derivation(so)
            return grammars.compile(so)
        except InvalidConstraint as e:
            raise RequestRejected(str(e), param=e.where) from None

    def _grammar_compiler(self, so: StructuredOutput) -> GrammarCompiler:
        if self.tokenizer is None:
            raise RequestRejected(f"{so.param}: engine {self.name!r} has no tokenizer to constrain the output with",
                                  param=so.param)
        with self._grammars_lock:  # built once, by whichever caller thread comes first
            if self.grammars is None:
                self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self._eos_token_ids())
                self.grammars.max_cached_bytes = self.compile_limits.cache_bytes
        return self.grammars
