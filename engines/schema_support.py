"""Which backend enforces a JSON schema exactly, decided before compiling: a walk over every keyword (with its
JSON pointer) against the table `KEYWORDS`, giving xgrammar, llguidance, or a refusal naming the keyword;
the same for regex features. Pure functions over JSON values."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

XGRAMMAR, LLGUIDANCE, REFUSED, ANNOTATION = "xgrammar", "llguidance", "refused", "annotation"

# keyword -> how it is enforced where it stands alone beside `type` (sibling rules in `_walk` may move a
# node to llguidance). docs/structured.md renders this table.
KEYWORDS: dict[str, str] = {
    "type": XGRAMMAR, "enum": XGRAMMAR, "const": XGRAMMAR, "anyOf": XGRAMMAR, "$ref": XGRAMMAR,
    "properties": XGRAMMAR, "required": XGRAMMAR, "additionalProperties": XGRAMMAR,
    "items": XGRAMMAR, "prefixItems": XGRAMMAR, "minItems": XGRAMMAR, "maxItems": XGRAMMAR,
    "minLength": XGRAMMAR, "maxLength": XGRAMMAR, "pattern": XGRAMMAR,
    "minimum": XGRAMMAR, "maximum": XGRAMMAR, "exclusiveMinimum": XGRAMMAR, "exclusiveMaximum": XGRAMMAR,
    "oneOf": LLGUIDANCE, "allOf": LLGUIDANCE, "multipleOf": LLGUIDANCE, "format": LLGUIDANCE,
    "patternProperties": LLGUIDANCE, "minProperties": LLGUIDANCE, "maxProperties": LLGUIDANCE,
    "additionalItems": LLGUIDANCE,
    "not": REFUSED, "if": REFUSED, "uniqueItems": REFUSED, "contains": REFUSED, "minContains": REFUSED,
    "maxContains": REFUSED, "propertyNames": REFUSED, "dependentRequired": REFUSED,
    "dependentSchemas": REFUSED, "dependencies": REFUSED, "unevaluatedProperties": REFUSED,
    "unevaluatedItems": REFUSED, "$dynamicRef": REFUSED, "$recursiveRef": REFUSED, "extends": REFUSED,
    "disallow": REFUSED, "divisibleBy": REFUSED,
}
# no assertion of their own (JSON Schema: unknown keywords are annotations too); stripped before compiling
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment",
    "$schema", "$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$vocabulary", "$defs",
    "definitions", "contentMediaType", "contentEncoding", "contentSchema", "then", "else"})
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
                     "uri"})
# llguidance's own `date` regex lets February 29 through in every year: these formats go to it as patterns of
# the valid calendar dates (years 0001-9999, the Gregorian leap rule), date-time with seconds 00-59, upper-case
# T and Z and at most 6 fractional digits (a subset of RFC 3339 that Python's parsers also accept)
_YEAR = r"(?:[1-9]\d{3}|0[1-9]\d{2}|00[1-9]\d|000[1-9])"
_LEAP = r"(?:\d\d(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
         rf"|02-(?:0[1-9]|1\d|2[0-8]))|{_LEAP}-02-29)")
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "date-time": f"^{_DATE}T{_TIME}$"}
TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
_BY_TYPE = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "array": {"items", "prefixItems", "minItems", "maxItems", "additionalItems"},
    "object": {"properties", "required", "additionalProperties", "patternProperties", "minProperties",
               "maxProperties"},
}
_TYPED = {k: t for t, ks in _BY_TYPE.items() for k in ks}
_APPLICATORS = {"anyOf", "oneOf", "allOf", "$ref", "enum", "const"}

# ECMA-262 features neither backend enforces: (regex, what to call it)
_REGEX_REFUSED = [
    (re.compile(r"\(\?<?[=!]"), "lookaround assertions"),
    (re.compile(r"\\[bB]"), "word boundaries (\\b, \\B)"),
    (re.compile(r"\\[1-9]|\\k<"), "backreferences"),
]
# what xgrammar's regex dialect covers exactly (anything else goes to llguidance)
_XGR_ATOM = re.compile(r"\\[dDwWsS./\-^$|?*+(){}\[\]]|\[(?:\\.|[^\]\\])*\]|\(\?:|[^\\\[]")


class SchemaRefused(ValueError):
    """A keyword no backend enforces exactly: `keyword` and `pointer` (JSON pointer into the schema)."""

    def __init__(self, keyword: str, pointer: str, message: str):
        super().__init__(message)
        self.keyword, self.pointer = keyword, pointer


@dataclass
class Plan:
    """The walk's verdict: the backend, the schema to compile (annotations stripped) and, when it is
    llguidance, the (keyword, pointer) pairs that need it."""

    backend: str
    schema: Any
    needs: list[tuple[str, str]] = field(default_factory=list)


def pointer_join(pointer: str, key: str | int) -> str:
    return f"{pointer}/{str(key).replace('~', '~0').replace('/', '~1')}"


def regex_refusal(pattern: str) -> str | None:
    """The regex feature in `pattern` that neither backend enforces, or None."""
    stripped = re.sub(r"\\\\", "", pattern)
    for rx, what in _REGEX_REFUSED:
        if rx.search(stripped):
            return what
    return None


def _xgrammar_pattern(pattern: str) -> bool:
    """Whether xgrammar matches `pattern` exactly as JSON Schema means it: xgrammar matches the whole string,
    so only ^...$ without a top-level alternation, written in the subset `_XGR_ATOM` covers."""
    if not (pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")):
        return False
    if '"' in pattern or re.search(r"\\[\\xuc0-9]", pattern):  # xgrammar emits a matched " or \ unescaped
        return False
    body, depth, pos = pattern[1:-1], 0, 0
    while pos < len(body):
        m = _XGR_ATOM.match(body, pos)
        if m is None:
            return False
        tok = m.group()
        if tok in ("(", "(?:"):
            depth += 1
        elif tok == ")":
            depth -= 1
        elif tok == "|" and depth == 0:
            return False
        elif tok in ("^", "$", "."):
            return False  # an inner anchor; '.' also matches line breaks in xgrammar
        pos = m.end()
    return depth == 0


class _Walk:
    def __init__(self, root: Any):
        self.root = root
        self.needs: list[tuple[str, str]] = []
        self.refs: list[tuple[str, str]] = []
        self.seen: set[int] = set()
        self.aliases: dict[str, str] = {}  # a $ref into a non-schema place -> its copy's name under $defs
        self.copies: dict[str, Any] = {}
        self.has_ref = '"$ref"' in _dumps(root)
        declared = root.get("$schema") if isinstance(root, dict) else None
        # before 2019-09, prefixItems is no keyword (an annotation) and `items` may be a list (tuples)
        self.old_draft = isinstance(declared, str) and bool(re.search(r"draft-0[3-7]", declared))

    def refuse(self, keyword: str, pointer: str, why: str) -> SchemaRefused:
        where = pointer or "/"
        return SchemaRefused(keyword, pointer, f"the JSON schema's `{keyword}` at {where}: {why}")

    def schema(self, node: Any, ptr: str) -> Any:
        """`node` with annotations stripped; records what needs llguidance, raises SchemaRefused."""
        if isinstance(node, bool):
            if node is False:
                self.needs.append(("false", ptr))
            return node
        if not isinstance(node, dict):
            raise self.refuse("type", ptr, "a schema must be an object or a boolean")
        out: dict[str, Any] = {}
        for key, value in node.items():
            here = pointer_join(ptr, key)
            how = KEYWORDS.get(key)
            if key == "prefixItems" and self.old_draft:
                continue
            if how == REFUSED:
                if key == "uniqueItems" and value is False:
                    continue
                raise self.refuse(key, here, _refusal_reason(key))
            if how is None:
                if key in ("$defs", "definitions") and isinstance(value, dict):
                    out[key] = {k: self.schema(v, pointer_join(here, k)) for k, v in value.items()}
                elif key in ("$id", "id") and ptr and self.has_ref and isinstance(value, str) \
                        and not value.startswith("#"):
                    raise self.refuse(key, here, "a nested $id changes what $ref resolves against; tandem "
                                                 "resolves $ref against the whole schema only")
                continue  # an annotation, or a keyword JSON Schema does not define (also an annotation)
            out[key] = self.keyword(key, value, here, node)
        if out.get("format") in FORMAT_PATTERNS:  # beside a pattern of its own: both must match (allOf)
            exact = FORMAT_PATTERNS[out.pop("format")]
            if "pattern" in out:
                out["allOf"] = [*out.get("allOf", []), {"pattern": exact}]
            else:
                out["pattern"] = exact
        self.node_backend(node, ptr)
        return out

    def keyword(self, key: str, value: Any, here: str, node: dict) -> Any:
        if key in ("properties", "patternProperties"):
            if not isinstance(value, dict):
                raise self.refuse(key, here, "must be an object of schemas")
            return {k: self.schema(v, pointer_join(here, k)) for k, v in value.items()}
        if key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if not isinstance(value, list) or not value:
                raise self.refuse(key, here, "must be a non-empty list of schemas")
            return [self.schema(v, pointer_join(here, i)) for i, v in enumerate(value)]
        if key == "items":
            if isinstance(value, list):  # draft 4-7 tuple form
                self.needs.append((key, here))
                return [self.schema(v, pointer_join(here, i)) for i, v in enumerate(value)]
            return self.schema(value, here)
        if key in ("additionalProperties", "additionalItems"):
            return value if isinstance(value, bool) else self.schema(value, here)
        if key == "$ref":
            return self.reference(value, here)
        if key == "required":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise self.refuse(key, here, "must be a list of property names (the draft 3 boolean form is "
                                             "not supported)")
            return value
        if key == "type":
            names = value if isinstance(value, list) else [value]
            if not names or not all(isinstance(t, str) and t in TYPES for t in names):
                raise self.refuse(key, here, f"must name JSON types among {sorted(TYPES)}")
            return value
        if key in ("exclusiveMinimum", "exclusiveMaximum", "minimum", "maximum", "multipleOf"):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise self.refuse(key, here, "must be a number (the draft 4 boolean form is not supported)")
            if abs(value) >= 2 ** 53:
                raise self.refuse(key, here, _BIG)
            if key == "multipleOf" and value <= 0:
                raise self.refuse(key, here, "must be greater than 0")
            return value
        if key in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise self.refuse(key, here, "must be a non-negative integer")
            return value
        if key == "pattern":
            if not isinstance(value, str):
                raise self.refuse(key, here, "must be a string")
            what = regex_refusal(value)
            if what is not None:
                raise self.refuse(key, here, f"the pattern uses {what}, which tandem cannot enforce")
            return value
        if key == "format":
            if not isinstance(value, str) or value not in FORMATS:
                raise self.refuse(key, here, f"format {value!r} is not enforced; supported formats: "
                                             f"{', '.join(sorted(FORMATS))}")
            return value
        if key == "enum" and (not isinstance(value, list) or not value):
            raise self.refuse(key, here, "must be a non-empty list")
        if key in ("enum", "const") and _has_big_number(value):
            raise self.refuse(key, here, _BIG)
        return value

    def reference(self, ref: Any, here: str) -> str:
        """Check and follow a $ref; the reference to compile (a copy under $defs for a target that sits in a
        place that is not a schema's, such as inside an unknown keyword, which is stripped)."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise self.refuse("$ref", here, f"{ref!r} is not a reference into this schema (#/...); remote "
                                            f"documents and anchors are not fetched")
        parts = [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")] if ref != "#" else []
        target: Any = self.root
        for part in parts:
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise self.refuse("$ref", here, f"{ref!r} points at nothing in this schema")
        if not isinstance(target, dict | bool):
            raise self.refuse("$ref", here, f"{ref!r} does not point at a schema")
        if _schema_place(parts):
            self.refs.append((ref, here))
            if id(target) not in self.seen:
                self.seen.add(id(target))
                self.schema(target, ref[1:])
            return ref
        if ref not in self.aliases:
            self.aliases[ref] = f"tandem-ref-{len(self.aliases)}"
            self.copies[self.aliases[ref]] = self.schema(target, ref[1:])
        return f"#/$defs/{self.aliases[ref]}"

    def node_backend(self, node: dict, ptr: str) -> None:
        """Record the keywords of `node` that xgrammar would approximate (the sibling rules)."""
        asserting = [k for k in node if k in KEYWORDS]
        for k in asserting:
            if KEYWORDS[k] == LLGUIDANCE:
                self.needs.append((k, pointer_join(ptr, k)))
        applied = [k for k in asserting if k in _APPLICATORS]
        if applied and len(asserting) > 1:  # xgrammar uses the first applicator alone, dropping siblings
            self.needs.append((applied[0], pointer_join(ptr, applied[0])))
        typed = [k for k in asserting if k in _TYPED]
        if typed and "type" not in node and not applied:  # e.g. bare `properties`: any other type is valid
            self.needs.append((typed[0], pointer_join(ptr, typed[0])))
        req, props = node.get("required"), node.get("properties")
        if isinstance(req, list) and not set(req) <= set(props if isinstance(props, dict) else ()):
            self.needs.append(("required", pointer_join(ptr, "required")))
        pattern = node.get("pattern")
        if isinstance(pattern, str) and (not _xgrammar_pattern(pattern) or "minLength" in node
                                         or "maxLength" in node or "format" in node):
            self.needs.append(("pattern", pointer_join(ptr, "pattern")))
        types = node.get("type")
        numeric = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(node)
        if numeric and (types == "number" or isinstance(types, list) and "number" in types):
            self.needs.append((sorted(numeric)[0], pointer_join(ptr, sorted(numeric)[0])))
        fractional = [k for k in sorted(numeric) if isinstance(node[k], float) and not node[k].is_integer()]
        if fractional:  # xgrammar takes only whole bounds for integers
            self.needs.append((fractional[0], pointer_join(ptr, fractional[0])))
        prefix = node.get("prefixItems")
        if isinstance(prefix, list) and isinstance(node.get("maxItems"), int) and node["maxItems"] < len(prefix):
            self.needs.append(("maxItems", pointer_join(ptr, "maxItems")))  # xgrammar wants every prefix item
        if isinstance(types, list) and len(types) > 1 and typed:
            self.needs.append(("type", pointer_join(ptr, "type")))
        enum = node.get("enum", [node["const"]] if "const" in node else [])
        if isinstance(enum, list) and any(isinstance(v, dict | list) for v in enum):  # xgrammar: compact only
            k = "enum" if "enum" in node else "const"
            self.needs.append((k, pointer_join(ptr, k)))


_BIG = "numbers of magnitude 2^53 or more are not enforced exactly (both backends round them)"


def _has_big_number(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_big_number(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_big_number(v) for v in value)
    return isinstance(value, int | float) and not isinstance(value, bool) and abs(value) >= 2 ** 53


_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_SCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
_SCHEMA_VALUES = {"additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedItems", "unevaluatedProperties"}


def _schema_place(parts: list[str]) -> bool:
    """Whether the JSON pointer `parts` leads from the root through schemas only (so the walk keeps it)."""
    state = "schema"
    for part in parts:
        if state == "items":  # `items` holds a schema or a list of them
            state = "schema"
            if part.isdigit():
                continue
        if state == "schema":
            state = ("map" if part in _SCHEMA_MAPS else "list" if part in _SCHEMA_LISTS else "items"
                     if part == "items" else "schema" if part in _SCHEMA_VALUES else "")
            if not state:
                return False
        elif state == "map":
            state = "schema"
        elif state == "list":
            if not part.isdigit():
                return False
            state = "schema"
    return state in ("schema", "items")


def _refusal_reason(keyword: str) -> str:
    if keyword in ("$dynamicRef", "$recursiveRef"):
        return "dynamic references are not supported"
    if keyword in ("extends", "disallow", "divisibleBy"):
        return "a draft 3 keyword tandem does not support"
    return "no grammar backend in tandem enforces it exactly, so the request is refused rather than served " \
           "with the keyword ignored"


def _dumps(value: Any) -> str:
    import json

    return json.dumps(value)


def plan(schema: Any) -> Plan:
    """Walk `schema`: the backend that enforces every keyword exactly and the schema to give it; SchemaRefused
    naming the first keyword none does."""
    walk = _Walk(schema)
    if schema is False:
        raise SchemaRefused("false", "", "the JSON schema is `false`: no answer can match it")
    if isinstance(schema, dict):
        walk.seen.add(id(schema))
    try:
        cleaned = walk.schema(schema, "")
    except RecursionError:  # a chain of $refs deeper than the interpreter's stack
        raise walk.refuse("$ref", "", "the schema's references nest too deeply") from None
    if walk.copies:
        if not isinstance(cleaned, dict) or not isinstance(cleaned.get("$defs", {}), dict):
            raise walk.refuse("$ref", "", "references into places that are not schemas need an object schema")
        cleaned["$defs"] = {**cleaned.get("$defs", {}), **walk.copies}
    for ref, here in walk.refs:  # a reference into a stripped annotation would dangle
        target: Any = cleaned
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            ok = isinstance(target, dict) and part in target or isinstance(target, list) and part.isdigit()
            if not ok:
                raise walk.refuse("$ref", here, f"{ref!r} points into a part of the schema that is not a schema")
            target = target[part] if isinstance(target, dict) else target[int(part)]
    return Plan(LLGUIDANCE if walk.needs else XGRAMMAR, cleaned, walk.needs)


def keyword_pointers(schema: Any, ptr: str = "") -> list[tuple[str, str]]:
    """Every (keyword, JSON pointer) of a walked schema, depth first."""
    out: list[tuple[str, str]] = []
    if isinstance(schema, dict):
        for key, value in schema.items():
            here = pointer_join(ptr, key)
            if key in KEYWORDS:
                out.append((key, here))
            if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
                for k, v in value.items():
                    out.extend(keyword_pointers(v, pointer_join(here, k)))
            elif isinstance(value, list) and key in ("anyOf", "oneOf", "allOf", "prefixItems", "items"):
                for i, v in enumerate(value):
                    out.extend(keyword_pointers(v, pointer_join(here, i)))
            elif isinstance(value, dict) and key in ("items", "additionalProperties", "additionalItems"):
                out.extend(keyword_pointers(value, here))
    return out
