"""The grammar of `tool_choice: "auto"` answers in the Hermes format: free text, and wherever the model opens
`<tool_call>`, one `{"name": <a tool>, "arguments": <its parameters>}` object in the compact layout, then
`</tool_call>`, then free text or more calls. An xgrammar structural tag (triggered tags) when xgrammar covers
every tool's parameters, else the same layout as an llguidance Lark grammar (`%json` per tool), which also
serves an answer schema beside the tools (response_format: either calls or a JSON answer, no free text)."""

from __future__ import annotations

import json
import re
from typing import Any

import engines.schema_support as schema_support
from engines.llguidance_backend import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# xgrammar's length-bounded string characters let control bytes through, which is not JSON (see CompactJSON)
_BOUNDED_CHARS = re.compile(r'\[\^\\"\\\\\\r\\n\]')


class ToolGrammarRefused(ValueError):
    """A tool's parameters (or the answer schema) cannot be enforced exactly inside the call grammar; `param`
    names the request field, `keyword` / `pointer` the keyword (pointer within that schema)."""

    def __init__(self, param: str, message: str, keyword: str | None = None, pointer: str | None = None):
        super().__init__(message)
        self.param, self.keyword, self.pointer = param, keyword, pointer


class XGrammarRejected(ValueError):
    """xgrammar would not compile a tool's parameters (the Lark form on llguidance may still take them)."""


def tool_param(index: int) -> str:
    return f"tools[{index}].function.parameters"


def spec(tools: list[tuple[str, Any]], parallel: bool = True, answer: Any = None,
         answer_param: str = "response_format") -> str:
    """The constraint's canonical text: the tools as (name, parameters schema), whether several calls may
    come (`parallel_tool_calls`) and, when the answer must otherwise be JSON, its schema (`answer`, from the
    request field `answer_param`)."""
    data: dict[str, Any] = {"tools": [{"name": n, "parameters": p} for n, p in tools], "parallel": parallel}
    if answer is not None:
        data["answer"], data["answer_param"] = answer, answer_param
    return json.dumps(data, separators=(",", ":"), sort_keys=True)


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    kinds = {"string": str, "boolean": bool, "null": type(None), "number": (int, float)}
    return name in kinds and isinstance(value, kinds[name]) and (name == "boolean" or not isinstance(value, bool))


def _typed_enums_alone(node: Any) -> Any:
    """`node` with every `{"type": T, "enum": [scalars]}` (nothing else beside them but annotations) written
    as the enum of its values of type T: the same set, in the form xgrammar enforces exactly (beside `type`
    the walk sends an enum to llguidance, which would put the whole call grammar on the Lark form). `const`
    likewise."""
    if isinstance(node, list):
        return [_typed_enums_alone(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _typed_enums_alone(v) for k, v in node.items()}
    t = node.get("type")
    names = [t] if isinstance(t, str) else t if isinstance(t, list) and all(isinstance(x, str) for x in t) else None
    values = node.get("enum") if isinstance(node.get("enum"), list) else (
        [node["const"]] if "const" in node and "enum" not in node else None)
    rest = set(node) - {"type", "enum", "const"} - schema_support.ANNOTATIONS
    if names is None or values is None or rest or any(isinstance(v, dict | list) for v in values):
        return out
    kept = [v for v in values if any(_is_type(v, n) for n in names)]
    if not kept:
        return out  # nothing fits: left for the walk to handle as written
    for k in ("type", "enum", "const"):
        out.pop(k, None)
    out["enum"] = kept
    return out


def _plan(param: str, schema: Any) -> schema_support.Plan:
    try:
        return schema_support.plan(schema)
    except schema_support.SchemaRefused as e:
        raise ToolGrammarRefused(param, str(e), e.keyword, e.pointer) from None


def xgrammar_covers(spec_text: str) -> bool:
    """Whether xgrammar enforces every tool's parameters exactly (the structural tag); else the Lark form on
    llguidance. An answer schema beside the tools has the Lark form only. ToolGrammarRefused for a keyword
    neither backend enforces."""
    data = json.loads(spec_text)
    plans = [_plan(tool_param(i), _typed_enums_alone(t["parameters"])) for i, t in enumerate(data["tools"])]
    return "answer" not in data and all(p.backend == schema_support.XGRAMMAR for p in plans)


def _arguments_ebnf(index: int, schema: Any) -> str:
    """The parameters schema (one xgrammar covers) as xgrammar EBNF in the compact layout; XGrammarRejected
    when xgrammar will not compile it."""
    import xgrammar as xgr

    chosen = _plan(tool_param(index), _typed_enums_alone(schema))
    if chosen.backend != schema_support.XGRAMMAR:  # xgrammar would approximate it (xgrammar_covers is False)
        raise XGrammarRejected(f"`{chosen.needs[0][0]}` needs llguidance")
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(chosen.schema), any_whitespace=False,
                                               separators=(", ", ": "))
    except Exception as e:  # a combination xgrammar rejects
        raise XGrammarRejected(str(e)) from None
    return _BOUNDED_CHARS.sub(r'[^\\0-\\x1f"\\\\\\r\\n]', str(grammar))


