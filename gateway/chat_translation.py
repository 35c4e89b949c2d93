"""What the APIs served as translations onto chat share (gateway/responses_api.py, gateway/anthropic_api.py):
decoding a nested part of a body with its path in errors, one choice's model text read as text and tool
calls as they complete, and serving a translated chat request with errors renamed into the API's own fields.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response
from litestar.response import Stream

from gateway.errors import APIError
from gateway.lifecycle import AnswerFormat, resolve_route, serve
from gateway.openai_format import tool_mode, tool_parser
from gateway.prompts import chat_prompt
from gateway.protocol import ChatCompletionRequest, InvalidParameter
from gateway.tool_parsers import ToolCall

T = TypeVar("T")


def convert(value: Any, type_: type[T], where: str) -> T:
    """`value` (a part of a decoded body) as `type_`, strictly; InvalidParameter naming `where` plus the path
    inside it (`input[2].content[0].type`)."""
    try:
        return msgspec.convert(value, type_, strict=True)
    except msgspec.ValidationError as exc:
        message = str(exc)
        path = ""
        at = message.rfind(" - at `$")
        if at >= 0:
            path = message[at + len(" - at `$"):].rstrip("`")
            message = message[:at]
        missing = message.removeprefix("Object missing required field `")
        if missing != message:
            param = f"{where}{path}.{missing.rstrip('`')}"
            raise InvalidParameter(param, f"Missing required parameter {param!r}",
                                   code="missing_required_parameter") from None
        raise InvalidParameter(where + path, f"Invalid value for {where + path!r}: {message}") from None


def refuse(param: str, message: str) -> InvalidParameter:
    return InvalidParameter(param, message, code="unsupported_parameter")


def text_of(parts: list[Any], attr: str = "text") -> str:
    return "".join(getattr(part, attr) or "" for part in parts)


@dataclass
class Piece:
    """One step of an answer as an API streams it: text, or a tool call's start, argument text or end."""

    kind: str  # "text" | "call_start" | "call_args" | "call_end"
    text: str = ""
    call: ToolCall | None = None


class OutputReader:
    """One choice's model text as `Piece`s, with the tool calls of a request with tools read out of it by the
    chat path's parsers (gateway/tool_parsers.py): a whole call becomes start, arguments and end at once; a
    forced named call streams its arguments as they come."""

    def __init__(self, data: ChatCompletionRequest):
        self.mode = tool_mode(data)
        self._data = data
        self._parser = tool_parser(data, self.mode) if self.mode else None
        self._open: ToolCall | None = None
        self.calls: list[ToolCall] = []  # every call, its arguments whole once ended
        self.text = ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer: its text and its calls."""
        if self._parser is None:
            return text, []
        parsed = tool_parser(self._data, self.mode).parse(text)
        return parsed.content, parsed.calls

    def feed(self, delta: str) -> list[Piece]:
        if self._parser is None:
            return self._text(delta)
        return self._pieces(self._parser.feed(delta))

    def flush(self) -> list[Piece]:
        pieces = self._pieces(self._parser.flush()) if self._parser is not None else []
        if self._open is not None:
            pieces.append(Piece("call_end", call=self._open))
            self._open = None
        return pieces

    def _text(self, text: str) -> list[Piece]:
        self.text += text
        return [Piece("text", text)] if text else []

    def _pieces(self, piece: Any) -> list[Piece]:
        out = self._text(piece.content)
        for call in piece.calls:
            self.calls.append(call)
            out += [Piece("call_start", call=call), Piece("call_args", call.arguments, call),
                    Piece("call_end", call=call)]
        if piece.call is not None:
            if piece.call_started:
                self._open = piece.call
                self.calls.append(piece.call)
                out.append(Piece("call_start", call=piece.call))
            if piece.arguments_delta:
                piece.call.arguments += piece.arguments_delta
                out.append(Piece("call_args", piece.arguments_delta, piece.call))
        return out


def tool_call_dicts(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls as a chat assistant message's tool_calls (what a later turn replays to the template)."""
    return [call.as_dict() for call in calls]


def arguments_object(arguments: str) -> Any:
    """A call's arguments text as JSON (a forced call cut short by max_tokens stays its text)."""
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments


def now() -> int:
    return int(time.time())


def field_renamer(prefixes: tuple[tuple[str, str], ...], tool_fields: tuple[tuple[str, str], ...]
                  ) -> Callable[[str], str]:
    """How an API names the chat field an error names: the first of `prefixes` (chat, ours) matching the whole
    field or its start before '.' or '[', else the first of `tool_fields` (chat, ours) found inside `tools[...]`."""

    def rename(param: str) -> str:
        for chat, ours in prefixes:
            if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
                return ours + param[len(chat):]
        if param.startswith("tools["):
            for chat, ours in tool_fields:
                if chat in param:
                    return param.replace(chat, ours, 1)
        return param

    return rename


async def serve_translated(request: Request, data: ChatCompletionRequest, answer_format: AnswerFormat,
                           rename: Callable[[str], str]) -> Response | Stream:
    """Serve `data` (another API's request translated to chat) through the chat path: the same routes, SLOs,
    admission, limits, metrics and traces; `answer_format` writes the answer, and an error's `param` (and its
    mention in the message) is `rename`d from the chat field to the API's own."""
    state = request.app.state.gateway
    try:
        route = resolve_route(request, state, data.model)
        prompt, messages = chat_prompt(data, allow_request_template=False)
        return await serve(request, state, route, data, "chat", prompt, conversation=messages,
                           answer_format=answer_format)
    except (APIError, InvalidParameter) as exc:
        if isinstance(exc, InvalidParameter):
            exc = APIError(400, str(exc), param=exc.param, code=exc.code)
        if exc.param:
            renamed = rename(exc.param)
            if renamed != exc.param:
                field, renamed_field = exc.param.split("#")[0], renamed.split("#")[0]  # '#': a schema pointer
                exc.message = exc.message.replace(exc.param, renamed).replace(field, renamed_field)
                exc.param = renamed
        raise exc from None
