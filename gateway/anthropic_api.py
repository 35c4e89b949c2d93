"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a translation onto the chat
path: `system`, text / tool_use / tool_result blocks and `tools` become chat messages and tools; the answer is
a `message` object, or its event stream (message_start, content_block_start / _delta / _stop, message_delta,
message_stop); every error, bad input included, is in Anthropic's shape `{"type": "error", "error": {...}}`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from litestar import Request, Response, post
from litestar.params import JSONBody
from litestar.response import Stream
from msgspec import Meta, Struct

from engines.outputs import RequestOutput
from gateway.answers import encode
from gateway.chat_translation import (
    OutputReader,
    Piece,
    arguments_object,
    field_renamer,
    refuse,
    serve_translated,
)
from gateway.errors import APIError
from gateway.lifecycle import resolve_route
from gateway.openapi import error_responses, streaming
from gateway.prompts import chat_prompt
from gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    InvalidParameter,
    MaxTokens,
    NamedToolChoice,
    StopText,
    Tool,
    TopK,
    TopP,
)
from gateway.tool_parsers import ToolCall

# ------------------------------------------------------------------------------------------- requests


class TextBlock(Struct, kw_only=True, tag="text", tag_field="type"):
    text: str
    cache_control: dict[str, Any] | None = None  # prefix caching is automatic: accepted, nothing to do


class ToolUseBlock(Struct, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Struct, kw_only=True, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False  # the chat template has no such mark: the result's text is what the model reads
    cache_control: dict[str, Any] | None = None


Block = TextBlock | ToolUseBlock | ToolResultBlock


class Message(Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, bash...) are not served here
    cache_control: dict[str, Any] | None = None


class ToolChoice(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(Struct, kw_only=True, forbid_unknown_fields=True):
    user_id: str | None = None


class MessagesRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    max_tokens: MaxTokens
    messages: Annotated[list[Message], Meta(min_length=1, description="must be a list of at least one message")]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[StopText], Meta(max_length=4, description="must hold at most 4 "
                                                   "sequences")] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0, le=1, description="must be between 0 and 1")] | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    thinking: dict[str, Any] | None = None  # only {"type": "disabled"}: the models served here do not think


class CountTokensRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1, description="must be a list of at least one message")]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: tool_use blocks are the assistant's tool_calls, tool_result blocks
    tool messages (before the text of their user turn, as the API orders them)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": _text(req.system)}] if req.system else []
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        text, calls = "", []
        for j, block in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(block, TextBlock):
                text += block.text
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise InvalidParameter(where, f"{where}: tool_use blocks belong to assistant messages")
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
            else:
                if message.role != "user":
                    raise InvalidParameter(where, f"{where}: tool_result blocks belong to user messages")
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
        if message.role == "assistant":
            out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
        elif text:
            out.append({"role": "user", "content": text})
    return out


def _check(req: MessagesRequest | CountTokensRequest) -> None:
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise refuse("thinking", "thinking: the models served here do not think; send thinking disabled or none")
    choice = req.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise InvalidParameter("tool_choice.name", "tool_choice of type tool needs the tool's name",
                               code="missing_required_parameter")


def chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    _check(req)
    tools = [Tool(type="function", function=FunctionDefinition(name=t.name, description=t.description,
                                                                parameters=t.input_schema)) for t in req.tools or ()]
    choice, parallel = None, None
    if req.tool_choice is not None:
        kind = req.tool_choice.type
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or NamedToolChoice(
            type="function", function=FunctionName(name=req.tool_choice.name or ""))
        parallel = False if req.tool_choice.disable_parallel_tool_use else None
    messages = [msgspec.convert(m, ChatMessage) for m in chat_messages(req)]
    if not isinstance(req, MessagesRequest):
        return ChatCompletionRequest(model=req.model, messages=messages, tools=tools or None, tool_choice=choice)
    return ChatCompletionRequest(
        model=req.model, messages=messages, max_tokens=req.max_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, stop=list(req.stop_sequences or []) or None, stream=req.stream,
        tools=tools or None, tool_choice=choice, parallel_tool_calls=parallel,
        user=req.metadata.user_id if req.metadata is not None else None)


rename = field_renamer((("max_completion_tokens", "max_tokens"), ("stop", "stop_sequences"),
                        ("tool_choice.function.name", "tool_choice.name")),
                       ((".function.parameters", ".input_schema"), (".function.", ".")))


