"""The float32 linears over the weight packed in panels (`cpu_kernels.pack_f32`, read in address order): every
path (1-8 rows, one or two panels a pass, 8-row blocks of many rows, column tails past the last panel, K past
1024 and not a multiple of 4, bias, two threads, with its bf16 copy, the AVX2 build) gives the bits of the
[K, N] weight through the streams and register blocks; the SGEMM rows read strips unpacked from the panels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_kernels as ck

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not ck.available(), reason=f"CPU kernels unavailable: {ck.build_error}")]

SHAPES = [(256, 256), (37, 19), (40, 63), (1409, 96), (3, 5), (200, 1030), (77, 1283), (2048, 640)]  # (N, K)


@pytest.fixture
def register_tiles():
    """The register tiles at every row count (no SGEMM), restored afterwards."""
    kn, rows = ck.block_max_kn(), ck.sgemm_min_rows()
    ck.sgemm_min_rows(ck.NEVER)
    yield
    ck.block_max_kn(kn)
    ck.sgemm_min_rows(rows)


def _column_major(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, k, generator=g).t().contiguous().t()  # [N, K], as cpu_weight_layout stores it


@pytest.mark.parametrize("rows", [range(1, 9), range(9, 20)])
def test_the_panels_give_the_kn_weights_bits(register_tiles, rows):
    g = torch.Generator().manual_seed(rows.start)
    for n, k in SHAPES:
        w = _column_major(n, k, g)
        packed = ck.pack_f32(w)
        assert packed.shape == ((n + 31) // 32, k, 32) and torch.equal(ck.unpack_f32(packed, n), w)
        b = torch.randn(n, generator=g)
        for m in rows:
            x = torch.randn(m, k, generator=g)
            for blocks in (0, ck.NEVER):  # the [K, N] weight through the 5-8 row register blocks, or the streams
                ck.block_max_kn(blocks)
                for bias in (None, b):
                    assert torch.equal(ck.linear_packed(x, packed, n, bias), ck.linear(x, w, bias)), (m, n, k)
    torch.set_num_threads(2)
    try:
        for m in (1, 4, 11):
            x = torch.randn(m, w.shape[1], generator=g)
            assert torch.equal(ck.linear_packed(x, packed, n, b), ck.linear(x, w, b))
    finally:
        torch.set_num_threads(1)


def test_the_panels_put_each_weight_where_the_kernels_read_it():
    """pack_f32's layout, element by element: panel p, row k, value i is column 32p + i; past N, zeros."""
    w = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    packed = ck.pack_f32(w)
    assert packed.shape == (3, 3, 32)
    for n in range(70):
        for k in range(3):
            assert packed[n // 32, k, n % 32] == w[n, k]
    assert not packed[2, :, 6:].any()


def test_with_a_bf16_copy_the_panels_read_it(register_tiles):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(77, 1030, generator=g).bfloat16().float().t().contiguous().t()
    packed, w16 = ck.pack_f32(w), ck.bf16_copy(w)
    for m in (1, 5, 12):
        x = torch.randn(m, 1030, generator=g)
        assert torch.equal(ck.linear_packed(x, packed, 77, weight16=w16), ck.linear(x, w))


def test_the_sgemm_rows_read_strips_of_the_panels():
    if ck.sgemm_address() is None:
        pytest.skip("this torch exports no SGEMM")
    rows = ck.sgemm_min_rows()
    ck.sgemm_min_rows(1)
    try:
        g = torch.Generator().manual_seed(5)
        for n, k in ((600, 1283), (37, 19), (256, 96)):  # strips of 256 columns and a ragged last one
            w = _column_major(n, k, g)
            x, b = torch.randn(17, k, generator=g), torch.randn(n, generator=g)
            torch.testing.assert_close(ck.linear_packed(x, ck.pack_f32(w), n, b), F.linear(x, w, b),
                                       rtol=1e-4, atol=1e-4)
    finally:
        ck.sgemm_min_rows(rows)


def test_the_avx2_build_reads_the_panels_to_the_same_bits():
    if not ck.simd_level().startswith("avx512"):
        pytest.skip(f"this CPU runs the {ck.simd_level()} paths only: nothing to compare")
    wide, narrow = ck.build_variant("native"), ck.build_variant("avx2")
    g = torch.Generator().manual_seed(11)
    for n, k in ((1409, 96), (77, 1283), (40, 63)):
        w = _column_major(n, k, g)
        packed, wt = ck.pack_f32(w), w.t().contiguous()
        for m in (1, 2, 5, 8, 11):
            x = torch.randn(m, k, generator=g)
            outs = []
            for lib in (wide, narrow):
                for panels in (True, False):
                    y = torch.empty(m, n)
                    if panels:
                        assert lib.tk_linear_f32_panels(x.data_ptr(), m, k, packed.data_ptr(), None, n, None,
                                                        y.data_ptr(), 1) == 0
                    else:
                        lib.tk_linear_f32(x.data_ptr(), m, k, wt.data_ptr(), n, n, None, y.data_ptr(), 1)
                    outs.append(y)
            assert all(torch.equal(o, outs[0]) for o in outs[1:]), (m, n, k)


def test_linear_packed_refuses_what_is_not_packed():
    w = torch.randn(64, 32)
    with pytest.raises(ValueError, match="pack_f32"):
        ck.linear_packed(torch.randn(2, 32), w, 64)
    with pytest.raises(ValueError, match="bf16_copy"):
        ck.linear_packed(torch.randn(2, 32), ck.pack_f32(w), 64, weight16=w.bfloat16())
