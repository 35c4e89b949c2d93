"""kernels/cpu_kernels: the C kernels against their PyTorch references, and the engine's greedy outputs with the
kernels against the torch paths."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engines.attention import PagedAttention, StepBatch, paged_attention_torch, plan_paged_attention
from kernels import cpu_kernels as ck

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
HAS_AVX2 = platform.machine() == "x86_64" and " avx2 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")


def test_kernels_build_where_a_compiler_and_avx2_exist():
    if shutil.which("cc") or shutil.which("gcc"):
        assert ck.available() == HAS_AVX2, ck.build_error
    else:
        assert not ck.available() and "compiler" in ck.build_error


needs_kernels = pytest.mark.skipif(not ck.available(), reason=f"CPU kernels unavailable: {ck.build_error}")


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 13, 33])
@pytest.mark.parametrize("n,k", [(256, 256), (704, 256), (37, 19), (4096, 64), (8, 3)])
def test_linear_matches_torch(m, n, k):
    g = torch.Generator().manual_seed(n * 31 + k + m)
    w = torch.randn(n, k, generator=g).t().contiguous().t()  # column-major, as cpu_weight_layout stores it
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g)
    torch.testing.assert_close(ck.linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ck.linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ck.linear(x[:, :k].t().contiguous().t(), w), F.linear(x, w), rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 8, 13, 33])
@pytest.mark.parametrize("n,k", [(256, 256), (30, 45), (7, 8), (6, 40), (4096, 64)])
def test_linear_int8_matches_reference(m, n, k):
    from kernels.quant_matmul import quantize_int8

    g = torch.Generator().manual_seed(n + k + m)
    q, s = quantize_int8(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g)
    torch.testing.assert_close(ck.linear_int8(x, q, s, b), ck.linear_int8_ref(x, q, s, b), rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 33])
@pytest.mark.parametrize("n,k", [(256, 256), (30, 64), (7, 32), (4096, 96), (1409, 704)])
def test_linear_w8a8_matches_reference(m, n, k):
    """Activations quantised bit for bit as `quantize_act_q8` (scales, rounding half to even, zero blocks),
    then the integer dots: the reference up to float summation order, for every row count (the 4 x 2 and
    4 x 1 tiles, the N tails) with and without bias and on two threads."""
    from kernels.quant_matmul import quantize_act_q8, quantize_int8

    g = torch.Generator().manual_seed(n + k + m)
    q, s = quantize_int8(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g) * 4
    x[0, :32] = 0  # a block of zeros: scale 0, q 0
    x[-1, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5] * 4)  # d = 1: ties to even
    xq, d = ck.quant_act_q8(x)
    rq, rd = quantize_act_q8(x)
    assert torch.equal(xq, rq) and torch.equal(d, rd)
    assert d[-1, 0] == 1 and xq[-1, :8].tolist() == [127, 0, 2, 2, 0, -2, 126, -126]
    if m > 1:
        assert d[0, 0] == 0 and not xq[0, :32].any()
    assert xq.abs().max() <= 127
    b = torch.randn(n, generator=g)
    ref = ck.linear_w8a8_ref(x, q, s)
    tol = dict(rtol=1e-4, atol=1e-5 * ref.abs().max().item())  # float32 sums of up to 704 products, reordered
    for bias in (None, b):
        torch.testing.assert_close(ck.linear_w8a8(x, q, s, bias), ck.linear_w8a8_ref(x, q, s, bias), **tol)
    torch.set_num_threads(2)
    try:
        torch.testing.assert_close(ck.linear_w8a8(x, q, s, b), ck.linear_w8a8_ref(x, q, s, b), **tol)
    finally:
        torch.set_num_threads(1)
    # the activation rounding is the only difference from int8's float activations: about 1% on random data
    full = ck.linear_int8_ref(x, q, s)
    assert (ck.linear_w8a8(x, q, s) - full).norm() / full.norm() < 0.02


@needs_kernels
def test_the_avx512_paths_give_the_avx2_paths_bits():
    """Where -march=native finds AVX-512 the float32 linears run 16 wide (masked last columns; 5-8 rows summed
    in registers on weights up to 4 MiB, streamed above): each output sums the same products in the same order
    as the AVX2 build, so the two give the same bits, for every row count (1-8, then blocks of 8) and column
    tails. With VNNI the w8a8 tiles take
    two blocks per vector (vpdpbusd): the same integer dots summed in another order, so close, not equal."""
    if not ck.simd_level().startswith("avx512"):
        pytest.skip(f"this CPU runs the {ck.simd_level()} paths only: nothing to compare")
    from kernels.quant_matmul import quantize_int8

    wide, narrow = ck.build_variant("native"), ck.build_variant("avx2")
    assert (wide.tk_simd_level(), narrow.tk_simd_level()) in ((2, 1), (3, 1))
    g = torch.Generator().manual_seed(7)
    for m in (1, 2, 5, 8, 11):
        for n, k in ((256, 256), (40, 64), (1409, 96), (3, 32), (2048, 640)):
            x = torch.randn(m, k, generator=g)
            wt = torch.randn(k, n, generator=g)
            q, s = quantize_int8(torch.randn(n, k, generator=g))
            outs = []
            for lib in (wide, narrow):
                y, y8 = torch.empty(m, n), torch.empty(m, n)
                lib.tk_linear_f32(x.data_ptr(), m, k, wt.data_ptr(), n, n, None, y.data_ptr(), 1)
                assert lib.tk_linear_w8a8(x.data_ptr(), m, k, q.data_ptr(), s.data_ptr(), n, None,
                                          y8.data_ptr(), 1) == 0
                outs.append((y, y8))
            (y_wide, y8_wide), (y_narrow, y8_narrow) = outs
            assert torch.equal(y_wide, y_narrow), (m, n, k)
            torch.testing.assert_close(y_wide, x @ wt, rtol=1e-4, atol=1e-4)
            if wide.tk_simd_level() == 3:
                torch.testing.assert_close(y8_wide, y8_narrow, rtol=1e-5, atol=1e-6 * y8_narrow.abs().max().item())
            else:
                assert torch.equal(y8_wide, y8_narrow), (m, n, k)


@needs_kernels
def test_the_calibrated_choices_change_only_the_path_and_are_kept_for_the_process(monkeypatch, tmp_path):
    """`calibrate` picks two things by timing them on the weights it is given: whether few rows over a float32
    weight above 4 MiB or with K above 1024 take the register blocks or the streams, and from how many rows (the
    same bits either way: the same FMA chain per output), and from how many rows the MKL SGEMM takes over from the register tiles (8 rows at a time)
    (the same values to float rounding). Either choice leaves the answers right; the result is kept for the
    process and set in the kernels."""
    lib = ck.load()
    default_kn, default_rows = ck.block_max_kn(), ck.sgemm_min_rows()
    default_k, default_min, default_pf = ck.block_max_k(), ck.block_min_rows(), ck.stream_pf()
    assert (default_k, default_min, default_pf) == (ck.BLOCK_MAX_K, ck.BLOCK_MIN_ROWS, ck.STREAM_PF)
    g = torch.Generator().manual_seed(3)
    big = torch.randn(1100, 1024, generator=g).t().contiguous().t()  # [N, K] column-major, 4.3 MiB
    long = torch.randn(300, 1100, generator=g).t().contiguous().t()  # K above the blocks' built-in 1024
    try:
        for m in (5, 6, 8):
            x = torch.randn(m, 1024, generator=g)
            ck.block_max_kn(0)
            streams = ck.linear(x, big)
            ck.block_max_kn(ck.NEVER)
            assert torch.equal(ck.linear(x, big), streams)
            torch.testing.assert_close(streams, x @ big.t(), rtol=1e-4, atol=1e-4)
        for m in (1, 2):  # the streams at any prefetch distance: the same bits
            x = torch.randn(m, 1100, generator=g)
            ref = ck.linear(x, long)
            for d in ck.STREAM_PF_CHOICES:
                ck.stream_pf(d)
                assert torch.equal(ck.linear(x, long), ref)
            ck.stream_pf(default_pf)
            torch.testing.assert_close(ref, x @ long.t(), rtol=1e-4, atol=1e-4)
        for m in (3, 4, 5, 8):  # a longer K, from 3 rows: the blocks where the knobs let them, the same bits
            x = torch.randn(m, 1100, generator=g)
            ck.block_max_kn(default_kn)
            streams = ck.linear(x, long)
            ck.block_max_kn(ck.NEVER)
            ck.block_max_k(ck.NEVER)
            ck.block_min_rows(3)
            assert torch.equal(ck.linear(x, long), streams)
            torch.testing.assert_close(streams, x @ long.t(), rtol=1e-4, atol=1e-4)
            ck.block_max_k(default_k)
            ck.block_min_rows(default_min)
        for m in (9, 16, 40):  # many rows: every row and column against torch, the SGEMM on and off
            x = torch.randn(m, 1024, generator=g)
            b = torch.randn(1100, generator=g)
            for rows in (ck.NEVER, 1):
                ck.sgemm_min_rows(rows)
                torch.testing.assert_close(ck.linear(x, big, b), x @ big.t() + b, rtol=1e-4, atol=1e-4)
        ck.block_max_kn(default_kn)
        ck.sgemm_min_rows(default_rows)
        monkeypatch.setenv("TANDEM_CPU_KERNELS_DIR", str(tmp_path))  # nothing remembered from earlier runs
        monkeypatch.setattr(ck, "_calibration", None)
        small = torch.randn(256, 512, generator=g).t().contiguous().t()
        out = ck.calibrate([big, small], reps=1)
        assert out["blocks"] in ("blocks", "streams") and "8 rows above the bound" in out["ms"]
        assert ck.block_max_kn() == (ck.NEVER if out["blocks"] == "blocks" else default_kn)
        assert ck.block_max_k() == (ck.NEVER if out["blocks"] == "blocks" else default_k)
        assert ck.block_min_rows() == out["block_min_rows"] and out["block_min_rows"] in (3, 4, 5)
        assert out["blocks"] == "blocks" or out["block_min_rows"] == 5
        assert out["stream_pf"] in ck.STREAM_PF_CHOICES and ck.stream_pf() == out["stream_pf"]
        assert "1 row above the bound" in out["ms"]
        if ck.sgemm_address() is not None:
            assert out["sgemm_min_rows"] in (ck.SGEMM_MIN_ROWS, *ck.CALIBRATION_ROWS[1:], ck.NEVER)
            assert "16 rows" in out["ms"]
        assert ck.sgemm_min_rows() == out["sgemm_min_rows"] and lib.tk_sgemm_min_rows(-1) == out["sgemm_min_rows"]
        assert ck.calibrate([small]) is out and ck.calibration() is out  # once per process
        monkeypatch.setattr(ck, "_calibration", None)
        first = ck.calibrate([small], reps=1)  # a draft model first: nothing above the bound, no blocks choice
        assert first["blocks"] is None and first["sgemm_min_rows"] is not None
        assert ck.calibrate([big], reps=1)["blocks"] in ("blocks", "streams")  # made by the next model that can
    finally:
        ck.block_max_kn(default_kn)
        ck.block_max_k(default_k)
        ck.block_min_rows(default_min)
        ck.stream_pf(default_pf)
        ck.sgemm_min_rows(default_rows)


def test_a_later_process_reads_the_calibrated_choices_instead_of_timing_again(monkeypatch, tmp_path):
    """Each choice is remembered on disk per kernel build, machine and weight shapes: a new process (here the
    per-process result reset) sets the same knobs without a timed pass; other shapes, or
    TANDEM_CPU_CALIBRATE=fresh, are timed again."""
    ck.load()
    defaults = (ck.block_max_kn(), ck.block_max_k(), ck.block_min_rows(), ck.stream_pf(), ck.sgemm_min_rows())
    monkeypatch.setenv("TANDEM_CPU_KERNELS_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(5)
    big = torch.randn(1100, 1024, generator=g).t().contiguous().t()  # above the blocks' bound
    small = torch.randn(256, 512, generator=g).t().contiguous().t()
    timed: list[int] = []
    real = ck._best_pass

    def counting(*args, **kwargs):
        timed.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(ck, "_best_pass", counting)
    try:
        monkeypatch.setattr(ck, "_calibration", None)
        first = dict(ck.calibrate([big, small], reps=1))
        assert timed and len(list(tmp_path.glob("calibration-*.json"))) == 2  # the blocks' and the SGEMM's
        knobs = (ck.block_max_kn(), ck.block_max_k(), ck.block_min_rows(), ck.stream_pf(), ck.sgemm_min_rows())
        ck.block_max_kn(defaults[0]), ck.block_max_k(defaults[1]), ck.block_min_rows(defaults[2])
        ck.stream_pf(defaults[3]), ck.sgemm_min_rows(defaults[4])
        timed.clear()
        monkeypatch.setattr(ck, "_calibration", None)
        again = ck.calibrate([big, small], reps=1)
        assert timed == [] and {k: again[k] for k in first if k != "ms"} == {k: first[k] for k in first if k != "ms"}
        assert (ck.block_max_kn(), ck.block_max_k(), ck.block_min_rows(), ck.stream_pf(),
                ck.sgemm_min_rows()) == knobs
        monkeypatch.setattr(ck, "_calibration", None)
        ck.calibrate([torch.randn(128, 384, generator=g).t().contiguous().t()], reps=1)  # a shape not seen
        assert timed or ck.sgemm_address() is None
        timed.clear()
        monkeypatch.setenv("TANDEM_CPU_CALIBRATE", "fresh")
        monkeypatch.setattr(ck, "_calibration", None)
        ck.calibrate([big, small], reps=1)
        assert 8 in timed  # the blocks timed again (and the file rewritten)
    finally:
        ck.block_max_kn(defaults[0])
        ck.block_max_k(defaults[1])
        ck.block_min_rows(defaults[2])
        ck.stream_pf(defaults[3])
        ck.sgemm_min_rows(defaults[4])


@needs_kernels
def test_the_amx_tiles_give_the_vector_tiles_w8a8_up_to_summation_order():
    """Where the CPU has AMX int8 (and Linux grants the tile state), w8a8 at 3+ rows multiplies on tiles: the
    weights' 16-row blocks as they lie against the activations packed per call (16 rows at a time, zeros past
    M), one tile product per 32-value block so each takes its own activation scale; up to 8 rows a pair of
    blocks per product, side by side in the columns. The same integer dots as the vector tiles, summed in
    another order: row counts on both sides of 8 and of the 16-row tiles, column tails past the last 16 (on
    the vector tiles), odd block counts, bias, two threads."""
    if not ck.set_amx():
        pytest.skip(f"no AMX int8 here (SIMD level {ck.simd_level()}, or Linux refused the tile state)")
    from kernels.quant_matmul import quantize_int8

    g = torch.Generator().manual_seed(11)
    try:
        for m in (3, 4, 7, 8, 9, 16, 17, 40):
            for n, k in ((256, 256), (1409, 96), (48, 32), (20, 736), (64, 64)):
                x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g) * 3
                q, s = quantize_int8(torch.randn(n, k, generator=g))
                b = torch.randn(n, generator=g)
                ck.set_amx(False)
                vec = ck.linear_w8a8(x, q, s, b)
                ck.set_amx(True)
                tol = dict(rtol=1e-5, atol=2e-6 * vec.abs().max().item())
                torch.testing.assert_close(ck.linear_w8a8(x, q, s, b), vec, **tol)
                torch.set_num_threads(2)
                try:
                    torch.testing.assert_close(ck.linear_w8a8(x, q, s, b), vec, **tol)
                finally:
                    torch.set_num_threads(1)
                torch.testing.assert_close(ck.linear_w8a8(x, q, s), vec - b, **tol)
    finally:
        ck.set_amx(True)


@needs_kernels
@pytest.mark.parametrize("kind", ["w8a8", "int4", "int4-f16", "int4-bf16", "bf16"])
@pytest.mark.parametrize("n,k", [(256, 1024), (1409, 128), (37, 3072), (6, 640), (20, 16512), (9, 65536)])
def test_one_row_gives_each_row_of_a_batch_its_bits(kind, n, k):
    """One activation row (a decode step of one sequence) reads the weight rows one after another, the tiles take
    two rows or more: a row's output must be the same bits either way, or a sequence's greedy tokens would depend
    on its batch. Odd block counts (w8a8's 256-bit tail), column counts off the tiles' 4 rows / 4 panels, group
    counts off int4's 8 at a time (640: 10 groups of 64, 5 of 128), int4's scales in each stored type with and
    without zero points, K past the one-row paths' stack bounds (16512: w8a8's, 65536: int4's; the tiles then),
    bias, two threads; and the same bits with the one-row paths off (`one_row(0)`)."""
    from kernels.quant_matmul import quantize_int4, quantize_int8

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    if kind == "w8a8":
        q, s = quantize_int8(w)
        run = lambda x, b: ck.linear_w8a8(x, q, s, b)  # noqa: E731
    elif kind.startswith("int4"):  # scales as float32 / float16 / bfloat16, zero points or none, groups 64 / 128
        group = 128 if kind.endswith("bf16") else 64
        packed, scale, zero = quantize_int4(w, group)
        sc = {"int4": scale.float(), "int4-f16": scale.half(), "int4-bf16": scale.bfloat16()}[kind]
        zp, off = (None, 0) if kind.endswith("f16") else (zero, 0 if kind == "int4" else -1)
        run = lambda x, b: ck.linear_w4a8(x, packed, sc, zp, group, b, off)  # noqa: E731
    else:
        packed = ck.pack_bf16_pairs(w)
        run = lambda x, b: ck.linear_bf16(x, packed, n, b)  # noqa: E731
    x = torch.randn(3, k, generator=g) * torch.rand(3, k, generator=g) * 4
    b = torch.randn(n, generator=g)
    for bias in (b, None):
        batch = run(x[:2], bias)
        for r in range(2):
            assert torch.equal(run(x[r:r + 1], bias)[0], batch[r])
    one = run(x[:1], b)
    torch.set_num_threads(2)
    try:
        assert torch.equal(run(x[:1], b), one)
    finally:
        torch.set_num_threads(1)
    before = ck.one_row()
    try:
        ck.one_row(0)
        assert torch.equal(run(x[:1], b), one)
    finally:
        ck.one_row(before)
    assert before == 1


@needs_kernels
def test_linear_w8a8_refuses_in_features_not_divisible_by_32():
    from kernels.quant_matmul import quantize_int8

    q, s = quantize_int8(torch.randn(8, 40))
    with pytest.raises(ValueError, match="a multiple of 32"):
        ck.linear_w8a8(torch.randn(2, 40), q, s)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 5, 13, 33])
@pytest.mark.parametrize("n,k,group", [(256, 256, 64), (30, 128, 128), (7, 64, 64), (1409, 768, 128), (96, 704, 64)])
def test_linear_w4a8_matches_reference(m, n, k, group):
    """int4 weights (asymmetric, per group) with the activations quantised per 32: the dequantised-weight
    reference up to float summation order, for every tile, with bias and on two threads; group 32 is refused
    (QuantLinear then keeps torch's packed op)."""
    from kernels.quant_matmul import pack_zero, quantize_int4

    g = torch.Generator().manual_seed(n + k + m + group)
    packed, scale, zero = quantize_int4(torch.randn(n, k, generator=g), group)
    zero = pack_zero(zero)  # the kernels take the zeros packed two per byte
    x = torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g) * 4
    x[0, :32] = 0
    b = torch.randn(n, generator=g)
    ref = ck.linear_w4a8_ref(x, packed, scale, zero)
    tol = dict(rtol=1e-4, atol=1e-5 * ref.abs().max().item())
    for bias in (None, b):
        torch.testing.assert_close(ck.linear_w4a8(x, packed, scale.float(), zero, group, bias),
                                   ck.linear_w4a8_ref(x, packed, scale, zero, bias), **tol)
    torch.set_num_threads(2)
    try:
        torch.testing.assert_close(ck.linear_w4a8(x, packed, scale.float(), zero, group, b),
                                   ck.linear_w4a8_ref(x, packed, scale, zero, b), **tol)
    finally:
        torch.set_num_threads(1)
    p32, s32, z32 = quantize_int4(torch.randn(8, 64, generator=g), 32)
    z32 = pack_zero(z32)
    with pytest.raises(ValueError, match="group"):
        ck.linear_w4a8(x[:, :64], p32, s32.float(), z32, 32)


def _pages(num_pages=48, block=16, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_pages, 2, 3, block, hkv, d, generator=g)
    return kv[:, 0, 1], kv[:, 1, 1]


def _shuffled_batch(num_pages: int, bs: int, q_lens: list[int], ctxs: list[int], hq: int, d: int,
                    seeds: tuple[int, int]) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Block tables over shuffled pages (padded with each row's first page), query starts, random queries."""
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seeds[0])).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctxs]
    width = max(map(len, tables))
    bt = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hq, d, generator=torch.Generator().manual_seed(seeds[1]))
    return bt, starts, q


