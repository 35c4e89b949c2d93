"""The OpenAI objects the server answers with, as msgspec Structs: chat completions and their streaming chunks,
legacy completions, model cards and OpenAI's error body, and their JSON / SSE encoding. Every field is encoded,
so absent values go out as explicit nulls."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct


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
    tool_calls: list[dict[str, Any]] | None = None


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


class PromptLogprob(Struct, kw_only=True):
    """vLLM's Logprob, one token of choices[].prompt_logprobs."""
    logprob: float
    rank: int | None
    decoded_token: str | None


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # vLLM's: with prompt_logprobs, per prompt token (None for the first) its token id -> logprob, the prompt's
    # own token and the top alternatives; in the first chunk of a stream
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class Completion(Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    system_fingerprint: str | None = None


class LoadedWeights(Struct, kw_only=True):
    """What one engine behind a model card loaded (engines/loaded.py's `info`)."""

    engine: str
    source: str  # a path, or a Hub id with its resolved revision (ORG/NAME@sha)
    format: str  # safetensors | gguf | torch (an in-memory model)
    quantization: str  # none, int8, int4, w8a8, bf16 (applied at load), or the file's own (gguf q8_0, gptq-int4...)
    weight_bytes: int
    context_length: int  # the model's own; max_model_len is what the engine serves


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    kind: Literal["route", "engine"]
    max_model_len: int | None = None
    loaded: list[LoadedWeights] | None = None  # per engine of the route (one for an engine); None: unknown


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
