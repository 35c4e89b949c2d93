"""`/v1/completions`: one prompt served through the chat path's pipeline (`lifecycle.serve`), several prompts
answered as one merged answer (choices indexed prompt by prompt, streamed or not), and the prompt-only requests
(`max_tokens: 0` with `echo`, vLLM's `prompt_logprobs`) that score a prompt without generating."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream
from opentelemetry import trace

from engines.errors import ErrorCode, RequestRejected
from engines.outputs import CompletionOutput, RequestOutput
from gateway.answers import SSE_DONE, Completion, CompletionChoice, Usage, encode, sse
from gateway.errors import APIError
from gateway.lifecycle import engine_request_id, prompt_logprobs_k, resolve_route, score_prompt, serve
from gateway.openai_format import Formatter
from gateway.prompts import Prompt, completion_prompts
from gateway.protocol import CompletionRequest, InvalidParameter, sampling_params
from gateway.routing import Route, RoutingContext
from gateway.state import GatewayState
from gateway.streaming import ClientWatch, EventStream
from gateway.strict_request import ClientDisconnected


async def serve_completion(request: Request, state: GatewayState, data: CompletionRequest) -> Response | Stream:
    """A legacy completion: one prompt (the common path), several (each served as its own engine request,
    answered together, choices numbered prompt by prompt; a stream merges theirs), or `max_tokens=0` with `echo`
    (the prompts and their logprobs, scored without generating)."""
    route = resolve_route(request, state, data.model)
    prompts = completion_prompts(data)
    if data.max_tokens == 0:
        return await _serve_prompt_only(request, state, route, data, prompts)
    if len(prompts) == 1:
        prompt, sent = prompts[0]
        if isinstance(sent, str):
            return await serve(request, state, route, data, "text_completion", prompt, prompt_text=sent)
        return await serve(request, state, route, data, "text_completion", prompt, prompt_token_ids=sent)
    watch = ClientWatch(request.receive, request.scope)
    try:
        parts = await asyncio.gather(*(
            serve(request, state, route, data, "text_completion", prompt, part=i, watch_client=False,
                  **({"prompt_text": sent} if isinstance(sent, str) else {"prompt_token_ids": sent}))
            for i, (prompt, sent) in enumerate(prompts)), return_exceptions=True)
    except asyncio.CancelledError:
        if not watch.uncancel_if_left():
            raise
        raise ClientDisconnected("The client closed the connection before its answer") from None
    finally:
        watch.stop()
    failed = next((p for p in parts if isinstance(p, BaseException)), None)
    if data.stream and failed is None:
        return _merged_stream(parts, data)
    for part in parts:  # a JSON answer is complete: its accounting runs now; a stream that started is closed
        if isinstance(part, Response | Stream) and part.background is not None:
            await part.background()
    if failed is not None:
        raise failed
    bodies = [msgspec.json.decode(part.content, type=Completion) for part in parts]
    choices = sorted((c for body in bodies for c in body.choices), key=lambda c: c.index)
    usage = Usage(prompt_tokens=sum(b.usage.prompt_tokens for b in bodies if b.usage),
                  completion_tokens=sum(b.usage.completion_tokens for b in bodies if b.usage),
                  total_tokens=sum(b.usage.total_tokens for b in bodies if b.usage))
    first = bodies[0]
    merged = Completion(id=first.id, created=first.created, model=first.model, choices=choices, usage=usage)
    return Response(content=encode(merged), media_type="application/json", headers=dict(parts[0].headers))


def _merged_stream(parts: list[Any], data: CompletionRequest) -> Stream:
    """One SSE stream of several prompts' streams (their choices numbered prompt by prompt): events as they come,
    each part's usage summed into one closing usage chunk, one [DONE]. Closing it closes every part."""
    include_usage = bool(data.stream_options and data.stream_options.include_usage)
    closed = False

    async def close_parts() -> None:
        nonlocal closed
        if not closed:
            closed = True
            for part in parts:
                await part.background()  # the part's stream ends, its request is finished or aborted

    async def events() -> AsyncIterator[bytes]:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def pump(part: Any) -> None:
            try:
                async for chunk in part.iterator:
                    await queue.put(chunk)
            finally:
                await queue.put(None)

        pumps = [asyncio.create_task(pump(part)) for part in parts]
        usage = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        last: dict[str, Any] = {}
        try:
            live = len(parts)
            while live:
                chunk = await queue.get()
                if chunk is None:
                    live -= 1
                    continue
                out = []
                for event in chunk.split(b"\n\n"):
                    if not event or event == SSE_DONE.strip():
                        continue
                    body = json.loads(event[len(b"data: "):])
                    if body.get("usage") and not body.get("choices"):  # a part's usage chunk: summed below
                        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                            setattr(usage, key, getattr(usage, key) + body["usage"][key])
                        last = body
                        continue
                    out.append(event + b"\n\n")
                if out:
                    yield b"".join(out)
            if include_usage and last:
                yield sse(Completion(id=last["id"], created=last["created"], model=last["model"], choices=[],
                                     usage=usage))
            yield SSE_DONE
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await close_parts()

    stream = events()

    async def after() -> None:
        await stream.aclose()
        await close_parts()  # the stream never started: the parts are closed here

    return EventStream(stream, media_type="text/event-stream",
                       headers=dict(parts[0].headers) | {"cache-control": "no-cache"}, background=BackgroundTask(after))


