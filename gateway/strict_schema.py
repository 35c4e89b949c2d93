"""OpenAI's `strict` mode for JSON schemas (`response_format.json_schema.strict`, `tools[].function.strict`):
the rules a strict schema must follow, checked before the schema reaches an engine; a broken rule is a
SchemaRefused naming its keyword and JSON pointer (docs/structured.md has the table)."""

from __future__ import annotations

from typing import Any

from engines.schema_support import KEYWORDS, SchemaRefused, pointer_join

# OpenAI's strict mode: the keywords it accepts (annotations aside); tandem adds minLength / maxLength,
# which it enforces exactly
STRICT_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf", "$ref",
    "$defs", "definitions", "pattern", "format", "multipleOf", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minItems", "maxItems", "minLength", "maxLength"})
STRICT_MAX_PROPERTIES, STRICT_MAX_DEPTH, STRICT_MAX_ENUM = 5000, 10, 1000


def strict_violation(schema: Any) -> SchemaRefused | None:
    """The first rule of OpenAI's strict mode that `schema` breaks, or None: the root is an object schema
    (not anyOf); every object sets additionalProperties false and lists each of its properties in required;
    only STRICT_KEYWORDS (and annotations); at most 5000 properties, 10 levels of nesting, 1000 enum values."""
    if isinstance(schema, dict) and "anyOf" in schema:
        return _strict("anyOf", "/anyOf", "the root must be a schema of type object, not anyOf")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return _strict("type", "/type", "the root must be a schema of type object")
    counts = {"properties": 0, "enum": 0}
    return _strict_node(schema, "", 1, counts)


def _strict(keyword: str, pointer: str, why: str) -> SchemaRefused:
    return SchemaRefused(keyword, pointer, f"strict mode: the JSON schema's `{keyword}` at {pointer or '/'}: {why}")


def _strict_node(node: Any, ptr: str, depth: int, counts: dict[str, int]) -> SchemaRefused | None:
    if not isinstance(node, dict):
        return None if node is True else _strict("type", ptr, "a schema must be an object")
    for key in node:
        if key in KEYWORDS and key not in STRICT_KEYWORDS:
            return _strict(key, pointer_join(ptr, key), "not allowed in strict mode; send strict: false to "
                                                        "use it")
    types = node.get("type")
    is_object = types == "object" or isinstance(types, list) and "object" in types or "properties" in node
    if is_object:
        if depth > STRICT_MAX_DEPTH:
            return _strict("properties", ptr, f"objects nest more than {STRICT_MAX_DEPTH} levels deep")
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if node.get("additionalProperties") is not False:
            return _strict("additionalProperties", pointer_join(ptr, "additionalProperties"),
                           "must be false on every object")
        missing = [k for k in props if k not in required]
        if missing:
            return _strict("required", pointer_join(ptr, "required"),
                           f"must list every property; missing {missing[0]!r} (make a property optional "
                           f"with a type that includes \"null\")")
        counts["properties"] += len(props)
        if counts["properties"] > STRICT_MAX_PROPERTIES:
            return _strict("properties", pointer_join(ptr, "properties"),
                           f"more than {STRICT_MAX_PROPERTIES} properties in all")
    if isinstance(node.get("enum"), list):
        counts["enum"] += len(node["enum"])
        if counts["enum"] > STRICT_MAX_ENUM:
            return _strict("enum", pointer_join(ptr, "enum"), f"more than {STRICT_MAX_ENUM} enum values in all")
    children: list[tuple[Any, str, int]] = []
    for key in ("properties", "$defs", "definitions"):
        for k, v in (node.get(key) or {}).items() if isinstance(node.get(key), dict) else ():
            children.append((v, pointer_join(pointer_join(ptr, key), k), depth + (key == "properties")))
    for i, v in enumerate(node["anyOf"] if isinstance(node.get("anyOf"), list) else []):
        children.append((v, pointer_join(pointer_join(ptr, "anyOf"), i), depth))
    if isinstance(node.get("items"), dict):
        children.append((node["items"], pointer_join(ptr, "items"), depth + 1))
    for child, where, d in children:
        found = _strict_node(child, where, d, counts)
        if found is not None:
            return found
    return None

