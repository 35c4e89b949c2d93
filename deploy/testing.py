"""Configs for the scale-out tests and benchmark: the embedded default's engines (both tiny models) with a
chosen subset of its routes, written to a TOML file (checkpoint paths made absolute)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from gateway.config import DEFAULT_CONFIG_PATH, PROJECT_ROOT


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML form for {value!r}")


def _dump(table: dict, prefix: str = "") -> list[str]:
    lines, subtables = [], []
    for key, value in table.items():
        if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()) and value:
            subtables.append((key, value))
        elif isinstance(value, dict) and not prefix:
            subtables.append((key, value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    out = lines
    for key, value in subtables:
        name = f"{prefix}{key}"
        if all(isinstance(v, dict) for v in value.values()) and value:
            for sub, body in value.items():
                out += ["", f"[{name}.{sub}]"] + _dump(body, f"{name}.{sub}.")
        else:
            out += ["", f"[{name}]"] + _dump(value, f"{name}.")
    return out


def default_config_with_routes(path: Path, routes: tuple[str, ...] = ("fast", "best")) -> Path:
    """Write the embedded default with only `routes` (its engines all kept) to `path`."""
    raw = tomllib.loads(DEFAULT_CONFIG_PATH.read_text())
    raw["routes"] = {name: r for name, r in raw.get("routes", {}).items() if name in routes}
    for engine in raw["engines"].values():
        engine["checkpoint"] = str((PROJECT_ROOT / engine["checkpoint"]).resolve())
    path.write_text("\n".join(_dump(raw)) + "\n")
    return path
