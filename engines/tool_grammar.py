"""The grammar of `tool_choice: "auto"` answers in the Hermes format: free text, and wherever the model opens
`<tool_call>`, one `{"name": <a tool>, "arguments": <its parameters>}` object in the compact layout, then
`</tool_call>`, then free text or more calls. Compiled as an xgrammar structural tag (triggered tags)."""

from __future__ import annotations

import json
import re
from typing import Any

import engines.schema_support as schema_support

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# xgrammar's length-bounded string characters let control bytes through, which is not JSON (see CompactJSON)
_BOUNDED_CHARS = re.compile(r'\[\^\\"\\\\\\r\\n\]')


class ToolGrammarRefused(ValueError):
    """A tool's parameters cannot be enforced exactly inside the call grammar; `index` is the tool's,
    `keyword` / `pointer` name the keyword (pointer within that tool's parameters)."""

    def __init__(self, index: int, message: str, keyword: str | None = None, pointer: str | None = None):
        super().__init__(message)
        self.index, self.keyword, self.pointer = index, keyword, pointer


def spec(tools: list[tuple[str, Any]], parallel: bool = True) -> str:
    """The constraint's canonical text: the tools as (name, parameters schema) and whether several calls may
    come (`parallel_tool_calls`)."""
    return json.dumps({"tools": [{"name": n, "parameters": p} for n, p in tools], "parallel": parallel},
                      separators=(",", ":"), sort_keys=True)


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    kinds = {"string": str, "boolean": bool, "null": type(None), "number": (int, float)}
    return name in kinds and isinstance(value, kinds[name]) and (name == "boolean" or not isinstance(value, bool))


def _typed_enums_alone(node: Any) -> Any:
    """`node` with every `{"type": T, "enum": [scalars]}` (nothing else beside them but annotations) written
    as the enum of its values of type T: the same set, in the form xgrammar enforces exactly (beside `type`
    the walk sends an enum to llguidance, which this grammar cannot embed). `const` likewise."""
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


def _arguments_ebnf(index: int, schema: Any) -> str:
    """The parameters schema as xgrammar EBNF in the compact layout, or ToolGrammarRefused when a keyword
    would need llguidance (which this grammar cannot embed) or is refused outright."""
    import xgrammar as xgr

    try:
        chosen = schema_support.plan(_typed_enums_alone(schema))
    except schema_support.SchemaRefused as e:
        raise ToolGrammarRefused(index, str(e), e.keyword, e.pointer) from None
    if chosen.backend != schema_support.XGRAMMAR:
        keyword, pointer = chosen.needs[0]
        raise ToolGrammarRefused(index, f"the parameters' `{keyword}` at {pointer or '/'} is enforced exactly "
                                 f"only by llguidance, which tool_choice auto cannot use yet; force the call "
                                 f"(tool_choice required or the function's name) or drop the keyword",
                                 keyword, pointer)
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(chosen.schema), any_whitespace=False,
                                               separators=(", ", ": "))
    except Exception as e:  # a combination xgrammar rejects
        raise ToolGrammarRefused(index, f"the parameters cannot be compiled: {e}") from None
    return _BOUNDED_CHARS.sub(r'[^\\0-\\x1f"\\\\\\r\\n]', str(grammar))


def structural_tag(spec_text: str) -> dict[str, Any]:
    """xgrammar's structural tag (JSON form) for a `spec` text."""
    data = json.loads(spec_text)
    tags = []
    for i, tool in enumerate(data["tools"]):
        begin = f'{OPEN}\n{{"name": {json.dumps(tool["name"])}, "arguments": '
        tags.append({"type": "tag", "begin": begin,
                     "content": {"type": "grammar", "grammar": _arguments_ebnf(i, tool["parameters"])},
                     "end": f"}}\n{CLOSE}"})
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [OPEN], "tags": tags,
                                                 "at_least_one": False, "stop_after_first": not data["parallel"]}}


def compile_tool_calls(compiler, spec_text: str):
    """The compiled grammar (xgrammar.GrammarCompiler `compiler`) of a tool_calls constraint."""
    return compiler.compile_structural_tag(json.dumps(structural_tag(spec_text)))
