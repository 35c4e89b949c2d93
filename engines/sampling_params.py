"""Per-request sampling settings, shaped like vLLM's `SamplingParams` (the OpenAI surface plus vLLM extras)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engines.structured import StructuredOutput

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes


class InvalidSamplingParameter(ValueError):
    """A sampling setting out of range; `param` names the field (the message says what is allowed)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int | None = 16  # None: up to the model's context
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob plus k top logprobs (k <= 20)
    skip_special_tokens: bool = True
    speculative: bool | None = None  # None: the engine decides; False: never draft for this request
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> bias in [-100, 100] added to the logits
    structured: StructuredOutput | None = None  # the output must match this (engines.structured)
    # None: off; k >= 0: each prompt token's logprob plus k top logprobs (the first token has none), computed
    # beside the step loop by engines/scoring.py (LLM.generate and the gateway fill RequestOutput.prompt_logprobs)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def plain(self, vocab: int, min_tokens_ok: bool = False) -> bool:
        """Sampling by temperature alone: the distribution is softmax(logits / T) of the raw logits (or their
        argmax): no penalties, top-k/top-p/min-p, logit_bias or grammar. `min_tokens_ok`: min_tokens allowed
        too (a ban of EOS and stop ids, which the C greedy loop applies)."""
        return (self.repetition_penalty == 1.0 and not self.frequency_penalty and not self.presence_penalty
                and (min_tokens_ok or not self.min_tokens) and not 0 < self.top_k < vocab and self.top_p >= 1.0
                and self.min_p <= 0.0 and not self.logit_bias and self.structured is None)

    def validate(self) -> None:
        """Raise InvalidSamplingParameter naming the parameter, the bad value and what is allowed. Ranges are
        written as `not lo <= x <= hi`, so NaN fails them too."""
        def bad(name: str, value: object, allowed: str) -> InvalidSamplingParameter:
            return InvalidSamplingParameter(name, f"{name}={value!r} is invalid: must be {allowed}")
        if self.n < 1 or self.n > 16:
            raise bad("n", self.n, "between 1 and 16")
        if not 0 <= self.temperature <= 2:
            raise bad("temperature", self.temperature, "between 0 and 2")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", self.top_k, "-1, 0 (off) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, getattr(self, name), "between -2 and 2")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise bad("repetition_penalty", self.repetition_penalty, "a finite number greater than 0")
        if self.seed is not None and not SEED_MIN <= self.seed <= self.seed + self.n - 1 <= SEED_MAX:
            # choice i of n samples with seed + i, so the last one must fit the generator too
            raise bad("seed", self.seed, f"with n={self.n}, seed through seed + n - 1 between {SEED_MIN} and "
                      f"{SEED_MAX} (a 64-bit generator seed)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "at least 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", self.min_tokens, "between 0 and max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", self.logprobs, "between 0 and 20")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", self.prompt_logprobs, "between 0 and 20")
        for t, b in (self.logit_bias or {}).items():
            if t < 0 or not -100 <= b <= 100:
                raise bad("logit_bias", {t: b}, "token ids >= 0 mapped to biases between -100 and 100")
        if self.structured is not None and self.min_tokens:
            raise bad("min_tokens", self.min_tokens, "0 with a structured output (the grammar decides the end)")
        if self.structured is not None and self.ignore_eos:
            raise bad("ignore_eos", self.ignore_eos, "false with a structured output (the grammar decides the end)")
        if len(self.stop) > 4:
            raise bad("stop", self.stop, "at most 4 sequences")
