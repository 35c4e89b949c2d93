"""The router's one native helper: a hashed char n-gram block of one text (scikit-learn's HashingVectorizer
with analyzer="char", alternate_sign=True, norm="l2" for one document) in C, so a routing decision stays far
under a millisecond. Built from the source below with the system C compiler at first use (one `cc -O2` call,
well under a second), cached under `~/.cache/tandem/router_native` (or `$TANDEM_ROUTER_NATIVE_DIR`) by a hash
of the source, the flags and the compiler, and called through ctypes. Where it cannot be built (no compiler,
or `TANDEM_ROUTER_NATIVE=0`), `router_model.features` hashes with its numpy reference; tests/router_model
check the two and scikit-learn's vectorizer agree bit for bit.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kernels.cbuild import NoCompiler, build_library

# The n-grams of a text are its windows of lo..hi characters (UTF-8: a character is its lead byte and its
# continuation bytes); each is hashed by murmurhash3_x86_32 with seed 0 (sklearn.utils.murmurhash3_32), taken
# as |h| % buckets with the sign of h, summed per bucket; buckets whose signs cancel are dropped and the rest
# divided by their l2 norm. The signs are summed in a per-thread count array and the buckets read back in order
# from a bitmap of those touched (past MAX_SCRATCH_BUCKETS, the (bucket, sign) pairs are radix-sorted instead),
# so the indices come out ascending, as in the vectorizer's CSR row. The sums are small integers and their
# squares exact, so the norm and the values are bit for bit scikit-learn's.
_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

static int32_t murmur3_32(const uint8_t *p, int64_t len) {
    const uint32_t c1 = 0xcc9e2d51u, c2 = 0x1b873593u;
    uint32_t h = 0, k;
    int64_t nblocks = len / 4;
    for (int64_t i = 0; i < nblocks; i++) {
        memcpy(&k, p + 4 * i, 4);
        k *= c1; k = rotl32(k, 15); k *= c2;
        h ^= k; h = rotl32(h, 13); h = h * 5 + 0xe6546b64u;
    }
    const uint8_t *tail = p + 4 * nblocks;
    k = 0;
    switch (len & 3) {
    case 3: k ^= (uint32_t)tail[2] << 16; /* fall through */
    case 2: k ^= (uint32_t)tail[1] << 8;  /* fall through */
    case 1: k ^= tail[0]; k *= c1; k = rotl32(k, 15); k *= c2; h ^= k;
    }
    h ^= (uint32_t)len;
    h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
    return (int32_t)h;
}

static inline uint64_t key_of(int32_t h, uint64_t mask, uint64_t buckets) {
    uint64_t a = h < 0 ? (uint64_t)(-(int64_t)h) : (uint64_t)h;
    return ((mask ? a & mask : a % buckets) << 1) | (uint64_t)(h < 0);
}

/* Sums the signs per bucket with a caller's all-zero scratch (counts [buckets], seen: a bitmap of buckets) and
   reads the buckets back in ascending order from the bitmap, leaving the scratch all-zero again. */
static int64_t sum_with_bitmap(const uint64_t *keys, int64_t total, int64_t buckets, int64_t offset,
                               int32_t *counts, uint64_t *seen, int64_t *out_idx, double *out_val, double *sq) {
    for (int64_t i = 0; i < total; i++) {
        uint64_t b = keys[i] >> 1;
        counts[b] += 1 - 2 * (int32_t)(keys[i] & 1);
        seen[b >> 6] |= (uint64_t)1 << (b & 63);
    }
    int64_t m = 0, words = (buckets + 63) / 64;
    for (int64_t w = 0; w < words; w++) {
        uint64_t word = seen[w];
        if (!word) continue;
        seen[w] = 0;
        for (; word; word &= word - 1) {
            int64_t b = w * 64 + __builtin_ctzll(word);
            int32_t v = counts[b];
            counts[b] = 0;
            if (v != 0) {
                out_idx[m] = offset + b;
                out_val[m] = (double)v;
                *sq += (double)v * (double)v;
                m++;
            }
        }
    }
    return m;
}

/* The same without scratch (bucket counts too large for it): an LSD radix sort of the keys, then runs summed.
   keys holds 2 * total entries, the second half free. */
static int64_t sum_with_sort(uint64_t *keys, int64_t total, int64_t buckets, int64_t offset,
                             int64_t *out_idx, double *out_val, double *sq) {
    int bits = 1;
    while (bits < 64 && ((uint64_t)1 << bits) <= (uint64_t)(buckets - 1) << 1) bits++;
    int passes = (bits + 10) / 11, width = (bits + passes - 1) / passes;  /* digits of at most 11 bits */
    uint64_t *src = keys, *dst = keys + total, digit = ((uint64_t)1 << width) - 1;
    uint32_t count[2048];
    for (int shift = 0; shift < bits; shift += width) {
        memset(count, 0, (digit + 1) * sizeof(uint32_t));
        for (int64_t i = 0; i < total; i++) count[(src[i] >> shift) & digit]++;
        uint32_t sum = 0;
        for (uint64_t d = 0; d <= digit; d++) { uint32_t c = count[d]; count[d] = sum; sum += c; }
        for (int64_t i = 0; i < total; i++) dst[count[(src[i] >> shift) & digit]++] = src[i];
        uint64_t *tmp = src; src = dst; dst = tmp;
    }
    int64_t m = 0;
    for (int64_t i = 0; i < total;) {
        uint64_t bucket = src[i] >> 1;
        int64_t v = 0;
        for (; i < total && (src[i] >> 1) == bucket; i++) v += 1 - 2 * (int64_t)(src[i] & 1);
        if (v != 0) {
            out_idx[m] = offset + (int64_t)bucket;
            out_val[m] = (double)v;
            *sq += (double)v * (double)v;
            m++;
        }
    }
    return m;
}

/* text: UTF-8, nbytes long, nchars characters (== nbytes for ASCII). out_idx / out_val hold at least as many
   entries as the text has n-grams; the indices written are offset + bucket. counts / seen: all-zero scratch of
   buckets int32 and ceil(buckets / 64) uint64 (left all-zero), or NULL. Returns how many entries were written
   (the nonzero buckets), -1 if out of memory. */
int64_t tr_hash_block(const uint8_t *text, int64_t nbytes, int64_t nchars, int lo, int hi, int64_t buckets,
                      int64_t offset, int64_t *out_idx, double *out_val, int32_t *counts, uint64_t *seen) {
    int64_t total = 0;
    for (int n = lo; n <= hi && n <= nchars; n++) total += nchars - n + 1;
    if (total == 0) return 0;
    uint64_t *keys = malloc((counts ? 1 : 2) * total * sizeof(uint64_t));
    if (!keys) return -1;
    /* key = bucket << 1 | (h < 0). A power-of-two bucket count takes a mask, not a 64-bit division. */
    uint64_t mask = (buckets & (buckets - 1)) == 0 ? (uint64_t)buckets - 1 : 0;
    int64_t t = 0;
    if (nbytes == nchars) {  /* ASCII: a character is a byte */
        for (int n = lo; n <= hi && n <= nchars; n++)
            for (int64_t i = 0; i + n <= nchars; i++) keys[t++] = key_of(murmur3_32(text + i, n), mask, buckets);
    } else {
        int64_t *starts = malloc((nchars + 1) * sizeof(int64_t));
        if (!starts) { free(keys); return -1; }
        int64_t c = 0;
        for (int64_t b = 0; b < nbytes; b++)
            if ((text[b] & 0xC0) != 0x80) starts[c++] = b;
        starts[nchars] = nbytes;
        for (int n = lo; n <= hi && n <= nchars; n++)
            for (int64_t i = 0; i + n <= nchars; i++)
                keys[t++] = key_of(murmur3_32(text + starts[i], starts[i + n] - starts[i]), mask, buckets);
        free(starts);
    }
    double sq = 0.0;
    int64_t m = counts ? sum_with_bitmap(keys, total, buckets, offset, counts, seen, out_idx, out_val, &sq)
                       : sum_with_sort(keys, total, buckets, offset, out_idx, out_val, &sq);
    free(keys);
    double norm = sqrt(sq);
    if (norm > 0)
        for (int64_t i = 0; i < m; i++) out_val[i] /= norm;
    return m;
}
"""
_FLAGS = ["-O2", "-shared", "-fPIC"]
_lock = threading.Lock()
_local = threading.local()  # each thread's bucket-count scratch (the helper leaves it all-zero)
# the largest block summed in scratch (4 MiB of counts a thread); larger ones are sorted
MAX_SCRATCH_BUCKETS = 1 << 20
_fn = None
_tried = False
build_error: str | None = None  # why the helper is unavailable, once `hash_block_fn()` has tried


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_ROUTER_NATIVE_DIR") or Path.home() / ".cache" / "tandem" / "router_native")


