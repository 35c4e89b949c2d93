"""Configuration errors worded for the operator: msgspec's validation of a config section turned into where
(the file and the dotted key), what was found and what is allowed."""

from __future__ import annotations

import re
from typing import Any

import msgspec


class ConfigError(ValueError):
    """A configuration problem, worded for the operator: where, what was found, what is allowed."""


_AT = re.compile(r"^(?P<what>.*) - at `\$(?P<path>[^`]*)`$")


def convert_section(raw: Any, kind: type, prefix: str, source: str) -> Any:
    try:
        return msgspec.convert(raw, kind, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(str(exc), raw, kind, prefix, source)) from None


def _explain(message: str, raw: Any, kind: type, prefix: str, source: str) -> str:
    """Re-word msgspec's error as `source: field = value is invalid: allowed`."""
    m = _AT.match(message)
    what, path = (m.group("what"), m.group("path")) if m else (message, "")
    steps = [s for s in re.findall(r"\.([A-Za-z0-9_\-]+)|\[(\d+)\]", path)]
    keys: list[str | int] = [name if name else int(index) for name, index in steps]
    field = ".".join(filter(None, [prefix] + [str(k) if isinstance(k, str) else f"[{k}]" for k in keys]))
    field = field.replace(".[", "[")
    unknown = re.match(r"Object contains unknown field `(.+)`", what)
    if unknown:
        allowed = _allowed_fields(kind, keys)
        where = f"{field}.{unknown.group(1)}" if field else unknown.group(1)
        return f"{source}: unknown setting {where}; allowed here: {', '.join(allowed)}"
    missing = re.match(r"Object missing required field `(.+)`", what)
    if missing:
        where = f"{field}.{missing.group(1)}" if field else missing.group(1)
        return f"{source}: {where} is required but missing"
    value = _lookup(raw, keys)
    allowed = _describe(_type_at(msgspec.inspect.type_info(kind), keys))
    return f"{source}: {field} = {value!r} is invalid: expected {allowed} ({what})"


def _lookup(raw: Any, keys: list[str | int]) -> Any:
    for key in keys:
        try:
            raw = raw[key]
        except (KeyError, IndexError, TypeError):
            return None
    return raw


def _type_at(t: Any, keys: list[str | int]) -> Any:
    for key in keys:
        t = _unwrap(t, key)
        if isinstance(t, msgspec.inspect.StructType):
            t = next((f.type for f in t.fields if f.encode_name == key), None)
        elif isinstance(t, msgspec.inspect.ListType):
            t = t.item_type
        elif isinstance(t, msgspec.inspect.DictType):
            t = t.value_type
        if t is None:
            return None
    return t


def _unwrap(t: Any, key: str | int) -> Any:
    """In a union, pick the member a path step can walk into."""
    if isinstance(t, msgspec.inspect.UnionType):
        for member in t.types:
            if isinstance(key, int) and isinstance(member, msgspec.inspect.ListType):
                return member
            if isinstance(key, str) and isinstance(member, msgspec.inspect.StructType | msgspec.inspect.DictType):
                return member
    return t


def _allowed_fields(kind: type, keys: list[str | int]) -> list[str]:
    t = _unwrap(_type_at(msgspec.inspect.type_info(kind), keys), "x")
    if isinstance(t, msgspec.inspect.StructType):
        return [f.encode_name for f in t.fields if f.encode_name != "source"]
    return []


def _describe(t: Any) -> str:
    ins = msgspec.inspect
    if t is None:
        return "a valid value"
    if isinstance(t, ins.LiteralType):
        return "one of " + ", ".join(repr(v) for v in t.values)
    if isinstance(t, ins.UnionType):
        return " or ".join(_describe(m) for m in t.types)
    if isinstance(t, ins.NoneType):
        return "unset"
    if isinstance(t, ins.IntType | ins.FloatType):
        noun = "an integer" if isinstance(t, ins.IntType) else "a number"
        bounds = [f"{op} {v}" for op, v in ((">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le)) if v is not None]
        return noun + (" " + " and ".join(bounds) if bounds else "")
    if isinstance(t, ins.StrType):
        return "a non-empty string" if t.min_length else "a string"
    if isinstance(t, ins.BoolType):
        return "true or false"
    if isinstance(t, ins.ListType):
        return f"a list of {_describe(t.item_type).removeprefix('a ').removeprefix('an ')}s"
    if isinstance(t, ins.StructType | ins.DictType):
        return "a table"
    return type(t).__name__
