"""What a request asks its output to match, as one `engines.structured.StructuredOutput`: OpenAI's
`response_format` and `tool_choice` (auto included), vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` and its newer `structured_outputs`. At most one may constrain a request (response_format beside
tools under auto counts as one: calls or its answer); anything that cannot be honoured is an InvalidParameter
naming its field. Every JSON schema is checked here before it reaches an engine (engines/schema_support.py):
OpenAI's strict rules where `strict` is true, then a keyword no backend enforces exactly is a 400 whose `param`
is the field plus the keyword's JSON pointer."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from engines import schema_support, tool_grammar
from engines.structured import StructuredOutput
from gateway.invalid_parameter import InvalidParameter
from gateway.strict_schema import strict_violation

if TYPE_CHECKING:
    from gateway.protocol import ChatCompletionRequest, CompletionRequest, Tool


def _invalid(param: str, message: str) -> Exception:
    return InvalidParameter(param, message)


def _schema(value: Any, param: str) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _invalid(param, f"{param} must be a JSON schema (an object, or a string holding one)") from None
    if not isinstance(value, dict | bool):
        raise _invalid(param, f"{param} must be a JSON schema object")
    return value


def checked_schema(schema: Any, param: str, strict: bool = False) -> Any:
    """`schema` if tandem can enforce it exactly (and, when `strict`, it follows OpenAI's strict rules); else
    InvalidParameter with param `<field>#<JSON pointer of the keyword>`."""
    try:
        schema_support.plan(schema)
        refused = strict_violation(schema) if strict else None
    except schema_support.SchemaRefused as e:
        refused = e
    if refused is not None:
        raise _invalid(f"{param}#{refused.pointer}", f"{param}: {refused}")
    return schema


def structured_output(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    """The request's one output constraint, or None; InvalidParameter when it asks for several or an
    impossible one."""
    found: list[StructuredOutput] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(StructuredOutput("json_object", "", "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise _invalid("response_format.json_schema", "response_format of type json_schema needs json_schema")
        where = "response_format.json_schema.schema"
        if rf.json_schema.schema is None:  # no schema: any JSON object (strict has nothing to check)
            found.append(StructuredOutput.json_schema({"type": "object"}, where))
        else:
            strict = bool(rf.json_schema.strict)
            found.append(StructuredOutput.json_schema(
                checked_schema(_schema(rf.json_schema.schema, where), where, strict), where))
    if req.guided_json is not None:
        found.append(StructuredOutput.json_schema(checked_schema(_schema(req.guided_json, "guided_json"),
                                                                 "guided_json"), "guided_json"))
    if req.guided_regex is not None:
        found.append(StructuredOutput("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        found.append(_choice(req.guided_choice, "guided_choice"))
    if req.guided_grammar is not None:
        found.append(StructuredOutput("grammar", req.guided_grammar, "guided_grammar"))
    so = req.structured_outputs
    if so is not None:
        where = "structured_outputs"
        if so.json is not None:
            found.append(StructuredOutput.json_schema(checked_schema(_schema(so.json, f"{where}.json"),
                                                                     f"{where}.json"), f"{where}.json"))
        if so.regex is not None:
            found.append(StructuredOutput("regex", so.regex, f"{where}.regex"))
        if so.choice is not None:
            found.append(_choice(so.choice, f"{where}.choice"))
        if so.grammar is not None:
            found.append(StructuredOutput("grammar", so.grammar, f"{where}.grammar"))
        if so.json_object:
            found.append(StructuredOutput("json_object", "", f"{where}.json_object"))
    answer = found[0] if len(found) == 1 and found[0].param.startswith("response_format") else None
    forced = tool_call_constraint(req, answer)
    if forced is not None and forced.kind == "tool_calls" and answer is not None:
        return forced  # calls or the response_format answer: one grammar
    if forced is not None:
        found.append(forced)
    if len(found) > 1 and found[1].kind == "tool_calls":
        raise _invalid(found[0].param, f"{found[0].param} and tools under tool_choice auto both constrain the "
                       f"output (only response_format combines with them): send tool_choice none, or one of "
                       f"them")
    if len(found) > 1:
        raise _invalid(found[1].param, f"{found[1].param} and {found[0].param} both constrain the output: "
                       f"send one of them")
    return found[0] if found else None


def _choice(options: list[str], param: str) -> StructuredOutput:
    if not options or not all(options):
        raise _invalid(param, f"{param} must be a non-empty list of non-empty strings")
    return StructuredOutput.choice(options, param)


def tool_call_constraint(req: Any, answer: StructuredOutput | None = None) -> StructuredOutput | None:
    """The grammar of the calls `tool_choice` allows. Auto (or absent, with tools): free text and Hermes
    `<tool_call>` blocks whose arguments match their function's parameters (engines/tool_grammar.py); with
    `answer` (response_format's json_schema or json_object), either such calls and nothing else or a JSON
    answer matching it.
    Named: the function's arguments object. Required: a JSON list of calls `[{"name": ..., "arguments":
    {...}}]` (one at most when parallel_tool_calls is false), each validating against its function's
    parameters."""
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if choice == "none" or (choice in (None, "auto") and not tools):
        return None
    if not tools:
        raise _invalid("tool_choice", "tool_choice needs tools to choose from")
    for i, t in enumerate(tools):
        if t.function.parameters is not None:
            checked_schema(t.function.parameters, f"tools[{i}].function.parameters", bool(t.function.strict))
    if choice in (None, "auto"):
        schema = None if answer is None else json.loads(answer.spec) if answer.kind == "json" else {"type": "object"}
        return StructuredOutput("tool_calls", tool_grammar.spec(
            [(t.function.name, parameters(t)) for t in tools], req.parallel_tool_calls is not False, schema,
            answer.param if answer is not None else "response_format"), "tool_choice")
    if choice == "required":
        calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                            "arguments": parameters(t)},
                            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
        schema: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutput.json_schema(schema, "tool_choice")
    tool = named_tool(req)
    return StructuredOutput.json_schema(parameters(tool), "tool_choice")


def named_tool(req: Any) -> Tool:
    name = req.tool_choice.function.name
    for t in req.tools or ():
        if t.function.name == name:
            return t
    raise _invalid("tool_choice.function.name", f"tool_choice names {name!r}, which is not among the tools")


def parameters(tool: Tool) -> dict[str, Any]:
    """A function's parameter schema (an object with no declared parameters when absent)."""
    p = tool.function.parameters
    return p if p is not None else {"type": "object", "properties": {}}