def _build() -> ctypes.CDLL | None:
    global build_error
    if os.environ.get("TANDEM_ROUTER_NATIVE", "1") == "0":
        build_error = "disabled by TANDEM_ROUTER_NATIVE=0"
        return None
    try:
        so = build_library(_SOURCE, "tandem_router_native", _FLAGS, cache_dir())
    except NoCompiler as exc:
        build_error = str(exc)
        return None
    return ctypes.CDLL(str(so))


def hash_block_fn():
    """The C function `tr_hash_block`, or None (the reason in `build_error`). Builds once per process."""
    global _fn, _tried, build_error
    if _tried:
        return _fn
    with _lock:
        if not _tried:
            try:
                lib = _build()
                if lib is not None:
                    fn = lib.tr_hash_block
                    fn.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p]
                    fn.restype = ctypes.c_int64
                    _fn = fn
            except Exception as exc:  # a failed build or an unloadable library: the numpy reference serves
                build_error = f"{type(exc).__name__}: {exc}"
                _fn = None
            _tried = True
    return _fn


def _scratch(buckets: int) -> tuple[int, int]:
    """This thread's all-zero scratch for up to `buckets` (addresses of int32 counts and the uint64 bitmap)."""
    held = getattr(_local, "scratch", None)
    if held is None or held[0].size < buckets:
        counts, seen = np.zeros(buckets, np.int32), np.zeros((buckets + 63) // 64, np.uint64)
        held = _local.scratch = (counts, seen, counts.ctypes.data, seen.ctypes.data)
    return held[2], held[3]


def hash_blocks(texts: Sequence[tuple[bytes, int]], blocks: Sequence[tuple[int, int, int, int]]
                ) -> tuple[np.ndarray, np.ndarray]:
    """The blocks of one feature vector, concatenated: for each UTF-8 text (data, characters), whose white
    space the caller has collapsed as the char analyzer does, and its block (lo, hi, buckets, offset), the
    ascending indices offset + bucket and the l2-normalised signed counts. Needs `hash_block_fn()`."""
    cap = sum(chars * (hi - lo + 1) for (_, chars), (lo, hi, _, _) in zip(texts, blocks))  # >= the n-grams
    idx = np.empty(cap, np.int64)
    val = np.empty(cap, np.float64)
    pi, pv = idx.ctypes.data, val.ctypes.data
    counts, seen = _scratch(min(max(b for _, _, b, _ in blocks), MAX_SCRATCH_BUCKETS)) if blocks else (0, 0)
    m = 0
    for (data, chars), (lo, hi, buckets, offset) in zip(texts, blocks):
        scratch = (counts, seen) if buckets <= MAX_SCRATCH_BUCKETS else (0, 0)
        k = _fn(data, len(data), chars, lo, hi, buckets, offset, pi + 8 * m, pv + 8 * m, *scratch)
        if k < 0:
            raise MemoryError("router n-gram hashing: out of memory")
        m += k
    return idx[:m], val[:m]
