"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) as a translation onto the
chat path: `input` items and `instructions` become chat messages (after the stored conversation of a
`previous_response_id`), `tools` / `tool_choice` / `text.format` the chat fields of the same names; the answer
is a `response` object, or its typed event stream. Stored responses live in gateway/responses_store.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.params import JSONBody, PathParameter
from litestar.response import Stream
from msgspec import Meta, Struct

from engines.outputs import RequestOutput
from gateway.answers import encode
from gateway.chat_translation import (
    OutputReader,
    Piece,
    convert,
    field_renamer,
    now,
    refuse,
    serve_translated,
    text_of,
)
from gateway.errors import APIError
from gateway.openapi import error_responses, streaming
from gateway.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    InvalidParameter,
    JSONSchemaFormat,
    MaxTokens,
    NamedToolChoice,
    ResponseFormat,
    Temperature,
    Tool,
    TopP,
)
from gateway.responses_store import ResponseStore
from gateway.tool_parsers import ToolCall

# ------------------------------------------------------------------------------------------- requests


class FunctionTool(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class TextFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the model's length is its own: only the default is honoured


class ResponsesRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching is automatic: accepted, nothing to do
    truncation: Literal["disabled"] | None = None  # "auto" (dropping input) is not implemented
    service_tier: Literal["auto", "default"] | None = None
    # present with a value tandem cannot honour: a 400 naming the field
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None


class InputText(Struct, kw_only=True, tag="input_text", tag_field="type"):
    text: str


class OutputText(Struct, kw_only=True, tag="output_text", tag_field="type"):
    text: str


class MessageItem(Struct, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | OutputText]
    type: Literal["message"] = "message"


class FunctionCallItem(Struct, kw_only=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Struct, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}

# the chat field an error names -> the Responses field it came from
rename = field_renamer((("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                        ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
                        ("messages", "input"), ("tool_choice.function.name", "tool_choice.name")),
                       ((".function.", "."),))


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.include:
        raise refuse("include", "include: this server adds nothing to a response (no reasoning, logprobs or "
                     "tool outputs to include); send no include")
    if req.reasoning is not None and req.reasoning.get("effort") not in (None, "none"):
        raise refuse("reasoning", "reasoning: the models served here do not reason; send no reasoning")
    if req.background:
        raise refuse("background", "background responses are not supported: send background false")
    if req.top_logprobs:
        raise refuse("top_logprobs", "top_logprobs is not supported on /v1/responses: use /v1/chat/completions")
    if req.max_tool_calls is not None:
        raise refuse("max_tool_calls", "max_tool_calls is not supported")
    if req.text is not None and req.text.format is not None and req.text.format.type == "json_schema" \
            and not req.text.format.name:
        raise InvalidParameter("text.format.name", "text.format of type json_schema needs a name",
                               code="missing_required_parameter")


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as chat messages: function calls join the assistant turn before them."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    if not req.input:
        raise InvalidParameter("input", "input must not be empty")
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(req.input):
        where = f"input[{i}]"
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        if kind not in ITEMS:
            raise refuse(f"{where}.type", f"{where}: item type {kind!r} is not supported; this server takes "
                         f"message, function_call and function_call_output items")
        item = convert(raw, ITEMS[kind], where)
        if isinstance(item, MessageItem):
            content = item.content if isinstance(item.content, str) else text_of(item.content)
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            output = item.output if isinstance(item.output, str) else text_of(item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    tools = [Tool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in req.tools or ()]
    choice: Any = req.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None and fmt.type != "text":
        schema = None if fmt.type == "json_object" else JSONSchemaFormat(
            name=fmt.name or "", schema=fmt.schema, strict=fmt.strict, description=fmt.description)
        response_format = ResponseFormat(type=fmt.type, json_schema=schema)
    return ChatCompletionRequest(
        model=req.model, messages=[msgspec.convert(m, ChatMessage) for m in messages],
        max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p, stream=req.stream,
        tools=tools or None, tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format, user=req.user)


# ------------------------------------------------------------------------------------------- answers


class ResponseStreamEvent(Struct, kw_only=True):
    """One event of a streamed response: its `type` names the event (`response.output_text.delta`, ...)."""
    type: str
    sequence_number: int


def _event(kind: str, seq: int, body: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + encode({"type": kind, "sequence_number": seq, **body}) \
        + b"\n\n"


class ResponsesFormat:
    """Engine outputs -> a `response` object, or its event stream (`response.created` ...
    `response.completed`); a finished response is stored when the request asked for it."""

    def __init__(self, req: ResponsesRequest, chat: ChatCompletionRequest, request_id: str, store: ResponseStore,
                 conversation: list[dict[str, Any]]):
        self.req, self.store, self.conversation = req, store, conversation
        self.id = "resp_" + request_id
        self.created = now()
        self.reader = OutputReader(chat)
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # output items so far
        self._text_item: dict[str, Any] | None = None  # the message item text is streaming into
        self._streamed = ""  # its text so far

    def _next(self, kind: str, body: dict[str, Any]) -> bytes:
        self.seq += 1
        return _event(kind, self.seq - 1, body)

    def body(self, status: str, out: RequestOutput | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        usage = None
        if out is not None:
            prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
            cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + completion}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
                else None, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": req.model, "output": self.items, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "store": req.store,
                "temperature": req.temperature, "top_p": req.top_p,
                "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
                "tool_choice": msgspec.to_builtins(req.tool_choice) if req.tool_choice is not None else "auto",
                "tools": msgspec.to_builtins(req.tools or []), "truncation": "disabled", "usage": usage,
                "user": req.user, "metadata": req.metadata or {}}

    def _message_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": f"msg_{self.id[5:]}_{len(self.items)}", "status": status,
                "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": [],
                                                  "logprobs": []}] if status == "completed" else []}

    def _call_item(self, call: ToolCall, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
                "name": call.name, "arguments": call.arguments if status == "completed" else "", "status": status}

    def _finished(self, out: RequestOutput) -> dict[str, Any]:
        """The response once the engine is done; stored (with its conversation) unless store is false."""
        c = out.outputs[0]
        body = self.body("incomplete" if c.finish_reason == "length" else "completed", out)
        if self.req.store:
            calls = [call.as_dict() for call in self.reader.calls]
            text = "".join(part["text"] for item in self.items if item["type"] == "message"
                           for part in item["content"])
            reply: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                reply["tool_calls"] = calls
            self.store.put(self.id, body, [*self.conversation, reply])
        return body

    # ---- one JSON body
    def full(self, out: RequestOutput) -> dict[str, Any]:
        text, calls = self.reader.parse(out.outputs[0].text)
        self.reader.calls = calls
        if text:
            self.items.append(self._message_item(text, "completed"))
        self.items += [self._call_item(call, "completed") for call in calls]
        return self._finished(out)

    # ---- the event stream
    def opening(self, n: int) -> list[bytes]:
        body = self.body("in_progress")
        return [self._next("response.created", {"response": body}),
                self._next("response.in_progress", {"response": body})]

    def deltas(self, out: RequestOutput) -> list[bytes]:
        c = out.outputs[0]
        events: list[bytes] = []
        for piece in self.reader.feed(c.delta_text) + (self.reader.flush() if c.finished else []):
            events += self._piece(piece)
        if c.finished:
            events += self._close_text()
            body = self._finished(out)
            events.append(self._next("response.incomplete" if body["status"] == "incomplete"
                                     else "response.completed", {"response": body}))
        return events

    def _piece(self, piece: Piece) -> list[bytes]:
        index = len(self.items)
        if piece.kind == "text":
            events = []
            if self._text_item is None:
                self._text_item = self._message_item("", "in_progress")
                events += [self._next("response.output_item.added", {"output_index": index, "item": self._text_item}),
                           self._next("response.content_part.added", {
                               "item_id": self._text_item["id"], "output_index": index, "content_index": 0,
                               "part": {"type": "output_text", "text": "", "annotations": []}})]
                self._streamed = ""
            self._streamed += piece.text
            return events + [self._next("response.output_text.delta", {
                "item_id": self._text_item["id"], "output_index": index, "content_index": 0, "delta": piece.text,
                "logprobs": []})]
        events = self._close_text()
        index = len(self.items)
        call = piece.call
        item_id = "fc_" + call.id.removeprefix("call_")
        if piece.kind == "call_start":
            return events + [self._next("response.output_item.added", {
                "output_index": index, "item": self._call_item(call, "in_progress")})]
        if piece.kind == "call_args":
            return events + [self._next("response.function_call_arguments.delta", {
                "item_id": item_id, "output_index": index, "delta": piece.text})]
        item = self._call_item(call, "completed")
        self.items.append(item)
        return events + [self._next("response.function_call_arguments.done", {
            "item_id": item_id, "output_index": index, "name": call.name, "arguments": call.arguments}),
            self._next("response.output_item.done", {"output_index": index, "item": item})]

    def _close_text(self) -> list[bytes]:
        if self._text_item is None:
            return []
        index, item_id, text = len(self.items), self._text_item["id"], self._streamed
        self._text_item = None
        item = self._message_item(text, "completed")
        item["id"] = item_id
        self.items.append(item)
        part = item["content"][0]
        return [self._next("response.output_text.done", {"item_id": item_id, "output_index": index,
                                                         "content_index": 0, "text": text, "logprobs": []}),
                self._next("response.content_part.done", {"item_id": item_id, "output_index": index,
                                                          "content_index": 0, "part": part}),
                self._next("response.output_item.done", {"output_index": index, "item": item})]

    def error_event(self, error: APIError) -> bytes:
        return self._next("error", {"code": error.code, "message": error.message, "param": error.param})

    def closing(self) -> bytes:
        return b""


