"""OpenAI's strict rules (gateway/strict_schema.py): a schema that follows them passes; each broken rule is
named by its keyword and JSON pointer; random keyword trees raise nothing but refusals."""

from __future__ import annotations

import random

import pytest

from engines.schema_support import ANNOTATIONS, KEYWORDS, SchemaRefused
from gateway.strict_schema import strict_violation

STRICT_OK = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                              "tags": {"type": "array", "items": {"type": "string"}},
                                              "when": {"type": ["string", "null"], "format": "date"}},
             "required": ["name", "tags", "when"], "additionalProperties": False}


@pytest.mark.parametrize("schema, keyword, pointer", [
    ({"anyOf": [STRICT_OK]}, "anyOf", "/anyOf"),
    ({"type": "array", "items": STRICT_OK}, "type", "/type"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "additionalProperties",
     "/additionalProperties"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"],
      "additionalProperties": False}, "required", "/required"),
    (dict(STRICT_OK, properties=dict(STRICT_OK["properties"], name={"allOf": [{"type": "string"}]})), "allOf",
     "/properties/name/allOf"),
    (dict(STRICT_OK, properties=dict(STRICT_OK["properties"], tags={"type": "array", "items": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False}})),
     "required", "/properties/tags/items/required"),
])
def test_openai_strict_rules(schema, keyword, pointer):
    assert strict_violation(STRICT_OK) is None
    found = strict_violation(schema)
    assert found is not None and (found.keyword, found.pointer) == (keyword, pointer), found


def test_strict_check_raises_nothing_on_random_keyword_trees():
    rng = random.Random(6)
    keys = [*KEYWORDS, *ANNOTATIONS, "x-editor", "a"]
    leaves = [None, True, False, 0, 1.5, "", "a", "object", "string", [], {}]

    def tree(depth: int):
        r = rng.random()
        if depth > 3 or r < 0.3:
            return rng.choice(leaves)
        if r < 0.5:
            return [tree(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(keys): tree(depth + 1) for _ in range(rng.randint(0, 4))}

    found = [strict_violation({"type": "object", "properties": {"p": tree(0)}, "required": ["p"],
                               "additionalProperties": False}) for _ in range(2000)]
    assert all(f is None or isinstance(f, SchemaRefused) and f.keyword for f in found)
    assert any(f is None for f in found) and any(f is not None for f in found)
