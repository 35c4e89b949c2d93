"""Model text -> OpenAI `tool_calls`, whole or as a stream of deltas. One parser per way a model writes calls:
`HermesToolParser` for the Hermes / Qwen2.5 `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format
(tool_choice auto), `NamedCallParser` and `RequiredCallsParser` for the grammar-forced shapes of
gateway/structured_outputs.py. A new format is a class with `parse` and `feed`/`flush`, registered in
PARSERS by name."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    content: str | None
    calls: list[ToolCall]


@dataclass
class StreamPiece:
    """What a stream of model text yields so far: content to send, and calls that completed (whole) or
    argument text of the call in progress (`arguments_delta` for `call`, first sent with its name)."""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    call: ToolCall | None = None
    call_started: bool = False
    arguments_delta: str = ""


def _call(obj: Any) -> ToolCall | None:
    """A {"name": str, "arguments": object} (or vLLM's "parameters") as a call; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser:
    """`<tool_call>` JSON `</tool_call>` blocks anywhere in the text; the text outside them is the content.
    A block that does not hold a call stays content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self._after_call = False  # whitespace right after a block is dropped
        self._gap = ""

    def parse(self, text: str) -> Parsed:
        """Calls and the content around them (whitespace next to a block dropped, as streaming drops it)."""
        calls, content, last = [], [], 0
        for m in self._block.finditer(text):
            try:
                call = _call(json.loads(m.group(1)))
            except ValueError:
                call = None
            if call is None:
                continue
            before = text[last:m.start()]
            content.append(before.rstrip() if not calls else before.strip())
            calls.append(call)
            last = m.end()
        content.append(text[last:].lstrip() if calls else text[last:])
        rest = "".join(content)
        return Parsed(rest or None, calls)

    def feed(self, delta: str) -> StreamPiece:
        """Content up to where a `<tool_call>` may begin (trailing whitespace held back: it is dropped if a
        block follows); a call once its block closes."""
        self._buf += delta
        piece = StreamPiece()
        while True:
            if not self._inside:
                if self._after_call:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        return piece
                    self._after_call = False
                i = self._buf.find(self.OPEN)
                if i < 0:  # hold back a tail that could start the tag, and trailing whitespace
                    keep = next((n for n in range(min(len(self.OPEN) - 1, len(self._buf)), 0, -1)
                                 if self.OPEN.startswith(self._buf[-n:])), 0)
                    head = self._buf[:len(self._buf) - keep]
                    sent = head.rstrip()
                    piece.content += sent
                    self._buf = self._buf[len(sent):]
                    return piece
                before = self._buf[:i].rstrip()
                piece.content += before
                self._gap = self._buf[len(before):i]  # restored if the block is not a call
                self._buf = self._buf[i:]
                self._inside = True
            j = self._buf.find(self.CLOSE)
            if j < 0:
                return piece
            block = self._buf[:j + len(self.CLOSE)]
            self._buf = self._buf[j + len(self.CLOSE):]
            self._inside = False
            parsed = self.parse(block)
            if parsed.calls:
                piece.calls += parsed.calls
                self._after_call = True
            else:
                piece.content += self._gap + block

    def flush(self) -> StreamPiece:
        """The end of the text: whatever is held back is content (an unclosed block included)."""
        rest = (self._gap + self._buf) if self._inside else self._buf
        self._buf, self._inside = "", False
        return StreamPiece(content=rest.lstrip() if self._after_call else rest)


class NamedCallParser:
    """tool_choice naming a function: the whole text is its arguments (the grammar made it valid)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._call: ToolCall | None = None

    def parse(self, text: str) -> Parsed:
        try:
            args = json.loads(text)
        except ValueError:  # cut short by max_tokens: the text as it is, as OpenAI does
            return Parsed(None, [ToolCall(self.name, text)])
        return Parsed(None, [ToolCall(self.name, json.dumps(args, ensure_ascii=False))])

    def feed(self, delta: str) -> StreamPiece:
        started = self._call is None
        if started:
            self._call = ToolCall(self.name, "")
        return StreamPiece(call=self._call, call_started=started, arguments_delta=delta)

    def flush(self) -> StreamPiece:
        return StreamPiece()


class RequiredCallsParser:
    """tool_choice required: the text is a JSON list of {"name", "arguments"} objects."""

    def __init__(self) -> None:
        self._buf = ""

    def parse(self, text: str) -> Parsed:
        try:
            items = json.loads(text)
        except ValueError:  # cut short by max_tokens: the calls that were complete
            items = _complete_items(text)
        calls = [c for c in (_call(i) for i in items) if c is not None] if isinstance(items, list) else []
        return Parsed(None if calls else text or None, calls)

    def feed(self, delta: str) -> StreamPiece:
        self._buf += delta
        return StreamPiece()

    def flush(self) -> StreamPiece:
        parsed = self.parse(self._buf)
        self._buf = ""
        return StreamPiece(content=parsed.content or "", calls=parsed.calls)


def _complete_items(text: str) -> list[Any]:
    """The whole items at the start of a JSON list whose text was cut off."""
    decoder, items, i = json.JSONDecoder(), [], 1
    if not text.startswith("["):
        return items
    while True:
        while i < len(text) and text[i] in " \n\t,":
            i += 1
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            return items
        items.append(item)


PARSERS = {"hermes": HermesToolParser}
