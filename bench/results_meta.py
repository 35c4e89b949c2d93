"""The record every bench/ results file carries: the machine (CPU model, SIMD level of the loaded C kernels,
cores), the commit the run was made from and the date. `write_results` stamps a script's result with it and
writes the one JSON file at the script's default path; tests/bench/ checks the files the README names."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
FIELDS = ("machine", "commit", "date")
MACHINE_FIELDS = ("cpu_model", "simd", "cores")


def _cpuinfo() -> tuple[str, set[str]]:
    """The CPU's model name and flags from /proc/cpuinfo (Linux); platform's answer elsewhere."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def simd_level(flags: set[str] | None = None) -> str:
    """The SIMD paths the project's C kernels run here ("avx512-vnni", "avx512", "avx2" or "none"); from the
    CPU flags when the kernels cannot be built (no compiler)."""
    try:
        from kernels import cpu_kernels

        level = cpu_kernels.simd_level()
        if level != "none":
            return level
    except Exception:  # noqa: BLE001 - the record must still be written without a compiler
        pass
    flags = _cpuinfo()[1] if flags is None else flags
    if {"avx512f", "avx512bw"} <= flags:
        return "avx512-vnni" if "avx512_vnni" in flags else "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "none"


def machine() -> dict[str, Any]:
    """CPU model, SIMD level, AMX int8, cores (online and usable by this process), architecture."""
    model, flags = _cpuinfo()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_model": model, "simd": simd_level(flags), "amx_int8": "amx_int8" in flags,
            "cores": os.cpu_count(), "usable_cores": usable, "arch": platform.machine()}


def commit() -> str:
    """HEAD's hash, with "+dirty" when tracked files outside bench/results/ differ from it (a rerun rewriting
    a results file is no change to what ran); "unknown" outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)bench/results"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def stamp() -> dict[str, Any]:
    """The three fields every results file carries."""
    return {"machine": machine(), "commit": commit(),
            "date": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()}


def write_results(path: str | Path, result: dict[str, Any], *, indent: int | None = 2) -> Path:
    """Write `result` plus the stamp (which replaces any "machine" / "commit" / "date" keys) as JSON at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, **stamp()}, indent=indent) + "\n")
    return path


def missing_fields(record: dict[str, Any]) -> list[str]:
    """The stamp fields a results record lacks or leaves empty (what tests/bench/ asserts is [])."""
    missing = [f for f in FIELDS if not record.get(f)]
    mach = record.get("machine")
    if isinstance(mach, dict):
        missing += [f"machine.{f}" for f in MACHINE_FIELDS if not mach.get(f)]
    elif "machine" not in missing:
        missing.append("machine (not a record)")
    return missing
