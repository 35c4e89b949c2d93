"""The OpenAI requests as msgspec Structs: chat and legacy completion requests (with vLLM-style extras,
unknown fields ignored) and their translation into `SamplingParams` (the answers: gateway/answers.py).
Request bodies are decoded strictly (`StrictJSONRequest`): JSON only, bounded nesting, no type coercion.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import numpy as np
from msgspec import Meta, Struct

from engines.sampling_params import SEED_MAX, SEED_MIN, InvalidSamplingParameter, SamplingParams
from gateway.invalid_parameter import InvalidParameter
from gateway.structured_outputs import structured_output

# ------------------------------------------------------------------------------------------- requests

T = TypeVar("T")


def _within(allowed: str, **constraints: Any) -> Meta:
    """A field's bounds: enforced while decoding (a 400 naming the field and `allowed`), and published in the
    OpenAPI document, which is msgspec's own schema of these Structs. SamplingParams.validate keeps the same
    ranges for the offline API (tests/gateway/test_gateway_openapi.py checks that they agree)."""
    return Meta(description=f"must be {allowed}", **constraints)


Choices = Annotated[int, _within("between 1 and 16", ge=1, le=16)]
Temperature = Annotated[float, _within("between 0 and 2", ge=0, le=2)]
TopP = Annotated[float, _within("in (0, 1]", gt=0, le=1)]
TopK = Annotated[int, _within("-1, 0 (off) or a positive integer", ge=-1)]
MinP = Annotated[float, _within("in [0, 1]", ge=0, le=1)]
Penalty = Annotated[float, _within("between -2 and 2", ge=-2, le=2)]
RepetitionPenalty = Annotated[float, _within("greater than 0", gt=0)]
# published only: SamplingParams.validate checks seed through seed + n - 1 (and msgspec's integer bounds must fit
# an int64, the generator's seeds do not)
Seed = Annotated[int, _within(f"between {SEED_MIN} and {SEED_MAX}",
                              extra_json_schema={"minimum": SEED_MIN, "maximum": SEED_MAX})]
MaxTokens = Annotated[int, _within("at least 1", ge=1)]
MinTokens = Annotated[int, _within("at least 0 (and at most max_tokens)", ge=0)]
TopLogprobs = Annotated[int, _within("between 0 and 20", ge=0, le=20)]
CompletionTopLogprobs = Annotated[int, _within("between 0 and 5", ge=0, le=5)]
TokenId = Annotated[int, _within("a token id: an integer from 0 to 2147483647", ge=0, le=2**31 - 1)]
StopText = Annotated[str, Meta(min_length=1)]
Stop = StopText | Annotated[list[StopText], _within("at most 4 sequences, each a non-empty string", max_length=4)]
# the options of guided_choice / structured_outputs.choice (their most is published from [preparation]
# max_choice_options, gateway/request_contract.py)
Choice = Annotated[list[Annotated[str, Meta(min_length=1)]], _within("a non-empty list of non-empty strings",
                                                                      min_length=1)]


class ContentPart(Struct, kw_only=True):
    # tandem serves text models: an image_url or input_audio part is refused while decoding, naming the field
    type: Annotated[Literal["text"], _within("'text': this server serves text models")] = "text"
    text: str | None = None


class ChatMessage(Struct, kw_only=True):
    role: Annotated[Literal["system", "developer", "user", "assistant", "tool", "function"],
                    _within("one of system, developer, user, assistant, tool, function")]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # shape published by gateway/request_contract.py
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The plain dict a chat template expects; text parts are joined."""
        if isinstance(self.content, list):
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


