"""w8a8 at 8 rows and more through the weight-stationary VNNI tiles (`tk_w8_many_rows`): weight rows transposed 32
at a time into a strip, activations as q + 128 against block sums that start at -128 x the weights' sums. With
integer activations whose blocks each hold a 127 (every block scale 1) every output is an exact integer sum, so
the tiles must give the integer reference's bits; with random activations they agree with the row-pair tiles to
float summation order. Column tails of a strip (N % 32, N % 16), K with a half 64-byte chunk (K % 64 == 32),
6-row tails, bias and two threads."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernels as ck
from kernels.quant_formats import quantize_int8

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not ck.available(), reason=f"CPU kernels unavailable: {ck.build_error}"),
              pytest.mark.skipif(ck.available() and ck.simd_level() != "avx512-vnni",
                                 reason="the weight-stationary tiles are the VNNI build's")]

SHAPES = [(100, 64), (37, 96), (1280, 768), (77, 1024), (16, 32), (33, 160), (64, 2048)]  # (N, K)


def _integer_rows(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randint(-127, 128, (m, k), generator=g).float()
    x.view(m, k // 32, 32)[:, :, 5] = 127.0  # every block's amax 127: scale 1, q = x
    return x


@pytest.mark.parametrize("threads", [1, 2])
def test_integer_activations_give_the_exact_integer_sums(threads):
    g = torch.Generator().manual_seed(threads)
    torch.set_num_threads(threads)
    try:
        for n, k in SHAPES:
            q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            scale = torch.ones(n)
            bias = torch.randint(-50, 50, (n,), generator=g).float()
            for m in (8, 9, 13, 32, 41):
                x = _integer_rows(m, k, g)
                want = (x.double() @ q.double().t() + bias.double()).float()
                assert torch.equal(ck.linear_w8a8(x, q, scale, bias), want), (n, k, m)
    finally:
        torch.set_num_threads(1)


def test_random_activations_agree_with_the_row_pair_tiles():
    lib = ck.load()
    many = lib.tk_w8_many_rows(-1)
    assert many == 8
    g = torch.Generator().manual_seed(4)
    try:
        for n, k in SHAPES:
            q, s = quantize_int8(torch.randn(n, k, generator=g))
            b = torch.randn(n, generator=g)
            for m in (8, 19, 32):
                x = torch.randn(m, k, generator=g)
                lib.tk_w8_many_rows(ck.NEVER)
                pairs = ck.linear_w8a8(x, q, s, b)
                lib.tk_w8_many_rows(many)
                tiles = ck.linear_w8a8(x, q, s, b)
                ref = ck.linear_w8a8_ref(x, q, s, b)
                tol = 1e-5 * float(ref.abs().max()) + 1e-6
                assert float((tiles - pairs).abs().max()) <= tol and float((tiles - ref).abs().max()) <= 2 * tol
    finally:
        lib.tk_w8_many_rows(many)
