"""The offline API, shaped like vLLM's: `LLM(model=DIR, **options).generate(prompts, params)` returns one
`RequestOutput` per prompt in input order. It steps the engine in the calling thread (no background loop);
`SamplingParams(prompt_logprobs=k)` adds each prompt token's logprob (engines/scoring.py) once it is done;
`embed(inputs)` gives embedding vectors from the same engine."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from engines.config import EngineSpec, PoolSpec, spec_kwargs
from engines.core import EngineCore
from engines.errors import RequestRejected
from engines.model import Transformer
from engines.outputs import RequestOutput
from engines.sampling_params import SamplingParams
from engines.scoring import prompt_logprobs

PromptInput = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | Path | Transformer, *, name: str = "default",
                 draft_model: str | Path | Transformer | None = None, draft_options: dict[str, Any] | None = None,
                 **options: Any):
        """`draft_model`: a second checkpoint (same tokenizer) that drafts for `model` (speculative decoding,
        up to `num_speculative_tokens` per step, default 4); it gets its own idle engine named "<name>-draft",
        with `draft_options` (EngineOptions fields, e.g. `{"quantization": "w8a8"}`) on top of the target's dtype
        and max_model_len."""
        device = options.pop("device", "cpu")
        engine_opts, pool_opts = spec_kwargs(options)
        specs = [EngineSpec(name=name, model=model, **engine_opts)]
        if draft_model is not None:
            specs[0].draft = f"{name}-draft"
            specs.append(EngineSpec(name=f"{name}-draft", model=draft_model,
                                    **{"dtype": specs[0].dtype, "max_model_len": specs[0].max_model_len,
                                       **(draft_options or {})}))
        self.core = EngineCore(specs, PoolSpec(**pool_opts), device)
        self.engine = self.core.engines[name]
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(self, prompts: PromptInput | Seq[PromptInput],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 priority: int | Seq[int] = 0,
                 draft_token_ids: list[int] | Seq[list[int] | None] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, `{"prompt_token_ids": [...]}` or a list of those (a bare list
        of ints is one tokenized prompt). Raises RequestRejected (nothing queued) if any prompt is invalid."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        prios = [priority] * len(prompts) if isinstance(priority, int) else list(priority)
        # draft_token_ids: a candidate output the engine verifies first (one list for every prompt, or one each)
        if draft_token_ids is None or (draft_token_ids and isinstance(draft_token_ids[0], int)):
            drafts = [draft_token_ids] * len(prompts)
        else:
            drafts = list(draft_token_ids)
        reqs = []
        for p, sp, prio in zip(prompts, params, prios):
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    p = list(p["prompt_token_ids"])
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise RequestRejected("a dict prompt needs 'prompt' or 'prompt_token_ids'")
            self._counter += 1
            reqs.append(self.engine.inputs.process(p, sp, f"llm-{self._counter}", priority=prio,
                                                   draft_token_ids=drafts[len(reqs)]))
        results: dict[str, RequestOutput] = {}
        for r in reqs:  # validated all first: either every prompt is queued or none
            self.engine.submit(r, lambda out: results.__setitem__(out.request_id, out), stream=False)
        while self.engine.has_work():
            self.core.step()
        outputs = [results[r.request_id] for r in reqs]
        for out, sp in zip(outputs, params):
            if sp.prompt_logprobs is not None:
                out.prompt_logprobs = prompt_logprobs(self.engine.model, out.prompt_token_ids, sp.prompt_logprobs,
                                                      self.tokenizer)
        return outputs

    def embed(self, inputs: str | list[int] | Seq[str | list[int]], pooling: str = "mean") -> torch.Tensor:
        """[len(inputs), hidden] unit vectors of each input's last hidden state, pooled (`mean` or `last`), as
        prefill-only requests in the engine's step loop (engines/embedding.py). Raises RequestRejected (nothing
        queued) for a bad input and RuntimeError where the engine failed one."""
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        reqs = []
        for one in inputs:
            self._counter += 1
            reqs.append(self.engine.inputs.process_embedding(one, pooling, f"llm-embed-{self._counter}"))
        results: dict[str, RequestOutput] = {}
        for r in reqs:
            self.engine.submit(r, lambda out: results.__setitem__(out.request_id, out), stream=False)
        while self.engine.has_work():
            self.core.step()
        outs = [results[r.request_id] for r in reqs]
        for out in outs:
            if out.error is not None:
                raise RuntimeError(f"embedding {out.request_id} failed: {out.error}")
        return torch.stack([out.embedding for out in outs])

    def stats(self) -> dict:
        """Pool (pages used/cached/free, prefix queries/hits) and engine (running, preemptions...) counters."""
        return {**self.core.pool.stats(), **{f"engine_{k}": v for k, v in self.engine.stats().items()}}
