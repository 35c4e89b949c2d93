"""What the published request schemas state beyond each field's own bounds: the rules across fields the server
enforces (one output constraint at most, tools under auto counted unless beside response_format, top_logprobs
needs logprobs, best_of equals n, ...), the bounds the configuration sets ([preparation] budgets, cascade
routes' n) and, once the engines are loaded, the vocabulary and context bounds of token ids. Applied to
msgspec's JSON Schema components (gateway/openapi.py publishes them); what JSON Schema cannot state is listed
in docs/api.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.prompts import RESERVED_TEMPLATE_KWARGS

Schemas = dict[str, Any]  # component name -> JSON Schema
NOT_NULL = {"not": {"type": "null"}}
INT_KEY = "^(0|[1-9][0-9]{0,17})$"  # a logit_bias key before the vocabulary is known: a token id as text


def _given(field: str, schema: dict[str, Any] = NOT_NULL) -> dict[str, Any]:
    """Holds when the request sends `field` and it matches `schema` (by default: is not null)."""
    return {"required": [field], "properties": {field: schema}}


# each structured_outputs member that constrains the output (gateway/structured_outputs.py)
STRUCTURED_MEMBERS = [*(_given(k) for k in ("json", "regex", "choice", "grammar")),
                      _given("json_object", {"const": True})]


RESPONSE_FORMAT = _given("response_format", {"type": "object", "properties": {"type": {"enum": [
    "json_object", "json_schema"]}}})


def _constraints(chat: bool) -> list[dict[str, Any]]:
    """Each request field that constrains the output; structured_output() refuses two of them."""
    found = [RESPONSE_FORMAT, *(_given(k) for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")),
             _given("structured_outputs", {"type": "object", "anyOf": STRUCTURED_MEMBERS})]
    return [*found, TOOLS_CONSTRAIN] if chat else found


FORCED_TOOL = _given("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]})
# tools constrain the output unless tool_choice is none: forced calls, or auto's free text and checked calls;
# auto beside response_format is one constraint with it (calls or its answer), counted as response_format
TOOLS_CONSTRAIN = {"anyOf": [FORCED_TOOL, {"allOf": [_given("tools", {"type": "array", "minItems": 1}),
                                                     {"not": _given("tool_choice", {"const": "none"})},
                                                     {"not": RESPONSE_FORMAT}]}]}


def _at_most_one(options: list[dict[str, Any]], then: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Exactly one branch holds: none of `options`, or one of them (and `then`): two would match two branches.
    One keyword, not a rule per pair: generators expand every combination of branches."""
    return [{"oneOf": [{"not": {"anyOf": options}}, *({"allOf": [o, then]} if then else o for o in options)]}]


def _rules(chat: bool, cascades: list[str]) -> list[dict[str, Any]]:
    # SamplingParams.validate: the grammar decides where a structured output ends
    rules = _at_most_one(_constraints(chat), then={"properties": {"min_tokens": {"const": 0},
                                                                   "ignore_eos": {"const": False}}})
    if cascades:  # one answer is checked and escalated (gateway/cascade.py)
        rules.append({"if": _given("model", {"enum": cascades}), "then": {"properties": {"n": {"const": 1}}}})
    if chat:
        rules += [{"if": _given("top_logprobs"), "then": _given("logprobs", {"const": True})},
                  {"if": FORCED_TOOL, "then": _given("tools", {"type": "array", "minItems": 1})}]
    else:
        rules.append({"if": _given("max_tokens", {"const": 0}), "then": _given("echo", {"const": True})})
    return rules


def _option(prop: dict[str, Any], kind: str) -> dict[str, Any]:
    """The non-null branch of type `kind` of an optional property's schema."""
    return next(b for b in prop.get("anyOf", [prop]) if b.get("type") == kind)


def _choices(prop: dict[str, Any], most: int) -> None:
    """Options of a choice: at most [preparation] max_choice_options, none holding NUL (the compiler refuses it)."""
    choices = _option(prop, "array")
    choices["maxItems"] = most
    choices["items"] = {**choices["items"], "pattern": "^[^\\u0000]*$"}


