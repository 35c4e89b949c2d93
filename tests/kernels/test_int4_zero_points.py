"""int4 zero points stored packed two per byte (kernels/quant_formats.py `pack_zero`: + an offset of 0 or 1, or
none where every zero is 8): the packing round-trips, and the C kernel, the Triton matmul and QuantLinear read
the packed zeros (offset 1 reaching 16, none, an odd number of groups) as the reference does with one byte
per group."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from kernels import cpu_kernels as ck  # noqa: E402
from kernels.quant_formats import dequantize_int4, pack_zero, quantize_int4, unpack_zero  # noqa: E402
from kernels.quant_matmul import QuantLinear, wq_matmul  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_kernels = pytest.mark.skipif(not ck.available(), reason=f"CPU kernels unavailable: {ck.build_error}")


def int4_weight(n: int, k: int, group: int, zeros: str, seed: int = 0):
    """packed q, scale, zero [N, G] one byte per group: "asym" (0..15), "gptq1" (1..16), "eight" (all 8)."""
    g = torch.Generator().manual_seed(seed)
    packed, scale, _ = quantize_int4(torch.randn(n, k, generator=g) * 0.05, group)
    lo = {"asym": 0, "gptq1": 1, "eight": 8}[zeros]
    hi = {"asym": 16, "gptq1": 17, "eight": 9}[zeros]
    zero = torch.randint(lo, hi, (n, k // group), generator=g).to(torch.int16)
    if zeros == "gptq1":
        zero[0, 0] = 16  # a zero point one past a nibble: only the offset stores it
    return packed, scale, zero


@pytest.mark.parametrize("groups", [1, 2, 3, 8])
def test_pack_zero_round_trips(groups):
    z = torch.randint(0, 16, (5, groups))
    p = pack_zero(z)
    assert p.dtype == torch.uint8 and p.shape == (5, (groups + 1) // 2)
    assert torch.equal(unpack_zero(p, groups).long(), z)
    z1 = torch.randint(1, 17, (5, groups))
    assert torch.equal(unpack_zero(pack_zero(z1, 1), groups, 1).long(), z1)
    assert pack_zero(torch.full((5, groups), 8)) is None
    assert torch.equal(unpack_zero(None, groups, rows=5), torch.full((5, groups), 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="1..16"):
        pack_zero(torch.zeros(2, groups), 1)


@needs_kernels
@pytest.mark.parametrize("zeros,offset", [("asym", 0), ("gptq1", 1), ("eight", 0)])
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("n,k,group", [(64, 192, 64), (36, 384, 128)])
def test_c_w4a8_reads_packed_zeros(zeros, offset, m, n, k, group):
    packed, scale, zero = int4_weight(n, k, group, zeros, seed=m)
    x = torch.randn(m, k)
    zp = pack_zero(zero, offset)
    assert (zp is None) == (zeros == "eight")
    ref = ck.linear_w4a8_ref(x, packed, scale, zp, zero_offset=offset)
    # the reference with the zeros one byte per group, unpacked independently
    full = ck.linear_w4a8_ref(x, packed, scale, pack_zero(zero, offset), zero_offset=offset)
    torch.testing.assert_close(ref, full)
    got = ck.linear_w4a8(x, packed, scale.float(), zp, group, zero_offset=offset)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("zeros,offset", [("asym", 0), ("gptq1", 1), ("eight", 0)])
def test_triton_int4_reads_packed_zeros(zeros, offset):
    n, k, m, group = 24, 192, 3, 64  # 3 groups: an odd count, the last byte half used
    packed, scale, zero = int4_weight(n, k, group, zeros)
    x = torch.randn(m, k)
    ref = x @ dequantize_int4(packed, scale, zero).T
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    zp = pack_zero(zero, offset)
    for split in (1, 2):
        got = wq_matmul(x.to(dev), packed.to(dev), scale.to(dev), None if zp is None else zp.to(dev),
                        split_k=split, zero_offset=offset).cpu()
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("zeros,offset", [("asym", 0), ("gptq1", 1), ("eight", 0)])
@pytest.mark.parametrize("group", [32, 64])
def test_quantlinear_int4_keeps_zeros_packed(zeros, offset, group):
    n, k = 48, 192
    packed, scale, zero = int4_weight(n, k, group, zeros)
    lin = QuantLinear(k, n, False, "int4", group_size=group)
    lin.weight.copy_(packed)
    lin.scale.copy_(scale)
    lin.set_zero_points(zero, offset)
    assert lin.zero_offset == (0 if zeros == "eight" else offset)
    assert lin.zero is None if zeros == "eight" else lin.zero.numel() == n * ((k // group + 1) // 2)
    w = dequantize_int4(packed, scale, zero)
    assert torch.equal(lin.dequantized_weight(), w)
    x = torch.randn(4, k)
    # torch's packed op (group 32) rounds the activations to bf16; the C kernel (64) quantises them per 32
    torch.testing.assert_close(lin(x), x @ w.T, atol=3e-2, rtol=3e-2)


@needs_kernels
def test_c_w4a8_reads_the_scales_as_stored():
    """float16 / bfloat16 scales read by the kernel itself (no float32 copy kept): the same bits as their
    float32 widening, subnormal float16 scales included, also in a build without F16C (the C conversion)."""
    import ctypes

    from kernels.cbuild import build_library

    packed, scale, zero = int4_weight(32, 256, 64, "asym")
    scale = scale.clone()
    scale[0, 0], scale[1, 1], scale[2, 2] = 3e-6, -6e-8, 65504.0  # subnormals, the largest half
    x = torch.randn(3, 256)
    zp = pack_zero(zero)
    want = ck.linear_w4a8(x, packed, scale.float(), zp, 64)
    assert torch.equal(ck.linear_w4a8(x, packed, scale, zp, 64), want)
    b16 = scale.to(torch.bfloat16)
    assert torch.equal(ck.linear_w4a8(x, packed, b16, zp, 64), ck.linear_w4a8(x, packed, b16.float(), zp, 64))
    so = build_library(ck._SRC.read_text(), "tandem_cpu_kernels_nof16c",
                       [*ck._FLAGS, "-mno-f16c", "-Wno-unknown-pragmas"], ck.cache_dir(), key=(ck._cpu_flags(),))
    lib = ck._bind(ctypes.CDLL(str(so)))
    y = torch.empty(3, 32)
    rc = lib.tk_linear_w4a8(x.data_ptr(), 3, 256, packed.data_ptr(), scale.data_ptr(), 1, zp.data_ptr(), 0, 64, 32,
                            None, y.data_ptr(), 1)
    assert rc == 0 and torch.equal(y, want)
