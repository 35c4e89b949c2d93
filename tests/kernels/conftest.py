"""Fixtures shared by the CPU kernel tests."""

from __future__ import annotations

import pytest

import kernels.cpu_kernels as ck


@pytest.fixture
def register_tiles():
    """The register tiles at every row count (no SGEMM), restored afterwards."""
    kn, rows = ck.block_max_kn(), ck.sgemm_min_rows()
    ck.sgemm_min_rows(ck.NEVER)
    yield
    ck.block_max_kn(kn)
    ck.sgemm_min_rows(rows)
