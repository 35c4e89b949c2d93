"""The shared paged KV pool: page carving for several geometries, refcounts, chained-hash prefix caching,
the LRU free list that keeps hashes until reuse, and statistics."""

from __future__ import annotations

import pytest
import torch

from engines.kv_pool import KVGeometry, KVPool

SMALL = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
LARGE = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)


def test_page_size_is_the_largest_models_block_and_views_are_disjoint_per_page():
    pool = KVPool([SMALL, LARGE], memory_bytes=10 * LARGE.page_bytes(4), block_size=4)
    assert pool.page_bytes == LARGE.page_bytes(4) == 2 * 4 * 4 * 2 * 16 * 2
    assert pool.num_pages == 10
    assert pool.page_utilization(1) == 1.0
    assert pool.page_utilization(0) == pytest.approx(SMALL.page_bytes(4) / LARGE.page_bytes(4))
    small, large = pool.view(0), pool.view(1)
    assert small.shape == (10, 2, 2, 4, 1, 8) and small.dtype == torch.float32
    assert large.shape == (10, 2, 4, 4, 2, 16) and large.dtype == torch.bfloat16
    small[3].fill_(7.0)  # a whole page of the small model touches only page 3's bytes
    raw = pool.buffer.view(10, pool.page_bytes)
    assert raw[3, :SMALL.page_bytes(4)].any() and not raw[3, SMALL.page_bytes(4):].any()
    assert not raw[[0, 1, 2, 4, 5, 6, 7, 8, 9]].any()
    large[5, 1, 3].fill_(1.0)  # the last layer's V of page 5 is the end of page 5
    assert raw[5, -1] != 0 and not raw[6].any()


def test_allocate_release_refcounts_and_exhaustion():
    pool = KVPool([SMALL], memory_bytes=4 * SMALL.page_bytes(4), block_size=4)
    a = pool.allocate(0, 3)
    assert pool.num_used == 3 and pool.num_free == 1
    pool.acquire(a[:1])  # a second holder (n > 1 or a prefix hit)
    pool.release(a)
    assert pool.num_used == 1 and pool.ref_count[a[0]] == 1
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(0, 4)
    pool.release(a[:1])
    assert pool.num_used == 0
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(a[:1])


def _commit(pool: KVPool, pages: list[int], tokens: list[int], model_id: int = 0) -> list[int]:
    parent, hashes = None, []
    for i, p in enumerate(pages):
        parent = pool.commit_block(model_id, p, parent, tuple(tokens[i * 4:(i + 1) * 4]))
        hashes.append(parent)
    return hashes


def test_prefix_match_is_chained_capped_and_survives_free_until_reuse():
    pool = KVPool([SMALL, SMALL], memory_bytes=6 * SMALL.page_bytes(4), block_size=4)
    tokens = list(range(12))
    pages = pool.allocate(0, 3)
    hashes = _commit(pool, pages, tokens)
    assert pool.match_prefix(0, tokens + [99]) == (pages, hashes)
    # a hit leaves at least one token to compute: 12 tokens match only 2 full blocks
    assert pool.match_prefix(0, tokens)[0] == pages[:2]
    # chained: the same second block after a different first block is a miss
    assert pool.match_prefix(0, [9, 9, 9, 9] + tokens[4:] + [1])[0] == []
    # the model id is part of the key
    assert pool.match_prefix(1, tokens + [1])[0] == []
    pool.release(pages)
    assert pool.num_used == 0 and pool.num_cached_free == 3
    assert pool.match_prefix(0, tokens + [1])[0] == pages  # freed pages still hit
    pool.acquire(pages[:2])
    assert pool.num_used == 2 and pool.num_free == 4
    pool.release(pages[:2])
    # unhashed free pages are handed out before cached ones; cached ones go oldest-freed first
    fresh = pool.allocate(0, 3)
    assert set(fresh).isdisjoint(pages)
    assert pool.match_prefix(0, tokens + [1])[0] == pages
    evicting = pool.allocate(0, 1)  # the tail block was freed first, so it is evicted first
    assert evicting == [pages[2]]
    assert pool.match_prefix(0, tokens + [1])[0] == pages[:2]
    assert pool.page_hash[pages[2]] is None


def test_stats_count_used_cached_free_and_queries():
    pool = KVPool([SMALL], memory_bytes=5 * SMALL.page_bytes(4), block_size=4)
    pages = pool.allocate(0, 2)
    _commit(pool, pages[:1], list(range(4)))
    pool.record_query(10, 4)
    pool.release(pages)
    s = pool.stats()
    assert (s["used_pages"], s["cached_pages"], s["free_pages"]) == (0, 1, 5)
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (10, 4)
    assert s["kv_usage"] == 0.0


def test_a_page_moving_to_another_model_is_zeroed():
    pool = KVPool([SMALL, LARGE], memory_bytes=2 * LARGE.page_bytes(4), block_size=4)
    (p,) = pool.allocate(1, 1)
    pool.view(1)[p].fill_(float("nan"))
    pool.release([p])
    pages = pool.allocate(0, 2)
    assert p in pages
    assert not torch.isnan(pool.view(0)[p]).any() and (pool.view(0)[p] == 0).all()


def test_a_page_changing_owner_is_cleared_only_where_the_new_owner_reads_it():
    pool = KVPool([SMALL, LARGE], memory_bytes=2 * LARGE.page_bytes(4), block_size=4)
    small, large = SMALL.page_bytes(4), LARGE.page_bytes(4)
    assert small < large
    (p,) = pool.allocate(1, 1)
    pool.view(1)[p].fill_(float("nan"))
    pool.release([p])
    assert p in pool.allocate(0, 2)
    page = pool.buffer.view(pool.num_pages, pool.page_bytes)[p]
    assert (page[:small] == 0).all() and (page[small:large] != 0).any()  # the large model's bytes past it stay
    pool.view(0)[p].fill_(float("nan"))
    pool.release([q for q in range(pool.num_pages) if pool.ref_count[q]])
    assert p in pool.allocate(1, 2)  # and back: the large model reads zeros in all of its part
    assert not torch.isnan(pool.view(1)[p]).any() and (page[:large] == 0).all()


def test_disabled_prefix_caching_never_hits():
    pool = KVPool([SMALL], memory_bytes=4 * SMALL.page_bytes(4), block_size=4, enable_prefix_caching=False)
    pages = pool.allocate(0, 2)
    _commit(pool, pages, list(range(8)))
    assert pool.match_prefix(0, list(range(9))) == ([], [])
    pool.release(pages)
    assert pool.num_cached_free == 0


def test_counters_stay_consistent_under_random_allocation_sharing_and_release():
    import random

    rng = random.Random(0)
    pool = KVPool([SMALL], memory_bytes=16 * SMALL.page_bytes(4), block_size=4)
    held: list[list[int]] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.4 and pool.num_free >= 3:
            tokens = [rng.randrange(3) for _ in range(12)]  # few distinct prefixes: hits and duplicates
            hit, _ = pool.match_prefix(0, tokens + [0])
            pool.acquire(hit)
            pages = hit + pool.allocate(0, 3 - len(hit))
            _commit(pool, pages, tokens)
            held.append(pages)
        elif held:
            pool.release(held.pop(rng.randrange(len(held))))
        brute_cached = sum(1 for p in pool._free if pool.page_hash[p] is not None)
        assert pool.num_cached_free == brute_cached
        assert pool.num_used == sum(1 for c in pool.ref_count if c > 0)
        assert all(pool.ref_count[p] == 0 for p in pool._free)
    for pages in held:
        pool.release(pages)
    assert pool.num_used == 0
