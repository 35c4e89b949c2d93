"""The float32 linears reading a bfloat16 copy of a bf16-exact weight packed in panels (`cpu_kernels.bf16_copy`):
every path (1-8 rows, one or two panels a pass, 8-row blocks of many rows, column and K tails, bias, two
threads, the AVX2 build) gives the bits of the float32 weight through the streams and register blocks, and so
does the whole C decoder stack on tiny-l."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import cpu_kernels as ck

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not ck.available(), reason=f"CPU kernels unavailable: {ck.build_error}")]

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(256, 256), (37, 19), (40, 63), (1409, 96), (3, 5), (200, 1030), (2048, 640)]  # (N, K)


def _bf16_exact(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, k, generator=g).bfloat16().float().t().contiguous().t()  # [N, K] column-major


@pytest.mark.parametrize("rows", [range(1, 9), range(9, 41)])
def test_the_bf16_copy_gives_the_float32_weights_bits(register_tiles, rows):
    g = torch.Generator().manual_seed(rows.start)
    for n, k in SHAPES:
        w = _bf16_exact(n, k, g)
        w16 = ck.bf16_copy(w)
        assert w16.dtype == torch.bfloat16 and torch.equal(ck.unpack_bf16(w16, n).float(), w)
        b = torch.randn(n, generator=g)
        for m in rows:
            x = torch.randn(m, k, generator=g)
            for blocks in (0, ck.NEVER):  # the 5-8 row register blocks, or the streams
                ck.block_max_kn(blocks)
                for bias in (None, b):
                    assert torch.equal(ck.linear(x, w, bias, weight16=w16), ck.linear(x, w, bias)), (m, n, k)
    torch.set_num_threads(2)
    try:
        x = torch.randn(11, w.shape[1], generator=g)
        assert torch.equal(ck.linear(x, w, b, weight16=w16), ck.linear(x, w, b))
    finally:
        torch.set_num_threads(1)


def test_the_packed_copy_puts_each_weight_where_the_kernels_read_it():
    """pack_bf16's layout, element by element: panel p, row k, word 2i is column 32p + i, word 2i + 1 column
    32p + 16 + i; the last panel's columns past N are zero."""
    n, k = 70, 3
    w = torch.arange(n * k, dtype=torch.float32).view(n, k)  # small integers: exact in bf16
    packed = ck.pack_bf16(w)
    assert packed.shape == (3, k, 32) and packed.dtype == torch.bfloat16
    for p in range(3):
        for kk in range(k):
            for i in range(16):
                for h in range(2):
                    col = 32 * p + 16 * h + i
                    want = w[col, kk].item() if col < n else 0.0
                    assert packed[p, kk, 2 * i + h].item() == want, (p, kk, i, h)
    assert torch.equal(ck.unpack_bf16(packed, n).float(), w)


def test_the_sgemm_rows_read_the_float32_weight():
    g = torch.Generator().manual_seed(5)
    w = _bf16_exact(300, 256, g)
    x = torch.randn(64, 256, generator=g)
    rows = ck.sgemm_min_rows()
    ck.sgemm_min_rows(1)
    try:
        assert torch.equal(ck.linear(x, w, weight16=ck.bf16_copy(w)), ck.linear(x, w))
    finally:
        ck.sgemm_min_rows(rows)


def test_the_avx2_build_reads_the_bf16_copy_to_the_same_bits():
    try:
        lib = ck.build_variant("avx2")
    except Exception as exc:  # no compiler for the variant: the native build's test covers this CPU
        pytest.skip(f"no AVX2 build: {exc}")
    g = torch.Generator().manual_seed(9)
    for n, k in SHAPES:
        w16 = torch.randn(k, n, generator=g).bfloat16()  # wt [K, N]
        w32 = w16.float()
        for m in (1, 2, 3, 6, 8, 11):
            x = torch.randn(m, k, generator=g)
            y, y16 = torch.empty(m, n), torch.empty(m, n)
            lib.tk_linear_f32(x.data_ptr(), m, k, w32.data_ptr(), n, n, None, y.data_ptr(), 1)
            packed = ck.pack_bf16(w16.t())
            lib.tk_linear_f32_w16(x.data_ptr(), m, k, w32.data_ptr(), packed.data_ptr(), n, n, None, y16.data_ptr(), 1)
            assert torch.equal(y16, y), (m, n, k)


