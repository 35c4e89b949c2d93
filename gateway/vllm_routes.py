"""The endpoints a vLLM user expects beside OpenAI's: `POST /tokenize` and `POST /detokenize` (vLLM's request
and response shapes), `GET /version`, and OpenAI's `GET /v1/models/{model}` (a 404 in OpenAI's shape for an
unknown one). A route's text is tokenised by its first engine (a route's engines share a tokenizer: a cascade
hands the small engine's tokens to the large one as drafts); long texts are tokenised in a worker thread.
"""

from __future__ import annotations

from importlib import metadata
from typing import Annotated, Any

import msgspec
from litestar import Request, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import JSONBody, PathParameter
from msgspec import Meta, Struct

from gateway.answers import LoadedWeights, ModelCard
from gateway.errors import APIError
from gateway.openapi import error_responses
from gateway.prompts import INLINE_CHARS, MAX_CHARS_PER_TOKEN
from gateway.protocol import ChatMessage
from gateway.routing import Route
from gateway.state import GatewayState
from gateway.tokenize_pool import POOL as TOKENIZE_POOL

MAX_DETOKENIZE_TOKENS = 1 << 20  # far beyond any context; the body limit binds first


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`): exactly one of them."""

    model: str | None = None  # optional when the server serves a single model, as in vLLM
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's defaults)
    add_generation_prompt: bool = True  # messages only
    chat_template_kwargs: dict[str, Any] | None = None  # messages only: extra template variables
    return_token_strs: bool = False


class TokenizeResponse(Struct, kw_only=True, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_DETOKENIZE_TOKENS)]


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


class Version(Struct, kw_only=True):
    version: str


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


def _route(state: GatewayState, model: str | None) -> Route:
    if not state.ready:
        raise APIError(503, f"The server is not ready: {state.load_error or 'models are loading'}",
                       code="not_ready", retry_after=5)
    if model is None:
        if len(state.routes.routes) != 1 and not _one_tokenizer(state):
            raise APIError(400, f"Missing required parameter 'model': this server serves "
                           f"{', '.join(state.routes.routes)}, whose tokenizers differ", param="model",
                           code="missing_required_parameter")
        model = next(iter(state.routes.routes))
    return state.routes.resolve(model)


_ONE_TOKENIZER: dict[tuple[int, ...], bool] = {}


def _one_tokenizer(state: GatewayState) -> bool:
    """Whether every engine tokenises alike (the same tokenizer.json), so `model` may be left out, as with one
    model in vLLM; worked out once per set of engines."""
    engines = [e for e in state.engines.values() if getattr(e, "tokenizer", None) is not None]
    key = tuple(id(e) for e in engines)
    if key not in _ONE_TOKENIZER:
        _ONE_TOKENIZER[key] = len({e.tokenizer.backend.to_str() for e in engines}) <= 1
    return _ONE_TOKENIZER[key]


@get("/version", sync_to_thread=False)
def version() -> Version:
    """The server's version (vLLM's `/version`)."""
    return Version(version=metadata.version("tandem-serve"))


def model_card(state: GatewayState, route: Route) -> ModelCard:
    lens = [getattr(state.engines.get(e), "max_model_len", None) for e in route.config.engines]
    loaded = []
    for e in route.config.engines:
        info = getattr(state.engines.get(e), "load_info", None)
        if isinstance(info, dict):
            loaded.append(LoadedWeights(engine=e, **{k: info[k] for k in LoadedWeights.__struct_fields__
                                                     if k != "engine"}))
    return ModelCard(id=route.name, created=state.created, owned_by="tandem",
                     kind="engine" if route.direct else "route",
                     max_model_len=min(lens) if lens and None not in lens else None, loaded=loaded or None)


@get("/v1/models/{model:path}", responses=error_responses(401, 404))
async def retrieve_model(request: Request, model: Annotated[str, PathParameter()]) -> ModelCard:
    """One model (route or engine) by its id, as OpenAI's `GET /v1/models/{model}`; ids may contain '/'."""
    state = _state(request)
    route = state.routes.routes.get(model.removeprefix("/"))
    if route is None:
        raise APIError(404, f"The model {model.removeprefix('/')!r} does not exist", param="model",
                       code="model_not_found")
    return model_card(state, route)


@post("/tokenize", status_code=200, responses={
    200: ResponseSpec(TokenizeResponse, description="The token ids (and their texts when asked)",
                      generate_examples=False), **error_responses(400, 401, 404, 413, 415, 429, 503)})
async def tokenize(request: Request, data: JSONBody[TokenizeRequest]) -> TokenizeResponse:
    """Tokenise a prompt, or a conversation rendered with the model's chat template (vLLM's `/tokenize`)."""
    state = _state(request)
    if (data.prompt is None) == (data.messages is None):
        raise APIError(400, "Send exactly one of 'prompt' (text) and 'messages' (a conversation)",
                       param="prompt" if data.prompt is None else "messages", code="invalid_value")
    route = _route(state, data.model)
    engine = state.engines[route.config.engines[0]]
    tokenizer = engine.tokenizer
    if data.messages is not None:
        text = _render(engine, data)
        special = bool(data.add_special_tokens)
    else:
        for field in ("chat_template_kwargs",):
            if getattr(data, field) is not None:
                raise APIError(400, f"{field} applies to 'messages' only", param=field, code="invalid_value")
        text = data.prompt or ""
        special = data.add_special_tokens is not False
    if len(text) > engine.max_model_len * MAX_CHARS_PER_TOKEN:  # bounded before any work, as for generation
        raise APIError(400, f"The text has {len(text)} characters, more than a context of {engine.max_model_len} "
                       f"tokens can hold; shorten it", param="messages" if data.messages is not None else "prompt",
                       code="context_length_exceeded")

    def work() -> tuple[list[int], list[str] | None]:
        ids = tokenizer.encode(text, add_special_tokens=special)
        return ids, [tokenizer.token_text(t) for t in ids] if data.return_token_strs else None

    ids, strs = await TOKENIZE_POOL.run(work) if len(text) > INLINE_CHARS else work()
    if len(ids) > engine.max_model_len:  # as vLLM's /tokenize: a text the model cannot take is refused
        raise APIError(400, f"The text is {len(ids)} tokens, more than the context of {engine.max_model_len} "
                       f"tokens of {route.name!r}", param="messages" if data.messages is not None else "prompt",
                       code="context_length_exceeded")
    return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)


def _render(engine: Any, data: TokenizeRequest) -> str:
    tokenizer = engine.tokenizer
    if not tokenizer.has_chat_template:
        raise APIError(400, f"model {engine.name!r} has no chat template; send 'prompt'", param="messages",
                       code="no_chat_template")
    extra = dict(data.chat_template_kwargs or {})
    for key in ("messages", "add_generation_prompt", "tools", "documents", "chat_template"):
        if key in extra:  # the request's own fields, or a template of its own (refused, as for chat requests)
            raise APIError(400, f"chat_template_kwargs may not set {key!r}", param=f"chat_template_kwargs.{key}",
                           code="invalid_value")
    try:
        messages = [m.to_template() for m in data.messages or []]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=data.add_generation_prompt, **extra)
    except ValueError as exc:  # InvalidParameter (a message part) or ChatTemplateError
        raise APIError(400, f"chat template error: {exc}", param="messages", code="invalid_value") from None


@post("/detokenize", status_code=200, responses={
    200: ResponseSpec(DetokenizeResponse, description="The decoded text", generate_examples=False),
    **error_responses(400, 401, 404, 413, 415, 429, 503)})
async def detokenize(request: Request, data: JSONBody[DetokenizeRequest]) -> DetokenizeResponse:
    """Decode token ids to text (vLLM's `/detokenize`; special tokens are kept, as vLLM's are)."""
    state = _state(request)
    route = _route(state, data.model)
    engine = state.engines[route.config.engines[0]]
    vocab = engine.tokenizer.vocab_size
    bad = next((t for t in data.tokens if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range: the vocabulary of {route.name!r} has {vocab} "
                       f"tokens", param="tokens", code="invalid_value")

    def work() -> str:
        return engine.tokenizer.decode(data.tokens, skip_special_tokens=False)

    text = await TOKENIZE_POOL.run(work) if len(data.tokens) > INLINE_CHARS else work()
    return DetokenizeResponse(prompt=text)


HANDLERS = [version, retrieve_model, tokenize, detokenize]
SCHEMAS: list[type[msgspec.Struct]] = [TokenizeRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse,
                                       Version, ModelCard]