def constrain(schemas: Schemas, cfg: Any) -> None:
    """Add the rules across fields and the configuration's bounds to the chat and completion request schemas."""
    cascades = sorted(name for name, route in cfg.routes.items() if route.strategy == "cascade")
    limits = cfg.preparation
    reserved = sorted(RESERVED_TEMPLATE_KWARGS | ({"chat_template"} if not cfg.server.allow_request_chat_template
                                                  else set()))
    for name, chat in (("ChatCompletionRequest", True), ("CompletionRequest", False)):
        request = schemas[name]
        request.setdefault("allOf", []).extend(_rules(chat, cascades))
        props = request["properties"]
        if not chat:  # the server also takes best_of equal to n (choices are not re-ranked); published: null
            props["best_of"] = {"type": "null", "default": None, "description": "best_of is not supported (a "
                                "best_of equal to n is accepted and changes nothing)"}
        _choices(props["guided_choice"], limits.max_choice_options)
        for field in ("guided_regex", "guided_grammar"):  # a character is at most 4 UTF-8 bytes
            _option(props[field], "string")["maxLength"] = limits.max_grammar_bytes // 4
        _option(props["logit_bias"], "object")["propertyNames"] = {"pattern": INT_KEY}
        if chat:
            props["modalities"] = {"anyOf": [{"type": "array", "items": {"const": "text"}, "minItems": 1,
                                              "maxItems": 1}, {"type": "null"}], "default": None,
                                   "description": 'must be ["text"]: this server answers with text only'}
            _option(props["chat_template_kwargs"], "object")["propertyNames"] = {"not": {"enum": reserved}}
    members = schemas["StructuredOutputsParams"]
    members.setdefault("allOf", []).extend(_at_most_one(STRUCTURED_MEMBERS))
    _choices(members["properties"]["choice"], limits.max_choice_options)
    for field in ("regex", "grammar"):
        _option(members["properties"][field], "string")["maxLength"] = limits.max_grammar_bytes // 4
    schemas["ResponseFormat"].setdefault("allOf", []).append(
        {"if": _given("type", {"const": "json_schema"}), "then": _given("json_schema")})
    message = schemas["ChatMessage"]
    # OpenAI's message shapes: content is required but for an assistant's (chat templates read it)
    message.setdefault("allOf", []).append({"if": _given("role", {"enum": ["system", "developer", "user", "tool"]}),
                                            "then": _given("content")})
    _option(message["properties"]["tool_calls"], "array")["items"] = {
        "type": "object", "required": ["id", "type", "function"], "properties": {
            "id": {"type": "string"}, "type": {"const": "function"},
            "function": {"type": "object", "required": ["name", "arguments"], "properties": {
                "name": {"type": "string"}, "arguments": {"type": "string", "description": "a JSON object as text"}}}}}


def _key_pattern(below: int) -> str:
    """A regex for the decimal integers 0 .. below - 1 as JSON object keys (no sign, no leading zeros)."""
    top = str(below - 1)
    parts, n = ["0"], len(top)
    if n > 1:  # the shorter numbers
        parts.append("[1-9]" + (f"[0-9]{{0,{n - 2}}}" if n > 2 else ""))
    for i, digit in enumerate(top):  # as many digits as top: its first i, a smaller one, then any
        low, high = (1 if i == 0 else 0), int(digit) - 1
        if high >= low:
            rest = n - i - 1
            parts.append(top[:i] + (f"[{low}-{high}]" if high > low else str(low)) + (f"[0-9]{{{rest}}}" if rest else ""))
    if top != "0":
        parts.append(top)
    return "^(" + "|".join(parts) + ")$"


def bound_tokens(schemas: Schemas, vocab: int | None, context: int | None) -> None:
    """Token ids below `vocab` and token-id prompts shorter than `context` (the strictest of the loaded
    engines), in the request schemas."""
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        if vocab is not None:
            _option(props["stop_token_ids"], "array")["items"]["maximum"] = vocab - 1
            _option(props["logit_bias"], "object")["propertyNames"] = {"pattern": _key_pattern(vocab)}
    forms = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][1]["anyOf"]  # ids, or a list of prompts
    for token_ids in (forms[0], forms[1]["items"]["anyOf"][1]):
        if vocab is not None:
            token_ids["items"] = {**token_ids["items"], "maximum": vocab - 1}
        if context is not None:
            token_ids["maxItems"] = context - 1


def engine_bounds(engines: Iterable[Any]) -> tuple[int | None, int | None]:
    """(the smallest vocabulary, the shortest context) of `engines`: an id any of them refuses, a prompt too
    long for one of them, is outside the contract (the route decides the engine)."""
    vocabs, contexts = [], []
    for engine in engines:
        for source in (getattr(engine, "config", None), getattr(engine, "tokenizer", None)):
            vocab = getattr(source, "vocab_size", None)
            if isinstance(vocab, int):
                vocabs.append(vocab)
        context = getattr(engine, "max_model_len", None)
        if isinstance(context, int):
            contexts.append(context)
    return min(vocabs, default=None), min(contexts, default=None)