@needs_kernels
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (4, 4, 64), (6, 2, 12)])
def test_paged_attention_matches_the_torch_path(hq, hkv, d):
    """Decodes, verify windows and prefill chunks in one batch, GQA, contexts ending mid-page, shuffled pages:
    the kernel's sequences (q_len <= 8) against the gather + SDPA path."""
    bs = 16
    kc, vc = _pages(hkv=hkv, d=d)
    q_lens, ctxs = [1, 5, 1, 40, 3, 1], [17, 30, 1, 70, 50, 100]
    bt, starts, q = _shuffled_batch(kc.shape[0], bs, q_lens, ctxs, hq, d, seeds=(1, 2))
    qsl, cl = torch.tensor(starts), torch.tensor(ctxs)
    ref = paged_attention_torch(q, kc, vc, bt, qsl, cl)
    plan = plan_paged_attention(bt, ctxs, starts, bs, kernel_max_query=8)
    assert plan.kernel_seqs[1].tolist() == [1, 5, 1, 3, 1] and len(plan.prefills) == 1
    got = paged_attention_torch(q, kc, vc, bt, qsl, cl, plan=plan)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # scale, and threads > 1 (OpenMP over sequence x KV head)
    ref = paged_attention_torch(q, kc, vc, bt, qsl, cl, scale=0.3)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = paged_attention_torch(q, kc, vc, bt, qsl, cl, scale=0.3, plan=plan)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 32), (12, 4, 64), (4, 4, 48)])
