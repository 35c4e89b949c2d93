"""kernels/hugepages.py: the decoder's weights on transparent huge pages where the kernel grants them, with the
same values, and torch's ordinary allocation where it does not or the caller turned them off."""

from __future__ import annotations

import torch

from engines.model import cpu_weight_layout
from kernels import hugepages


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages of the mapping of this process that holds `addr` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_a_large_tensor_sits_on_huge_pages_where_the_kernel_grants_them():
    t = hugepages.empty((3, 1 << 20), torch.float32)  # 12 MiB: six huge pages
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    t.fill_(1.5)  # first touch: the pages are faulted in now
    assert float(t.sum()) == 1.5 * 3 * (1 << 20)
    if hugepages.enabled():
        assert t.data_ptr() % hugepages.HUGE == 0
        huge = _anon_huge_kb(t.data_ptr())
        assert 4096 <= huge <= 12 * 1024  # at least two of its six 2 MiB pages, and none past its end
    else:  # THP off here (mode never, or not Linux): torch's own allocation
        assert hugepages.mode() not in ("always", "madvise") or not hugepages.enabled()


def test_the_tail_past_the_last_whole_huge_page_stays_on_base_pages():
    t = hugepages.empty(((5 << 20) // 4,), torch.float32)  # 5 MiB: two huge pages and a 1 MiB tail
    t.fill_(1.0)
    if hugepages.enabled():
        assert _anon_huge_kb(t.data_ptr()) == 4096


def test_small_tensors_and_the_switch_keep_torchs_allocation(monkeypatch):
    small = hugepages.empty((100, 100), torch.float32)
    assert small.nbytes < hugepages.MIN_BYTES and small.shape == (100, 100)
    monkeypatch.setenv("TANDEM_HUGEPAGES", "0")
    assert not hugepages.enabled()
    big = hugepages.empty((1 << 22,), torch.float32)
    # torch's own allocation (resizable, unlike a tensor over our mapping). Not its AnonHugePages: torch's 16 MiB
    # may come from glibc's heap, whose huge pages depend on what the process did before (once 18 MiB in make test)
    assert big.untyped_storage().resizable() and small.untyped_storage().resizable()
    monkeypatch.delenv("TANDEM_HUGEPAGES")
    if hugepages.enabled():  # the switch back on: the same request is our mapping
        assert not hugepages.empty((1 << 22,), torch.float32).untyped_storage().resizable()


def test_the_kv_pool_is_zeroed_and_on_huge_pages_untouched_pages_costing_nothing(monkeypatch):
    from engines.kv_pool import KVGeometry, KVPool

    geo = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    pool = KVPool([geo], memory_bytes=24 << 20, block_size=16)
    buf = pool.buffer
    assert buf.dtype == torch.uint8 and buf.numel() == pool.num_pages * pool.page_bytes
    assert _anon_huge_kb(buf.data_ptr()) == 0  # nothing touched yet: no memory taken
    assert int(buf[: 8 << 20].count_nonzero()) == 0  # zero at first touch
    buf[: 8 << 20].fill_(0)  # written: now the pages are the pool's (a read maps the shared zero page)
    if hugepages.enabled():
        assert buf.data_ptr() % hugepages.HUGE == 0 and _anon_huge_kb(buf.data_ptr()) >= 4096
    pool.view(0)[0, 0, 0].fill_(2.0)
    assert float(pool.view(0)[0, 0, 0].sum()) == 2.0 * 16 * 2 * 64
    monkeypatch.setenv("TANDEM_HUGEPAGES", "0")  # the switch off: base pages, still zeroed
    off = hugepages.zeros(4 << 20)
    assert int(off.count_nonzero()) == 0
    if hugepages.mode() == "madvise":  # ("always" gives unadvised memory huge pages too)
        assert _anon_huge_kb(off.data_ptr()) == 0


def test_copy_keeps_values_and_strides_of_any_source():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 1024, generator=g)
    for src in (w, w.t(), w[:, ::2]):
        out = hugepages.copy(src)
        assert out.is_contiguous() and torch.equal(out, src)
    w.add_(1)  # the copy owns its memory
    assert not torch.equal(hugepages.copy(w[:8]), w[:8] - 1)


def test_the_model_layout_keeps_every_value_and_outlives_its_source():
    lin = torch.nn.Linear(1024, 1536, bias=False)
    before = lin.weight.detach().clone()
    model = torch.nn.Sequential(lin)
    cpu_weight_layout(model)
    assert lin.weight.stride() == (1, 1536) and torch.equal(lin.weight, before)
    if hugepages.enabled():
        assert lin.weight.data_ptr() % hugepages.HUGE == 0
    x = torch.randn(3, 1024)
    torch.testing.assert_close(lin(x), x @ before.t())


def test_an_arena_lays_tensors_end_to_end_on_huge_pages_and_they_outlive_it():
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randn(384, 1024, generator=g), torch.randn(256, 1024, generator=g), torch.randn(40, 1000, generator=g)]
    with hugepages.arena() as a:
        outs = [hugepages.copy(s) for s in srcs]  # 1.5 MiB, 1 MiB, 160,000 bytes: each under a huge page
        small = hugepages.empty((100,), torch.float32)  # under ARENA_MIN: torch's allocation
    assert all(torch.equal(o, s) for o, s in zip(outs, srcs)) and small.shape == (100,)
    srcs[0].add_(1)  # the copies own their memory
    assert not torch.equal(outs[0], srcs[0])
    if hugepages.enabled():
        p = [o.data_ptr() for o in outs]
        assert p[0] % hugepages.HUGE == 0 and p[1] == p[0] + outs[0].nbytes and p[2] == p[1] + outs[1].nbytes
        for o in outs:
            o.fill_(2.0)  # first touch, after the block: the mapping lives on in its tensors
        assert _anon_huge_kb(p[0]) >= 2048  # the 2.66 MB they span sit on huge pages (one per-tensor mapping each: none)
        assert a._map is not None and small.data_ptr() not in range(p[0], p[0] + a._size)
    outside = hugepages.empty((384, 1024), torch.float32)  # after the block: its own mapping again (under MIN_BYTES: torch's)
    assert outside.nbytes < hugepages.MIN_BYTES and outside.shape == (384, 1024)


def test_an_arena_opens_a_new_mapping_for_what_does_not_fit_and_whole_pages_for_a_large_tensor():
    with hugepages.arena(chunk=4 << 20):
        a = hugepages.empty((3 << 20,), torch.uint8)
        b = hugepages.empty((3 << 20,), torch.uint8)  # 3 + 3 MiB > 4 MiB: a second mapping
        c = hugepages.empty((9 << 20,), torch.uint8)  # larger than a chunk: its own 10 MiB of huge pages
        d = hugepages.empty((1 << 20,), torch.uint8)  # fits in what c's mapping leaves
    for t, v in ((a, 1), (b, 2), (c, 3), (d, 4)):
        t.fill_(v)
    assert [int(t[0]) + int(t[-1]) for t in (a, b, c, d)] == [2, 4, 6, 8]
    if hugepages.enabled():
        assert b.data_ptr() % hugepages.HUGE == 0 and b.data_ptr() != a.data_ptr() + a.nbytes
        assert d.data_ptr() == c.data_ptr() + c.nbytes