async def _serve_prompt_only(request: Request, state: GatewayState, route: Route, data: CompletionRequest,
                             prompts: list[tuple[Prompt, str | list[int]]]) -> Response | Stream:
    """`max_tokens=0` with `echo`: each prompt echoed n times, with its logprobs when asked (lm-eval's
    log-likelihood requests), scored on the engine the route's strategy plans, and nothing generated. No engine
    request runs, so admission and the engine metrics do not see it; the key's tokens/minute count its prompt
    tokens, [server] max_inflight_requests counts it, and the HTTP span says what it was."""
    scope_state = request.scope["state"]
    request_id = scope_state["request_id"]
    try:
        params = sampling_params(data, default_max_tokens=16, max_tokens_cap=route.config.max_tokens)
    except InvalidParameter as exc:  # the other fields are checked as for any request
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    k = prompt_logprobs_k(data)
    span = trace.get_current_span()
    span.update_name(f"text_completion {data.model}")
    span.set_attributes({"gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "tandem",
                         "gen_ai.request.model": data.model, "tandem.route": route.name,
                         "gen_ai.request.max_tokens": 0})
    tokens = state.keyring.limiter.reservation(scope_state.get("api_key"))
    strategy = state.routes.strategy(route)
    state.inflight += 1
    try:
        choices: list[CompletionChoice] = []
        prompt_tokens = 0
        engine = None
        for i, (prompt, sent) in enumerate(prompts):
            prompt.check_size(state.engines[name] for name in route.config.engines)
            prompt.tokenize = True
            ctx = RoutingContext(request_id=engine_request_id(scope_state, i), route=route, params=params,
                                 prompt=prompt, prompt_text=sent if isinstance(sent, str) else None,
                                 prompt_token_ids=None if isinstance(sent, str) else sent)
            engine = state.engines[strategy.plan(ctx, state.engines).engine]
            ids = list(await prompt.get(engine))
            try:
                engine.inputs.check_prompt(ids, scoring=True)  # the engine's own prompt checks (the whole context)
            except RequestRejected as exc:
                code = exc.code.value if exc.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED else "invalid_value"
                raise APIError(400, str(exc), param=prompt.param, code=code) from None
            if tokens is not None:
                await tokens.reserve(len(ids))
                tokens.settle(len(ids))
            prompt_tokens += len(ids)
            scored = await score_prompt(engine, ids, k) if k is not None else None
            out = RequestOutput(request_id=ctx.request_id, prompt=sent if isinstance(sent, str) else None,
                                prompt_token_ids=ids, finished=True, outputs=[
                                    CompletionOutput(index=j, logprobs=[] if params.logprobs is not None else None,
                                                     finish_reason="length") for j in range(params.n)])
            fmt = Formatter("text_completion", "cmpl-" + request_id, int(time.time()), data.model, engine.tokenizer,
                            data, params.logprobs, ctx.prompt_text, index_base=i * params.n, prompt_logprobs=scored)
            choices += fmt.full(out).choices
    finally:
        state.inflight -= 1
    body = Completion(id="cmpl-" + request_id, created=int(time.time()), model=data.model, choices=choices,
                      usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens))
    span.set_attributes({"gen_ai.usage.input_tokens": prompt_tokens, "gen_ai.usage.output_tokens": 0})
    if engine is not None:
        span.set_attribute("gen_ai.response.model", engine.name)
    headers = {"x-request-id": request_id, "x-tandem-route": route.name,
               "x-tandem-model": engine.name if engine is not None else ""}
    if not data.stream:
        return Response(content=encode(body), media_type="application/json", headers=headers)

    async def events() -> AsyncIterator[bytes]:
        usage = body.usage
        body.usage = None
        yield sse(body)
        if data.stream_options and data.stream_options.include_usage:
            yield sse(Completion(id=body.id, created=body.created, model=body.model, choices=[], usage=usage))
        yield SSE_DONE

    return EventStream(events(), media_type="text/event-stream", headers=headers | {"cache-control": "no-cache"})
