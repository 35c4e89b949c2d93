"""The prompt each engine gets for one request: a chat conversation rendered with the engine's chat template,
or a completion prompt as sent; token ids when admission needs the count. The size check bounds the work
before any starts, and a long prompt renders and tokenises on the gateway's tokenisation pool
(gateway/tokenize_pool.py) so the event loop keeps serving. A chat prompt's template parts are encoded once
(gateway/prompt_tokens.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from gateway.errors import APIError
from gateway.prompt_tokens import piece_encoder
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidParameter,
    prompt_input,
    prompt_inputs,
)
from gateway.tokenize_pool import POOL as TOKENIZE_POOL

# More characters per token than any tokenizer packs into its tokens: a longer text cannot fit the context.
MAX_CHARS_PER_TOKEN = 16
# Shorter prompts are prepared on the event loop: a worker thread costs more than rendering them.
INLINE_CHARS = 4096
# Template variables the gateway itself passes: a request may not override them through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "documents"})

Rendered = str | list[int]


class Prompt:
    """One request's prompt, prepared once per engine on first use (a cascade needs it for two engines)."""

    def __init__(self, render: Callable[[Any], Rendered], chars: int, param: str, *, templated: bool = False):
        self._render = render  # engine -> its prompt (the engine's chat template, or the prompt as sent)
        self.chars = chars  # characters of text the prompt holds (0 for token ids)
        self.param = param  # the request field holding it, for errors
        self.templated = templated  # rendered by a chat template: encoded piece by cached piece
        self.tokenize = False  # True: `get` gives token ids (admission counts them; the engine need not encode)
        self._prepared: dict[str, Rendered] = {}

    def check_size(self, engines: Iterable[Any]) -> None:
        """400 context_length_exceeded, before any work, for a text no engine of the route could hold."""
        longest = max((getattr(e, "max_model_len", None) or 0 for e in engines), default=0)
        if longest and self.chars > longest * MAX_CHARS_PER_TOKEN:
            raise APIError(400, f"The prompt has {self.chars} characters, more than a context of {longest} tokens "
                           f"can hold; shorten it", param=self.param, code="context_length_exceeded")

    async def get(self, engine: Any) -> Rendered:
        """The prompt for `engine`: rendered (and tokenised when `tokenize`), in a worker thread when long."""
        prompt = self._prepared.get(engine.name)
        if prompt is None:
            prompt = await TOKENIZE_POOL.run(self._prepare, engine) if self.chars > INLINE_CHARS \
                else self._prepare(engine)
            self._prepared[engine.name] = prompt
        return prompt

    def _prepare(self, engine: Any) -> Rendered:
        prompt = self._render(engine)
        if self.tokenize and isinstance(prompt, str):
            prompt = piece_encoder(engine.tokenizer).encode(prompt) if self.templated \
                else engine.tokenizer.encode(prompt)
        return prompt


def chat_prompt(data: ChatCompletionRequest, *, allow_request_template: bool) -> tuple[Prompt, list[dict[str, Any]]]:
    """The prompt of a chat request and its conversation as plain dicts; 400 for what cannot be rendered."""
    try:
        messages = [m.to_template() for m in data.messages]
    except InvalidParameter as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    if not messages:
        raise APIError(400, "messages must contain at least one message", param="messages", code="invalid_value")
    extra = dict(data.chat_template_kwargs or {})
    reserved = sorted(extra.keys() & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {reserved}: pass them as request fields",
                       param=f"chat_template_kwargs.{reserved[0]}", code="invalid_value")
    if "chat_template" in extra and not allow_request_template:
        raise APIError(400, "chat_template_kwargs.chat_template: a request's own chat template is disabled on "
                       "this server (the operator can allow it with [server] allow_request_chat_template)",
                       param="chat_template_kwargs.chat_template", code="invalid_value")
    if "chat_template" in extra and not isinstance(extra["chat_template"], str):
        raise APIError(400, "chat_template_kwargs.chat_template must be a string",
                       param="chat_template_kwargs.chat_template", code="invalid_value")
    add_generation_prompt = data.add_generation_prompt
    if data.tools and data.tool_choice != "none":  # the template shows the model what it may call
        extra["tools"] = [{"type": t.type, "function": {k: v for k, v in msgspec.to_builtins(t.function).items()
                                                         if v is not None}} for t in data.tools]

    def render(engine: Any) -> str:
        tokenizer = engine.tokenizer
        if not tokenizer.has_chat_template:
            raise APIError(400, f"model {engine.name!r} has no chat template; use /v1/completions",
                           param="messages", code="no_chat_template")
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        except ValueError as exc:  # ChatTemplateError: the template rejected this conversation
            raise APIError(400, f"chat template error: {exc}", param="messages", code="invalid_value") from None

    chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    return Prompt(render, chars, "messages", templated=True), messages


def _sent(prompt: str | list[int], param: str) -> tuple[Prompt, str | list[int]]:
    return Prompt(lambda engine: prompt, len(prompt) if isinstance(prompt, str) else 0, param), prompt


def completion_prompt(data: CompletionRequest) -> tuple[Prompt, str | list[int]]:
    """The prompt of a legacy completion request and the prompt as sent (text or token ids)."""
    try:
        prompt = prompt_input(data)
    except InvalidParameter as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    return _sent(prompt, "prompt")


def completion_prompts(data: CompletionRequest) -> list[tuple[Prompt, str | list[int]]]:
    """Each prompt of a legacy completion request (one or a list) and the prompt as sent."""
    try:
        prompts = prompt_inputs(data)
    except InvalidParameter as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    if len(prompts) == 1:
        return [_sent(prompts[0], "prompt")]
    return [_sent(p, f"prompt[{i}]") for i, p in enumerate(prompts)]