# ------------------------------------------------------------------------------------------- errors

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_detail(err: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    message = f"{err.param}: {err.message}" if err.param and not err.message.startswith(err.param) \
        and err.param not in err.message else err.message
    return {"type": kind, "message": message}


class AnthropicErrorDetail(Struct, kw_only=True):
    type: str
    message: str


class AnthropicErrorBody(Struct, kw_only=True):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def error_body(err: APIError) -> bytes:
    """Anthropic's error shape (the handlers' `opt`: gateway/errors.py answers their errors with it)."""
    return encode(AnthropicErrorBody(error=AnthropicErrorDetail(**error_detail(err))))


# ------------------------------------------------------------------------------------------- answers


class MessageStreamEvent(Struct, kw_only=True):
    """One event of a streamed message: its `type` names the event (`content_block_delta`, ...)."""
    type: str


def _event(kind: str, body: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + encode({"type": kind, **body}) + b"\n\n"


class MessagesFormat:
    """Engine outputs -> a `message` object, or its event stream; content blocks numbered as they open."""

    def __init__(self, req: MessagesRequest, chat: ChatCompletionRequest, request_id: str):
        self.req = req
        self.id = "msg_" + request_id
        self.reader = OutputReader(chat)
        self.block: str | None = None  # the open block's type
        self.index = -1  # the open (or last) block's index
        self.started = False  # message_start sent

    def _stop(self, out: RequestOutput, calls: int) -> tuple[str, str | None]:
        c = out.outputs[0]
        if c.finish_reason == "length":
            return "max_tokens", None
        if calls:
            return "tool_use", None
        if isinstance(c.stop_reason, str) and c.stop_reason in (self.req.stop_sequences or ()):
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def _usage(self, out: RequestOutput) -> dict[str, int]:
        cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
        return {"input_tokens": len(out.prompt_token_ids), "output_tokens": len(out.outputs[0].token_ids),
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                 usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    @staticmethod
    def _tool_use(call: ToolCall, whole: bool) -> dict[str, Any]:
        return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1), "name": call.name,
                "input": arguments_object(call.arguments) if whole else {}}

    # ---- one JSON body
    def full(self, out: RequestOutput) -> dict[str, Any]:
        text, calls = self.reader.parse(out.outputs[0].text)
        content = ([{"type": "text", "text": text}] if text else []) + [self._tool_use(c, True) for c in calls]
        return self._message(content, self._stop(out, len(calls)), self._usage(out))

    # ---- the event stream
    def opening(self, n: int) -> list[bytes]:
        return []  # message_start needs the prompt's token count: sent with the first output

    def deltas(self, out: RequestOutput) -> list[bytes]:
        c = out.outputs[0]
        events: list[bytes] = []
        if not self.started:
            self.started = True
            usage = {**self._usage(out), "output_tokens": 0}
            events.append(_event("message_start", {"message": self._message([], (None, None), usage)}))
        for piece in self.reader.feed(c.delta_text) + (self.reader.flush() if c.finished else []):
            events += self._piece(piece)
        if c.finished:
            events += self._close()
            stop = self._stop(out, len(self.reader.calls))
            events += [_event("message_delta", {"delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                                "usage": {"output_tokens": len(c.token_ids)}}),
                       _event("message_stop", {})]
        return events

    def _open(self, block: dict[str, Any]) -> bytes:
        self.index += 1
        self.block = block["type"]
        return _event("content_block_start", {"index": self.index, "content_block": block})

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        self.block = None
        return [_event("content_block_stop", {"index": self.index})]

    def _piece(self, piece: Piece) -> list[bytes]:
        if piece.kind == "text":
            events = [] if self.block == "text" else [*self._close(), self._open({"type": "text", "text": ""})]
            return events + [_event("content_block_delta", {"index": self.index, "delta": {
                "type": "text_delta", "text": piece.text}})]
        if piece.kind == "call_start":
            return [*self._close(), self._open(self._tool_use(piece.call, False))]
        if piece.kind == "call_args":
            return [_event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": piece.text}})]
        return self._close()

    def error_event(self, error: APIError) -> bytes:
        return _event("error", {"error": error_detail(error)})

    def closing(self) -> bytes:
        return b""


# ------------------------------------------------------------------------------------------- handlers

ERRORS = error_responses(400, 401, 404, 413, 415, 429, 503, body=AnthropicErrorBody)


@post("/v1/messages", status_code=200, operation_class=streaming(MessageStreamEvent, typed_events=True),
      responses=ERRORS, opt={"error_body": error_body})
async def create_message(request: Request, data: JSONBody[MessagesRequest]) -> Response | Stream:
    """Anthropic's Messages API over the chat path (docs/api.md): system, text and tool blocks, tools,
    stop_sequences, streaming events; auth by `x-api-key` or Bearer."""
    chat = chat_request(data)

    def answer_format(request_id: str, tokenizer: Any) -> MessagesFormat:
        return MessagesFormat(data, chat, request_id)

    return await serve_translated(request, chat, answer_format, rename)


@post("/v1/messages/count_tokens", status_code=200, responses=ERRORS, opt={"error_body": error_body})
async def count_tokens(request: Request, data: JSONBody[CountTokensRequest]) -> dict[str, int]:
    """The prompt's tokens as the route's first engine renders and tokenises it (nothing is generated)."""
    state = request.app.state.gateway
    chat = chat_request(data)
    route = resolve_route(request, state, data.model)
    try:
        prompt, _ = chat_prompt(chat, allow_request_template=False)
        prompt.tokenize = True
        ids = await prompt.get(state.engines[route.config.engines[0]])
    except APIError as exc:
        exc.param = rename(exc.param) if exc.param else None
        raise
    return {"input_tokens": len(ids)}


HANDLERS = [create_message, count_tokens]
