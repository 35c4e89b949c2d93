"""The OpenAI wire format as msgspec Structs: chat and legacy completion requests (with vLLM-style extras,
unknown fields ignored), their responses and streaming chunks, and the translation of a request into
`SamplingParams`. Response Structs encode every field, so absent values go out as explicit nulls.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

from engines.sampling_params import SamplingParams

# ------------------------------------------------------------------------------------------- requests


class ContentPart(Struct, kw_only=True):
    type: str = "text"
    text: str | None = None


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The plain dict a chat template expects; text parts are joined, other parts are not supported."""
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text":
                    raise InvalidParameter("messages", f"content part type {part.type!r} is not supported; "
                                           f"this server accepts text parts only")
            content: str | None = "".join(part.text or "" for part in self.content)
        else:
            content = self.content
        out: dict[str, Any] = {"role": self.role, "content": content}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class _SamplingFields(Struct, kw_only=True):
    """Fields shared by both endpoints: OpenAI's and the vLLM extras."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a one-element list of either (checked by prompt_input)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def prompt_input(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a legacy completion request, as text or token ids."""
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise InvalidParameter("prompt", f"prompt holds {len(prompt)} prompts; send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise InvalidParameter("prompt", "prompt must be a string, a list of token ids, or a list holding one "
                               "of those")
    if not prompt:
        raise InvalidParameter("prompt", "prompt must not be empty")
    return prompt


class InvalidParameter(ValueError):
    """A request parameter the server cannot accept; `param` names it for the OpenAI error body."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def sampling_params(req: ChatCompletionRequest | CompletionRequest, *, default_max_tokens: int | None,
                    max_tokens_cap: int | None = None) -> SamplingParams:
    """Translate the request's sampling fields; raises InvalidParameter naming the field."""
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs requires logprobs to be true")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise InvalidParameter("top_logprobs", f"top_logprobs={req.top_logprobs} is invalid: must be "
                                   f"between 0 and 20")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens, max_name = req.max_tokens, "max_tokens"
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise InvalidParameter("logprobs", f"logprobs={req.logprobs} is invalid: must be between 0 and 5")
        logprobs = req.logprobs
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidParameter("best_of", "best_of different from n is not supported")
        if req.suffix:
            raise InvalidParameter("suffix", "suffix is not supported")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise InvalidParameter(max_name, f"{max_name}={max_tokens} is invalid: must be at least 1")
    if max_tokens_cap is not None:
        max_tokens = max_tokens_cap if max_tokens is None else min(max_tokens, max_tokens_cap)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4:
        raise InvalidParameter("stop", f"stop has {len(stop)} sequences; at most 4 are allowed")
    if any(not s for s in stop):
        raise InvalidParameter("stop", "stop sequences must be non-empty strings")
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens, max_tokens=max_tokens, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens)
    except ValueError as exc:  # SamplingParams names the field first: "temperature=3 is invalid: ..."
        param = str(exc).split("=", 1)[0] if "=" in str(exc) else None
        if param == "max_tokens":
            param = max_name
        raise InvalidParameter(param, str(exc)) from None


# ------------------------------------------------------------------------------------------ responses


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct, kw_only=True):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletion(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    service_tier: str | None = None


class Delta(Struct, kw_only=True, omit_defaults=True):
    # OpenAI omits absent delta fields rather than sending nulls: {"content": "x"} after the first chunk.
    role: str | None = None
    content: str | None = None


class ChunkChoice(Struct, kw_only=True):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None


class CompletionLogprobs(Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    system_fingerprint: str | None = None


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    kind: Literal["route", "engine"]
    max_model_len: int | None = None


class ModelList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(Struct, kw_only=True):
    error: ErrorDetail


_encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def sse(obj: Any) -> bytes:
    """One server-sent event carrying a JSON payload."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
