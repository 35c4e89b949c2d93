"""OpenAI's wire format for one request's answer: engine outputs -> `chat.completion` / `text_completion` JSON
bodies and SSE chunks, with logprobs in the chat and legacy shapes, usage counts, and `tool_calls` parsed
from the text of a chat request with tools (gateway/tool_parsers.py), streamed as OpenAI streams them.
"""

from __future__ import annotations

from typing import Any

from engines.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from gateway.answers import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    PromptLogprob,
    TokenLogprob,
    TopLogprob,
    Usage,
    sse,
)
from gateway.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from gateway.tool_parsers import PARSERS, NamedCallParser, RequiredCallsParser, StreamPiece


class Formatter:
    """RequestOutputs -> OpenAI JSON bodies and SSE chunks for one request (chat or legacy completions)."""

    def __init__(self, operation: str, response_id: str, created: int, model: str, tokenizer: Any,
                 data: ChatCompletionRequest | CompletionRequest, logprobs: int | None,
                 prompt_text: str | None = None, *, index_base: int = 0,
                 prompt_logprobs: list[PositionLogprobs | None] | None = None):
        """`index_base`: this prompt's first choice index (a completion of several prompts numbers prompt i's
        n choices from i * n); `prompt_logprobs`: the prompt's own (engines/scoring.py), for `echo` with
        `logprobs` and for vLLM's `prompt_logprobs`."""
        self.index_base = index_base
        self.prompt_lps = prompt_logprobs
        self._vllm_plp: list[dict[int, PromptLogprob] | None] | None = None
        self.chat = operation == "chat"
        self.prompt_text = prompt_text  # a text prompt as sent (the engine may have been given its token ids)
        self.id, self.created, self.model, self.tokenizer = response_id, created, model, tokenizer
        self.data = data
        self.logprobs = logprobs
        self.echo = (not self.chat) and data.echo
        self.finished: set[int] = set()
        self.offsets: dict[int, int] = {}  # completions logprobs: text offset per choice
        self.started: set[int] = set()  # completion choices that have sent their first chunk
        self.tool_mode = tool_mode(data) if self.chat else None
        self.parsers: dict[int, Any] = {}  # choice -> its tool-call parser (streaming)
        self.num_calls: dict[int, int] = {}  # choice -> tool calls sent

    def _parser(self, index: int | None = None) -> Any:
        if index is not None and index in self.parsers:
            return self.parsers[index]
        parser = tool_parser(self.data, self.tool_mode)
        if index is not None:
            self.parsers[index] = parser
        return parser

    def _finish(self, c: CompletionOutput, num_calls: int) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required); a forced named call stops."""
        if num_calls and c.finish_reason == "stop" and self.tool_mode != "named":
            return "tool_calls"
        return _finish_reason(c)

    def _tool_chunks(self, index: int, piece: StreamPiece, logprobs: ChoiceLogprobs | None) -> list[bytes]:
        deltas: list[Delta] = []
        if piece.content or logprobs is not None:
            deltas.append(Delta(content=piece.content))
        for call in piece.calls:
            k = self.num_calls.get(index, 0)
            self.num_calls[index] = k + 1
            deltas.append(Delta(tool_calls=[{"index": k, **call.as_dict()}]))
        if piece.call is not None:
            if piece.call_started:
                self.num_calls[index] = self.num_calls.get(index, 0) + 1
                deltas.append(Delta(tool_calls=[{"index": 0, "id": piece.call.id, "type": "function",
                                                 "function": {"name": piece.call.name, "arguments": ""}}]))
            if piece.arguments_delta:
                deltas.append(Delta(tool_calls=[{"index": 0, "function": {"arguments": piece.arguments_delta}}]))
        return [self._chunk([ChunkChoice(index=index, delta=d, logprobs=logprobs if j == 0 else None)])
                for j, d in enumerate(deltas)]

    # ---- chat
    def _chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                       usage=usage))

    def opening(self, n: int) -> list[bytes]:
        if not self.chat:
            return []
        return [self._chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))]) for i in range(n)]

    def deltas(self, out: RequestOutput) -> list[bytes]:
        events = []
        for c in out.outputs:
            if c.index in self.finished:
                continue
            has_delta = bool(c.delta_text) or (self.logprobs is not None and bool(c.delta_logprobs))
            if self.tool_mode is not None:
                parser = self._parser(c.index)
                piece = parser.feed(c.delta_text)
                lps = self._chat_logprobs(c.delta_token_ids, c.delta_logprobs) if has_delta else None
                events += self._tool_chunks(c.index, piece, lps)
                if c.finished:
                    events += self._tool_chunks(c.index, parser.flush(), None)
                    events.append(self._chunk([ChunkChoice(index=c.index, delta=Delta(),
                                                           finish_reason=self._finish(c, self.num_calls.get(
                                                               c.index, 0)))]))
            elif self.chat:
                if has_delta:
                    events.append(self._chunk([ChunkChoice(
                        index=c.index, delta=Delta(content=c.delta_text),
                        logprobs=self._chat_logprobs(c.delta_token_ids, c.delta_logprobs))]))
                if c.finished:
                    events.append(self._chunk([ChunkChoice(index=c.index, delta=Delta(),
                                                           finish_reason=_finish_reason(c))]))
            elif has_delta or c.finished:
                text, first = c.delta_text, c.index not in self.started
                prompt_part = None
                if self.echo and first:
                    text = self._echo(out, c.index) + text
                    prompt_part = self._prompt_part(out)
                self.started.add(c.index)
                lp = _joined(prompt_part, self._completion_logprobs(c.index, c.delta_token_ids, c.delta_logprobs))
                events.append(sse(Completion(id=self.id, created=self.created, model=self.model, usage=None,
                                             choices=[CompletionChoice(
                                                 index=self.index_base + c.index, text=text, logprobs=lp,
                                                 finish_reason=_finish_reason(c),
                                                 prompt_logprobs=self._vllm_prompt_logprobs(out) if first else None)])))
            if c.finished:
                self.finished.add(c.index)
        return events

    def error_event(self, error: Any) -> bytes:
        """The event a stream sends when it fails after its first chunk (an APIError's body)."""
        return error.sse_event()

    def closing(self) -> bytes:
        return SSE_DONE

    def usage_chunk(self, out: RequestOutput) -> bytes:
        if self.chat:
            return self._chunk([], usage=_usage(out))
        return sse(Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=_usage(out)))

    def full(self, out: RequestOutput) -> ChatCompletion | Completion:
        if self.chat:
            return ChatCompletion(id=self.id, created=self.created, model=self.model, usage=_usage(out),
                                  choices=[self._chat_choice(c) for c in out.outputs])
        return Completion(id=self.id, created=self.created, model=self.model, usage=_usage(out), choices=[
            self._completion_choice(out, c) for c in out.outputs])

    def _completion_choice(self, out: RequestOutput, c: CompletionOutput) -> CompletionChoice:
        text, prompt_part = c.text, None
        if self.echo:
            text = self._echo(out, c.index) + text
            prompt_part = self._prompt_part(out)
        return CompletionChoice(index=self.index_base + c.index, text=text, finish_reason=_finish_reason(c),
                                logprobs=_joined(prompt_part, self._completion_logprobs(c.index, c.token_ids,
                                                                                         c.logprobs)),
                                prompt_logprobs=self._vllm_prompt_logprobs(out))

    def _chat_choice(self, c: CompletionOutput) -> ChatChoice:
        logprobs = self._chat_logprobs(c.token_ids, c.logprobs)
        if self.tool_mode is None:
            return ChatChoice(index=c.index, message=AssistantMessage(content=c.text), logprobs=logprobs,
                              finish_reason=_finish_reason(c))
        parsed = self._parser().parse(c.text)
        calls = [call.as_dict() for call in parsed.calls] or None
        return ChatChoice(index=c.index, message=AssistantMessage(content=parsed.content, tool_calls=calls),
                          logprobs=logprobs, finish_reason=self._finish(c, len(parsed.calls)))

    def _echo(self, out: RequestOutput, index: int) -> str:
        """The prompt text an `echo` completion starts with; its token offsets then count from its end."""
        prompt = self.prompt_text if self.prompt_text is not None else out.prompt
        if prompt is None:  # the request sent token ids
            prompt = self.tokenizer.decode(out.prompt_token_ids)
        self.offsets[index] = len(prompt)
        return prompt

    # ---- logprobs
    def _prompt_part(self, out: RequestOutput) -> CompletionLogprobs | None:
        """An echoed prompt's tokens in the legacy logprobs shape (OpenAI's, vLLM's): the first token has no
        logprob (null) and no top logprobs; offsets count from the prompt's start."""
        if self.logprobs is None or self.prompt_lps is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for token_id, position in zip(out.prompt_token_ids, self.prompt_lps):
            own = position.get(token_id) if position is not None else None
            text = self._text(token_id, own)
            tokens.append(text)
            token_lps.append(_finite(own.logprob) if own is not None else None)
            tops.append(dict(self._top(position)) if position is not None and self.logprobs > 0 else None)
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets)

    def _vllm_prompt_logprobs(self, out: RequestOutput) -> list[dict[int, PromptLogprob] | None] | None:
        """vLLM's choices[].prompt_logprobs: per prompt token its own logprob and the top `prompt_logprobs`."""
        k = None if self.chat else self.data.prompt_logprobs
        if k is None or self.prompt_lps is None:
            return None
        if self._vllm_plp is None:
            ids = out.prompt_token_ids
            self._vllm_plp = [None if position is None else {
                tid: PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=self._text(tid, lp))
                for tid, lp in position.items() if tid == ids[i] or (lp.rank is not None and lp.rank <= k)}
                for i, position in enumerate(self.prompt_lps)]
        return self._vllm_plp

    def _chat_logprobs(self, ids: list[int], positions: list[PositionLogprobs] | None) -> ChoiceLogprobs | None:
        if self.logprobs is None or positions is None:
            return None
        content = []
        for token_id, position in zip(ids, positions):
            sampled = position.get(token_id)
            text = self._text(token_id, sampled)
            content.append(TokenLogprob(
                token=text, logprob=_finite(sampled.logprob if sampled else float("-inf")),
                bytes=list(text.encode()),
                top_logprobs=[TopLogprob(token=t, logprob=_finite(lp), bytes=list(t.encode()))
                              for t, lp in self._top(position)]))
        return ChoiceLogprobs(content=content)

    def _completion_logprobs(self, index: int, ids: list[int],
                             positions: list[PositionLogprobs] | None) -> CompletionLogprobs | None:
        if self.logprobs is None or positions is None:
            return None
        offset = self.offsets.get(index, 0)
        tokens, token_lps, tops, offsets = [], [], [], []
        for token_id, position in zip(ids, positions):
            sampled = position.get(token_id)
            text = self._text(token_id, sampled)
            tokens.append(text)
            token_lps.append(_finite(sampled.logprob) if sampled else None)
            tops.append(dict(self._top(position)) if self.logprobs > 0 else None)
            offsets.append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets)

    def _top(self, position: PositionLogprobs) -> list[tuple[str, float]]:
        ranked = sorted(((lp.rank, tid, lp) for tid, lp in position.items()
                         if lp.rank is not None and lp.rank <= (self.logprobs or 0)), key=lambda r: r[0])
        return [(self._text(tid, lp), lp.logprob) for _, tid, lp in ranked]

    def _text(self, token_id: int, lp: Any) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.token_text(token_id)


