"""Benchmark results as reference: every results file the README's "Measured" table names exists and records
the machine (CPU model, SIMD level, cores), the commit and the date; each row stays short and names its file;
docs/benchmarks.md gives each of those files its reproduction; every bench script writes through the one
helper that stamps those fields (bench/results_meta.py)."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

from bench import results_meta

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def measured_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Measured\n"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| what |")
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]


def named_files(cell: str) -> list[str]:
    return re.findall(r"([\w.-]+\.json)", cell)


def test_every_measured_row_names_a_results_file_that_carries_machine_commit_and_date():
    rows = measured_rows()
    assert len(rows) >= 15
    for what, _, command in rows:
        files = named_files(command)
        assert files, f"row {what!r} names no results file"
        for name in files:
            path = RESULTS / name
            assert path.is_file(), f"row {what!r}: {path} is missing"
            record = json.loads(path.read_text())
            assert results_meta.missing_fields(record) == [], f"{name} lacks {results_meta.missing_fields(record)}"
            assert int(record["machine"]["cores"]) >= 1
            dt.datetime.fromisoformat(record["date"].replace("Z", "+00:00"))
            assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", record["commit"]), record["commit"]


def test_each_row_is_at_most_two_lines():
    for what, result, _ in measured_rows():
        assert len(result) <= 160, f"row {what!r}: {len(result)} characters of result"


def test_docs_benchmarks_reproduces_every_file_the_readme_quotes():
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    quoted = {name for _, _, command in measured_rows() for name in named_files(command)}
    assert quoted and {name for name in quoted if name not in docs} == set()
    assert (ROOT / "docs" / "benchmark_log.md").is_file()


def test_every_bench_script_writes_through_the_one_helper():
    helpers = {"results_meta.py", "loadgen.py"}  # modules the scripts import, not scripts
    scripts = sorted(p for p in (ROOT / "bench").glob("*.py") if p.name not in helpers)
    assert len(scripts) >= 25
    assert [p.name for p in scripts if "write_results(" not in p.read_text()] == []


def test_the_stamp_records_this_machine_and_replaces_stale_fields(tmp_path):
    out = results_meta.write_results(tmp_path / "r" / "x.json", {"rows": [1], "machine": "x86_64", "date": ""})
    record = json.loads(out.read_text())
    assert record["rows"] == [1] and results_meta.missing_fields(record) == []
    assert record["machine"]["simd"] in {"avx512-vnni", "avx512", "avx2", "none"}
    assert record["machine"]["cores"] >= 1 and record["machine"]["cpu_model"]
    assert results_meta.missing_fields({"machine": "x86_64", "commit": "abc"}) == ["date", "machine (not a record)"]
    assert results_meta.missing_fields({"machine": {"cpu_model": "c", "simd": "", "cores": 2}, "commit": "a",
                                        "date": "d"}) == ["machine.simd"]
