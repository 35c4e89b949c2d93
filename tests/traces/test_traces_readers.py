"""Trace readers and workload mixes: small fixtures of each format, and the shared real traces when present."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from traces.readers import (
    detect_format,
    read_azure,
    read_burstgpt,
    read_mooncake,
    read_trace,
    shared_traces_dir,
)
from traces.workloads import (
    MIXES_PATH,
    RequestSpec,
    WorkloadError,
    build_workload,
    fit_to_context,
    quantile_sampler,
    workload_names,
)

FIX = Path(__file__).parent / "fixtures" / "traces"


def test_azure_reader_rebases_timestamps_and_keeps_lengths():
    specs = read_azure(FIX / "azure_small.csv")
    assert [(s.input_tokens, s.output_tokens) for s in specs] == [(374, 44), (396, 109), (879, 55), (91, 16)]
    assert specs[0].timestamp_s == 0.0
    assert specs[1].timestamp_s == pytest.approx(50.9951690 - 46.6805900, abs=1e-6)
    assert specs[3].timestamp_s == pytest.approx(51.3910170 - 46.6805900, abs=1e-6)


def test_burstgpt_reader_finds_columns_by_name_sorts_and_skips_failed_rows():
    specs = read_burstgpt(FIX / "burstgpt_small.csv")
    # The 0-token response (a failed request in BurstGPT) is dropped; rows come back in time order.
    assert [(s.timestamp_s, s.input_tokens, s.output_tokens) for s in specs] == [
        (0.0, 472, 18), (12.0, 120, 300), (26.5, 2000, 25)]
    assert [s.index for s in specs] == [0, 1, 2]


def test_mooncake_reader_keeps_hash_ids_and_converts_milliseconds():
    specs = read_mooncake(FIX / "mooncake_small.jsonl")
    assert [s.timestamp_s for s in specs] == [0.0, 1.0, 3.0]
    assert [s.hash_ids for s in specs] == [(0, 1, 2), (0, 4), (0, 1, 3)]
    assert all(s.block_tokens == 512 for s in specs)


def test_format_detection_and_clear_errors(tmp_path):
    assert detect_format(FIX / "azure_small.csv") == "azure"
    assert detect_format(FIX / "burstgpt_small.csv") == "burstgpt"
    assert detect_format(FIX / "mooncake_small.jsonl") == "mooncake"
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(WorkloadError, match="cannot tell the trace format"):
        read_trace(bad)
    with pytest.raises(WorkloadError, match="no column named 'TIMESTAMP'"):
        read_trace(bad, "azure")
    with pytest.raises(WorkloadError, match="does not exist"):
        read_trace(tmp_path / "missing.csv")


def test_mixes_carry_attribution_and_every_name_builds():
    data = json.loads(MIXES_PATH.read_text())
    assert "CC-BY-4.0" in data["_attribution"] and "Mooncake" in data["_attribution"]
    for name in workload_names():
        specs = build_workload(name, 5, seed=1)
        assert len(specs) == 5 and all(s.input_tokens >= 1 and s.output_tokens >= 1 for s in specs)
    with pytest.raises(WorkloadError, match="unknown workload"):
        build_workload("nope", 3)


def test_quantile_sampler_reproduces_the_table():
    table = {"1": 29, "50": 1020, "90": 2734, "100": 14050}
    draws = quantile_sampler(table)(np.random.default_rng(0), 200_000)
    assert np.percentile(draws, 50) == pytest.approx(1020, rel=0.02)
    assert np.percentile(draws, 90) == pytest.approx(2734, rel=0.02)
    assert draws.min() >= 29 and draws.max() <= 14050


def test_chat_mix_matches_azure_median_lengths():
    specs = build_workload("chat", 20_000, seed=3)
    assert np.median([s.input_tokens for s in specs]) == pytest.approx(1020, rel=0.05)
    assert np.median([s.output_tokens for s in specs]) == pytest.approx(129, rel=0.05)


def test_long_context_mix_shares_prefix_blocks_at_the_published_rate():
    specs = build_workload("long_context_multiturn", 2000, seed=0)
    full_blocks = seen = 0
    known: set[tuple[int, ...]] = set()
    for s in specs:
        assert len(s.hash_ids) == -(-s.input_tokens // 512)
        full = s.input_tokens // 512
        for k in range(full):  # a block is reusable when its whole prefix chain was sent before
            chain = s.hash_ids[: k + 1]
            seen += chain in known
            known.add(chain)
        full_blocks += full
        if full:
            assert s.hash_ids[0] == 0  # every request starts with the shared system-prompt block
    assert 0.30 < seen / full_blocks < 0.40  # published: 37% of blocks reused (we reach about 33%)


def test_fit_to_context_scales_one_factor_and_respects_the_limit():
    specs = [RequestSpec(i, 1000 * (i + 1), 100 * (i + 1), (1, 2), 512) for i in range(10)]
    fitted, scaling = fit_to_context(specs, 512, reserve=8)
    assert scaling.factor < 1
    assert all(s.input_tokens + s.output_tokens <= 504 for s in fitted)
    # Ratios survive: request 9 is still ~10x request 0 on both axes (within rounding).
    assert fitted[9].input_tokens / fitted[0].input_tokens == pytest.approx(10, rel=0.15)
    assert fitted[0].block_tokens == round(512 * scaling.factor)
    same, s2 = fit_to_context(specs, None)
    assert same == specs and s2.factor == 1.0


def test_loadtest_cli_imports_no_torch_gateway_or_engines():
    code = ("import sys, traces.cli, traces.loadtest, traces.report; "
            "bad = [m for m in ('torch', 'gateway.app', 'engines') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def shared():
    d = shared_traces_dir()
    if d is None:
        pytest.skip("../shared/traces is absent (set TANDEM_TRACES_DIR to the Azure trace folder)")
    return d


def test_azure_conversation_trace_matches_its_published_facts(shared):
    specs = read_trace(shared / "azure2023_conv.csv")
    assert len(specs) == 19366
    ins = np.array([s.input_tokens for s in specs])
    outs = np.array([s.output_tokens for s in specs])
    assert np.percentile(ins, 50) == pytest.approx(1020, abs=5)
    assert np.percentile(outs, 50) == pytest.approx(129, abs=2)
    rate = len(specs) / specs[-1].timestamp_s
    assert 5.0 < rate < 6.0  # published: 5.5 req/s over 58 minutes


def test_azure_code_trace_reads_with_bursts(shared):
    specs = read_trace(shared / "azure2023_code.csv")
    assert len(specs) == 8819
    per_minute = np.bincount((np.array([s.timestamp_s for s in specs]) // 60).astype(int))
    assert (per_minute == 0).sum() >= 10  # published: 12 of 58 minutes idle