def tool_mode(data: ChatCompletionRequest) -> str | None:
    """How a chat request's answer may call tools: None (no tools, or tool_choice none), "auto", "required"
    or "named"."""
    if not data.tools or data.tool_choice == "none":
        return None
    if isinstance(data.tool_choice, NamedToolChoice):
        return "named"
    return "required" if data.tool_choice == "required" else "auto"


def tool_parser(data: ChatCompletionRequest, mode: str | None) -> Any:
    """The parser reading tool calls out of the model's text in tool mode `mode` (gateway/tool_parsers.py)."""
    if mode == "named":
        return NamedCallParser(data.tool_choice.function.name)
    if mode == "required":
        return RequiredCallsParser()
    return PARSERS["hermes"]()


def _joined(first: CompletionLogprobs | None, second: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """An echoed prompt's logprobs followed by the generated tokens'."""
    if first is None or second is None:
        return second if first is None else first
    return CompletionLogprobs(tokens=first.tokens + second.tokens,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              top_logprobs=first.top_logprobs + second.top_logprobs,
                              text_offset=first.text_offset + second.text_offset)


def _finite(x: float) -> float:
    return max(x, -9999.0)  # JSON has no -inf; OpenAI clients expect a number


def _finish_reason(c: CompletionOutput) -> str | None:
    if c.finish_reason in (None, "stop", "length"):
        return c.finish_reason
    return "stop" if c.finish_reason == "abort" else c.finish_reason


def _usage(out: RequestOutput) -> Usage:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