def _begin(name: str) -> str:
    """What follows `<tool_call>` before a call's arguments."""
    return f'\n{{"name": {json.dumps(name)}, "arguments": '


def structural_tag(spec_text: str) -> dict[str, Any]:
    """xgrammar's structural tag (JSON form) for a `spec` text."""
    data = json.loads(spec_text)
    tags = []
    for i, tool in enumerate(data["tools"]):
        tags.append({"type": "tag", "begin": OPEN + _begin(tool["name"]),
                     "content": {"type": "grammar", "grammar": _arguments_ebnf(i, tool["parameters"])},
                     "end": f"}}\n{CLOSE}"})
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [OPEN], "tags": tags,
                                                 "at_least_one": False, "stop_after_first": not data["parallel"]}}


def compile_tool_calls(compiler, spec_text: str):
    """The compiled grammar (xgrammar.GrammarCompiler `compiler`) of a tool_calls constraint."""
    return compiler.compile_structural_tag(json.dumps(structural_tag(spec_text)))


# free text holds no `<tool_call>` (that opens a call); llguidance's regexes have & (and) and ~ (not)
_TEXT = r"/(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/"


def _json_rule(schema: Any) -> str:
    """`%json` of a walked schema in the compact layout (llguidance's JSON options as `x-guidance`)."""
    body = {} if schema is True else dict(schema)
    body["x-guidance"] = JSON_OPTIONS
    return "%json " + json.dumps(body)


def lark_grammar(spec_text: str) -> str:
    """The same answers as `structural_tag` as an llguidance Lark grammar, each tool's parameters a `%json`
    in the same layout as llguidance's JSON schemas. With an answer schema: either one or more
    calls (separated by a line break, nothing around them) or a JSON answer matching it."""
    data = json.loads(spec_text)
    rules = [f"tool_{i}: {json.dumps(_begin(t['name']))} "
             f"{_json_rule(_plan(tool_param(i), t['parameters']).schema)}" for i, t in enumerate(data["tools"])]
    tools = " | ".join(f"tool_{i}" for i in range(len(rules)))
    close = json.dumps("}\n" + CLOSE)
    if "answer" in data:
        answer = _plan(data["answer_param"], data["answer"]).schema
        head = ["start: answer | calls", f"answer: {_json_rule(answer)}",
                'calls: call ("\\n" call)*' if data["parallel"] else "calls: call",
                f"call: {json.dumps(OPEN)} ({tools}) {close}"]
    else:  # text up to and with the first <tool_call> is one lazy lexeme: the call must follow
        head = ["start: call* TEXT" if data["parallel"] else "start: TEXT | call", f"TEXT: {_TEXT}",
                f"open[lazy]: /(.|\\n)*{OPEN}/", f"call: open ({tools}) {close}"]
    return "\n".join(["%llguidance {}", *head, *rules]) + "\n"