def test_paged_attention_long_chunks_match_the_torch_path(hq, hkv, d):
    """Prefill chunks of 16+ queries (the kernel's tiled prefill path: keys transposed, four (query, head)
    pairs a tile, tiles of 16 sharing the value pass; pair counts not a multiple of 4 or 16) beside decodes
    and a verify window in one call, contexts ending mid-page, shuffled pages, one and two threads: against the
    gather + SDPA path."""
    bs = 16
    kc, vc = _pages(num_pages=64, hkv=hkv, d=d)
    q_lens, ctxs = [1, 16, 37, 5, 77, 1], [9, 16, 200, 30, 301, 120]
    bt, starts, q = _shuffled_batch(kc.shape[0], bs, q_lens, ctxs, hq, d, seeds=(3, 4))
    ref = paged_attention_torch(q, kc, vc, bt, torch.tensor(starts), torch.tensor(ctxs))
    seqs = torch.tensor([starts[:-1], q_lens, ctxs, list(range(len(ctxs)))], dtype=torch.int64)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = ck.paged_attention(q, kc, vc, bt, seqs, max(ctxs))
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(old)


@needs_kernels
@pytest.mark.parametrize("hq,hkv,d,bs", [(16, 4, 64, 16), (14, 2, 64, 16), (32, 4, 128, 16), (16, 1, 32, 3),
                                         (4, 2, 64, 5), (6, 6, 64, 16), (12, 4, 80, 16), (40, 2, 48, 16)])
