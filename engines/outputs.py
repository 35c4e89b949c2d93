"""What an engine hands back: `RequestOutput` with one `CompletionOutput` per choice (vLLM-shaped).

Outputs are cumulative (`text`, `token_ids`, `logprobs`) and also carry the delta since the previous output
of the same request, which is what a streaming client needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.errors import EngineError


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob, holding the sampled token and the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None (still running)
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: EngineError | None = None  # set when the engine failed this request; `finished` is then True
    metrics: RequestMetrics | None = None
    model: str | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), engines/scoring.py
    prompt_logprobs: list[PositionLogprobs | None] | None = None