def test_only_bf16_exact_weights_get_a_copy(monkeypatch):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=g).t().contiguous().t()
    assert ck.bf16_copy(w) is None  # a float32 checkpoint keeps the float32 path
    exact = w.bfloat16().float()
    exact_view = torch.randn(32, 80, generator=g).bfloat16().float()[:, :64].t()  # a row stride wider than N
    assert ck.bf16_copy(exact) is not None
    assert torch.equal(ck.unpack_bf16(ck.bf16_copy(exact_view), 64).float(), exact_view)
    monkeypatch.setenv("TANDEM_CPU_BF16_WEIGHTS", "0")
    assert ck.bf16_copy(exact) is None
    with pytest.raises(ValueError, match="weight16"):
        ck.linear(torch.randn(2, 32), exact, weight16=exact.bfloat16().contiguous())  # [N, K], not packed


def _w16_pointers(fwd) -> list[int | None]:
    return [getattr(lay, name).w16 for lay in fwd._layers for name in ("qkv", "o", "gate_up", "down")]


def test_the_decoder_stack_and_draft_are_bit_identical_with_bf16_weights(monkeypatch):
    """tiny-l (a bf16 checkpoint): every projection and the head get a bf16 copy, and `forward` (decodes,
    verify windows and chunks, with the tiles or the SGEMM at many rows), `draft_greedy` and `logits` give the
    same bits and tokens, and write the same K/V, as with TANDEM_CPU_BF16_WEIGHTS=0. A random float32
    checkpoint gets no copies."""
    from engines import LLM
    from kernels.cpu_forward import CpuForward

    llm = LLM(ROOT / "models" / "tandem-tiny-l", max_model_len=256)
    runner = llm.engine.runner
    model, kv = runner.model, runner.kv_view
    fast16 = CpuForward.build(model, runner.k_caches, runner.v_caches)
    monkeypatch.setenv("TANDEM_CPU_BF16_WEIGHTS", "0")
    fast32 = CpuForward.build(model, runner.k_caches, runner.v_caches)
    assert all(_w16_pointers(fast16)) and fast16._head[1] is not None and fast16._head_lin.w16
    assert not any(_w16_pointers(fast32)) and fast32._head[1] is None and not fast32._head_lin.w16

    g = torch.Generator().manual_seed(0)
    kv.copy_(torch.randn(kv.shape, generator=g))  # contexts of random K/V: both paths read the same bytes
    pages = kv.shape[0]
    bs = runner.block_size
    vocab = fast16.vocab

    def step(qlens, ctxs):
        n = len(qlens)
        tables = torch.randperm(pages, generator=g)[:n * 8].view(n, 8).contiguous()
        starts = [sum(qlens[:i]) for i in range(n)]
        seqs = torch.tensor([starts, qlens, ctxs, list(range(n))], dtype=torch.long)
        t = sum(qlens)
        ids = torch.randint(4, vocab, (t,), generator=g)
        pos = torch.tensor([c - q + i for q, c in zip(qlens, ctxs) for i in range(q)], dtype=torch.long)
        return ids, pos, tables, seqs, max(ctxs)

    def both(call):
        before = kv.clone()
        a = call(fast16)
        after16 = kv.clone()
        kv.copy_(before)
        b = call(fast32)
        assert torch.equal(kv, after16)  # the same K/V written
        return a, b

    assert 8 * bs >= 104 and pages >= 9 * 8
    default_rows = ck.sgemm_min_rows()
    try:
        for qlens, ctxs in [([1], [17]), ([1] * 5, [9, 30, 2, 64, 41]), ([5, 1, 3], [20, 7, 33]),
                            ([8], [8]), ([13, 4], [40, 90]), ([1] * 8 + [32], [5] * 8 + [100])]:
            for rows in (ck.NEVER, default_rows):  # many rows: the register tiles, or the SGEMM on both sides
                ck.sgemm_min_rows(rows)
                args = step(qlens, ctxs)
                h16, h32 = both(lambda f, a=args: f.forward(*a))
                assert torch.equal(h16, h32), (qlens, rows)
                assert torch.equal(fast16.logits(h16), fast32.logits(h32))
                d16, d32 = both(lambda f, a=args: f.draft_greedy(*a[:3], a[3].clone(), a[4], 4))
                assert torch.equal(d16, d32), (qlens, rows)
    finally:
        ck.sgemm_min_rows(default_rows)


def test_a_float32_checkpoint_gets_no_bf16_copies(tmp_path):
    from tiny_checkpoints import build_checkpoint

    from engines import LLM

    llm = LLM(build_checkpoint(tmp_path / "llama", "llama", hidden_size=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, seed=3), max_model_len=128)
    fwd = llm.engine.runner.cpu_forward
    assert fwd is not None and not any(_w16_pointers(fwd))