def test_decode_attention_head_tiles_and_splits(hq, hkv, d, bs):
    """Decodes and short verify windows over contexts up to ~300 keys (several pages, mid-page ends, blocks of
    keys straddling pages where the page size is not a multiple of 8), GQA ratios 1-20 (the value pass's
    register tiles of 2, 4, 8 and 16 query heads, heads past a tile's width repeated, head sizes 32-128), one
    sequence and several, one and two threads (a sequence's KV heads then split between them): against the
    gather + SDPA path, each sequence's rows the same bits alone as in the batch, and the AVX2 build (8-wide
    tiles of 2, 4 and 8 heads) the AVX-512 build's bits."""
    q_lens, ctxs = [1, 3, 1, 1, 2], [300, 41, 1, 129, 77]
    kc, vc = _pages(num_pages=sum(-(-c // bs) for c in ctxs) + 4, block=bs, hkv=hkv, d=d, seed=5)
    bt, starts, q = _shuffled_batch(kc.shape[0], bs, q_lens, ctxs, hq, d, seeds=(6, 7))
    ref = paged_attention_torch(q, kc, vc, bt, torch.tensor(starts), torch.tensor(ctxs))
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            seqs = torch.tensor([starts[:-1], q_lens, ctxs, list(range(len(ctxs)))], dtype=torch.int64)
            got = ck.paged_attention(q, kc, vc, bt, seqs, max(ctxs))
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
            for s in range(len(ctxs)):  # alone: the batch's bits
                one = torch.tensor([[starts[s]], [q_lens[s]], [ctxs[s]], [s]], dtype=torch.int64)
                alone = ck.paged_attention(q, kc, vc, bt, one, ctxs[s], out=torch.zeros_like(q))
                rows = slice(starts[s], starts[s + 1])
                assert torch.equal(alone[rows], got[rows]), (threads, s)
            if ck.simd_level().startswith("avx512"):  # the AVX2 build's 8-wide value tiles: the same bits
                narrow = torch.zeros_like(q)
                p = seqs.data_ptr()
                assert _avx2_lib().tk_paged_attention_f32(
                    q.data_ptr(), hq, d, kc.data_ptr(), vc.data_ptr(), hkv, bs, kc.stride(0), kc.stride(1),
                    kc.stride(2), bt.data_ptr(), bt.shape[1], p, p + 8 * len(ctxs), p + 16 * len(ctxs),
                    p + 24 * len(ctxs), len(ctxs), max(ctxs), d ** -0.5, narrow.data_ptr(), threads, 0) == 0
                assert torch.equal(narrow, got), threads
    finally:
        torch.set_num_threads(old)


_AVX2 = []


def _avx2_lib():
    """The kernels built without AVX-512 (with OpenMP), once per session."""
    if not _AVX2:
        _AVX2.append(ck.build_variant("avx2", stem="tandem_cpu_kernels_avx2_omp", openmp=True))
    return _AVX2[0]


@needs_kernels
def test_write_kv_is_the_indexed_store():
    kc, vc = _pages()
    kc2, vc2 = kc.clone(), vc.clone()
    pages, offs = torch.tensor([3, 3, 7, 0]), torch.tensor([0, 15, 4, 9])
    k, v = torch.randn(4, 2, 32), torch.randn(4, 2, 32)
    ck.write_kv(k, v, kc, vc, pages, offs)
    kc2[pages, offs] = k
    vc2[pages, offs] = v
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


NARROW_KV = [torch.bfloat16, torch.float16]


@needs_kernels
@pytest.mark.parametrize("dtype", NARROW_KV)
def test_write_kv_into_a_narrow_cache_rounds_as_torch(dtype):
    """The C write into a bfloat16 / float16 cache is torch's own conversion, bit for bit: round to nearest even
    (ties both ways), subnormals kept, overflow to inf, signed zeros, infinities; a NaN stays a NaN."""
    if ck.kv_kind(torch.empty(0, dtype=dtype)) is None:
        pytest.skip(f"this build reads no {dtype} cache (float16 needs F16C)")
    g = torch.Generator().manual_seed(11)
    k, v = torch.randn(5, 2, 32, generator=g) * 3, torch.randn(5, 2, 32, generator=g)
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x3F800001, 0x3F807FFF, 0x3F80FFFF], dtype=torch.int32)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40, -3e-39, 1e-7, 6e-8, 65504.0, 65520.0,
                            70000.0, -1e30, 3.3895e38, 1.0009765625, 1.00048828125])
    k[0, 0, :5] = ties.view(torch.float32)
    k[1, 1, :special.numel()] = special
    k[2, 0, 0] = float("nan")
    kc = torch.zeros(8, 16, 2, 32, dtype=dtype)
    vc = torch.zeros_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    pages, offs = torch.tensor([3, 3, 7, 0, 5]), torch.tensor([0, 15, 4, 9, 2])
    ck.write_kv(k, v, kc, vc, pages, offs)
    kc2[pages, offs] = k.to(dtype)
    vc2[pages, offs] = v.to(dtype)
    nan = kc2.isnan()
    assert torch.equal(kc.isnan(), nan) and nan.sum() == 1
    assert torch.equal(kc.masked_fill(nan, 0).view(torch.int16), kc2.masked_fill(nan, 0).view(torch.int16))
    assert torch.equal(vc.view(torch.int16), vc2.view(torch.int16))