# structured outputs and tools (gateway/structured_outputs.py turns them into the engine's constraint); a key
# these objects do not know is a 400 naming it, never ignored
class JSONSchemaFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: one of json (a schema), regex, choice, grammar (EBNF), json_object."""
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Choice | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName


LogitBias = dict[int, Annotated[float, Meta(ge=-100, le=100, description="must be between -100 and 100")]]


class _SamplingFields(Struct, kw_only=True):
    """Fields shared by both endpoints: OpenAI's and the vLLM extras."""

    model: str
    n: Choices = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_tokens: MaxTokens | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    user: str | None = None
    # vLLM extras
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop_token_ids: Annotated[list[TokenId], _within("at most 64 token ids", max_length=64)] | None = None
    ignore_eos: bool = False
    min_tokens: MinTokens = 0
    skip_special_tokens: bool = True
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Choice | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], _within("a list of at least one message", min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields tandem does not implement: present is a 400 naming them (modalities: only ["text"])
    audio: Any = None
    modalities: list[str] | None = None  # ["text"] or a 400 naming it (published: gateway/request_contract.py)
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
MAX_PROMPTS = 64  # prompts in one /v1/completions request (each answered with n choices)
# msgspec takes one array type per union: the list forms are published here and checked by prompt_inputs
PromptInput = Annotated[str, Meta(min_length=1)] | Annotated[list[Any], Meta(
    description=f"token ids, or a list of 1 to {MAX_PROMPTS} prompts (strings or token ids): n choices each",
    extra_json_schema={"anyOf": [_TOKEN_IDS, {"minItems": 1, "maxItems": MAX_PROMPTS, "items": {
        "anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]}}]})]
CompletionMaxTokens = Annotated[int, _within("at least 0 (0 needs echo: the prompt's logprobs, nothing generated)",
                                             ge=0)]


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: PromptInput
    max_tokens: CompletionMaxTokens | None = None
    logprobs: CompletionTopLogprobs | None = None
    echo: bool = False
    suffix: Annotated[str, _within("empty: suffix is not supported", max_length=0)] | None = None
    best_of: int | None = None
    # vLLM extra: each prompt token's logprob and this many top alternatives, in choices[].prompt_logprobs
    prompt_logprobs: TopLogprobs | None = None


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def prompt_inputs(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a legacy completion request, each as text or token ids (OpenAI's four forms: a string,
    token ids, a list of strings, a list of token-id lists)."""
    prompt: Any = req.prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and not isinstance(prompt[0], str | list)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise InvalidParameter("prompt", "prompt must not be empty")
    if len(prompts) > MAX_PROMPTS:
        raise InvalidParameter("prompt", f"prompt holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request")
    for i, one in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 and one is prompt else f"prompt[{i}]"
        if isinstance(one, list) and one and all(isinstance(t, float) and t.is_integer()
                                                 or isinstance(t, int) and not isinstance(t, bool) for t in one):
            one = prompts[i] = [int(t) for t in one]  # 5.0 is an integer to JSON Schema, as for every field
        if not isinstance(one, str) and not _is_token_ids(one):
            raise InvalidParameter(where, "prompt must be a string, a list of token ids, or a list of those")
        if not one:
            raise InvalidParameter(where, "prompt must not be empty")
    return prompts


def prompt_input(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a legacy completion request (a 400 if it holds several)."""
    prompts = prompt_inputs(req)
    if len(prompts) != 1:
        raise InvalidParameter("prompt", f"prompt holds {len(prompts)} prompts; one is expected here")
    return prompts[0]


# A client's X-Request-Id is kept (echoed in the response header, the base of the response id) when it is 1 to
# 128 of these characters; anything else is a 400 naming the header (a log- or header-injection vector otherwise).
REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


def client_request_id(value: bytes) -> str:
    """A client's X-Request-Id header value, validated (raises InvalidParameter naming the header)."""
    if REQUEST_ID.fullmatch(value) is None:
        raise InvalidParameter("X-Request-Id", "The X-Request-Id header must be 1 to 128 characters of A-Z, a-z, "
                               "0-9, '.', '_', ':' and '-'", code="invalid_request_id")
    return value.decode("ascii")


# ------------------------------------------------------------------------------------ decoding a body

MAX_JSON_DEPTH = 64  # arrays and objects; far beyond any real request, far below the decoder's recursion limit
QUOTE, OPENERS, CLOSERS = 0x22, (0x5B, 0x7B), (0x5D, 0x7D)  # " [ { ] }


def nests_deeper_than(body: bytes, limit: int) -> bool:
    """Whether the JSON text nests arrays and objects more than `limit` deep (brackets inside strings do not
    count), found without parsing it: the nesting a decoder would recurse on. Vectorised: about 10 ms per MiB,
    paid only by bodies holding more than `limit` brackets."""
    if body.count(b"[") + body.count(b"{") <= limit:  # most requests: too few brackets to nest that deep
        return False
    chars = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)  # escapes gone
    in_string = (np.cumsum(chars == QUOTE, dtype=np.int32) & 1).astype(bool)
    step = ((chars == OPENERS[0]) | (chars == OPENERS[1])).view(np.int8) \
        - ((chars == CLOSERS[0]) | (chars == CLOSERS[1])).view(np.int8)
    step[in_string] = 0
    return int(np.cumsum(step, dtype=np.int32).max()) > limit


def _where(path: str) -> str | None:
    """msgspec's `$.messages[0].role` as the OpenAI param `messages[0].role`; None for the body itself."""
    return path.removeprefix("$").removeprefix(".") or None


def _alternatives(kind: Any, said: str | None = None) -> list[tuple[Any, str | None]]:
    """The types `kind` stands for (unions and Meta unwrapped), each with its innermost `_within` wording."""
    if isinstance(kind, msgspec.inspect.UnionType):
        return [alt for member in kind.types for alt in _alternatives(member, said)]
    if isinstance(kind, msgspec.inspect.Metadata):
        return _alternatives(kind.type, (kind.extra_json_schema or {}).get("description", said))
    return [(kind, said)]


def _allowed(type_: Any, where: str) -> str | None:
    """What the field at `where` (`n`, `stop[1]`, `messages[0].role`) of `type_` allows, as its `_within`
    (or its container's, for an item) words it: msgspec's error names only the value it refused."""
    kinds, said, path = _alternatives(msgspec.inspect.type_info(type_)), None, ""
    for step in re.findall(r"\[[^\]]*\]|[^.\[]+", where):  # field names, [index] and [...] (a dict's value)
        inner = []
        for kind, _ in kinds:
            if step.startswith("[") and isinstance(kind, msgspec.inspect.ListType | msgspec.inspect.DictType):
                inner += _alternatives(kind.item_type if isinstance(kind, msgspec.inspect.ListType)
                                       else kind.value_type)
            elif isinstance(kind, msgspec.inspect.StructType):
                inner += [alt for f in kind.fields if f.encode_name == step for alt in _alternatives(f.type)]
        kinds, path = inner, path + (step if step.startswith("[") or not path else "." + step)
        wording = next((wording for _, wording in kinds if wording), None)
        if wording or not step.startswith("["):  # a field's wording covers its items, not a nested field
            said = f"{path} {wording}" if wording else None
    return said


def _invalid_body(exc: msgspec.ValidationError, type_: Any) -> InvalidParameter:
    message = str(exc)
    at = re.search(r" - at `(\$[^`]*)`$", message)  # msgspec says where in the body: "... - at `$.n`"
    where = _where(at.group(1)) if at else None
    message = message[:at.start()] if at else message
    missing = re.fullmatch(r"Object missing required field `(.+?)`", message)
    if missing:
        param = f"{where}.{missing.group(1)}" if where else missing.group(1)
        return InvalidParameter(param, f"Missing required parameter {param!r}", code="missing_required_parameter")
    unknown = re.fullmatch(r"Object contains unknown field `(.+?)`", message)
    if unknown:  # a field this endpoint does not implement: refused, named
        param = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        return InvalidParameter(param, f"Unknown parameter {param!r}: this server does not implement it",
                                code="unknown_parameter")
    if where is None:
        return InvalidParameter(None, f"Invalid request body: {message}")
    hint = _allowed(type_, where)
    return InvalidParameter(where, f"Invalid value for {where!r}: {message}" + (f"; {hint}" if hint else ""))


def decode_request(body: bytes, type_: type[T]) -> T:
    """The JSON body as `type_`, strictly: no string-to-number or string-to-bool coercion, numbers in range
    (no inf), nesting bounded by MAX_JSON_DEPTH. Raises InvalidParameter naming the offending field."""
    if nests_deeper_than(body, MAX_JSON_DEPTH):
        raise InvalidParameter(None, f"The JSON body nests arrays and objects more than {MAX_JSON_DEPTH} "
                               f"levels deep", code="invalid_json")
    try:
        return msgspec.json.decode(body, type=type_, strict=True)
    except msgspec.ValidationError as exc:
        # JSON Schema (and so the published document) counts 2.0 as an integer: the one coercion taken
        try:
            relaxed = _integral_floats_as_ints(msgspec.json.decode(body))
            if relaxed is not None:
                # decoded again as JSON (not converted): object keys stay text, as logit_bias' ids arrive
                return msgspec.json.decode(msgspec.json.encode(relaxed), type=type_, strict=True)
        except msgspec.MsgspecError:
            pass
        raise _invalid_body(exc, type_) from None
    except msgspec.DecodeError as exc:
        where = _non_finite_number(body)
        if where is not None:
            raise InvalidParameter(where, f"Invalid value for {where!r}: NaN and Infinity are not JSON numbers; "
                                   f"send a finite number", code="invalid_json") from None
        raise InvalidParameter(None, f"Could not parse the JSON body of the request: {exc}",
                               code="invalid_json") from None


def _integral_floats_as_ints(value: Any) -> Any:
    """`value` with every float that is a whole number (2.0) as an int, or None when it holds none."""
    found = False

    def walk(v: Any) -> Any:
        nonlocal found
        if isinstance(v, float) and v.is_integer():  # as large as an integer literal may be
            found = True
            return int(v)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v

    out = walk(value)
    return out if found else None


_NOT_FINITE = object()


def _non_finite_number(body: bytes) -> str | None:
    """Where a body that is JSON but for a NaN / Infinity literal holds one (`temperature`, `messages[0].x`),
    or None. Only on the error path: the standard library's parser accepts those literals."""
    try:
        value = json.loads(body, parse_constant=lambda _: _NOT_FINITE)
    except (ValueError, RecursionError):
        return None

    def find(v: Any, path: str) -> str | None:
        if v is _NOT_FINITE:
            return path or None
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, x in items:
            hit = find(x, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else k)
            if hit is not None:
                return hit
        return None

    return find(value, "")


def refuse_unsupported(req: ChatCompletionRequest) -> None:
    """A 400 naming the first OpenAI field the request uses that tandem does not implement."""
    for name in ("audio", "prediction", "web_search_options", "functions", "function_call"):
        if getattr(req, name) is not None:
            raise InvalidParameter(name, f"{name} is not supported by this server (it serves text models; use "
                                   f"tools and tool_choice for function calling)")
    if req.modalities is not None and req.modalities != ["text"]:
        raise InvalidParameter("modalities", 'modalities: this server answers with text only (send ["text"])')


def sampling_params(req: ChatCompletionRequest | CompletionRequest, *, default_max_tokens: int | None,
                    max_tokens_cap: int | None = None) -> SamplingParams:
    """Translate the request's sampling fields (their bounds were checked while decoding); raises
    InvalidParameter naming the field."""
    if isinstance(req, ChatCompletionRequest):
        refuse_unsupported(req)
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs requires logprobs to be true")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens, max_name = req.max_tokens, "max_tokens"
        if max_tokens == 0:  # the caller answers a prompt-only request without the engine (gateway/lifecycle.py)
            if not req.echo:
                raise InvalidParameter("max_tokens", "max_tokens=0 needs echo=true: the answer is the prompt "
                                       "(with its logprobs when logprobs is set), nothing is generated")
            max_tokens = 1
        logprobs = req.logprobs
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidParameter("best_of", "best_of different from n is not supported")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens_cap is not None:
        max_tokens = max_tokens_cap if max_tokens is None else min(max_tokens, max_tokens_cap)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens, max_tokens=max_tokens, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens, logit_bias=req.logit_bias,
            structured=structured_output(req),
            prompt_logprobs=req.prompt_logprobs if isinstance(req, CompletionRequest) else None)
    except InvalidSamplingParameter as exc:
        raise InvalidParameter(max_name if exc.param == "max_tokens" else exc.param, str(exc)) from None
