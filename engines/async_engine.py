"""The asyncio face of one engine: `generate` queues a request with the `EngineCore` thread and yields its
outputs as they arrive (handed over with `loop.call_soon_threadsafe`); asyncio never runs torch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

import torch

from engines.embedding import MAX_PENDING, EmbeddingBusy, EmbeddingFailed
from engines.errors import EngineError, ErrorCode
from engines.outputs import PositionLogprobs, RequestOutput
from engines.sampling_params import SamplingParams
from engines.scoring import score_async

if TYPE_CHECKING:
    from engines.engine import ModelEngine


class _Core(Protocol):
    """What an AsyncEngine needs of `engines.core.EngineCore`: its liveness and its wake-up."""

    def check_alive(self) -> None: ...

    def wake(self) -> None: ...


class AsyncEngine:
    def __init__(self, core: _Core, engine: ModelEngine):
        self._core = core
        self._engine = engine
        self.name = engine.name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.inputs = engine.inputs  # the engine's checks, for the gateway's prompt-only path too
        self.embedding_size = engine.config.hidden_size  # /v1/embeddings' vectors (engines/embedding.py)
        self.eos_token_ids = engine.eos_token_ids
        self.generation_defaults = engine.generation_defaults
        self.load_info = getattr(engine.model, "load_info", None)  # engines/loaded.py: what was loaded
        self._embed_pending = 0  # embedding inputs in flight (event-loop side): MAX_PENDING bounds them

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, *,
                       priority: int = 0, draft_token_ids: list[int] | None = None,
                       ttft_s: float | None = None, tpot_s: float | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs (with deltas) until one has finished=True. Raises RequestRejected before
        the first output for a request that can never be served; an engine failure arrives as an output
        with `error` set. Cancelling the iteration aborts the request and frees its KV. `ttft_s`/`tpot_s` are the
        route's SLO targets in seconds: they order the waiting queue and cap the batch (SLO scheduling)."""
        self._core.check_alive()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def emit(out: RequestOutput) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                pass

        # the engine hands a step's outputs for this loop over in one call (ModelEngine._emit_many)
        emit.loop, emit.put = loop, queue.put_nowait

        if params.structured is not None and self.inputs.needs_compile(params.structured):
            await self.inputs.precompile_async(params.structured)  # bounded, never on the event loop
        req = self._engine.add_request(prompt, params, request_id, priority=priority,
                                       draft_token_ids=draft_token_ids, emit=emit, stream=True,
                                       ttft_s=ttft_s, tpot_s=tpot_s)
        self._core.wake()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(req.request_id)

    async def score_prompt(self, token_ids: list[int], top_k: int = 0) -> list[PositionLogprobs | None]:
        """Each prompt token's logprob and top-k (the first: None), on the scoring thread beside the step loop
        (engines/scoring.py); raises ScoringBusy when too many wait."""
        self._core.check_alive()
        return await score_async(self._engine.model, token_ids, top_k, self.tokenizer)

    async def embed(self, inputs: list[list[int]] | list[str], pooling: str = "mean", *, priority: int = 0,
                    ttft_s: float | None = None) -> torch.Tensor:
        """[len(inputs), hidden] unit vectors of each input's last hidden state (`mean` or `last` pooling): one
        prefill-only request per input in the engine's step loop, batched with every other request there
        (engines/embedding.py). Raises RequestRejected (nothing queued) for a bad input, EmbeddingBusy past
        MAX_PENDING inputs in flight, and EmbeddingFailed where the engine failed one; cancelling aborts all."""
        self._core.check_alive()
        reqs = [self.inputs.process_embedding(one, pooling, priority=priority, ttft_s=ttft_s) for one in inputs]
        if self._embed_pending + len(reqs) > MAX_PENDING:
            raise EmbeddingBusy(f"{self._embed_pending} inputs are already being embedded; retry shortly")
        loop = asyncio.get_running_loop()
        futures = []
        for req in reqs:
            done: asyncio.Future[RequestOutput] = loop.create_future()

            def put(out: RequestOutput, done: asyncio.Future = done) -> None:
                if out.finished and not done.done():
                    done.set_result(out)

            def emit(out: RequestOutput, put=put) -> None:  # the engine hands outputs over per loop (deliver)
                loop.call_soon_threadsafe(put, out)

            emit.loop, emit.put = loop, put
            self._engine.submit(req, emit, stream=False)
            futures.append(done)
        self._embed_pending += len(reqs)
        self._core.wake()
        try:
            outs = await asyncio.gather(*futures)
        finally:
            self._embed_pending -= len(reqs)
            for req, fut in zip(reqs, futures):
                if fut.cancelled() or not fut.done():  # a cancelled gather cancels its futures
                    self.abort(req.request_id)
        for out in outs:
            if out.error is not None or out.embedding is None:
                raise EmbeddingFailed(out.error or EngineError(ErrorCode.ENGINE_ERROR, "no vector was computed"))
        return torch.stack([out.embedding for out in outs])

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's KV pages are freed at the engine's next step."""
        self._engine.abort(request_id)
        self._core.wake()

    def stats(self) -> dict:
        return self._engine.stats()