# ------------------------------------------------------------------------------------------- handlers


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


@post("/v1/responses", status_code=200, operation_class=streaming(ResponseStreamEvent, typed_events=True),
      responses=error_responses(400, 401, 404, 413, 415, 429, 503))
async def create_response(request: Request, data: JSONBody[ResponsesRequest]) -> Response | Stream:
    """OpenAI's Responses API over the chat path (docs/api.md): text, function tools, `text.format`
    json_schema, streaming events, `previous_response_id` from the server-side store."""
    _refuse_unsupported(data)
    store = _store(request)
    prior: list[dict[str, Any]] = []
    if data.previous_response_id is not None:
        stored = store.get(data.previous_response_id)
        if stored is None:
            raise APIError(404, f"Previous response with id {data.previous_response_id!r} not found (never "
                           f"stored, sent with store false, or expired)", param="previous_response_id",
                           code="previous_response_not_found")
        prior = stored.conversation
    conversation = [*prior, *input_messages(data)]
    system = [{"role": "system", "content": data.instructions}] if data.instructions else []
    chat = chat_request(data, system + conversation)

    def answer_format(request_id: str, tokenizer: Any) -> ResponsesFormat:
        return ResponsesFormat(data, chat, request_id, store, conversation)

    return await serve_translated(request, chat, answer_format, rename)


@get("/v1/responses/{response_id:str}", responses=error_responses(401, 404))
async def get_response(request: Request, response_id: Annotated[str, PathParameter()]) -> dict[str, Any]:
    stored = _store(request).get(response_id)
    if stored is None:
        raise APIError(404, f"Response with id {response_id!r} not found (never stored, sent with store false, "
                       f"or expired)", param="response_id", code="not_found")
    return stored.body


@delete("/v1/responses/{response_id:str}", status_code=200, responses=error_responses(401, 404))
async def delete_response(request: Request, response_id: Annotated[str, PathParameter()]) -> dict[str, Any]:
    if not _store(request).delete(response_id):
        raise APIError(404, f"Response with id {response_id!r} not found", param="response_id", code="not_found")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


HANDLERS = [create_response, get_response, delete_response]
