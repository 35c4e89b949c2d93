"""Trace readers: Azure LLM inference 2023 CSV, BurstGPT CSV and Mooncake JSONL into `RequestSpec` lists.

Columns are found by name (BurstGPT's newer files add columns), timestamps become seconds from the first
request, and Mooncake `hash_ids` are kept so shared prompt blocks become real shared prefixes.
"""

from __future__ import annotations

import csv
import json
import os
from datetime import UTC, datetime
from pathlib import Path

from traces.workloads import RequestSpec, WorkloadError

MOONCAKE_BLOCK_TOKENS = 512  # Mooncake traces hash prompts in blocks of 512 tokens


def shared_traces_dir() -> Path | None:
    """The shared trace folder (`$TANDEM_TRACES_DIR`, else ../shared/traces next to the project), if present."""
    env = os.environ.get("TANDEM_TRACES_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2] / "shared" / "traces")
    for c in candidates:
        if c.is_dir():
            return c
    return None


def _column(header: list[str], *names: str, path: Path) -> str:
    by_lower = {h.strip().lower(): h for h in header}
    for n in names:
        if n.lower() in by_lower:
            return by_lower[n.lower()]
    raise WorkloadError(f"{path}: no column named {' or '.join(repr(n) for n in names)} (columns: {header})")


def _azure_time(text: str) -> float:
    # Azure writes 7 fractional digits; datetime takes at most 6.
    head, _, frac = text.strip().partition(".")
    base = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def _rebase(specs: list[RequestSpec]) -> list[RequestSpec]:
    specs.sort(key=lambda s: s.timestamp_s or 0.0)
    t0 = specs[0].timestamp_s if specs else 0.0
    return [RequestSpec(i, s.input_tokens, s.output_tokens, s.hash_ids, s.block_tokens,
                        (s.timestamp_s or 0.0) - (t0 or 0.0)) for i, s in enumerate(specs)]


def read_azure(path: str | Path, limit: int | None = None) -> list[RequestSpec]:
    """Azure LLM inference trace 2023: `TIMESTAMP,ContextTokens,GeneratedTokens`."""
    path = Path(path)
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        ts_col = _column(header, "TIMESTAMP", path=path)
        in_col = _column(header, "ContextTokens", path=path)
        out_col = _column(header, "GeneratedTokens", path=path)
        specs = []
        for row in reader:
            specs.append(RequestSpec(len(specs), max(1, int(row[in_col])), max(1, int(row[out_col])),
                                     timestamp_s=_azure_time(row[ts_col])))
            if limit is not None and len(specs) >= limit:
                break
    return _rebase(specs)


def read_burstgpt(path: str | Path, limit: int | None = None) -> list[RequestSpec]:
    """BurstGPT: `Timestamp` (s), `Request tokens`, `Response tokens`, other columns ignored.

    Rows with 0 response tokens are failed requests in BurstGPT's logs and are skipped.
    """
    path = Path(path)
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        ts_col = _column(header, "Timestamp", path=path)
        in_col = _column(header, "Request tokens", path=path)
        out_col = _column(header, "Response tokens", path=path)
        specs = []
        for row in reader:
            out = int(float(row[out_col]))
            if out <= 0:
                continue
            specs.append(RequestSpec(len(specs), max(1, int(float(row[in_col]))), out,
                                     timestamp_s=float(row[ts_col])))
            if limit is not None and len(specs) >= limit:
                break
    return _rebase(specs)


def read_mooncake(path: str | Path, limit: int | None = None) -> list[RequestSpec]:
    """Mooncake JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (512-token blocks)."""
    path = Path(path)
    specs = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                spec = RequestSpec(len(specs), max(1, int(row["input_length"])),
                                   max(1, int(row["output_length"])), tuple(int(h) for h in row.get("hash_ids", ())),
                                   MOONCAKE_BLOCK_TOKENS, float(row.get("timestamp", 0)) / 1000.0)
            except (ValueError, KeyError, TypeError) as e:
                raise WorkloadError(f"{path}:{lineno}: not a Mooncake trace line ({e!r})") from None
            specs.append(spec)
            if limit is not None and len(specs) >= limit:
                break
    return _rebase(specs)


READERS = {"azure": read_azure, "burstgpt": read_burstgpt, "mooncake": read_mooncake}


def detect_format(path: str | Path) -> str:
    path = Path(path)
    if path.suffix in (".jsonl", ".json"):
        return "mooncake"
    with path.open(newline="") as f:
        header = [h.strip().lower() for h in next(csv.reader(f), [])]
    if "contexttokens" in header:
        return "azure"
    if "request tokens" in header:
        return "burstgpt"
    raise WorkloadError(f"{path}: cannot tell the trace format from its header {header}; pass --trace-format")


def read_trace(path: str | Path, fmt: str = "auto", limit: int | None = None) -> list[RequestSpec]:
    """Read any supported trace; `fmt` is azure | burstgpt | mooncake | auto."""
    if not Path(path).is_file():
        raise WorkloadError(f"trace file {path} does not exist")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in READERS:
        raise WorkloadError(f"unknown trace format {fmt!r}; choose one of: auto, {', '.join(READERS)}")
    return READERS[fmt](path, limit)