@needs_kernels
@pytest.mark.parametrize("dtype", NARROW_KV)
@pytest.mark.parametrize("hq,hkv,d,bs", [(16, 4, 64, 16), (6, 2, 12, 16), (12, 4, 48, 5), (8, 8, 32, 16)])
def test_paged_attention_over_a_narrow_cache_is_the_float32_path_over_its_values(dtype, hq, hkv, d, bs):
    """Every path of the C attention over a bfloat16 / float16 cache (decodes and verify windows in the blocked
    kernel with its value tiles, prefill chunks in the tiled one, head sizes off the vector width in the plain
    one), one and two threads: the same bits as the float32 kernel over the cache's values widened to float32
    (and as the AVX2 build's, where D is a multiple of 8), and within 1e-4 of the gather + SDPA path over the
    narrow cache."""
    if ck.kv_kind(torch.empty(0, dtype=dtype)) is None:
        pytest.skip(f"this build reads no {dtype} cache (float16 needs F16C)")
    q_lens, ctxs = [1, 3, 20, 1, 2], [300, 41, 57, 1, 77]
    kc, vc = _pages(num_pages=sum(-(-c // bs) for c in ctxs) + 4, block=bs, hkv=hkv, d=d, seed=9)
    kn, vn = kc.to(dtype), vc.to(dtype)
    kw, vw = kn.float(), vn.float()
    bt, starts, q = _shuffled_batch(kc.shape[0], bs, q_lens, ctxs, hq, d, seeds=(10, 11))
    seqs = torch.tensor([starts[:-1], q_lens, ctxs, list(range(len(ctxs)))], dtype=torch.int64)
    ref = paged_attention_torch(q, kn, vn, bt, torch.tensor(starts), torch.tensor(ctxs))
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = ck.paged_attention(q, kn, vn, bt, seqs, max(ctxs))
            wide = ck.paged_attention(q, kw, vw, bt, seqs, max(ctxs))
            assert torch.equal(got, wide), threads
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
            if ck.simd_level().startswith("avx512") and d % 8 == 0:  # (the plain kernel's sums differ by width)
                narrow = torch.zeros_like(q)
                p = seqs.data_ptr()
                assert _avx2_lib().tk_paged_attention_f32(
                    q.data_ptr(), hq, d, kn.data_ptr(), vn.data_ptr(), hkv, bs, kn.stride(0), kn.stride(1),
                    kn.stride(2), bt.data_ptr(), bt.shape[1], p, p + 8 * len(ctxs), p + 16 * len(ctxs),
                    p + 24 * len(ctxs), len(ctxs), max(ctxs), d ** -0.5, narrow.data_ptr(), threads,
                    ck.KV_KINDS[dtype]) == 0
                assert torch.equal(narrow, got), threads
    finally:
        torch.set_num_threads(old)


@needs_kernels
def test_a_narrow_cache_over_the_plain_kernels_row_buffer_is_refused():
    """Head sizes past the plain kernel's row buffer: attention_fits says no (the runner keeps the torch path) and a
    direct call is refused, not overrun."""
    kc = torch.zeros(2, 16, 1, ck.KV_NARROW_MAX_D + 8, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, kc.shape[3])
    assert not ck.attention_fits(q, kc) and ck.attention_fits(q, kc.float())
    seqs = torch.tensor([[0], [1], [1], [0]], dtype=torch.int64)
    with pytest.raises(ValueError, match="head sizes up to"):
        ck.paged_attention(q, kc, kc, torch.tensor([[0]]), seqs, 1)


@needs_kernels
def test_paged_attention_context_writes_then_attends():
    kc, vc = _pages(hkv=2, d=32)
    bt = torch.tensor([[5, 9], [2, 2]])
    ctxs, starts = [20, 3], [0, 2, 3]
    pos = torch.tensor([18, 19, 2])
    wp, wo = torch.tensor([9, 9, 2]), pos % 16
    q, k, v = torch.randn(3, 4, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    outs = []
    for kmq in (0, 4):
        kcs, vcs = [kc.clone()], [vc.clone()]
        plan = plan_paged_attention(bt, ctxs, starts, 16, kmq)
        b = StepBatch([], [], [], bt, 2, 20, [], [], [], positions=pos, write_pages=wp, write_offsets=wo,
                      query_start_loc=torch.tensor(starts), context_lens=torch.tensor(ctxs), plan=plan)
        outs.append((PagedAttention(kcs, vcs, b, False).forward(0, q, k, v), kcs[0], vcs[0]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-4)
    assert torch.equal(outs[1][1], outs[0][1]) and torch.equal(outs[1][2], outs[0][2])


@needs_kernels
def test_engine_greedy_outputs_match_the_torch_paths():
    """tandem-tiny-l, greedy, batched: the kernels' engine against the same engine on the torch paths."""
    from engines import LLM, SamplingParams

    llm = LLM(ROOT / "models" / "tandem-tiny-l")
    prompts = [[5 + (i * 7 + j * 3) % 200 for j in range(20 + i * 9)] for i in range(5)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runner = llm.engine.runner
    assert runner.kernel_max_query > 0
    with_kernels = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    runner.kernel_max_query = 0
    torch_path = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert with_kernels == torch_path


def test_threads_knob(monkeypatch):
    import os

    from engines.config import EngineOptions
    from engines.core import cpu_threads

    cpus = len(os.sched_getaffinity(0))
    assert EngineOptions().threads == 0
    assert cpu_threads(1) == 1
    assert cpu_threads(10_000) == cpus  # capped at the CPUs this process may use
    monkeypatch.setenv("TANDEM_THREADS", "1")
    assert cpu_threads(0) == 1
    assert cpu_threads(0, reserve=1) == 1  # an explicit count is kept whatever the reserve
    monkeypatch.delenv("TANDEM_THREADS")
    assert cpu_threads(0) == min(torch.get_num_threads(), cpus)
    # the server's automatic count leaves one CPU to the event loop, and never goes below one thread
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert (cpu_threads(0), cpu_threads(0, reserve=1), cpu_threads(3, reserve=1)) == (8, 7, 3)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert cpu_threads(0, reserve=1) == 1


@needs_kernels
def test_rope_is_bit_identical_to_apply_rope():
    from engines.model import apply_rope

    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d = 7, 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    pos = torch.arange(t) * 13.0
    freqs = pos[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    want_q = apply_rope(q.reshape(t, hq, d), cos, sin)
    want_k = apply_rope(k.reshape(t, hkv, d), cos, sin)
    v_before = v.clone()
    ck.rope_(qkv, (0, hq + hkv), d, cos, sin)
    assert torch.equal(q.reshape(t, hq, d), want_q) and torch.equal(k.reshape(t, hkv, d), want_k)
    assert torch.equal(v, v_before)


@needs_kernels
def test_the_torch_build_exports_the_sgemm_many_row_linears_take():
    """The pinned x86 torch wheel links MKL: `linear`/`linear_int8` of 13+ rows call its SGEMM (the m=13/33 cases
    above check its results); without it they would silently fall back to the streaming kernel."""
    assert ck.sgemm_address() is not None
