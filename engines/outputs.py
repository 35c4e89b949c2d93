"""What an engine hands back: `RequestOutput` with one `CompletionOutput` per choice (vLLM-shaped).

An output carries the delta since the previous output of the same request (what a streaming client reads) and
the cumulative `text`, `token_ids` and `logprobs`. Those are read from the sequence at the length it had when
the output was built, on first access only (`CompletionOutput.of`), so a stream of n tokens costs O(n) in all,
not O(n) an output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engines.errors import EngineError

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob, holding the sampled token and the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


def _none() -> None:
    return None


@dataclass
class CompletionOutput:
    # text, token_ids and logprobs have factories, not class-level defaults, so that an output built by `of`
    # (which leaves them unset) reaches `__getattr__` for them
    index: int
    text: str = field(default_factory=str)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = field(default_factory=_none)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None (still running)
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, index: int, tokens: list[int], start: int, end: int, logprobs: list[PositionLogprobs] | None,
           text: str, text_end: int, **fields) -> CompletionOutput:
        """An output whose cumulative fields are `tokens[start:end]`, `logprobs` as long as it is now and
        `text[:text_end]`, copied out on first access. The engine only appends to those lists below `end`, and
        `text` is an immutable string, so what is read later is what was there when the output was built."""
        out = cls.__new__(cls)
        out.__dict__.update(index=index, delta_text="", delta_token_ids=[], delta_logprobs=None,
                            cumulative_logprob=None, finish_reason=None, stop_reason=None)
        out.__dict__.update(fields)
        out._view = (tokens, start, end, logprobs, None if logprobs is None else len(logprobs), text, text_end)
        return out

    def __getattr__(self, name: str):  # only for text, token_ids, logprobs of an output built by `of`
        view = self.__dict__.get("_view")
        if view is None or name not in ("text", "token_ids", "logprobs"):
            raise AttributeError(name)
        tokens, start, end, lps, lps_end, text, text_end = view
        self.token_ids = tokens[start:end]
        self.logprobs = None if lps is None else lps[:lps_end]
        self.text = text[:text_end]
        del self._view
        return self.__dict__[name]


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
    # an embedding request (`InputProcessor.process_embedding`): its unit vector, float32 [hidden], once finished
    embedding: torch.Tensor | None = None
