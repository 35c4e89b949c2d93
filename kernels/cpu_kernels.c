/* tandem's CPU kernels (plain C, built by kernels/cpu_kernels.py with the system C compiler at first use and
 * called through ctypes). Each has a PyTorch reference in kernels/cpu_kernels.py that the tests compare it to.
 *
 *   tk_linear_f32    y[M, N] = x[M, K] @ wt[K, N] (+ bias): the decode GEMV / skinny GEMM over a column-major
 *                    nn.Linear weight (engines.model.cpu_weight_layout stores weight.t() contiguous);
 *                    tk_linear_f32_panels over the same weight packed in panels of 32 columns (what the C
 *                    decoder stack's projections are stored as: one address-order stream a panel, which memory
 *                    serves faster than [K, N]'s four interleaved rows), tk_linear_f32_w16 / its w16 over a bf16
 *                    copy of a bf16-exact weight packed the same way; all the same bits
 *   tk_linear_i8     y[M, N] = (x[M, K] @ q[N, K]^T) * scale[N] (+ bias): weight-only int8, fp32 activations
 *   tk_linear_w8a8   the same weights with the activations quantised per 32 (int8 dots, q8_0's numerics;
 *                    AMX int8 tiles at 3+ rows where the CPU has them)
 *   tk_linear_i8g, tk_linear_w8a8g  the same with a scale per 32 weights (GGUF Q8_0's blocks), scale float16
 *                    [N, K / 32] as the file stores it
 *   tk_linear_w4a8   int4 weights (per-group scale and zero point) with the activations quantised the same way
 *   tk_paged_attention_f32  attention of T queries over float32 KV pages read in place (no gather): each
 *                    sequence's queries are the last q_len of its context_len positions, causal
 *
 * Threads: `nthreads` > 1 splits the output columns (linear) or the (sequence, KV head) pairs (attention) with
 * OpenMP; 1 runs on the calling thread with no OpenMP region at all.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TK_AVX2 1
#else
#define TK_AVX2 0
#endif
/* AVX-512 (foundation + byte/word + VL) where -march=native has it: 16-wide float32 streams and register-blocked
 * 5-8 row linears, giving the AVX2 build's bits (same summation order); with VNNI, the w8a8 tiles take two
 * blocks per vpdpbusd (the same integer dots, summed in another order). The AVX2 paths stay for the rest */
#if TK_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TK_AVX512 1
#else
#define TK_AVX512 0
#endif
#if TK_AVX512 && defined(__AVX512VNNI__)
#define TK_VNNI 1
#else
#define TK_VNNI 0
#endif

/* AMX int8 tiles (Sapphire Rapids and later) where -march=native has them and Linux grants the tile state: w8a8
 * at three rows and more */
#if TK_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define TK_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define TK_AMX 0
#endif

int tk_has_avx2(void) { return TK_AVX2; }
/* which SIMD paths this build took: 1 AVX2, 2 AVX-512, 3 AVX-512 with VNNI (0: portable C) */
int tk_simd_level(void) { return TK_VNNI ? 3 : TK_AVX512 ? 2 : TK_AVX2; }

/* CALL(a, b) over output columns [0, N): on the calling thread when one thread or N < 128 (no OpenMP region
 * at all), else split in chunks of a multiple of ALIGN columns, SPLIT chunks a thread, which the threads take
 * in turn as they finish one: a thread the OS preempts mid-call (the server's event loop wanting a core of
 * two) then holds up one chunk, not its whole share. The quantised and bf16 linears take split_per_thread
 * chunks a thread (their columns are independent row streams or 64-column tiles; on a 2-core Zen 4 VM serving
 * one stream at two threads, 4 chunks a thread against 1: bf16 TPOT 7.2-7.9 -> 6.3-6.9 ms on ~80M, w8a8
 * 4.8-7.9 -> 3.9-4.7 ms); the float32 panels one (a chunk boundary restarts their prefetch streams). Every
 * column is computed by the same code wherever the chunks fall: the same bits at any split. */
static int64_t split_per_thread = 4; /* tk_split_per_thread */
#define TK_OVER_COLUMNS_SPLIT(N, nthreads, ALIGN, SPLIT, CALL)                                                \
    do {                                                                                                       \
        if ((nthreads) <= 1 || (N) < 128) {                                                                    \
            CALL(0, (N));                                                                                      \
        } else {                                                                                               \
            const int64_t parts_ = (int64_t)(nthreads) * ((SPLIT) > 0 ? (SPLIT) : 1);                          \
            const int64_t chunk_ = (((N) + parts_ - 1) / parts_ + (ALIGN) - 1) / (ALIGN) * (ALIGN);            \
            const int64_t nchunks_ = ((N) + chunk_ - 1) / chunk_;                                              \
            _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 1)")                            \
            for (int64_t t_ = 0; t_ < nchunks_; t_++) {                                                        \
                const int64_t a_ = t_ * chunk_, b_ = a_ + chunk_ < (N) ? a_ + chunk_ : (N);                     \
                if (a_ < b_) CALL(a_, b_);                                                                     \
            }                                                                                                  \
        }                                                                                                      \
    } while (0)
#define TK_OVER_COLUMNS(N, nthreads, ALIGN, CALL) TK_OVER_COLUMNS_SPLIT(N, nthreads, ALIGN, split_per_thread, CALL)

/* grow a per-thread scratch buffer to `need` bytes (kept between calls: no page faults per call; its contents
 * are not kept when it grows), 64-byte aligned: the kernels' 512-bit loads of quantised activations would
 * otherwise each cross a cache line; 0 on success */
static int grow_scratch(void **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    void *p = 0;
    if (posix_memalign(&p, 64, need)) return 1;
    free(*buf);
    *buf = p;
    *cap = need;
    return 0;
}

/* ---- float32 linear over wt [K, N] (row stride ldw) ------------------------------------------------------ */

/* An external SGEMM (the Fortran-ABI `SGEMM` of the MKL that torch ships, its address given by
 * tk_set_sgemm): the many-row case, from sgemm_min_rows rows. Whether MKL's packed GEMM beats the register
 * tiles depends on the CPU (it takes its fast paths on some only): kernels/cpu_kernels.py's `calibrate` sets the
 * threshold by timing both. NULL: ours. */
typedef void (*tk_sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                            const float *, const int *, const float *, const int *, const float *, float *,
                            const int *);
static tk_sgemm_fn tk_sgemm = 0;
void tk_set_sgemm(void *fn) { tk_sgemm = (tk_sgemm_fn)fn; }

/* over wt [K, N], up to this many rows stream the weight (each byte read once, four rows of k at a time; the
 * rows' outputs stay in L1); more rows in blocks of STREAM_ROWS, or the external SGEMM from sgemm_min_rows rows
 * (SGEMM_MIN_ROWS until calibrated; the int8 weight-only path keeps SGEMM_MIN_ROWS) */
#define STREAM_ROWS 8
#define SGEMM_MIN_ROWS 13
static int64_t sgemm_min_rows = SGEMM_MIN_ROWS; /* tk_sgemm_min_rows */
/* the AVX-512 register blocks take weights up to BLOCK_MAX_KN floats (see below) */
#ifndef BLOCK_MAX_KN /* bench/cpu_dram.py builds with -DBLOCK_MAX_KN=0 (streams only) and larger, to compare */
#define BLOCK_MAX_KN (1 << 20)
#endif
/* the bound in force (tk_block_max_kn): where memory serves strided reads well, the blocks beat the streams on
 * weights from memory too, and kernels/cpu_kernels.py's `calibrate` lifts it */
static int64_t block_max_kn = BLOCK_MAX_KN;
/* the AVX-512 register blocks (below) take 5-8 rows (BLOCK_MIN_ROWS), over K up to BLOCK_MAX_K */
#define BLOCK_MIN_ROWS 5
#define BLOCK_MAX_K 1024
/* Above those bounds (a weight from memory) the blocks are `calibrate`'s choice (kernels/cpu_kernels.py), per
 * machine: it lifts tk_block_max_kn and tk_block_max_k where the blocks win at 8 rows, and lowers
 * tk_block_min_rows (the rows from which they take such a weight) where they also win at 3 or 4. On a 2-core
 * Zen 4 VM, over the widened tiny-l's weights (K 1280 and 3520, 463 MB): 5 rows 28.1 -> 20.4 ms a pass, 8 rows
 * 30.8 -> 20.2, 3-4 rows 26-28 -> 21.5 (one row 20.7: the blocks are slower there, a one-row block is a
 * latency-bound chain) */
static int64_t block_max_k = BLOCK_MAX_K;       /* tk_block_max_k */
static int64_t block_min_rows = BLOCK_MIN_ROWS; /* tk_block_min_rows: for weights above the built-in bounds */
/* the streaming GEMV prefetches the weight rows this far ahead of the four it reads (four interleaved rows
 * defeat the hardware prefetcher: a 5-row pass over tiny-l's weights from memory 2.75 -> 2.05 ms, one row
 * 2.12 -> 1.93 ms; 8 and 16 rows ahead measured no better, on an AVX2 EPYC VM). Per machine `calibrate` may
 * change it (tk_stream_pf; 0: no prefetch instructions): on a Zen 4 VM with the weights on huge pages, a one-row
 * pass over the widened tiny-l's weights took 21.7 ms at 4 rows ahead, 19.3 at 2, 20.3 at none; over a ~200M
 * Llama's 35.7 / 34.0 / 32.4 ms */
#ifndef STREAM_PF
#define STREAM_PF 4
#endif
static int64_t stream_pf = STREAM_PF;

/* The float32 linears also read their weight as bfloat16 (uint16_t bits, packed in panels: see "the bf16 copy
 * in panels" below) where the caller has a bf16 copy: a checkpoint stored in bf16 and upcast at load holds only
 * bf16-exact values, and widening one back (its bits shifted up 16) gives the float32 exactly, so the same
 * FMAs in the same order give the same bits while reading half the bytes. The streams are defined over the
 * weight's type WT, its loads (AT: one value; LD*: a vector) and SUF, the name's suffix. */
static inline float bf16_to_f32(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } v = {(uint32_t)h << 16};
    return v.f;
}
/* float16 bits to float32, exactly (F16C where the build has it; the GGUF Q8_0 block scales, int4 scales) */
static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
    union {
        uint32_t u;
        float f;
    } v;
    if (e == 31) v.u = sign | 0x7F800000u | (m << 13);      /* inf, nan */
    else if (e) v.u = sign | ((e + 112) << 23) | (m << 13); /* normal */
    else {                                                  /* zero, subnormal: m * 2^-24 */
        v.f = (float)m * 5.9604644775390625e-8f;
        v.u |= sign;
    }
    return v.f;
#endif
}

#define AT_F32(p) (*(p))
#define AT_BF16(p) bf16_to_f32(*(p))

/* the streams' scalar pieces, shared by the 8- and 16-wide builds so that both give the same bits: columns
 * [n0, n1) of one step of four k (w0: its first weight row; x at that k), and the last values of k, k0..K-1 */
#define TK_DEF_STREAM_SCALAR(SUF, WT, AT)                                                                      \
    static inline void stream_cols4##SUF(const float *x, int64_t ldx, int MR, const WT *w0, int64_t ldw,      \
                                         float *y, int64_t ldy, int64_t n0, int64_t n1) {                     \
        const WT *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;                                              \
        for (int64_t n = n0; n < n1; n++)                                                                      \
            for (int r = 0; r < MR; r++) {                                                                     \
                const float *xr = x + r * ldx;                                                                 \
                y[r * ldy + n] += xr[0] * AT(w0 + n) + xr[1] * AT(w1 + n) + xr[2] * AT(w2 + n) +               \
                                  xr[3] * AT(w3 + n);                                                          \
            }                                                                                                  \
    }                                                                                                          \
    static inline void stream_k_rest##SUF(const float *x, int64_t ldx, int MR, int64_t k0, int64_t K,         \
                                          const WT *w, int64_t ldw, float *y, int64_t ldy, int64_t n0,        \
                                          int64_t n1) {                                                        \
        for (int64_t k = k0; k < K; k++) {                                                                     \
            const WT *wk = w + k * ldw;                                                                        \
            for (int r = 0; r < MR; r++) {                                                                     \
                float xv = x[r * ldx + k];                                                                     \
                for (int64_t n = n0; n < n1; n++) y[r * ldy + n] += xv * AT(wk + n);                           \
            }                                                                                                  \
        }                                                                                                      \
    }
TK_DEF_STREAM_SCALAR(, float, AT_F32)

/* the kernels' shape: x [rows, K] (row stride ldx), the weight (float32 [K, N], row stride ldw), y's columns
 * [n0, n1) (row stride ldy) */
typedef void (*stream_fn)(const float *, int64_t, int64_t, const void *, int64_t, float *, int64_t, int64_t,
                          int64_t);

#if TK_AVX2
#define LD256_F32(p) _mm256_loadu_ps(p)
/* y[MR rows, n0:n1] (+)= x[MR, K] @ w[K, n0:n1]: four weight rows per pass over y; a prefetch per cache line
 * (PFCOLS weights) of each */
#define TK_DEF_STREAM(MR, SUF, WT, LD, PFCOLS)                                                                 \
    static void stream_##MR##SUF(const float *x, int64_t ldx, int64_t K, const void *wv, int64_t ldw,         \
                                 float *y, int64_t ldy, int64_t n0, int64_t n1) {                             \
        const WT *w = (const WT *)wv;                                                                          \
        for (int r = 0; r < MR; r++) memset(y + r * ldy + n0, 0, sizeof(float) * (size_t)(n1 - n0));         \
        int64_t k = 0;                                                                                         \
        for (; k + 4 <= K; k += 4) {                                                                           \
            const WT *w0 = w + k * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;                      \
            __m256 xb[MR][4];                                                                                  \
            for (int r = 0; r < MR; r++)                                                                       \
                for (int j = 0; j < 4; j++) xb[r][j] = _mm256_broadcast_ss(x + r * ldx + k + j);              \
            int64_t n = n0;                                                                                    \
            const WT *pf = w0 + stream_pf * ldw; /* rows further down, as in the int8 GEMVs */               \
            for (; n + 8 <= n1; n += 8) {                                                                      \
                if (stream_pf && !((n - n0) & (PFCOLS - 1))) {                                                 \
                    _mm_prefetch((const char *)(pf + n), _MM_HINT_T0);                                         \
                    _mm_prefetch((const char *)(pf + ldw + n), _MM_HINT_T0);                                   \
                    _mm_prefetch((const char *)(pf + 2 * ldw + n), _MM_HINT_T0);                               \
                    _mm_prefetch((const char *)(pf + 3 * ldw + n), _MM_HINT_T0);                               \
                }                                                                                              \
                __m256 a = LD(w0 + n), b = LD(w1 + n);                                                         \
                __m256 c = LD(w2 + n), d = LD(w3 + n);                                                         \
                for (int r = 0; r < MR; r++) {                                                                 \
                    float *yr = y + r * ldy + n;                                                               \
                    __m256 acc = _mm256_loadu_ps(yr);                                                          \
                    acc = _mm256_fmadd_ps(xb[r][0], a, acc);                                                   \
                    acc = _mm256_fmadd_ps(xb[r][1], b, acc);                                                   \
                    acc = _mm256_fmadd_ps(xb[r][2], c, acc);                                                   \
                    acc = _mm256_fmadd_ps(xb[r][3], d, acc);                                                   \
                    _mm256_storeu_ps(yr, acc);                                                                 \
                }                                                                                              \
            }                                                                                                  \
            stream_cols4##SUF(x + k, ldx, MR, w0, ldw, y, ldy, n, n1);                                         \
        }                                                                                                      \
        stream_k_rest##SUF(x, ldx, MR, k, K, w, ldw, y, ldy, n0, n1);                                          \
    }
#define TK_DEF_STREAMS(SUF, WT, LD, PFCOLS)                                                                    \
    TK_DEF_STREAM(1, SUF, WT, LD, PFCOLS)                                                                      \
    TK_DEF_STREAM(2, SUF, WT, LD, PFCOLS)                                                                      \
    TK_DEF_STREAM(3, SUF, WT, LD, PFCOLS)                                                                      \
    TK_DEF_STREAM(4, SUF, WT, LD, PFCOLS)                                                                      \
    TK_DEF_STREAM(5, SUF, WT, LD, PFCOLS)                                                                      \
    TK_DEF_STREAM(6, SUF, WT, LD, PFCOLS)                                                                      \
    TK_DEF_STREAM(7, SUF, WT, LD, PFCOLS)                                                                      \
    TK_DEF_STREAM(8, SUF, WT, LD, PFCOLS)
TK_DEF_STREAMS(, float, LD256_F32, 16)
static const stream_fn STREAM[9] = {0, stream_1, stream_2, stream_3, stream_4, stream_5, stream_6, stream_7,
                                    stream_8};
#endif

#if TK_AVX512
#define LD512_F32(p) _mm512_loadu_ps(p)
#define LD512M_F32(m, p) _mm512_maskz_loadu_ps(m, p)
/* the same streams 16 columns wide (one cache line of each of the four float32 weight rows per step; 8 of the
 * last columns masked): each output column sums its products in the same order as the
 * 8-wide ones */
#define TK_DEF_STREAM512(MR, SUF, WT, LD, LDM, PFCOLS)                                                         \
    static void stream512_##MR##SUF(const float *x, int64_t ldx, int64_t K, const void *wv, int64_t ldw,      \
                                    float *y, int64_t ldy, int64_t n0, int64_t n1) {                          \
        const WT *w = (const WT *)wv;                                                                          \
        for (int r = 0; r < MR; r++) memset(y + r * ldy + n0, 0, sizeof(float) * (size_t)(n1 - n0));         \
        const int64_t nfull = n0 + (n1 - n0) / 16 * 16;                                                        \
        /* a masked step for 8 of the last columns, the last < 8 as the AVX2 build's scalar tail computes them */\
        const __mmask16 tail = (n1 - n0) & 8 ? (__mmask16)0xff : (__mmask16)0;                                \
        const int64_t nvec = nfull + ((n1 - n0) & 8);                                                          \
        int64_t k = 0;                                                                                         \
        for (; k + 4 <= K; k += 4) {                                                                           \
            const WT *w0 = w + k * ldw, *w1 = w0 + ldw, *w2 = w1 + ldw, *w3 = w2 + ldw;                      \
            __m512 xb[MR][4];                                                                                  \
            for (int r = 0; r < MR; r++)                                                                       \
                for (int j = 0; j < 4; j++) xb[r][j] = _mm512_set1_ps(x[r * ldx + k + j]);                    \
            const WT *pf = w0 + stream_pf * ldw;                                                               \
            int64_t n = n0;                                                                                    \
            for (; n < nfull; n += 16) {                                                                       \
                if (stream_pf && (PFCOLS == 16 || !((n - n0) & 31))) { /* a line per step at 16 columns */ \
                    _mm_prefetch((const char *)(pf + n), _MM_HINT_T0);                                         \
                    _mm_prefetch((const char *)(pf + ldw + n), _MM_HINT_T0);                                   \
                    _mm_prefetch((const char *)(pf + 2 * ldw + n), _MM_HINT_T0);                               \
                    _mm_prefetch((const char *)(pf + 3 * ldw + n), _MM_HINT_T0);                               \
                }                                                                                              \
                __m512 a = LD(w0 + n), b = LD(w1 + n);                                                         \
                __m512 c = LD(w2 + n), d = LD(w3 + n);                                                         \
                for (int r = 0; r < MR; r++) {                                                                 \
                    float *yr = y + r * ldy + n;                                                               \
                    __m512 acc = _mm512_loadu_ps(yr);                                                          \
                    acc = _mm512_fmadd_ps(xb[r][0], a, acc);                                                   \
                    acc = _mm512_fmadd_ps(xb[r][1], b, acc);                                                   \
                    acc = _mm512_fmadd_ps(xb[r][2], c, acc);                                                   \
                    acc = _mm512_fmadd_ps(xb[r][3], d, acc);                                                   \
                    _mm512_storeu_ps(yr, acc);                                                                 \
                }                                                                                              \
            }                                                                                                  \
            if (tail) {                                                                                        \
                __m512 a = LDM(tail, w0 + n), b = LDM(tail, w1 + n);                                           \
                __m512 c = LDM(tail, w2 + n), d = LDM(tail, w3 + n);                                           \
                for (int r = 0; r < MR; r++) {                                                                 \
                    float *yr = y + r * ldy + n;                                                               \
                    __m512 acc = _mm512_maskz_loadu_ps(tail, yr);                                              \
                    acc = _mm512_fmadd_ps(xb[r][0], a, acc);                                                   \
                    acc = _mm512_fmadd_ps(xb[r][1], b, acc);                                                   \
                    acc = _mm512_fmadd_ps(xb[r][2], c, acc);                                                   \
                    acc = _mm512_fmadd_ps(xb[r][3], d, acc);                                                   \
                    _mm512_mask_storeu_ps(yr, tail, acc);                                                      \
                }                                                                                              \
            }                                                                                                  \
            stream_cols4##SUF(x + k, ldx, MR, w0, ldw, y, ldy, nvec, n1);                                      \
        }                                                                                                      \
        stream_k_rest##SUF(x, ldx, MR, k, K, w, ldw, y, ldy, n0, n1);                                          \
    }

/* 2-8 rows: 32 columns at a time summed over all of K in registers (2 MR accumulators), so no output
 * traffic per step of k; the weight read as a 32-value column, prefetched BLOCK_PF rows of k ahead, and the
 * next 32 columns' bytes of each row into L2 as it goes (so memory serves two columns' bytes per row, not
 * one). The same FMA chain per output column as the streams (k in order from 0): the same bits */
#define BLOCK_PF 8
/* where the blocks beat the streams (bench/gemv_cpu.py on a 2-core AVX-512 VM, docs/benchmarks.md): from 5 rows
 * (a verify window of 4 drafts), over K up to 1024 (a longer column, the 80M model's down projection, streams),
 * on weights up to BLOCK_MAX_KN floats (4 MiB, a core's L2 on that VM): a larger one comes from memory, where
 * the streams' address-order reads won on that VM; above those bounds `calibrate` chooses per machine (see
 * block_min_rows above) */
#ifndef BLOCK_NEXT_PF /* the next 32 columns into L2 (bench/cpu_dram.py also builds without) */
#define BLOCK_NEXT_PF 1
#endif
#define TK_DEF_BLOCK512(MR, SUF, WT, LD)                                                                       \
    static void block512_##MR##SUF(const float *x, int64_t ldx, int64_t K, const void *wv, int64_t ldw,       \
                                   float *y, int64_t ldy, int64_t n0, int64_t n1) {                           \
        const WT *w = (const WT *)wv;                                                                          \
        int64_t n = n0;                                                                                        \
        for (; n + 32 <= n1; n += 32) {                                                                        \
            __m512 acc[MR][2];                                                                                 \
            for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                        \
            const WT *wk = w + n;                                                                              \
            for (int64_t k = 0; k < K; k++, wk += ldw) {                                                       \
                if (k + BLOCK_PF < K) {                                                                        \
                    _mm_prefetch((const char *)(wk + BLOCK_PF * ldw), _MM_HINT_T0);                            \
                    _mm_prefetch((const char *)(wk + BLOCK_PF * ldw + 16), _MM_HINT_T0);                       \
                }                                                                                              \
                if (BLOCK_NEXT_PF && n + 64 <= n1) {                                                           \
                    _mm_prefetch((const char *)(wk + 32), _MM_HINT_T1);                                        \
                    _mm_prefetch((const char *)(wk + 48), _MM_HINT_T1);                                        \
                }                                                                                              \
                __m512 a = LD(wk), b = LD(wk + 16);                                                            \
                for (int r = 0; r < MR; r++) {                                                                 \
                    __m512 xb = _mm512_set1_ps(x[r * ldx + k]);                                                \
                    acc[r][0] = _mm512_fmadd_ps(xb, a, acc[r][0]);                                             \
                    acc[r][1] = _mm512_fmadd_ps(xb, b, acc[r][1]);                                             \
                }                                                                                              \
            }                                                                                                  \
            for (int r = 0; r < MR; r++) {                                                                     \
                _mm512_storeu_ps(y + r * ldy + n, acc[r][0]);                                                  \
                _mm512_storeu_ps(y + r * ldy + n + 16, acc[r][1]);                                             \
            }                                                                                                  \
        }                                                                                                      \
        if (n < n1) stream512_##MR##SUF(x, ldx, K, w, ldw, y, ldy, n, n1);                                     \
    }
#define TK_DEF_TILES512(SUF, WT, LD, LDM, PFCOLS)                                                              \
    TK_DEF_STREAM512(1, SUF, WT, LD, LDM, PFCOLS)                                                              \
    TK_DEF_STREAM512(2, SUF, WT, LD, LDM, PFCOLS)                                                              \
    TK_DEF_STREAM512(3, SUF, WT, LD, LDM, PFCOLS)                                                              \
    TK_DEF_STREAM512(4, SUF, WT, LD, LDM, PFCOLS)                                                              \
    TK_DEF_STREAM512(5, SUF, WT, LD, LDM, PFCOLS)                                                              \
    TK_DEF_STREAM512(6, SUF, WT, LD, LDM, PFCOLS)                                                              \
    TK_DEF_STREAM512(7, SUF, WT, LD, LDM, PFCOLS)                                                              \
    TK_DEF_STREAM512(8, SUF, WT, LD, LDM, PFCOLS)                                                              \
    TK_DEF_BLOCK512(2, SUF, WT, LD)                                                                            \
    TK_DEF_BLOCK512(3, SUF, WT, LD)                                                                            \
    TK_DEF_BLOCK512(4, SUF, WT, LD)                                                                            \
    TK_DEF_BLOCK512(5, SUF, WT, LD)                                                                            \
    TK_DEF_BLOCK512(6, SUF, WT, LD)                                                                            \
    TK_DEF_BLOCK512(7, SUF, WT, LD)                                                                            \
    TK_DEF_BLOCK512(8, SUF, WT, LD)
TK_DEF_TILES512(, float, LD512_F32, LD512M_F32, 16)
static const stream_fn STREAM512[9] = {0, stream512_1, stream512_2, stream512_3, stream512_4, stream512_5,
                                       stream512_6, stream512_7, stream512_8};
static const stream_fn BLOCK512[9] = {0, stream512_1, block512_2, block512_3, block512_4, block512_5,
                                      block512_6, block512_7, block512_8};
#endif

/* ---- the weight in panels ------------------------------------------------------------------------------------
 * The float32 weight (kernels/cpu_kernels.py `pack_f32`) and the bf16 copy (`bf16_copy`) are packed for the
 * register tiles, not kept in the [K, N] layout: panels of 32 output columns, each panel its K rows of 32 values
 * back to back, so a pass reads every panel in address order (one stream a panel, which memory serves faster than
 * four interleaved rows of [K, N]) and sums all of K in registers with no output traffic per step of k.
 * float32: value i of a panel row is column i (128 bytes, two cache lines). bf16 (64 bytes, one line): word 2i
 * is column i and word 2i + 1 column 16 + i of the panel, so one 64-byte load widens to the panel's two 16-column
 * halves with a shift and a mask (not a cross-lane zero-extension). Columns past N are zero. Each output column's
 * FMA chain runs over k in order from 0, as the streams' does, and the last N % 8 columns take the streams'
 * scalar sums: the same bits as the [K, N] weight through the streams (tests/kernels/test_cpu_kernels.py,
 * tests/kernels/test_cpu_bf16_weights.py). */
#define PANEL 32
static inline int64_t panel_at_F32(int64_t K, int64_t k, int64_t n) { /* the value of (k, n) in the panels */
    return (n / PANEL) * K * PANEL + k * PANEL + n % PANEL;
}
static inline int64_t panel_at_BF16(int64_t K, int64_t k, int64_t n) {
    const int64_t c = n % PANEL;
    return (n / PANEL) * K * PANEL + k * PANEL + (c < 16 ? 2 * c : 2 * (c - 16) + 1);
}
/* the last columns [v1, n1) (fewer than 8, past the vector columns) as the streams' scalar pieces sum them */
#define TK_DEF_PANEL_TAIL(SUF, WT, AT)                                                                         \
    static void panel_tail##SUF(const float *x, int64_t ldx, int MR, int64_t K, const WT *wp, float *y,       \
                                int64_t ldy, int64_t v1, int64_t n1) {                                        \
        for (int64_t n = v1; n < n1; n++)                                                                      \
            for (int r = 0; r < MR; r++) {                                                                     \
                const float *xr = x + r * ldx;                                                                 \
                float acc = 0.f;                                                                               \
                int64_t k = 0;                                                                                 \
                for (; k + 4 <= K; k += 4)                                                                     \
                    acc += xr[k] * AT(wp + panel_at##SUF(K, k, n)) + xr[k + 1] * AT(wp + panel_at##SUF(K, k + 1, n)) + \
                           xr[k + 2] * AT(wp + panel_at##SUF(K, k + 2, n)) +                                   \
                           xr[k + 3] * AT(wp + panel_at##SUF(K, k + 3, n));                                    \
                for (; k < K; k++) acc += xr[k] * AT(wp + panel_at##SUF(K, k, n));                             \
                y[r * ldy + n] = acc;                                                                          \
            }                                                                                                  \
    }
TK_DEF_PANEL_TAIL(_F32, float, AT_F32)
TK_DEF_PANEL_TAIL(_BF16, uint16_t, AT_BF16)
#ifndef PANEL_PF /* software prefetch this many panel rows ahead (0: the hardware prefetcher alone) */
#define PANEL_PF 16
#endif
/* up to how many rows the AVX-512 panels are read one panel a pass with no prefetch instructions (at most 4; at 3-4
 * rows the bf16 widening makes a pass compute-bound enough that two panels with prefetches measured faster) */
#ifndef PANEL_HW_ROWS_F32
#define PANEL_HW_ROWS_F32 4
#endif
#ifndef PANEL_HW_ROWS_BF16
#define PANEL_HW_ROWS_BF16 2
#endif
/* a mask of the columns of [c0, c0 + 16) below v1 */
static inline uint32_t cols_below(int64_t c0, int64_t v1) {
    const int64_t n = v1 - c0;
    return n >= 16 ? 0xffffu : n <= 0 ? 0u : (uint32_t)((1u << n) - 1);
}
/* the kernels' shape: x [rows, K] (row stride ldx), the panels, y (row stride ldy), the vector columns from c0
 * (a panel's first) up to v1 */
typedef void (*panel_fn)(const float *, int64_t, int64_t, const void *, float *, int64_t, int64_t, int64_t);
#if TK_AVX512
/* a panel row as its two 16-column halves */
#define ROW512_F32(wk, lo, hi)                                                                                 \
    const __m512 lo = _mm512_loadu_ps(wk), hi = _mm512_loadu_ps((wk) + 16)
#define ROW512_BF16(wk, lo, hi)                                                                                \
    const __m512i v_ = _mm512_loadu_si512((const void *)(wk));                                                 \
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v_, 16));                                          \
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v_, _mm512_set1_epi32((int)0xffff0000u)))
/* MR rows over NP panels side by side (NP * 2 * MR accumulators); a prefetch per cache line of a row, PF rows
 * ahead (0: none); NAME the function's name */
#define TK_DEF_PANEL512_AS(NAME, WT, ROW, MR, NP, PF)                                                          \
    static void NAME(const float *x, int64_t ldx, int64_t K, const void *wv, float *y, int64_t ldy, int64_t c0, \
                     int64_t v1) {                                                                             \
        __m512 acc[MR][NP][2];                                                                                 \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int p = 0; p < NP; p++) acc[r][p][0] = acc[r][p][1] = _mm512_setzero_ps();                  \
        const WT *w0 = (const WT *)wv + (c0 / PANEL) * K * PANEL;                                              \
        for (int64_t k = 0; k < K; k++) {                                                                      \
            for (int p = 0; p < NP; p++) {                                                                     \
                const WT *wk = w0 + p * K * PANEL + k * PANEL;                                                 \
                if (PF && k + PF < K)                                                                          \
                    for (int b = 0; b < (int)(PANEL * sizeof(WT)); b += 64)                                    \
                        _mm_prefetch((const char *)(wk + PF * PANEL) + b, _MM_HINT_T0);                        \
                ROW(wk, lo, hi);                                                                               \
                for (int r = 0; r < MR; r++) {                                                                 \
                    const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);                                          \
                    acc[r][p][0] = _mm512_fmadd_ps(xb, lo, acc[r][p][0]);                                      \
                    acc[r][p][1] = _mm512_fmadd_ps(xb, hi, acc[r][p][1]);                                      \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int p = 0; p < NP; p++)                                                                           \
            for (int h = 0; h < 2; h++) {                                                                      \
                const int64_t c = c0 + p * PANEL + h * 16;                                                     \
                const __mmask16 m = (__mmask16)cols_below(c, v1);                                              \
                if (m)                                                                                         \
                    for (int r = 0; r < MR; r++) _mm512_mask_storeu_ps(y + r * ldy + c, m, acc[r][p][h]);      \
            }                                                                                                  \
    }
#define TK_DEF_PANEL512(SUF, WT, ROW, MR, NP)                                                                  \
    TK_DEF_PANEL512_AS(panel512##SUF##_##MR##_##NP, WT, ROW, MR, NP, PANEL_PF)
/* [rows][panels at once - 1]: two panels a pass up to 4 rows (4-16 independent FMA chains), one beyond. At the
 * fewest rows, where a pass is bound by memory, one panel a pass with no prefetch instructions instead
 * (`PANEL_HW_ROWS`): the weight read as one address-order stream that the hardware prefetcher alone serves,
 * which measured faster at those rows (bench/cpu_panel_stream.py); the same bits, each column's chain unchanged */
#define TK_DEF_PANELS512(SUF, WT, ROW)                                                                         \
    TK_DEF_PANEL512_AS(panel512##SUF##_hw_1, WT, ROW, 1, 1, 0)                                                 \
    TK_DEF_PANEL512_AS(panel512##SUF##_hw_2, WT, ROW, 2, 1, 0)                                                 \
    TK_DEF_PANEL512_AS(panel512##SUF##_hw_3, WT, ROW, 3, 1, 0)                                                 \
    TK_DEF_PANEL512_AS(panel512##SUF##_hw_4, WT, ROW, 4, 1, 0)                                                 \
    static const panel_fn PANEL512_HW##SUF[5] = {0, panel512##SUF##_hw_1, panel512##SUF##_hw_2,                \
                                                 panel512##SUF##_hw_3, panel512##SUF##_hw_4};                  \
    TK_DEF_PANEL512(SUF, WT, ROW, 1, 1) TK_DEF_PANEL512(SUF, WT, ROW, 1, 2) TK_DEF_PANEL512(SUF, WT, ROW, 2, 1)  \
    TK_DEF_PANEL512(SUF, WT, ROW, 2, 2) TK_DEF_PANEL512(SUF, WT, ROW, 3, 1) TK_DEF_PANEL512(SUF, WT, ROW, 3, 2)  \
    TK_DEF_PANEL512(SUF, WT, ROW, 4, 1) TK_DEF_PANEL512(SUF, WT, ROW, 4, 2) TK_DEF_PANEL512(SUF, WT, ROW, 5, 1)  \
    TK_DEF_PANEL512(SUF, WT, ROW, 6, 1) TK_DEF_PANEL512(SUF, WT, ROW, 7, 1) TK_DEF_PANEL512(SUF, WT, ROW, 8, 1)  \
    TK_DEF_PANEL512(SUF, WT, ROW, 5, 2) TK_DEF_PANEL512(SUF, WT, ROW, 6, 2)                                      \
    static const panel_fn PANEL512##SUF[9][2] = {{0, 0},                                                       \
                                                 {panel512##SUF##_1_1, panel512##SUF##_1_2},                   \
                                                 {panel512##SUF##_2_1, panel512##SUF##_2_2},                   \
                                                 {panel512##SUF##_3_1, panel512##SUF##_3_2},                   \
                                                 {panel512##SUF##_4_1, panel512##SUF##_4_2},                   \
                                                 {panel512##SUF##_5_1, panel512##SUF##_5_2},                   \
                                                 {panel512##SUF##_6_1, panel512##SUF##_6_2},                   \
                                                 {panel512##SUF##_7_1, 0},                                     \
                                                 {panel512##SUF##_8_1, 0}};                                    \
    /* more than 8 rows: two panels at a time (64 columns, 128 or 256 bytes a k), every 6-row block over them    \
     * while they are in L2 (4 x 6 accumulators: ~100 GFLOP/s on a Zen 4 core at 32 rows, MKL's SGEMM 71;     \
     * bench/cpu_w8a8_rows.py), then the tail columns; the same sums as the 8-row blocks */                    \
    static void panel_many##SUF(const float *x, int64_t ldx, int64_t M, int64_t K, const WT *wp, float *y,      \
                                int64_t ldy, int64_t n0, int64_t n1) {                                        \
        const int64_t v1 = n0 + (n1 - n0) / 8 * 8;                                                             \
        for (int64_t c = n0; c < v1; c += 2 * PANEL) {                                                         \
            const int two = c + PANEL < v1;                                                                    \
            for (int64_t m0 = 0; m0 < M; m0 += 6) {                                                            \
                const int mr = M - m0 < 6 ? (int)(M - m0) : 6;                                                 \
                PANEL512##SUF[mr][two](x + m0 * ldx, ldx, K, wp, y + m0 * ldy, ldy, c, v1);                    \
            }                                                                                                  \
        }                                                                                                      \
        if (v1 < n1) panel_tail##SUF(x, ldx, (int)M, K, wp, y, ldy, v1, n1);                                   \
    }                                                                                                          \
    static void panel_rows##SUF(const float *x, int64_t ldx, int MR, int64_t K, const WT *wp, float *y,       \
                                int64_t ldy, int64_t n0, int64_t n1) {                                        \
        const int64_t v1 = n0 + (n1 - n0) / 8 * 8;                                                             \
        int64_t c = n0;                                                                                        \
        if (MR <= PANEL_HW_ROWS##SUF)                                                                          \
            for (; c < v1; c += PANEL) PANEL512_HW##SUF[MR](x, ldx, K, wp, y, ldy, c, v1);                     \
        if (MR <= 4)                                                                                           \
            for (; c + PANEL < v1; c += 2 * PANEL) /* the second panel has vector columns, so it exists */     \
                PANEL512##SUF[MR][1](x, ldx, K, wp, y, ldy, c, v1);                                            \
        for (; c < v1; c += PANEL) PANEL512##SUF[MR][0](x, ldx, K, wp, y, ldy, c, v1);                         \
        if (v1 < n1) panel_tail##SUF(x, ldx, MR, K, wp, y, ldy, v1, n1);                                       \
    }
TK_DEF_PANELS512(_F32, float, ROW512_F32)
TK_DEF_PANELS512(_BF16, uint16_t, ROW512_BF16)
#elif TK_AVX2
/* 8 wide: a panel row as four 8-column vectors, at columns OFF_* of the panel; up to 2 rows a pass over whole
 * rows (8 accumulators a row pair), more rows over half a row at a time, 4 rows a pass (8 accumulators, fewer
 * loads per FMA), each panel's passes back to back so that their rereads come from L2 */
#define ROW256_F32(wk, a, b, c, d)                                                                             \
    const __m256 a = _mm256_loadu_ps(wk), b = _mm256_loadu_ps((wk) + 8), c = _mm256_loadu_ps((wk) + 16),       \
                 d = _mm256_loadu_ps((wk) + 24)
#define ROW256_BF16(wk, a, b, c, d)                                                                            \
    const __m256i hi16_ = _mm256_set1_epi32((int)0xffff0000u);                                                 \
    const __m256i v0_ = _mm256_loadu_si256((const __m256i *)(wk));                                             \
    const __m256i v1_ = _mm256_loadu_si256((const __m256i *)((wk) + 16));                                      \
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(v0_, 16));                                          \
    const __m256 b = _mm256_castsi256_ps(_mm256_and_si256(v0_, hi16_));                                        \
    const __m256 c = _mm256_castsi256_ps(_mm256_slli_epi32(v1_, 16));                                          \
    const __m256 d = _mm256_castsi256_ps(_mm256_and_si256(v1_, hi16_))
static const int OFF_F32[4] = {0, 8, 16, 24}, OFF_BF16[4] = {0, 16, 8, 24};
#define TK_DEF_PANEL256(SUF, WT, ROW, MR)                                                                      \
    static void panel256##SUF##_##MR(const float *x, int64_t ldx, int64_t K, const WT *wp, float *y,          \
                                     int64_t ldy, int64_t c0, int64_t v1) {                                   \
        __m256 acc[MR][4];                                                                                     \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();                                      \
        const WT *wk = wp + (c0 / PANEL) * K * PANEL;                                                          \
        for (int64_t k = 0; k < K; k++, wk += PANEL) {                                                         \
            if (PANEL_PF && k + PANEL_PF < K)                                                                  \
                for (int b = 0; b < (int)(PANEL * sizeof(WT)); b += 64)                                        \
                    _mm_prefetch((const char *)(wk + PANEL_PF * PANEL) + b, _MM_HINT_T0);                      \
            ROW(wk, a, b, c, d);                                                                               \
            for (int r = 0; r < MR; r++) {                                                                     \
                const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);                                        \
                acc[r][0] = _mm256_fmadd_ps(xb, a, acc[r][0]);                                                 \
                acc[r][1] = _mm256_fmadd_ps(xb, b, acc[r][1]);                                                 \
                acc[r][2] = _mm256_fmadd_ps(xb, c, acc[r][2]);                                                 \
                acc[r][3] = _mm256_fmadd_ps(xb, d, acc[r][3]);                                                 \
            }                                                                                                  \
        }                                                                                                      \
        for (int j = 0; j < 4; j++) {                                                                          \
            const int64_t c = c0 + OFF##SUF[j];                                                                \
            if (c + 8 <= v1)                                                                                   \
                for (int r = 0; r < MR; r++) _mm256_storeu_ps(y + r * ldy + c, acc[r][j]);                   \
        }                                                                                                      \
    }
/* half j of a panel row as two 8-column vectors, at columns HALF_COLS_*[j] of the panel */
#define HALF256_F32(wk, j, a, b)                                                                               \
    const __m256 a = _mm256_loadu_ps((wk) + 16 * (j)), b = _mm256_loadu_ps((wk) + 16 * (j) + 8)
#define HALF256_BF16(wk, j, a, b)                                                                              \
    const __m256i v_ = _mm256_loadu_si256((const __m256i *)((wk) + 16 * (j)));                                 \
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(v_, 16));                                           \
    const __m256 b = _mm256_castsi256_ps(_mm256_and_si256(v_, _mm256_set1_epi32((int)0xffff0000u)))
static const int HALF_COLS_F32[2][2] = {{0, 8}, {16, 24}}, HALF_COLS_BF16[2][2] = {{0, 16}, {8, 24}};
#define TK_DEF_HALF256(SUF, WT, HALF, MR)                                                                      \
    static void half256##SUF##_##MR(const float *x, int64_t ldx, int64_t K, const WT *wp, float *y,           \
                                    int64_t ldy, int64_t c0, int64_t v1, int j) {                             \
        __m256 acc[MR][2];                                                                                     \
        for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                             \
        const WT *wk = wp + (c0 / PANEL) * K * PANEL;                                                          \
        for (int64_t k = 0; k < K; k++, wk += PANEL) {                                                         \
            if (PANEL_PF && k + PANEL_PF < K)                                                                  \
                for (int b = 0; b < (int)(PANEL * sizeof(WT)); b += 64)                                        \
                    _mm_prefetch((const char *)(wk + PANEL_PF * PANEL) + b, _MM_HINT_T0);                      \
            HALF(wk, j, a, b);                                                                                 \
            for (int r = 0; r < MR; r++) {                                                                     \
                const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);                                        \
                acc[r][0] = _mm256_fmadd_ps(xb, a, acc[r][0]);                                                 \
                acc[r][1] = _mm256_fmadd_ps(xb, b, acc[r][1]);                                                 \
            }                                                                                                  \
        }                                                                                                      \
        for (int h = 0; h < 2; h++) {                                                                          \
            const int64_t c = c0 + HALF_COLS##SUF[j][h];                                                       \
            if (c + 8 <= v1)                                                                                   \
                for (int r = 0; r < MR; r++) _mm256_storeu_ps(y + r * ldy + c, acc[r][h]);                   \
        }                                                                                                      \
    }
#define TK_DEF_PANELS256(SUF, WT, ROW, HALF)                                                                   \
    TK_DEF_PANEL256(SUF, WT, ROW, 1)                                                                           \
    TK_DEF_PANEL256(SUF, WT, ROW, 2)                                                                           \
    TK_DEF_HALF256(SUF, WT, HALF, 1)                                                                           \
    TK_DEF_HALF256(SUF, WT, HALF, 2)                                                                           \
    TK_DEF_HALF256(SUF, WT, HALF, 3)                                                                           \
    TK_DEF_HALF256(SUF, WT, HALF, 4)                                                                           \
    static void panel_rows##SUF(const float *x, int64_t ldx, int MR, int64_t K, const WT *wp, float *y,       \
                                int64_t ldy, int64_t n0, int64_t n1) {                                        \
        static void (*const half[5])(const float *, int64_t, int64_t, const WT *, float *, int64_t, int64_t,   \
                                     int64_t, int) = {0, half256##SUF##_1, half256##SUF##_2, half256##SUF##_3,  \
                                                      half256##SUF##_4};                                       \
        const int64_t v1 = n0 + (n1 - n0) / 8 * 8;                                                             \
        for (int64_t c = n0; c < v1; c += PANEL) {                                                             \
            if (MR <= 2) {                                                                                     \
                (MR == 2 ? panel256##SUF##_2 : panel256##SUF##_1)(x, ldx, K, wp, y, ldy, c, v1);               \
                continue;                                                                                      \
            }                                                                                                  \
            for (int j = 0; j < 2; j++)                                                                        \
                for (int r0 = 0; r0 < MR; r0 += 4)                                                             \
                    half[MR - r0 < 4 ? MR - r0 : 4](x + r0 * ldx, ldx, K, wp, y + r0 * ldy, ldy, c, v1, j);  \
        }                                                                                                      \
        if (v1 < n1) panel_tail##SUF(x, ldx, MR, K, wp, y, ldy, v1, n1);                                       \
    }
TK_DEF_PANELS256(_F32, float, ROW256_F32, HALF256_F32)
TK_DEF_PANELS256(_BF16, uint16_t, ROW256_BF16, HALF256_BF16)
#else
#define TK_DEF_PANELS_C(SUF, WT, AT)                                                                           \
    static void panel_rows##SUF(const float *x, int64_t ldx, int MR, int64_t K, const WT *wp, float *y,       \
                                int64_t ldy, int64_t n0, int64_t n1) {                                        \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int64_t n = n0; n < n1; n++) {                                                                \
                float s = 0.f;                                                                                 \
                for (int64_t k = 0; k < K; k++) s += x[r * ldx + k] * AT(wp + panel_at##SUF(K, k, n));        \
                y[r * ldy + n] = s;                                                                            \
            }                                                                                                  \
    }
TK_DEF_PANELS_C(_F32, float, AT_F32)
TK_DEF_PANELS_C(_BF16, uint16_t, AT_BF16)
#endif

/* The float32 weight as the linears take it: wt [K, N] (row stride ldw), or packed in panels (wp, `pack_f32`;
 * then wt is NULL), and its bf16 copy w16 (or NULL) in panels, which the register tiles read instead of either */
typedef struct {
    const float *wt, *wp;
    const uint16_t *w16;
    int64_t ldw;
} f32_weight;

/* columns [n0, n1) of rows [0, M), bias added, from the panels where there are some, else from wt. Over the
 * panels, more than 8 rows take two panels at a time through every 6-row block (panel_many: the pair's weight
 * read from memory once, then from L2); over wt, the whole column range block after block (each reads the
 * weight again; narrow column strips of the [K, N] weight kept in L2 for every block measured slower, their
 * short strided bursts costing more than the rereads) */
static void linear_cols(const float *x, int64_t M, int64_t K, const f32_weight *w, const float *bias, float *y,
                        int64_t N, int64_t n0, int64_t n1) {
#if TK_AVX512
    if (M > STREAM_ROWS && (w->w16 || w->wp)) { /* many rows over panels: column pairs outer (see panel_many) */
        if (w->w16) panel_many_BF16(x, K, M, K, w->w16, y, N, n0, n1);
        else panel_many_F32(x, K, M, K, w->wp, y, N, n0, n1);
        if (bias)
            for (int64_t r = 0; r < M; r++)
                for (int64_t n = n0; n < n1; n++) y[r * N + n] += bias[n];
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += STREAM_ROWS) {
        int mr = (int)(M - m0 < STREAM_ROWS ? M - m0 : STREAM_ROWS);
        if (w->w16) {
            panel_rows_BF16(x + m0 * K, K, mr, K, w->w16, y + m0 * N, N, n0, n1);
        } else if (w->wp) {
            panel_rows_F32(x + m0 * K, K, mr, K, w->wp, y + m0 * N, N, n0, n1);
        } else {
            const float *wt = w->wt;
            const int64_t ldw = w->ldw;
#if TK_AVX512
            /* within the built-in bounds from BLOCK_MIN_ROWS rows; above them as calibrated */
            const int block = K * N <= block_max_kn && (K <= BLOCK_MAX_K && K * N <= BLOCK_MAX_KN
                                                           ? mr >= BLOCK_MIN_ROWS
                                                           : K <= block_max_k && mr >= block_min_rows);
            (block ? BLOCK512 : STREAM512)[mr](x + m0 * K, K, K, wt, ldw, y + m0 * N, N, n0, n1);
#elif TK_AVX2
            STREAM[mr](x + m0 * K, K, K, wt, ldw, y + m0 * N, N, n0, n1);
#else
            for (int r = 0; r < mr; r++)
                for (int64_t n = n0; n < n1; n++) {
                    float s = 0.f;
                    for (int64_t k = 0; k < K; k++) s += x[(m0 + r) * K + k] * wt[k * ldw + n];
                    y[(m0 + r) * N + n] = s;
                }
#endif
        }
        if (bias)
            for (int r = 0; r < mr; r++)
                for (int64_t n = n0; n < n1; n++) y[(m0 + r) * N + n] += bias[n];
    }
}

/* the external SGEMM over panels: strips of SGEMM_STRIP columns unpacked to [K, strip] in a scratch buffer (a
 * bounded copy of the weight's bytes, small beside the 2 M K N flops of the rows that take the SGEMM) */
#define SGEMM_STRIP 256
static void *sgemm_scratch;
static size_t sgemm_scratch_cap;
static int sgemm_panels(const float *x, int64_t M, int64_t K, const float *wp, int64_t N, float *y) {
    if (grow_scratch(&sgemm_scratch, &sgemm_scratch_cap, sizeof(float) * (size_t)K * SGEMM_STRIP)) return 1;
    float *s = (float *)sgemm_scratch;
    for (int64_t c0 = 0; c0 < N; c0 += SGEMM_STRIP) {
        const int64_t nb = N - c0 < SGEMM_STRIP ? N - c0 : SGEMM_STRIP; /* c0 starts a panel */
        for (int64_t k = 0; k < K; k++)
            for (int64_t c = 0; c < nb; c += PANEL)
                memcpy(s + k * nb + c, wp + ((c0 + c) / PANEL) * K * PANEL + k * PANEL,
                       sizeof(float) * (size_t)(nb - c < PANEL ? nb - c : PANEL));
        int n = (int)nb, m = (int)M, k = (int)K, ld = (int)N;
        float one = 1.f, zero = 0.f;
        tk_sgemm("N", "N", &n, &m, &k, &one, s, &n, x, &k, &zero, y + c0, &ld);
    }
    return 0;
}

/* y[M, N] = x @ w (+ bias); 0, or 1 when the SGEMM's scratch allocation failed */
static int linear_f32(const float *x, int64_t M, int64_t K, const f32_weight *w, int64_t N, const float *bias,
                      float *y, int nthreads) {
    if (tk_sgemm && M >= sgemm_min_rows && M < (1 << 30) && K < (1 << 30) && N < (1 << 30)) {
        if (w->wt) {
            /* row-major y[M,N] = x[M,K] wt[K,N] is column-major y^T = wt^T x^T */
            int n = (int)N, m = (int)M, k = (int)K, lw = (int)w->ldw;
            float one = 1.f, zero = 0.f;
            tk_sgemm("N", "N", &n, &m, &k, &one, w->wt, &lw, x, &k, &zero, y, &n);
        } else if (sgemm_panels(x, M, K, w->wp, N, y)) {
            return 1;
        }
        if (bias)
            for (int64_t r = 0; r < M; r++)
                for (int64_t c = 0; c < N; c++) y[r * N + c] += bias[c];
        return 0;
    }
#define F32_COLS(a, b) linear_cols(x, M, K, w, bias, y, N, a, b)
    if (w->w16 || w->wp) TK_OVER_COLUMNS_SPLIT(N, nthreads, PANEL, 1, F32_COLS); /* chunks start a panel */
    else TK_OVER_COLUMNS_SPLIT(N, nthreads, 16, 1, F32_COLS);
#undef F32_COLS
    return 0;
}

/* tk_linear_f32 with the weight's bf16 copy w16 (or NULL) for the register tiles; the SGEMM reads wt */
void tk_linear_f32_w16(const float *x, int64_t M, int64_t K, const float *wt, const uint16_t *w16, int64_t ldw,
                       int64_t N, const float *bias, float *y, int nthreads) {
    const f32_weight w = {wt, 0, w16, ldw};
    linear_f32(x, M, K, &w, N, bias, y, nthreads); /* (wt: no scratch) */
}

void tk_linear_f32(const float *x, int64_t M, int64_t K, const float *wt, int64_t ldw, int64_t N,
                   const float *bias, float *y, int nthreads) {
    tk_linear_f32_w16(x, M, K, wt, 0, ldw, N, bias, y, nthreads);
}

/* the same over the weight packed in panels (wp, `pack_f32`) and its bf16 copy w16 or NULL; 0, or 1 when a
 * scratch allocation failed */
int tk_linear_f32_panels(const float *x, int64_t M, int64_t K, const float *wp, const uint16_t *w16, int64_t N,
                         const float *bias, float *y, int nthreads) {
    const f32_weight w = {0, wp, w16, 0};
    return linear_f32(x, M, K, &w, N, bias, y, nthreads);
}

/* ---- weight-only int8 linear: q [N, K] row-major, per-row scale -------------------------------------------- */

#if TK_AVX2
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if TK_AVX2
static inline __m256 i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* two weight rows x MR activation rows: each weight vector converted once, used MR times */
#define TK_DEF_I8(MR)                                                                                          \
    static void i8_2x##MR(const float *x, int64_t K, const int8_t *q0, const int8_t *q1, float *s0, float *s1) { \
        __m256 a0[MR], a1[MR];                                                                                 \
        for (int r = 0; r < MR; r++) a0[r] = a1[r] = _mm256_setzero_ps();                                     \
        int64_t k = 0;                                                                                         \
        for (; k + 8 <= K; k += 8) {                                                                           \
            __m256 w0 = i8x8(q0 + k), w1 = i8x8(q1 + k);                                                       \
            for (int r = 0; r < MR; r++) {                                                                     \
                __m256 xv = _mm256_loadu_ps(x + r * K + k);                                                    \
                a0[r] = _mm256_fmadd_ps(xv, w0, a0[r]);                                                        \
                a1[r] = _mm256_fmadd_ps(xv, w1, a1[r]);                                                        \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < MR; r++) {                                                                         \
            float t0 = hsum256(a0[r]), t1 = hsum256(a1[r]);                                                    \
            for (int64_t j = k; j < K; j++) {                                                                  \
                t0 += x[r * K + j] * q0[j];                                                                    \
                t1 += x[r * K + j] * q1[j];                                                                    \
            }                                                                                                  \
            s0[r] = t0;                                                                                        \
            s1[r] = t1;                                                                                        \
        }                                                                                                      \
    }
TK_DEF_I8(1)
TK_DEF_I8(2)
TK_DEF_I8(3)
TK_DEF_I8(4)
typedef void (*i8_fn)(const float *, int64_t, const int8_t *, const int8_t *, float *, float *);
static const i8_fn I8[5] = {0, i8_2x1, i8_2x2, i8_2x3, i8_2x4};

/* one activation row, four weight rows, two accumulators each (eight FMA chains: the one-row GEMV is
 * bound by converting int8 to float, not by the FMA latency) */
static void i8_4x1(const float *x, int64_t K, const int8_t *q, float *s) {
    __m256 a[4][2];
    for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        _mm_prefetch((const char *)(q + 4 * K) + 4 * k, _MM_HINT_T0); /* the next four rows, as w8_4x1 does */
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        for (int i = 0; i < 4; i++) {
            const int8_t *qi = q + i * K + k;
            a[i][0] = _mm256_fmadd_ps(x0, i8x8(qi), a[i][0]);
            a[i][1] = _mm256_fmadd_ps(x1, i8x8(qi + 8), a[i][1]);
        }
    }
    for (int i = 0; i < 4; i++) {
        float t = hsum256(_mm256_add_ps(a[i][0], a[i][1]));
        for (int64_t j = k; j < K; j++) t += x[j] * q[i * K + j];
        s[i] = t;
    }
}
#endif

/* rows [n0, n1) of the weight for every x row: two weight rows at a time (read from memory once; the
 * activation blocks of four rows reuse them from L1) */
static void linear_i8_rows(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale,
                           const float *bias, float *y, int64_t N, int64_t n0, int64_t n1) {
    int64_t n = n0;
#if TK_AVX2
    float s0[4], s1[4];
    if (M == 1)
        for (; n + 4 <= n1; n += 4) {
            i8_4x1(x, K, q + n * K, s0);
            for (int i = 0; i < 4; i++) y[n + i] = s0[i] * scale[n + i] + (bias ? bias[n + i] : 0.f);
        }
    for (; n + 2 <= n1; n += 2) {
        const int8_t *q0 = q + n * K, *q1 = q0 + K;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int mr = (int)(M - m0 < 4 ? M - m0 : 4);
            I8[mr](x + m0 * K, K, q0, q1, s0, s1);
            for (int r = 0; r < mr; r++) {
                y[(m0 + r) * N + n] = s0[r] * scale[n] + (bias ? bias[n] : 0.f);
                y[(m0 + r) * N + n + 1] = s1[r] * scale[n + 1] + (bias ? bias[n + 1] : 0.f);
            }
        }
    }
#endif
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float s = 0.f;
            for (int64_t k = 0; k < K; k++) s += x[m * K + k] * q[n * K + k];
            y[m * N + n] = s * scale[n] + (bias ? bias[n] : 0.f);
        }
}

/* many rows: the weight widened to float32 once (a per-thread scratch kept between calls: no page faults per
 * call) and the external SGEMM, then the per-row scale: the int8 GEMM's conversions amortised over all rows */
static __thread void *i8_scratch = 0;
static __thread size_t i8_scratch_cap = 0;

static int linear_i8_sgemm(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N,
                           const float *bias, float *y) {
    size_t need = (size_t)N * (size_t)K;
    if (grow_scratch(&i8_scratch, &i8_scratch_cap, sizeof(float) * need)) return 1;
    float *wf = (float *)i8_scratch;
    for (size_t i = 0; i < need; i++) wf[i] = (float)q[i];
    /* row-major y[M,N] = x[M,K] wf[N,K]^T: column-major y^T = wf^T' x^T with wf read as [K,N] col-major, 'T' */
    int n = (int)N, m = (int)M, k = (int)K;
    float one = 1.f, zero = 0.f;
    tk_sgemm("T", "N", &n, &m, &k, &one, wf, &k, x, &k, &zero, y, &n);
    for (int64_t r = 0; r < M; r++)
        for (int64_t c = 0; c < N; c++) y[r * N + c] = y[r * N + c] * scale[c] + (bias ? bias[c] : 0.f);
    return 0;
}

void tk_linear_i8(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N,
                  const float *bias, float *y, int nthreads) {
    if (tk_sgemm && M >= SGEMM_MIN_ROWS && M < (1 << 30) && K < (1 << 30) && N < (1 << 30)
        && (int64_t)N * K < ((int64_t)1 << 31) && !linear_i8_sgemm(x, M, K, q, scale, N, bias, y))
        return;
#define I8_ROWS(a, b) linear_i8_rows(x, M, K, q, scale, bias, y, N, a, b)
    TK_OVER_COLUMNS(N, nthreads, 2, I8_ROWS);
#undef I8_ROWS
}

/* ---- int8 weights x int8 activations (w8a8): q [N, K] with per-row scales, activations quantised per 32 ----
 * The activations of each row are quantised in blocks of 32 (d = amax / 127, q = round-half-even(x / d), as
 * llama.cpp's q8_0 and kernels.quant_matmul.quantize_act_q8), so a block's dot is an integer dot: vpmaddubsw
 * of |x| (u8) with sign(x) * w (s8), then vpmaddwd to int32, one convert and one FMA by d per 32 products,
 * where the weight-only path converts and multiplies every weight. Needs K % 32 == 0. */

#define Q8 32

static __thread void *q8_scratch = 0;
static __thread size_t q8_scratch_cap = 0;

static void quant_act_q8(const float *x, int64_t M, int64_t K, int8_t *xq, uint8_t *xa, float *d) {
    const int64_t B = K / Q8;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < B; b++) {
            const float *p = x + m * K + b * Q8;
            int8_t *o = xq + m * K + b * Q8;
            uint8_t *oa = xa + m * K + b * Q8;
#if TK_AVX2
            const __m256 sgn = _mm256_set1_ps(-0.f);
            __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8), v2 = _mm256_loadu_ps(p + 16),
                   v3 = _mm256_loadu_ps(p + 24);
            __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sgn, v0), _mm256_andnot_ps(sgn, v1)),
                                      _mm256_max_ps(_mm256_andnot_ps(sgn, v2), _mm256_andnot_ps(sgn, v3)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            float db = _mm_cvtss_f32(h) / 127.f, id = db > 0.f ? 1.f / db : 0.f;
            d[m * B + b] = db;
            __m256 vi = _mm256_set1_ps(id);
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vi)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vi));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vi)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vi));
            __m256i s = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            s = _mm256_permutevar8x32_epi32(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            s = _mm256_max_epi8(s, _mm256_set1_epi8(-127)); /* q in [-127, 127]: |q| fits the u8 side */
            _mm256_storeu_si256((__m256i *)o, s);
            _mm256_storeu_si256((__m256i *)oa, _mm256_abs_epi8(s));
#else
            float amax = 0.f;
            for (int j = 0; j < Q8; j++) amax = fabsf(p[j]) > amax ? fabsf(p[j]) : amax;
            float db = amax / 127.f, id = db > 0.f ? 1.f / db : 0.f;
            d[m * B + b] = db;
            for (int j = 0; j < Q8; j++) {
                float r = nearbyintf(p[j] * id);
                r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
                o[j] = (int8_t)r;
                oa[j] = (uint8_t)(r < 0 ? -r : r);
            }
#endif
        }
}

/* a w8a8 output: the row's dot times its channel scale, plus the bias, rounded the same way on every path (an
 * explicit FMA: the compiler's own contraction could differ between two copies of `s * scale + bias`, and a
 * row's bits with them between batch sizes) */
static inline float w8_out(float s, const float *scale, const float *bias, int64_t n) {
    return bias ? fmaf(s, scale[n], bias[n]) : s * scale[n];
}

/* tk_one_row: 1 (default) where one activation row (a one-sequence decode step) reads the quantised and bf16
 * weights one row or panel after another in address order, one stream the hardware prefetcher follows (w8a8:
 * w8v_rows1 where the build has VNNI; int4: its 1-row tile; bf16: one pair panel at a time), instead of the
 * tiles' four interleaved rows or panels; 0: the tiles (for A/B runs). Each row's arithmetic is the tiles' own:
 * the same bits either way, and at any batch size (docs/benchmarks.md, bench/decode_share.py, has the times) */
static int64_t one_row = 1;
#if TK_AVX2
/* the eight int32 partial sums of a block's 32 products x * w */
static inline __m256i dot_q8(__m256i xa, __m256i xs, __m256i w) {
#if TK_VNNI /* one vpdpbusd for vpmaddubsw + vpmaddwd: the same eight sums of four products, bit for bit */
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), xa, _mm256_sign_epi8(w, xs));
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w, xs)), _mm256_set1_epi16(1));
#endif
}

/* NR weight rows x MR activation rows: s[r * NR + i] = sum_b SCALE * (x_q[r, b] . q[i, b]), SCALE a __m256 of
 * r, i, b (and B, d, the tile's own EXTRA arguments): the per-channel tiles below scale by d[r, b] alone (the
 * channel scale comes after), the block-scaled ones by d[r, b] * ws[i, b] */
#define TK_DEF_W8T(PRE, NR, MR, EXTRA, SCALE)                                                                  \
    static void PRE##NR##x##MR(const int8_t *xq, const uint8_t *xa, const float *d, int64_t K, const int8_t *q,  \
                               EXTRA float *s) {                                                               \
        const int64_t B = K / Q8;                                                                              \
        __m256 acc[MR][NR];                                                                                    \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int i = 0; i < NR; i++) acc[r][i] = _mm256_setzero_ps();                                     \
        for (int64_t b = 0; b < B; b++) {                                                                      \
            if (NR == 4) { /* the next four rows' bytes, 128 per block: 4 interleaved short rows defeat the   \
                            * hardware prefetcher (8 -> 16 GB/s from memory on this VM) */                    \
                const char *pf = (const char *)(q + 4 * K) + b * 128;                                          \
                _mm_prefetch(pf, _MM_HINT_T0);                                                                 \
                _mm_prefetch(pf + 64, _MM_HINT_T0);                                                            \
            }                                                                                                  \
            __m256i w[NR];                                                                                     \
            for (int i = 0; i < NR; i++) w[i] = _mm256_loadu_si256((const __m256i *)(q + i * K + b * Q8));   \
            for (int r = 0; r < MR; r++) {                                                                     \
                __m256i a = _mm256_loadu_si256((const __m256i *)(xa + r * K + b * Q8));                        \
                __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * Q8));                        \
                for (int i = 0; i < NR; i++)                                                                   \
                    acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_q8(a, x, w[i])), SCALE, acc[r][i]);    \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int i = 0; i < NR; i++) s[r * NR + i] = hsum256(acc[r][i]);                                   \
    }
#define W8_CHANNEL _mm256_broadcast_ss(d + r * B + b)
TK_DEF_W8T(w8_, 4, 1, , W8_CHANNEL)
TK_DEF_W8T(w8_, 4, 2, , W8_CHANNEL)
TK_DEF_W8T(w8_, 1, 1, , W8_CHANNEL)
#endif

#if TK_VNNI
/* an odd last block's product on the 256-bit dot, scaled by its activation scale `db` and summed */
static inline float w8_odd_block(__m256i a, __m256i x, const int8_t *w, __m256 db) {
    return hsum256(_mm256_mul_ps(_mm256_cvtepi32_ps(dot_q8(a, x, _mm256_loadu_si256((const __m256i *)w))), db));
}

/* the same tiles two blocks per 512-bit vector (lanes 0-7 block b, 8-15 block b + 1): the weights' signs flipped
 * where x < 0 by one masked subtract (no 512-bit vpsignb), one vpdpbusd, one convert and one FMA by the two
 * blocks' scales per pair of blocks; an odd last block takes the 256-bit dot. Sums in another order than the
 * AVX2 tiles (not the same bits; the same integer dots) */
#define TK_DEF_W8V(NR, MR)                                                                                     \
    static void w8v_##NR##x##MR(const int8_t *xq, const uint8_t *xa, const float *d, int64_t K, const int8_t *q,\
                                float *s) {                                                                    \
        const int64_t B = K / Q8;                                                                              \
        const __m512i zero = _mm512_setzero_si512();                                                           \
        __m512 acc[MR][NR];                                                                                    \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int i = 0; i < NR; i++) acc[r][i] = _mm512_setzero_ps();                                     \
        int64_t b = 0;                                                                                         \
        for (; b + 2 <= B; b += 2) {                                                                           \
            if (NR == 4) { /* the next four rows, 256 bytes per pair of blocks, as the AVX2 tiles do */       \
                const char *pf = (const char *)(q + 4 * K) + b * 128;                                          \
                for (int j = 0; j < 4; j++) _mm_prefetch(pf + 64 * j, _MM_HINT_T0);                           \
            }                                                                                                  \
            __m512i w[NR];                                                                                     \
            for (int i = 0; i < NR; i++) w[i] = _mm512_loadu_si512((const void *)(q + i * K + b * Q8));       \
            for (int r = 0; r < MR; r++) {                                                                     \
                __m512i a = _mm512_loadu_si512((const void *)(xa + r * K + b * Q8));                           \
                __mmask64 neg = _mm512_movepi8_mask(_mm512_loadu_si512((const void *)(xq + r * K + b * Q8)));  \
                __m512 db = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(d[r * B + b]),              \
                                                 _mm512_set1_ps(d[r * B + b + 1]));                            \
                for (int i = 0; i < NR; i++) {                                                                 \
                    __m512i sw = _mm512_mask_sub_epi8(w[i], neg, zero, w[i]);                                  \
                    acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, a, sw)), db,      \
                                                acc[r][i]);                                                    \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int i = 0; i < NR; i++) s[r * NR + i] = _mm512_reduce_add_ps(acc[r][i]);                     \
        if (b < B)                                                                                             \
            for (int r = 0; r < MR; r++) {                                                                     \
                __m256i a = _mm256_loadu_si256((const __m256i *)(xa + r * K + b * Q8));                        \
                __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * Q8));                        \
                __m256 db = _mm256_set1_ps(d[r * B + b]);                                                      \
                for (int i = 0; i < NR; i++) s[r * NR + i] += w8_odd_block(a, x, q + i * K + b * Q8, db);      \
            }                                                                                                  \
    }
TK_DEF_W8V(4, 1)
TK_DEF_W8V(4, 2)
TK_DEF_W8V(1, 1)
#define W8_TILE(NR, MR) w8v_##NR##x##MR

/* one activation row over weight rows [n0, n1) in address order (one stream the hardware prefetcher follows,
 * where the 4-row tiles read four interleaved short ones), the activation's side of each pair of blocks (the
 * sign mask and the two scales) computed once for all rows: w8v_1x1's arithmetic in its order, so the same bits
 * as every tile gives a row */
#define W8R_MAX_PAIRS 256
static int w8v_rows1(const int8_t *xq, const uint8_t *xa, const float *d, int64_t K, const int8_t *q,
                     const float *scale, const float *bias, float *y, int64_t n0, int64_t n1) {
    const int64_t B = K / Q8, P = B / 2;
    if (P > W8R_MAX_PAIRS) return 0;
    __mmask64 neg[W8R_MAX_PAIRS];
    __m512 dbs[W8R_MAX_PAIRS];
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t p = 0; p < P; p++) {
        neg[p] = _mm512_movepi8_mask(_mm512_loadu_si512((const void *)(xq + p * 2 * Q8)));
        dbs[p] = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(d[2 * p]), _mm512_set1_ps(d[2 * p + 1]));
    }
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *w = q + n * K;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t p = 0; p < P; p++) {
            __m512i wv = _mm512_loadu_si512((const void *)(w + p * 2 * Q8));
            __m512i sw = _mm512_mask_sub_epi8(wv, neg[p], zero, wv);
            __m512i a = _mm512_loadu_si512((const void *)(xa + p * 2 * Q8));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, a, sw)), dbs[p], acc);
        }
        float s = _mm512_reduce_add_ps(acc);
        if (B & 1) {
            const int64_t b = B - 1;
            s += w8_odd_block(_mm256_loadu_si256((const __m256i *)(xa + b * Q8)),
                              _mm256_loadu_si256((const __m256i *)(xq + b * Q8)), w + b * Q8, _mm256_set1_ps(d[b]));
        }
        y[n] = w8_out(s, scale, bias, n);
    }
    return 1;
}
#elif TK_AVX2
#define W8_TILE(NR, MR) w8_##NR##x##MR
#endif

/* weight rows [n0, n1) for every activation row, from the quantised activations */
static void linear_w8_rows(const int8_t *xq, const uint8_t *xa, const float *d, int64_t M, int64_t K,
                           const int8_t *q, const float *scale, const float *bias, float *y, int64_t N, int64_t n0,
                           int64_t n1) {
    const int64_t B = K / Q8;
    int64_t n = n0;
#if TK_VNNI
    if (one_row && M == 1 && w8v_rows1(xq, xa, d, K, q, scale, bias, y, n0, n1)) return;
#endif
#if TK_AVX2
    float s[8];
    for (; n + 4 <= n1; n += 4) {
        const int8_t *qn = q + n * K;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            W8_TILE(4, 2)(xq + m * K, xa + m * K, d + m * B, K, qn, s);
            for (int r = 0; r < 2; r++)
                for (int i = 0; i < 4; i++)
                    y[(m + r) * N + n + i] = w8_out(s[r * 4 + i], scale, bias, n + i);
        }
        for (; m < M; m++) {
            W8_TILE(4, 1)(xq + m * K, xa + m * K, d + m * B, K, qn, s);
            for (int i = 0; i < 4; i++) y[m * N + n + i] = w8_out(s[i], scale, bias, n + i);
        }
    }
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            W8_TILE(1, 1)(xq + m * K, xa + m * K, d + m * B, K, q + n * K, s);
            y[m * N + n] = w8_out(s[0], scale, bias, n);
        }
#else
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float t = 0.f;
            for (int64_t b = 0; b < B; b++) {
                int32_t acc = 0;
                for (int j = 0; j < Q8; j++) acc += (int32_t)xq[m * K + b * Q8 + j] * q[n * K + b * Q8 + j];
                t += d[m * B + b] * (float)acc;
            }
            y[m * N + n] = t * scale[n] + (bias ? bias[n] : 0.f);
        }
#endif
}

#if TK_AMX
/* ---- w8a8 on AMX tiles (at AMX_MIN_ROWS rows and more) -----------------------------------------------------
 * The weights are tdpbssd's A operand as they lie (16 rows of one 32-value block, stride K: no repacked copy);
 * the quantised activations, B, are packed per call into the tile's VNNI order, 16 rows at a time (zeros past
 * M). One tile product per block keeps the block's int32 dots apart, so each takes its activation scale:
 * acc[n][m] += float(dot) * d[m, b], in block order, then * scale[n] (+ bias). The same integer dots as the
 * vector tiles; float sums in another order. */
#define AMX_MIN_ROWS 3
#define AMX_PAIRED_ROWS 8 /* up to this many rows, one tile product takes two blocks (linear_w8_amx_paired) */
#define AMX_PREFETCH_BLOCKS 4

static int amx_granted = -1; /* -1: not asked yet; 0: Linux refused the tile state; 1: granted */
static int amx_wanted = 1;   /* tk_set_amx */

static int amx_ready(void) {
    if (amx_granted < 0) /* Linux hands out the 8 KB tile state only on request: ARCH_REQ_XCOMP_PERM, XTILEDATA */
        amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_granted && amx_wanted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* tiles 0, 1, 6, 7: int32 results [16 n x 16 m]; 2, 4: weights [16 n x 32 k]; 3, 5: activations
 * [8 x (16 m x 4 k)] */
static const amx_config amx_cfg = {1, 0, {0}, {64, 64, 32, 64, 32, 64, 64, 64}, {16, 16, 16, 8, 16, 8, 16, 16}};

/* paired (up to 8 rows): 0, 1: int32 results [16 n x 16 (block parity, m)]; 2, 6: weights [16 n x 64 k];
 * 3, 7: activations [16 x (16 (block parity, m) x 4 k)]; 4, 5: an odd last block, as 2 and 3 of amx_cfg */
static const amx_config amx_cfg_paired = {1, 0, {0}, {64, 64, 64, 64, 32, 64, 64, 64},
                                          {16, 16, 16, 16, 16, 8, 16, 16}};

/* xp[(t B + b) 512 + r 64 + 4 j + c] = xq[16 t + j, 32 b + 4 r + c]; dt[(t B + b) 16 + j] = d[16 t + j, b] */
static void amx_pack(const int8_t *xq, const float *d, int64_t M, int64_t K, int8_t *xp, float *dt) {
    const int64_t B = K / Q8, T = (M + 15) / 16;
    memset(xp, 0, (size_t)T * (size_t)B * 512);
    memset(dt, 0, sizeof(float) * (size_t)T * (size_t)B * 16);
    for (int64_t m = 0; m < M; m++) {
        const int64_t t = m / 16, j = m % 16;
        const uint32_t *src = (const uint32_t *)(xq + m * K);
        uint32_t *dst = (uint32_t *)xp + t * B * 128 + j;
        for (int64_t b = 0; b < B; b++) {
            for (int r = 0; r < 8; r++) dst[b * 128 + r * 16] = src[b * 8 + r];
            dt[(t * B + b) * 16 + j] = d[m * B + b];
        }
    }
}

/* up to 8 rows, by pairs of blocks p = b / 2, h = b % 2: xp[p 1024 + (8 h + r) 64 + 4 (8 h + m) + c] =
 * xq[m, 32 b + 4 r + c] and dt[p 16 + 8 h + m] = d[m, b], zeros elsewhere: one 64-value tile product gives the
 * pair's two blocks' dots side by side (the zeros keep each block to its own 8 columns) */
static void amx_pack_paired(const int8_t *xq, const float *d, int64_t M, int64_t K, int8_t *xp, float *dt) {
    const int64_t B = K / Q8, P = (B + 1) / 2;
    memset(xp, 0, (size_t)P * 1024);
    memset(dt, 0, sizeof(float) * (size_t)P * 16);
    for (int64_t m = 0; m < M; m++) {
        const uint32_t *src = (const uint32_t *)(xq + m * K);
        for (int64_t b = 0; b < B; b++) {
            const int64_t p = b / 2, h = b % 2;
            uint32_t *dst = (uint32_t *)xp + p * 256 + 8 * h * 16 + 8 * h + m;
            for (int r = 0; r < 8; r++) dst[r * 16] = src[b * 8 + r];
            dt[p * 16 + 8 * h + m] = d[m * B + b];
        }
    }
}

/* y[m0 + j, n + i] = o[i][j] (+ o[i][j + 8] when `fold`, the paired layout's two halves) * scale (+ bias) */
static inline void amx_write(const float *o, int fold, int64_t rows, int64_t m0, float *y, int64_t N, int64_t n,
                             const float *scale, const float *bias) {
    for (int64_t j = 0; j < rows; j++) {
        float *yr = y + (m0 + j) * N + n;
        for (int i = 0; i < 16; i++)
            yr[i] = (fold ? o[16 * i + j] + o[16 * i + j + 8] : o[16 * i + j]) * scale[n + i] + (bias ? bias[n + i] : 0.f);
    }
}

/* a pair of blocks (bb, bb + 1) into result tiles C0, C1 (weights through tiles 2 and 4, activations 3 and 5) */
#define AMX_PAIR(C0, C1, bb)                                                                                   \
    do {                                                                                                       \
        _tile_zero(C0);                                                                                        \
        _tile_zero(C1);                                                                                        \
        _tile_loadd(2, w + (bb) * Q8, K);                                                                      \
        _tile_loadd(3, xb + (bb) * 512, 64);                                                                   \
        _tile_loadd(4, w + ((bb) + 1) * Q8, K);                                                                \
        _tile_loadd(5, xb + ((bb) + 1) * 512, 64);                                                             \
        _tile_dpbssd(C0, 2, 3);                                                                                \
        _tile_dpbssd(C1, 4, 5);                                                                                \
    } while (0)

/* acc[n] += float(c[n][m]) * d[m, bb] for the 16 weight rows, over `nb` (1 or 2) stored blocks from bb */
static inline void amx_scale_add(__m512 *acc, const int32_t *c, const float *db, int64_t bb, int nb) {
    for (int h = 0; h < nb; h++) {
        const __m512 dv = _mm512_loadu_ps(db + (bb + h) * 16);
        for (int i = 0; i < 16; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 256 * h + 16 * i)), dv, acc[i]);
    }
}

/* weight rows [n0, n1) for every activation row: whole groups of 16 on the tiles, the rest on the vector tiles.
 * Pairs of blocks alternate between result tiles (0, 1) and (6, 7), so the tiles multiply the next pair while
 * the vector units scale and add the last one */
static void linear_w8_amx(const int8_t *xp, const float *dt, const int8_t *xq, const uint8_t *xa, const float *d,
                          int64_t M, int64_t K, const int8_t *q, const float *scale, const float *bias, float *y,
                          int64_t N, int64_t n0, int64_t n1) {
    const int64_t B = K / Q8, T = (M + 15) / 16, P = B / 2;
    int32_t c[2][512] __attribute__((aligned(64)));
    float o[256] __attribute__((aligned(64)));
    int64_t n = n0;
    _tile_loadconfig(&amx_cfg);
    for (; n + 16 <= n1; n += 16) {
        const int8_t *w = q + n * K;
        for (int64_t t = 0; t < T; t++) {
            const int8_t *xb = xp + t * B * 512;
            const float *db = dt + t * B * 16;
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            if (P > 0) AMX_PAIR(0, 1, 0);
            for (int64_t p = 0; p < P; p += 2) {
                if (t == 0 && 2 * p + AMX_PREFETCH_BLOCKS < B) /* 16 strided rows defeat the hardware prefetcher */
                    for (int i = 0; i < 16; i++)
                        _mm_prefetch((const char *)(w + i * K + (2 * p + AMX_PREFETCH_BLOCKS) * Q8), _MM_HINT_T0);
                if (p + 1 < P) AMX_PAIR(6, 7, 2 * (p + 1));
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[0] + 256, 64);
                amx_scale_add(acc, c[0], db, 2 * p, 2);
                if (p + 1 < P) {
                    if (p + 2 < P) AMX_PAIR(0, 1, 2 * (p + 2));
                    _tile_stored(6, c[1], 64);
                    _tile_stored(7, c[1] + 256, 64);
                    amx_scale_add(acc, c[1], db, 2 * (p + 1), 2);
                }
            }
            if (B % 2) {
                _tile_zero(0);
                _tile_loadd(2, w + (B - 1) * Q8, K);
                _tile_loadd(3, xb + (B - 1) * 512, 64);
                _tile_dpbssd(0, 2, 3);
                _tile_stored(0, c[0], 64);
                amx_scale_add(acc, c[0], db, B - 1, 1);
            }
            for (int i = 0; i < 16; i++) _mm512_store_ps(o + 16 * i, acc[i]);
            amx_write(o, 0, M - 16 * t < 16 ? M - 16 * t : 16, 16 * t, y, N, n, scale, bias);
        }
    }
    _tile_release();
    if (n < n1) linear_w8_rows(xq, xa, d, M, K, q, scale, bias, y, N, n, n1);
}
#undef AMX_PAIR

/* pair p of blocks (64 values) into result tile C through weight tile A and activation tile X */
#define AMX_PAIRED(C, A, X, p)                                                                                 \
    do {                                                                                                       \
        _tile_zero(C);                                                                                         \
        _tile_loadd(A, w + (p) * 2 * Q8, K);                                                                   \
        _tile_loadd(X, xp + (p) * 1024, 64);                                                                   \
        _tile_dpbssd(C, A, X);                                                                                 \
    } while (0)

/* linear_w8_amx for up to 8 rows (amx_pack_paired): one tile product per pair of blocks, half the products and
 * half the scaling of a 16-row tile per block, where 8 of its 16 columns would be zeros */
static void linear_w8_amx_paired(const int8_t *xp, const float *dt, const int8_t *xq, const uint8_t *xa,
                                 const float *d, int64_t M, int64_t K, const int8_t *q, const float *scale,
                                 const float *bias, float *y, int64_t N, int64_t n0, int64_t n1) {
    const int64_t B = K / Q8, P = B / 2;
    int32_t c[2][256] __attribute__((aligned(64)));
    float o[256] __attribute__((aligned(64)));
    int64_t n = n0;
    _tile_loadconfig(&amx_cfg_paired);
    for (; n + 16 <= n1; n += 16) {
        const int8_t *w = q + n * K;
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        if (P > 0) AMX_PAIRED(0, 2, 3, 0);
        for (int64_t p = 0; p < P; p += 2) {
            if (2 * p + AMX_PREFETCH_BLOCKS < B)
                for (int i = 0; i < 16; i++)
                    _mm_prefetch((const char *)(w + i * K + (2 * p + AMX_PREFETCH_BLOCKS) * Q8), _MM_HINT_T0);
            if (p + 1 < P) AMX_PAIRED(1, 6, 7, p + 1);
            _tile_stored(0, c[0], 64);
            amx_scale_add(acc, c[0], dt, p, 1);
            if (p + 1 < P) {
                if (p + 2 < P) AMX_PAIRED(0, 2, 3, p + 2);
                _tile_stored(1, c[1], 64);
                amx_scale_add(acc, c[1], dt, p + 1, 1);
            }
        }
        if (B % 2) { /* the last block alone: the first 8 rows of pair P's activations (columns 8-15 zero) */
            _tile_zero(0);
            _tile_loadd(4, w + (B - 1) * Q8, K);
            _tile_loadd(5, xp + P * 1024, 64);
            _tile_dpbssd(0, 4, 5);
            _tile_stored(0, c[0], 64);
            amx_scale_add(acc, c[0], dt, P, 1);
        }
        for (int i = 0; i < 16; i++) _mm512_store_ps(o + 16 * i, acc[i]);
        amx_write(o, 1, M, 0, y, N, n, scale, bias);
    }
    _tile_release();
    if (n < n1) linear_w8_rows(xq, xa, d, M, K, q, scale, bias, y, N, n, n1);
}
#undef AMX_PAIRED

typedef void (*amx_fn)(const int8_t *, const float *, const int8_t *, const uint8_t *, const float *, int64_t,
                       int64_t, const int8_t *, const float *, const float *, float *, int64_t, int64_t, int64_t);
#endif

/* the fewest rows the w8a8 linear takes through the weight-stationary tiles below (where VNNI is) */
static int64_t w8_many_rows = 8; /* tk_w8_many_rows */
#if TK_VNNI
/* Many rows (w8_many_rows and more): weight-stationary tiles. The weight rows (output columns) are taken 32 at
 * a time and transposed into a per-thread strip, [K / 4][32 columns][4 bytes] (two 16-column vectors a quad of
 * k; 16 x 16 dword transposes), with each block's column sums; then every 6-row block of activations runs over
 * the strip while it is in L1/L2: per quad of k, 2 weight loads, 6 broadcasts of a row's 4 bytes, 12 vpdpbusd
 * into 16-column int32 sums. vpdpbusd multiplies unsigned by signed bytes: the activations go in as q + 128 and
 * each block's sums start from -128 x the weights' block sums, so every block's integer dot is exact (as in the
 * tiles above); then one convert and one FMA by the row's block scale per 32 products, the channel scale and
 * bias at the end. ~2x the row-pair tiles at 32 rows on a Zen 4 core: 233 against 118 GOP/s
 * (bench/cpu_w8a8_rows.py). */
#define W8M_STRIP 32
static __thread void *w8m_scratch = 0;
static __thread size_t w8m_scratch_cap = 0;

/* r[i] (16 dwords each) -> r[j] lane i = the old r[i] lane j */
static inline void transpose16x16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + c], 128-bit lane L: rows 4i..4i+3, dword 4L + c */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i p = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), q = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i p2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44),
                      q2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(p, p2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(p, p2, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(q, q2, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(q, q2, 0xDD);
    }
}

/* weight rows [n, n + cols) (cols <= 32; the rest zero) -> strip [K / 4][32][4] and corr [K / 32][32] */
static void w8m_pack(const int8_t *q, int64_t K, int64_t n, int64_t cols, int8_t *strip, int32_t *corr) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int h = 0; h < 2; h++)
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            const __mmask16 m = K - k0 >= 64 ? (__mmask16)0xFFFF : (__mmask16)0x00FF; /* K % 32 == 0 */
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t c = 16 * h + i;
                r[i] = c < cols ? _mm512_maskz_loadu_epi32(m, q + (n + c) * K + k0) : _mm512_setzero_si512();
            }
            transpose16x16(r);
            const int quads = m == 0xFFFF ? 16 : 8;
            for (int j = 0; j < quads; j++) _mm512_storeu_si512((void *)(strip + (k0 / 4 + j) * 128 + h * 64), r[j]);
            for (int b = 0; b < quads / 8; b++) {
                __m512i s = _mm512_setzero_si512();
                for (int j = 0; j < 8; j++) s = _mm512_dpbusd_epi32(s, ones, r[8 * b + j]);
                _mm512_storeu_si512((void *)(corr + (k0 / 32 + b) * 32 + h * 16), _mm512_slli_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), s), 7));
            }
        }
}

#define TK_DEF_W8M(MR)                                                                                         \
    static void w8m_##MR(const uint8_t *xu, const float *d, int64_t K, const int8_t *strip, const int32_t *corr, \
                         const float *scale, const float *bias, float *y, int64_t ldy, int64_t cols) {         \
        const int64_t B = K / Q8;                                                                              \
        __m512 acc[MR][2];                                                                                     \
        for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                             \
        for (int64_t b = 0; b < B; b++) {                                                                      \
            __m512i s[MR][2];                                                                                  \
            const __m512i c0 = _mm512_loadu_si512((const void *)(corr + b * 32)),                              \
                          c1 = _mm512_loadu_si512((const void *)(corr + b * 32 + 16));                         \
            for (int r = 0; r < MR; r++) s[r][0] = c0, s[r][1] = c1;                                           \
            for (int j = 0; j < 8; j++) {                                                                      \
                const int8_t *w = strip + (b * 8 + j) * 128;                                                   \
                const __m512i w0 = _mm512_loadu_si512((const void *)w), w1 = _mm512_loadu_si512((const void *)(w + 64)); \
                for (int r = 0; r < MR; r++) {                                                                 \
                    int32_t x4;                                                                                \
                    memcpy(&x4, xu + r * K + b * Q8 + 4 * j, 4);                                               \
                    const __m512i xb = _mm512_set1_epi32(x4);                                                  \
                    s[r][0] = _mm512_dpbusd_epi32(s[r][0], xb, w0);                                            \
                    s[r][1] = _mm512_dpbusd_epi32(s[r][1], xb, w1);                                            \
                }                                                                                              \
            }                                                                                                  \
            for (int r = 0; r < MR; r++) {                                                                     \
                const __m512 db = _mm512_set1_ps(d[r * B + b]);                                                \
                acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), db, acc[r][0]);                       \
                acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), db, acc[r][1]);                       \
            }                                                                                                  \
        }                                                                                                      \
        for (int h = 0; h < 2; h++) {                                                                          \
            const int64_t left = cols - 16 * h;                                                                \
            if (left <= 0) break;                                                                              \
            const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);                \
            const __m512 sc = _mm512_maskz_loadu_ps(m, scale + 16 * h),                                        \
                         bi = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * h) : _mm512_setzero_ps();            \
            for (int r = 0; r < MR; r++) _mm512_mask_storeu_ps(y + r * ldy + 16 * h, m, _mm512_fmadd_ps(acc[r][h], sc, bi)); \
        }                                                                                                      \
    }
TK_DEF_W8M(1) TK_DEF_W8M(2) TK_DEF_W8M(3) TK_DEF_W8M(4) TK_DEF_W8M(5) TK_DEF_W8M(6)
typedef void (*w8m_fn)(const uint8_t *, const float *, int64_t, const int8_t *, const int32_t *, const float *,
                       const float *, float *, int64_t, int64_t);
static const w8m_fn W8M[7] = {0, w8m_1, w8m_2, w8m_3, w8m_4, w8m_5, w8m_6};

/* columns [n0, n1) of every row; returns 1 when this thread's strip could not be allocated */
static int w8m_columns(const uint8_t *xu, const float *d, int64_t M, int64_t K, const int8_t *q, const float *scale,
                       const float *bias, float *y, int64_t N, int64_t n0, int64_t n1) {
    if (grow_scratch(&w8m_scratch, &w8m_scratch_cap, (size_t)K * W8M_STRIP + sizeof(int32_t) * (size_t)K)) return 1;
    int8_t *strip = (int8_t *)w8m_scratch;
    int32_t *corr = (int32_t *)(strip + K * W8M_STRIP); /* K * 32 bytes: aligned for int32 */
    for (int64_t n = n0; n < n1; n += W8M_STRIP) {
        const int64_t cols = n1 - n < W8M_STRIP ? n1 - n : W8M_STRIP;
        w8m_pack(q, K, n, cols, strip, corr);
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
            const int mr = M - m0 < 6 ? (int)(M - m0) : 6;
            W8M[mr](xu + m0 * K, d + m0 * (K / Q8), K, strip, corr, scale + n, bias ? bias + n : 0, y + m0 * N + n, N, cols);
        }
    }
    return 0;
}
#endif

/* whether w8a8 takes the AMX tiles at AMX_MIN_ROWS rows and more: `on` 0 or 1 sets it (tests and benchmarks
 * compare both ways), -1 only asks; 0 where the build or the kernel has no AMX */
int tk_set_amx(int on) {
#if TK_AMX
    if (on >= 0) amx_wanted = on != 0;
    return amx_ready();
#else
    (void)on;
    return 0;
#endif
}

/* The path settings, `tk_<name>(v)`: v >= 0 sets it, -1 only asks. The same bits whatever they say; only the
 * speed differs (kernels/cpu_kernels.py `calibrate` sets them per machine):
 * - sgemm_min_rows: the fewest rows the float32 linear hands to the external SGEMM (below it, the register
 *   tiles, 8 rows at a time);
 * - block_max_kn: the largest float32 weight (K * N floats) the register blocks take;
 * - block_max_k, block_min_rows: the longest column (K) they take, and the fewest rows from which they take a
 *   weight above the built-in bounds;
 * - stream_pf: rows of k the float32 streams prefetch ahead (0: none);
 * - split_per_thread: chunks a thread of the quantised and bf16 linears' columns (TK_OVER_COLUMNS);
 * - w8_many_rows: the fewest rows w8a8 takes through the weight-stationary tiles (with VNNI). */
#define TK_KNOB(name)                                                                                          \
    int64_t tk_##name(int64_t v) {                                                                             \
        if (v >= 0) name = v;                                                                                  \
        return name;                                                                                           \
    }
TK_KNOB(sgemm_min_rows)
TK_KNOB(split_per_thread)
TK_KNOB(block_max_kn)
TK_KNOB(block_max_k)
TK_KNOB(block_min_rows)
TK_KNOB(stream_pf)
TK_KNOB(w8_many_rows)
TK_KNOB(one_row)

/* y[M, N] = (q8(x) . q) * scale (+ bias); returns 0, or 1 when the scratch allocation failed */
int tk_linear_w8a8(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N,
                   const float *bias, float *y, int nthreads) {
    if (K % Q8) return 2;
    const int64_t B = K / Q8;
    size_t need = 2 * (size_t)M * (size_t)K + sizeof(float) * (size_t)M * (size_t)B;
#if TK_AMX
    const int amx = M >= AMX_MIN_ROWS && N >= 16 && amx_ready();
    const int paired = M <= AMX_PAIRED_ROWS;
    const size_t at = (need + 63) / 64 * 64,
                 pack = paired ? (size_t)((B + 1) / 2) * 1024 : (size_t)((M + 15) / 16) * (size_t)B * 512;
    if (amx) need = at + pack + pack / 8; /* + the scales, 16 floats per 512 bytes */
#endif
    if (grow_scratch(&q8_scratch, &q8_scratch_cap, need)) return 1;
    int8_t *xq = (int8_t *)q8_scratch;
    uint8_t *xa = (uint8_t *)(xq + M * K);
    float *d = (float *)(xa + M * K); /* 2 M K is a multiple of 64: aligned for float */
    quant_act_q8(x, M, K, xq, xa, d);
#if TK_AMX
    if (amx) {
        int8_t *xp = (int8_t *)q8_scratch + at;
        float *dt = (float *)(xp + pack);
        (paired ? amx_pack_paired : amx_pack)(xq, d, M, K, xp, dt);
        amx_fn tiles = paired ? linear_w8_amx_paired : linear_w8_amx;
#define W8_AMX(a, b) tiles(xp, dt, xq, xa, d, M, K, q, scale, bias, y, N, a, b)
        TK_OVER_COLUMNS(N, nthreads, 16, W8_AMX);
#undef W8_AMX
        return 0;
    }
#endif
#if TK_VNNI
    if (M >= w8_many_rows) {
        uint8_t *xu = xa; /* q + 128 as unsigned bytes, in place of |q| (the row-pair tiles' side) */
        for (int64_t i = 0; i < M * K; i++) xu[i] = (uint8_t)xq[i] ^ 0x80u;
        int failed = 0;
#define W8_MANY(a, b)                                                                                          \
    if (w8m_columns(xu, d, M, K, q, scale, bias, y, N, (a), (b))) __atomic_store_n(&failed, 1, __ATOMIC_RELAXED)
        TK_OVER_COLUMNS(N, nthreads, W8M_STRIP, W8_MANY);
#undef W8_MANY
        return failed;
    }
#endif
#define W8_ROWS(a, b) linear_w8_rows(xq, xa, d, M, K, q, scale, bias, y, N, a, b)
    TK_OVER_COLUMNS(N, nthreads, 4, W8_ROWS);
#undef W8_ROWS
    return 0;
}

/* ---- int8 weights with a scale per block of 32 (GGUF Q8_0's own blocks): q [N, K], scale float16 [N, K / 32] --
 * Weight-only (float32 activations: each block's 32 products summed, then scaled by its block's scale) and
 * w8a8 (the activations quantised per 32 as above: one integer dot per block, scaled by both blocks' scales,
 * llama.cpp's q8_0 x q8_0 dot). Need K % 32 == 0. The w8a8 tiles are the 256-bit ones (dot_q8: vpdpbusd where
 * the build has VNNI); no AMX. */

#if TK_AVX2
/* two weight rows x MR activation rows: s0[r], s1[r] = sum_b c[b] * (x[r, b] . q[b]) */
#define TK_DEF_I8G(MR)                                                                                         \
    static void i8g_2x##MR(const float *x, int64_t K, const int8_t *q0, const int8_t *q1, const uint16_t *c0,  \
                           const uint16_t *c1, float *s0, float *s1) {                                        \
        __m256 a0[MR], a1[MR];                                                                                 \
        for (int r = 0; r < MR; r++) a0[r] = a1[r] = _mm256_setzero_ps();                                     \
        for (int64_t b = 0; b < K / Q8; b++) {                                                                 \
            __m256 p0[MR], p1[MR];                                                                             \
            for (int r = 0; r < MR; r++) p0[r] = p1[r] = _mm256_setzero_ps();                                 \
            for (int j = 0; j < Q8; j += 8) {                                                                  \
                __m256 w0 = i8x8(q0 + b * Q8 + j), w1 = i8x8(q1 + b * Q8 + j);                                 \
                for (int r = 0; r < MR; r++) {                                                                 \
                    __m256 xv = _mm256_loadu_ps(x + r * K + b * Q8 + j);                                       \
                    p0[r] = _mm256_fmadd_ps(xv, w0, p0[r]);                                                    \
                    p1[r] = _mm256_fmadd_ps(xv, w1, p1[r]);                                                    \
                }                                                                                              \
            }                                                                                                  \
            __m256 g0 = _mm256_set1_ps(f16_to_f32(c0[b])), g1 = _mm256_set1_ps(f16_to_f32(c1[b]));             \
            for (int r = 0; r < MR; r++) {                                                                     \
                a0[r] = _mm256_fmadd_ps(p0[r], g0, a0[r]);                                                     \
                a1[r] = _mm256_fmadd_ps(p1[r], g1, a1[r]);                                                     \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < MR; r++) {                                                                         \
            s0[r] = hsum256(a0[r]);                                                                            \
            s1[r] = hsum256(a1[r]);                                                                            \
        }                                                                                                      \
    }
TK_DEF_I8G(1)
TK_DEF_I8G(2)
TK_DEF_I8G(3)
TK_DEF_I8G(4)
typedef void (*i8g_fn)(const float *, int64_t, const int8_t *, const int8_t *, const uint16_t *, const uint16_t *,
                       float *, float *);
static const i8g_fn I8G[5] = {0, i8g_2x1, i8g_2x2, i8g_2x3, i8g_2x4};

/* NR weight rows x MR activation rows of w8a8 with block scales on both sides: the per-channel tiles' shape
 * (TK_DEF_W8T) with each block's product scaled by d[r, b] * ws[i, b] */
#define W8G_ARGS const uint16_t *ws,
#define W8_BLOCK _mm256_set1_ps(d[r * B + b] * f16_to_f32(ws[i * B + b]))
TK_DEF_W8T(w8g_, 4, 1, W8G_ARGS, W8_BLOCK)
TK_DEF_W8T(w8g_, 4, 2, W8G_ARGS, W8_BLOCK)
TK_DEF_W8T(w8g_, 1, 1, W8G_ARGS, W8_BLOCK)
#endif

static void linear_i8g_rows(const float *x, int64_t M, int64_t K, const int8_t *q, const uint16_t *sc,
                            const float *bias, float *y, int64_t N, int64_t n0, int64_t n1) {
    const int64_t B = K / Q8;
    int64_t n = n0;
#if TK_AVX2
    float s0[4], s1[4];
    for (; n + 2 <= n1; n += 2)
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int mr = (int)(M - m0 < 4 ? M - m0 : 4);
            I8G[mr](x + m0 * K, K, q + n * K, q + (n + 1) * K, sc + n * B, sc + (n + 1) * B, s0, s1);
            for (int r = 0; r < mr; r++) {
                y[(m0 + r) * N + n] = s0[r] + (bias ? bias[n] : 0.f);
                y[(m0 + r) * N + n + 1] = s1[r] + (bias ? bias[n + 1] : 0.f);
            }
        }
#endif
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float t = 0.f;
            for (int64_t b = 0; b < B; b++) {
                float p = 0.f;
                for (int j = 0; j < Q8; j++) p += x[m * K + b * Q8 + j] * q[n * K + b * Q8 + j];
                t += p * f16_to_f32(sc[n * B + b]);
            }
            y[m * N + n] = t + (bias ? bias[n] : 0.f);
        }
}

/* many rows: the weight widened once with its block scales (q * scale, as the dequantised reference), SGEMM */
static int linear_i8g_sgemm(const float *x, int64_t M, int64_t K, const int8_t *q, const uint16_t *sc, int64_t N,
                            const float *bias, float *y) {
    size_t need = (size_t)N * (size_t)K;
    if (grow_scratch(&i8_scratch, &i8_scratch_cap, sizeof(float) * need)) return 1;
    float *wf = (float *)i8_scratch;
    for (size_t i = 0; i < need; i++) wf[i] = (float)q[i] * f16_to_f32(sc[i / Q8]);
    int n = (int)N, m = (int)M, k = (int)K;
    float one = 1.f, zero = 0.f;
    tk_sgemm("T", "N", &n, &m, &k, &one, wf, &k, x, &k, &zero, y, &n);
    if (bias)
        for (int64_t r = 0; r < M; r++)
            for (int64_t c = 0; c < N; c++) y[r * N + c] += bias[c];
    return 0;
}

/* y[M, N] = x . (q * scale[n, k / 32]) (+ bias); 0, or 2 when K is not a multiple of 32 */
int tk_linear_i8g(const float *x, int64_t M, int64_t K, const int8_t *q, const uint16_t *scale, int64_t N,
                  const float *bias, float *y, int nthreads) {
    if (K % Q8) return 2;
    if (tk_sgemm && M >= SGEMM_MIN_ROWS && M < (1 << 30) && K < (1 << 30) && N < (1 << 30)
        && (int64_t)N * K < ((int64_t)1 << 31) && !linear_i8g_sgemm(x, M, K, q, scale, N, bias, y))
        return 0;
#define I8G_ROWS(a, b) linear_i8g_rows(x, M, K, q, scale, bias, y, N, a, b)
    TK_OVER_COLUMNS(N, nthreads, 2, I8G_ROWS);
#undef I8G_ROWS
    return 0;
}

static void linear_w8g_rows(const int8_t *xq, const uint8_t *xa, const float *d, int64_t M, int64_t K,
                            const int8_t *q, const uint16_t *ws, const float *bias, float *y, int64_t N, int64_t n0,
                            int64_t n1) {
    const int64_t B = K / Q8;
    int64_t n = n0;
#if TK_AVX2
    float s[8];
    for (; n + 4 <= n1; n += 4) {
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            w8g_4x2(xq + m * K, xa + m * K, d + m * B, K, q + n * K, ws + n * B, s);
            for (int r = 0; r < 2; r++)
                for (int i = 0; i < 4; i++) y[(m + r) * N + n + i] = s[r * 4 + i] + (bias ? bias[n + i] : 0.f);
        }
        for (; m < M; m++) {
            w8g_4x1(xq + m * K, xa + m * K, d + m * B, K, q + n * K, ws + n * B, s);
            for (int i = 0; i < 4; i++) y[m * N + n + i] = s[i] + (bias ? bias[n + i] : 0.f);
        }
    }
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            w8g_1x1(xq + m * K, xa + m * K, d + m * B, K, q + n * K, ws + n * B, s);
            y[m * N + n] = s[0] + (bias ? bias[n] : 0.f);
        }
#else
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float t = 0.f;
            for (int64_t b = 0; b < B; b++) {
                int32_t acc = 0;
                for (int j = 0; j < Q8; j++) acc += (int32_t)xq[m * K + b * Q8 + j] * q[n * K + b * Q8 + j];
                t += d[m * B + b] * f16_to_f32(ws[n * B + b]) * (float)acc;
            }
            y[m * N + n] = t + (bias ? bias[n] : 0.f);
        }
#endif
}

/* y[M, N] = q8(x) . (q * scale[n, k / 32]) (+ bias); 0, 1 when the scratch allocation failed, 2 for K % 32 */
int tk_linear_w8a8g(const float *x, int64_t M, int64_t K, const int8_t *q, const uint16_t *scale, int64_t N,
                    const float *bias, float *y, int nthreads) {
    if (K % Q8) return 2;
    if (grow_scratch(&q8_scratch, &q8_scratch_cap, 2 * (size_t)M * (size_t)K + sizeof(float) * (size_t)M * (size_t)(K / Q8)))
        return 1;
    int8_t *xq = (int8_t *)q8_scratch;
    uint8_t *xa = (uint8_t *)(xq + M * K);
    float *d = (float *)(xa + M * K);
    quant_act_q8(x, M, K, xq, xa, d);
#define W8G_ROWS(a, b) linear_w8g_rows(xq, xa, d, M, K, q, scale, bias, y, N, a, b)
    TK_OVER_COLUMNS(N, nthreads, 4, W8G_ROWS);
#undef W8G_ROWS
    return 0;
}

/* ---- int4 weights x int8 activations (w4a8): kernels.quant_matmul's int4 format ------------------------------
 * q uint8 [N, K / 2] (even k in the low nibble), scale [N, K / group] as stored (skind 0: float32, 1: float16,
 * 2: bfloat16; read once per row and group),
 * zero packed two per byte, uint8 [N, ceil(G / 2)] (even g in the low nibble; zero = nibble + zoff), or NULL
 * for 8 everywhere (symmetric); w = (q - zero) * scale; group 64 or 128. The activations are quantised per 32 as
 * for w8a8 and stored per pair of blocks in the nibbles' order (both blocks' even positions, then both
 * blocks' odd ones), so 32 packed bytes (64 weights) give two vectors of nibbles, `& 15` and `>> 4 & 15`, each
 * one vpmaddubsw with the matching activations (nibbles are the unsigned side: no sign trick, and the two
 * products add in int16 without saturating); the zero point comes off once per group through the group's
 * activation sum: sum (q - z) x = q.x - z sum x. */

/* scale i of an int4 weight stored as float32 (skind 0), float16 (1) or bfloat16 (2) */
static inline float scale_at(const void *s, int64_t skind, int64_t i) {
    return skind == 1 ? f16_to_f32(((const uint16_t *)s)[i])
           : skind == 2 ? bf16_to_f32(((const uint16_t *)s)[i]) : ((const float *)s)[i];
}

/* the zero point of group g in a row of packed zeros (NULL: 8) */
static inline float zero_at(const uint8_t *zrow, int64_t g, int64_t zoff) {
    return zrow ? (float)(((zrow[g >> 1] >> ((g & 1) * 4)) & 15) + zoff) : 8.f;
}

static __thread void *q4_scratch = 0;
static __thread size_t q4_scratch_cap = 0;

/* xp: the quantised activations, each pair of blocks as [evens of both | odds of both]; d [M, K / 32];
 * gsum[m, g] = sum over the group's blocks of d * (the block's sum of quantised values) */
static void quant_act_q8_pairs(const float *x, int64_t M, int64_t K, int64_t group, int8_t *xp, float *d,
                               float *gsum) {
    const int64_t B = K / Q8, G = K / group, bpg = group / Q8;
    uint8_t *xa = (uint8_t *)(xp + M * K); /* scratch beyond xp (the caller sized it 2 M K) */
    quant_act_q8(x, M, K, xp, xa, d);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < G; g++) {
            float t = 0.f;
            for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
                const int8_t *p = xp + m * K + b * Q8;
                int sum = 0;
                for (int j = 0; j < Q8; j++) sum += p[j];
                t += d[m * B + b] * (float)sum;
            }
            gsum[m * G + g] = t;
        }
        for (int64_t b = 0; b + 2 <= B; b += 2) {
            int8_t *p = xp + m * K + b * Q8, t[2 * Q8];
            for (int j = 0; j < Q8 / 2; j++) {
                t[j] = p[2 * j];                      /* block b's evens */
                t[Q8 / 2 + j] = p[Q8 + 2 * j];        /* block b + 1's evens */
                t[Q8 + j] = p[2 * j + 1];             /* block b's odds */
                t[Q8 + Q8 / 2 + j] = p[Q8 + 2 * j + 1];
            }
            memcpy(p, t, 2 * Q8);
        }
    }
}

#if TK_AVX2
/* NR weight rows x MR activation rows over K (q rows at stride K / 2 bytes, scales/zeros at stride G) */
/* the eight int32 sums of a pair of blocks' products: the low nibbles against the evens, the high ones against
 * the odds. VNNI: two chained vpdpbusd; else vpmaddubsw twice, an add, vpmaddwd (nothing saturates, 15 * 127 * 4
 * fits the 16-bit lanes): the same exact integers in the same lanes either way. A 512-bit form (two pairs per
 * dot) measured faster on K = 1024 weights and slower on K = 2048-5632 ones (docs/benchmarks.md) */
static inline __m256i w4_dot(__m256i wl, __m256i wh, __m256i xl, __m256i xh) {
#if TK_VNNI
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), wl, xl), wh, xh);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(wl, xl), _mm256_maddubs_epi16(wh, xh)),
                             _mm256_set1_epi16(1));
#endif
}

#if defined(__F16C__) /* eight float16 scales at once (else one by one, as scale_at) */
#define W4_F16C 1
#define W4_F16X8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#else
#define W4_F16C 0
#define W4_F16X8(p) _mm256_setzero_ps()
#endif
/* the scales of groups g .. g + 7 of a row (srow: the row's first), exactly scale_at's values; F16C for float16 */
static inline __m256 w4_scale8(const char *srow, int64_t sk, int64_t g) {
    return sk == 1 ? W4_F16X8(srow + 2 * g)
         : sk == 2 ? _mm256_castsi256_ps(
                         _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(srow + 2 * g))), 16))
                   : _mm256_loadu_ps((const float *)srow + g);
}

/* the zero points of groups g .. g + 7 of a row of packed zeros (NULL: 8), exactly zero_at's values */
static inline __m256 w4_zero8(const uint8_t *zrow, int64_t zoff, int64_t g) {
    if (!zrow) return _mm256_set1_ps(8.f);
    const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), sh = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    int32_t four;
    memcpy(&four, zrow + g / 2, 4);
    __m256i z = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi32_si128(four)), dup);
    z = _mm256_and_si256(_mm256_srlv_epi32(z, sh), _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(z, _mm256_set1_epi32((int32_t)zoff)));
}

/* row n's zero-point term, the sum over its groups of scale * zero * gsum[g]: eight groups at a time in the lanes
 * of one vector (summed as hsum256 sums), then any groups past the last eight in order. Every path takes a row's
 * term from here, so a row has the same bits in any of them */
static inline float w4_corr(const void *scale, int64_t sk, const uint8_t *zp, int64_t zoff, int64_t G, int64_t GZ,
                            int64_t n, const float *gsum) {
    const char *srow = (const char *)scale + n * G * (sk ? 2 : 4);
    const uint8_t *zrow = zp ? zp + n * GZ : 0;
    __m256 c = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G && (sk != 1 || W4_F16C); g += 8)
        c = _mm256_fmadd_ps(_mm256_mul_ps(w4_scale8(srow, sk, g), w4_zero8(zrow, zoff, g)), _mm256_loadu_ps(gsum + g),
                            c);
    float t = hsum256(c);
    for (; g < G; g++) t = fmaf(scale_at(scale, sk, n * G + g) * zero_at(zrow, g, zoff), gsum[g], t);
    return t;
}

#define TK_DEF_W4(NR, MR)                                                                                      \
    static void w4_##NR##x##MR(const int8_t *xp, const float *d, const float *gsum, int64_t K, int64_t group,   \
                               const uint8_t *q, const void *sc, int64_t sk, const uint8_t *zp, int64_t zoff,    \
                               float *s) {                                                                     \
        const int64_t B = K / Q8, G = K / group, ppg = group / (2 * Q8), GZ = (G + 1) / 2;                   \
        const __m256i lo4 = _mm256_set1_epi8(0x0F);                                                            \
        __m256 acc[MR][NR];                                                                                    \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int i = 0; i < NR; i++) acc[r][i] = _mm256_setzero_ps();                                      \
        for (int64_t g = 0; g < G; g++) {                                                                      \
            __m256 grp[MR][NR];                                                                                \
            for (int r = 0; r < MR; r++)                                                                       \
                for (int i = 0; i < NR; i++) grp[r][i] = _mm256_setzero_ps();                                  \
            for (int64_t pi = 0; pi < ppg; pi++) {                                                             \
                const int64_t b = (g * ppg + pi) * 2; /* the pair's first block */                             \
                if (NR == 4) { /* the next 4 rows, 2 lines a step (this step's 4 x 32 bytes) */                \
                    _mm_prefetch((const char *)(q + 2 * K) + b * 64, _MM_HINT_T0);                             \
                    _mm_prefetch((const char *)(q + 2 * K) + b * 64 + 64, _MM_HINT_T0);                        \
                }                                                                                              \
                __m256i wl[NR], wh[NR];                                                                        \
                for (int i = 0; i < NR; i++) {                                                                 \
                    __m256i p = _mm256_loadu_si256((const __m256i *)(q + i * (K / 2) + b * 16));              \
                    wl[i] = _mm256_and_si256(p, lo4);                                                          \
                    wh[i] = _mm256_and_si256(_mm256_srli_epi16(p, 4), lo4);                                    \
                }                                                                                              \
                for (int r = 0; r < MR; r++) {                                                                 \
                    const int8_t *xr = xp + r * K + b * Q8;                                                    \
                    __m256i xl = _mm256_loadu_si256((const __m256i *)xr);                                      \
                    __m256i xh = _mm256_loadu_si256((const __m256i *)(xr + Q8));                               \
                    __m256 dv = _mm256_set_m128(_mm_set1_ps(d[r * B + b + 1]), _mm_set1_ps(d[r * B + b]));    \
                    for (int i = 0; i < NR; i++)                                                               \
                        grp[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(w4_dot(wl[i], wh[i], xl, xh)), dv,     \
                                                    grp[r][i]);                                                \
                }                                                                                              \
            }                                                                                                  \
            for (int i = 0; i < NR; i++) {                                                                     \
                const __m256 wv = _mm256_set1_ps(scale_at(sc, sk, i * G + g));                                 \
                for (int r = 0; r < MR; r++) acc[r][i] = _mm256_fmadd_ps(grp[r][i], wv, acc[r][i]);             \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int i = 0; i < NR; i++)                                                                       \
                s[r * NR + i] = hsum256(acc[r][i]) - w4_corr(sc, sk, zp, zoff, G, GZ, i, gsum + r * G);        \
    }
TK_DEF_W4(4, 1)
TK_DEF_W4(4, 2)
TK_DEF_W4(1, 1)
#endif

#if TK_AVX2
/* one activation row over weight rows [n0, n1), two rows at a time where K <= W4_PAIRED_MAX_K: w4_1x1's
 * arithmetic in its order for each row (the same bits), with the activation's block-scale vectors built once for
 * all rows, each pair of blocks' activation loads shared by the two rows, and each row's group scales
 * converted eight at a time before its blocks instead of one per group inside them. Two rows read side by side
 * are two short streams the hardware prefetcher does not follow (alone, ~2.5x slower from memory), so the loop
 * prefetches the rows ~W4_AHEAD bytes on, one line a step, in address order; rows over 1 KB (K > 2048) measured
 * slower paired even so and are read alone (docs/benchmarks.md). 0 where K has more groups than its stack arrays
 * hold (the tiles then) */
#define W4R_MAX 512
#define W4_AHEAD 4096       /* bytes: the prefetch distance, in whole pairs of rows */
#define W4_PAIRED_MAX_K 2048 /* longer rows alone (paired, their two streams ran slower from memory) */
/* one row's group scales, exactly as scale_at gives them */
static inline void w4_row_scales(const void *scale, int64_t sk, int64_t G, int64_t n, float *ws) {
    const char *srow = (const char *)scale + n * G * (sk ? 2 : 4);
    int64_t g = 0;
    for (; g + 8 <= G && (sk != 1 || W4_F16C); g += 8) _mm256_storeu_ps(ws + g, w4_scale8(srow, sk, g));
    for (; g < G; g++) ws[g] = scale_at(scale, sk, n * G + g);
}

/* R (1 or 2) rows at once, each row's arithmetic exactly as one alone (the same bits) */
#define TK_DEF_W4R(R)                                                                                          \
    static inline void w4_rowsx##R(const int8_t *xp, const __m256 *dvs, const float *gsum, int64_t K,        \
                                   int64_t G, int64_t GZ, int64_t ppg, const uint8_t *q, const void *scale,     \
                                   int64_t sk, const uint8_t *zp, int64_t zoff, const float *bias, float *y,   \
                                   int64_t n, float (*ws)[W4R_MAX]) {                                          \
        const __m256i lo4 = _mm256_set1_epi8(0x0F);                                                            \
        for (int r = 0; r < R; r++) w4_row_scales(scale, sk, G, n + r, ws[r]);                                 \
        const uint8_t *qn = q + n * (K / 2);                                                                   \
        const int64_t ahead_rows = R * ((W4_AHEAD + R * (K / 2) - 1) / (R * (K / 2)));                         \
        __m256 acc[R];                                                                                         \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                              \
        for (int64_t g = 0; g < G; g++) {                                                                      \
            __m256 grp[R];                                                                                     \
            for (int r = 0; r < R; r++) grp[r] = _mm256_setzero_ps();                                          \
            for (int64_t pi = 0; pi < ppg; pi++) {                                                             \
                const int64_t pr = g * ppg + pi, b = pr * 2;                                                   \
                const int8_t *xr = xp + b * Q8;                                                                \
                const __m256i xl = _mm256_loadu_si256((const __m256i *)xr);                                    \
                const __m256i xh = _mm256_loadu_si256((const __m256i *)(xr + Q8));                             \
                const __m256 dv = dvs[pr];                                                                     \
                if (R > 1) { /* R rows' 32 bytes a step, R / 2 lines, ahead_rows on */                         \
                    const char *ahead = (const char *)qn + ahead_rows * (K / 2) + pr * 32 * R;                 \
                    for (int l = 0; l < R / 2; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);                 \
                }                                                                                              \
                for (int r = 0; r < R; r++) {                                                                  \
                    __m256i pk = _mm256_loadu_si256((const __m256i *)(qn + r * (K / 2) + b * 16));            \
                    __m256i wl = _mm256_and_si256(pk, lo4), wh = _mm256_and_si256(_mm256_srli_epi16(pk, 4), lo4); \
                    grp[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(w4_dot(wl, wh, xl, xh)), dv, grp[r]);          \
                }                                                                                              \
            }                                                                                                  \
            for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(grp[r], _mm256_set1_ps(ws[r][g]), acc[r]);    \
        }                                                                                                      \
        for (int r = 0; r < R; r++)                                                                            \
            y[n + r] = hsum256(acc[r]) - w4_corr(scale, sk, zp, zoff, G, GZ, n + r, gsum)                      \
                       + (bias ? bias[n + r] : 0.f);                                                           \
    }
TK_DEF_W4R(2)
TK_DEF_W4R(1)

static int w4_rows1(const int8_t *xp, const float *d, const float *gsum, int64_t K, int64_t group,
                    const uint8_t *q, const void *scale, int64_t sk, const uint8_t *zp, int64_t zoff,
                    const float *bias, float *y, int64_t n0, int64_t n1) {
    const int64_t B = K / Q8, G = K / group, ppg = group / (2 * Q8), GZ = (G + 1) / 2;
    if (B / 2 > W4R_MAX || G > W4R_MAX) return 0;
    __m256 dvs[W4R_MAX];
    float ws[2][W4R_MAX];
    for (int64_t p = 0; p < B / 2; p++)
        dvs[p] = _mm256_set_m128(_mm_set1_ps(d[2 * p + 1]), _mm_set1_ps(d[2 * p]));
    int64_t n = n0;
    if (K <= W4_PAIRED_MAX_K)
        for (; n + 2 <= n1; n += 2) w4_rowsx2(xp, dvs, gsum, K, G, GZ, ppg, q, scale, sk, zp, zoff, bias, y, n, ws);
    for (; n < n1; n++) w4_rowsx1(xp, dvs, gsum, K, G, GZ, ppg, q, scale, sk, zp, zoff, bias, y, n, ws);
    return 1;
}
#endif

static void linear_w4_rows(const int8_t *xp, const float *d, const float *gsum, int64_t M, int64_t K,
                           int64_t group, const uint8_t *q, const void *scale, int64_t sk, const uint8_t *zp,
                           int64_t zoff, const float *bias, float *y, int64_t N, int64_t n0, int64_t n1) {
    const int64_t B = K / Q8, G = K / group, GZ = (G + 1) / 2;
#define ZROW(n) (zp ? zp + (n) * GZ : 0)
#define SROW(n) ((const char *)scale + (n) * G * (sk ? 2 : 4))
    int64_t n = n0;
#if TK_AVX2
    if (one_row && M == 1 && w4_rows1(xp, d, gsum, K, group, q, scale, sk, zp, zoff, bias, y, n0, n1)) return;
    float s[8];
    for (; n + 4 <= n1 && !(one_row && M == 1); n += 4) {
        const uint8_t *qn = q + n * (K / 2);
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            w4_4x2(xp + m * K, d + m * B, gsum + m * G, K, group, qn, SROW(n), sk, ZROW(n), zoff, s);
            for (int r = 0; r < 2; r++)
                for (int i = 0; i < 4; i++)
                    y[(m + r) * N + n + i] = s[r * 4 + i] + (bias ? bias[n + i] : 0.f);
        }
        for (; m < M; m++) {
            w4_4x1(xp + m * K, d + m * B, gsum + m * G, K, group, qn, SROW(n), sk, ZROW(n), zoff, s);
            for (int i = 0; i < 4; i++) y[m * N + n + i] = s[i] + (bias ? bias[n + i] : 0.f);
        }
    }
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            w4_1x1(xp + m * K, d + m * B, gsum + m * G, K, group, q + n * (K / 2), SROW(n), sk, ZROW(n), zoff, s);
            y[m * N + n] = s[0] + (bias ? bias[n] : 0.f);
        }
#else
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float t = 0.f;
            for (int64_t g = 0; g < G; g++) {
                float tg = 0.f;
                for (int64_t b = g * (group / Q8); b < (g + 1) * (group / Q8); b += 2) {
                    const int8_t *xr = xp + m * K + b * Q8;
                    const uint8_t *qr = q + n * (K / 2) + b * 16;
                    int32_t a0 = 0, a1 = 0;
                    for (int j = 0; j < 16; j++) {
                        a0 += (int32_t)(qr[j] & 15) * xr[j] + (int32_t)(qr[j] >> 4) * xr[Q8 + j];
                        a1 += (int32_t)(qr[16 + j] & 15) * xr[16 + j] + (int32_t)(qr[16 + j] >> 4) * xr[Q8 + 16 + j];
                    }
                    tg += d[m * B + b] * (float)a0 + d[m * B + b + 1] * (float)a1;
                }
                const float ws = scale_at(scale, sk, n * G + g);
                t += ws * tg - ws * zero_at(ZROW(n), g, zoff) * gsum[m * G + g];
            }
            y[m * N + n] = t + (bias ? bias[n] : 0.f);
        }
#endif
#undef ZROW
#undef SROW
}

/* y[M, N] = q8(x) . ((q - zero) * scale) (+ bias); returns 0, 1 when the scratch allocation failed, 2 when the
 * group is not 64 or 128 or does not divide K */
int tk_linear_w4a8(const float *x, int64_t M, int64_t K, const uint8_t *q, const void *scale, int64_t skind,
                   const uint8_t *zero, int64_t zoff, int64_t group, int64_t N, const float *bias, float *y,
                   int nthreads) {
    if ((group != 64 && group != 128) || K % group) return 2;
    const int64_t B = K / Q8, G = K / group;
    size_t need = 2 * (size_t)M * (size_t)K + sizeof(float) * (size_t)M * (size_t)(B + G);
    if (grow_scratch(&q4_scratch, &q4_scratch_cap, need)) return 1;
    int8_t *xp = (int8_t *)q4_scratch;
    float *d = (float *)(xp + 2 * M * K), *gsum = d + M * B;
    quant_act_q8_pairs(x, M, K, group, xp, d, gsum);
#define W4_ROWS(a, b) linear_w4_rows(xp, d, gsum, M, K, group, q, scale, skind, zero, zoff, bias, y, N, a, b)
    TK_OVER_COLUMNS(N, nthreads, 4, W4_ROWS);
#undef W4_ROWS
    return 0;
}

/* the quantised activations themselves (for the tests: the same rounding as quantize_act_q8) */
void tk_quant_act_q8(const float *x, int64_t M, int64_t K, int8_t *xq, float *d) {
    uint8_t *xa = (uint8_t *)malloc((size_t)(M * K > 0 ? M * K : 1));
    if (!xa) return;
    quant_act_q8(x, M, K, xq, xa, d);
    free(xa);
}

/* ---- bfloat16 weights with bfloat16 activations (llama.cpp's BF16 numerics) ---------------------------------
 * y[M, N] = bf16(x)[M, K] @ w (+ bias): each activation rounded to bfloat16 (to nearest even; a subnormal to
 * zero, as vcvtneps2bf16 does), each product of two bfloat16 exact in float32, the sums float32. The weight is
 * packed in pair panels (kernels/cpu_kernels.py `pack_bf16_pairs`): panels of 16 output columns, each panel its
 * ceil(K / 2) rows of 16 (k, k + 1) pairs back to back, word 2c + h of row j the weight of column c at k = 2j + h
 * (zero past K and past N), which is what one vdpbf16ps takes: a 64-byte line against a broadcast activation
 * pair, 32 products into 16 sums. With AVX512-BF16 that is twice the products an FMA gives per instruction, and
 * half the weight bytes of float32: at 32 rows on a Zen 4 core ~200 GFLOP/s, MKL's float32 SGEMM 71
 * (bench/cpu_w8a8_rows.py).
 * Elsewhere the same sums widened to float32 FMAs (the pair's two products in turn). The 16 columns of 4 panels
 * stay in registers across all of K for up to 6 rows (24 sums); a thread takes 64 columns at a time and every
 * row block over them, so those panels are read from memory once and from L2 after. */
#define PAIR_PANEL 16
#define PAIR_GROUP 4 /* panels a tile takes at once */
#define PAIR_ROWS 6  /* rows a tile takes at once */
static __thread void *pair_scratch = 0;
static __thread size_t pair_scratch_cap = 0;

/* round to bfloat16, to nearest even; NaN stays NaN, a subnormal becomes a signed zero (vcvtneps2bf16's) */
static inline uint16_t f32_to_bf16_ne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* the rows of x [M, K] rounded to bfloat16 into out (row stride ldo) */
static void round_rows(const float *x, int64_t M, int64_t K, uint16_t *out, int64_t ldo) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        uint16_t *o = out + m * ldo;
        int64_t k = 0;
#if TK_AVX512 && defined(__AVX512BF16__)
        for (; k + 16 <= K; k += 16)
            _mm256_storeu_si256((__m256i *)(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xr + k)));
#endif
        for (; k < K; k++) o[k] = f32_to_bf16_ne(xr[k]);
    }
}

/* x [M, K] -> bfloat16 pairs [M, ceil(K / 2)] (a zero after an odd K) */
static void pairs_of(const float *x, int64_t M, int64_t K, uint16_t *xh) {
    const int64_t Kp = (K + 1) / 2 * 2;
    round_rows(x, M, K, xh, Kp);
    if (K & 1)
        for (int64_t m = 0; m < M; m++) xh[m * Kp + K] = 0;
}

#if TK_AVX512 && defined(__AVX512BF16__)
#define TK_PAIRS_BF16 1
#define TK_DEF_PAIR_TILE(MR, NP)                                                                               \
    static void pair_tile_##MR##_##NP(const uint32_t *xp, int64_t Kh, const uint16_t *w0, float *y, int64_t ldy, \
                                      int64_t c0, int64_t N, const float *bias) {                              \
        __m512 acc[MR][NP];                                                                                    \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int p = 0; p < NP; p++) acc[r][p] = _mm512_setzero_ps();                                     \
        for (int64_t j = 0; j < Kh; j++) {                                                                     \
            __m512i wv[NP];                                                                                    \
            for (int p = 0; p < NP; p++)                                                                       \
                wv[p] = _mm512_loadu_si512((const void *)(w0 + (p * Kh + j) * 2 * PAIR_PANEL));               \
            for (int r = 0; r < MR; r++) {                                                                     \
                const __m512i xb = _mm512_set1_epi32((int)xp[r * Kh + j]);                                     \
                for (int p = 0; p < NP; p++)                                                                   \
                    acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)xb, (__m512bh)wv[p]);                    \
            }                                                                                                  \
        }                                                                                                      \
        for (int p = 0; p < NP; p++) {                                                                         \
            const int64_t c = c0 + p * PAIR_PANEL, left = N - c;                                               \
            const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);                \
            const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + c) : _mm512_setzero_ps();                  \
            for (int r = 0; r < MR; r++) _mm512_mask_storeu_ps(y + r * ldy + c, m, _mm512_add_ps(acc[r][p], b)); \
        }                                                                                                      \
    }
TK_DEF_PAIR_TILE(1, 4) TK_DEF_PAIR_TILE(2, 4) TK_DEF_PAIR_TILE(3, 4) TK_DEF_PAIR_TILE(4, 4) TK_DEF_PAIR_TILE(5, 4)
TK_DEF_PAIR_TILE(6, 4) TK_DEF_PAIR_TILE(1, 1) TK_DEF_PAIR_TILE(2, 1) TK_DEF_PAIR_TILE(3, 1) TK_DEF_PAIR_TILE(4, 1)
TK_DEF_PAIR_TILE(5, 1) TK_DEF_PAIR_TILE(6, 1)
typedef void (*pair_fn)(const uint32_t *, int64_t, const uint16_t *, float *, int64_t, int64_t, int64_t,
                        const float *);
static const pair_fn PAIR_TILES[2][PAIR_ROWS + 1] = {
    {0, pair_tile_1_1, pair_tile_2_1, pair_tile_3_1, pair_tile_4_1, pair_tile_5_1, pair_tile_6_1},
    {0, pair_tile_1_4, pair_tile_2_4, pair_tile_3_4, pair_tile_4_4, pair_tile_5_4, pair_tile_6_4}};
#else
#define TK_PAIRS_BF16 0
/* the same sums with float32 FMAs: one panel and row at a time */
static void pair_tile_c(const uint16_t *xh, int64_t Kh, const uint16_t *wp, float *y, int64_t c0, int64_t N,
                        const float *bias) {
    float acc[PAIR_PANEL] = {0};
    for (int64_t j = 0; j < Kh; j++) {
        const float x0 = bf16_to_f32(xh[2 * j]), x1 = bf16_to_f32(xh[2 * j + 1]);
        const uint16_t *w = wp + j * 2 * PAIR_PANEL;
        for (int c = 0; c < PAIR_PANEL; c++) {
            acc[c] = fmaf(x1, bf16_to_f32(w[2 * c + 1]), acc[c]);
            acc[c] = fmaf(x0, bf16_to_f32(w[2 * c]), acc[c]);
        }
    }
    for (int c = 0; c < PAIR_PANEL && c0 + c < N; c++) y[c0 + c] = acc[c] + (bias ? bias[c0 + c] : 0.f);
}
#endif

/* columns [n0, n1) (n0 a multiple of 64) of every row */
static void pair_columns(const uint16_t *xh, int64_t M, int64_t Kh, const uint16_t *wp, int64_t N,
                         const float *bias, float *y, int64_t n0, int64_t n1) {
    const int64_t p1 = (n1 + PAIR_PANEL - 1) / PAIR_PANEL, stride = Kh * 2 * PAIR_PANEL;
    for (int64_t p0 = n0 / PAIR_PANEL; p0 < p1; p0 += PAIR_GROUP) {
        const int np = p1 - p0 >= PAIR_GROUP ? PAIR_GROUP : (int)(p1 - p0);
        for (int64_t m0 = 0; m0 < M; m0 += PAIR_ROWS) {
            const int mr = M - m0 >= PAIR_ROWS ? PAIR_ROWS : (int)(M - m0);
#if TK_PAIRS_BF16
            const uint32_t *xp = (const uint32_t *)(xh + m0 * Kh * 2);
            if (np == PAIR_GROUP && !(one_row && M == 1))
                PAIR_TILES[1][mr](xp, Kh, wp + p0 * stride, y + m0 * N, N, p0 * PAIR_PANEL, N, bias);
            else
                for (int p = 0; p < np; p++)
                    PAIR_TILES[0][mr](xp, Kh, wp + (p0 + p) * stride, y + m0 * N, N, (p0 + p) * PAIR_PANEL, N, bias);
#else
            for (int r = 0; r < mr; r++)
                for (int p = 0; p < np; p++)
                    pair_tile_c(xh + (m0 + r) * Kh * 2, Kh, wp + (p0 + p) * stride, y + (m0 + r) * N,
                                (p0 + p) * PAIR_PANEL, N, bias);
#endif
        }
    }
}

/* y[M, N] = bf16(x) @ w (+ bias), w in pair panels; returns 0, or 1 when the scratch allocation failed */
int tk_linear_bf16(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N, const float *bias,
                   float *y, int nthreads) {
    const int64_t Kh = (K + 1) / 2;
    if (grow_scratch(&pair_scratch, &pair_scratch_cap, sizeof(uint16_t) * 2 * (size_t)(M * Kh > 0 ? M * Kh : 1)))
        return 1;
    uint16_t *xh = (uint16_t *)pair_scratch;
    pairs_of(x, M, K, xh);
#define PAIR_CALL(a, b) pair_columns(xh, M, Kh, wp, N, bias, y, (a), (b))
    TK_OVER_COLUMNS(N, nthreads, PAIR_PANEL * PAIR_GROUP, PAIR_CALL);
#undef PAIR_CALL
    return 0;
}

/* the activations as tk_linear_bf16 rounds them (for the tests): x [M, K] -> bfloat16 bits [M, K] */
void tk_round_bf16(const float *x, int64_t M, int64_t K, uint16_t *out) { round_rows(x, M, K, out, K); }
int tk_has_bf16_dots(void) { return TK_PAIRS_BF16; }

/* ---- paged attention over float32 pages, in place ---------------------------------------------------------- */

static inline float dot_f(const float *a, const float *b, int64_t D) {
    int64_t d = 0;
    float s = 0.f;
#if TK_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    s = hsum256(acc);
#endif
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

static inline void axpy_f(float *y, float a, const float *x, int64_t D) {
    int64_t d = 0;
#if TK_AVX2
    __m256 av = _mm256_set1_ps(a);
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(y + d, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
#endif
    for (; d < D; d++) y[d] += a * x[d];
}

/* The caches' element kinds (a cache's dtype): float32, float16 or bfloat16 K/V, each widened to float32 as it
 * is read (exactly: both narrower kinds are float32 values), so every sum is the float32 path's over the stored
 * values. The kinds are the int4 scales' (skind), read by the same scale_at / w4_scale8. Offsets and strides
 * count elements; `es` bytes an element */
#define KV_F32 0
#define KV_F16 1
#define KV_BF16 2
#define KV_NARROW_MAX_D 512 /* attend_one's row buffer: the head sizes a narrow cache takes */
#define TK_INLINE static inline __attribute__((always_inline))
static inline int64_t kv_es(int kvk) { return kvk == KV_F32 ? 4 : 2; }
/* element i of a K/V row as float32 */
TK_INLINE float kv_get(const char *p, int64_t i, int kvk) { return scale_at(p, kvk, i); }
/* a row of D elements as float32: the row itself (float32) or widened into tmp */
TK_INLINE const float *kv_row(const char *p, int64_t D, int kvk, float *tmp) {
    if (kvk == KV_F32) return (const float *)p;
    for (int64_t d = 0; d < D; d++) tmp[d] = kv_get(p, d, kvk);
    return tmp;
}
/* float32 to bfloat16 bits, to nearest even (NaN: 0x7FC0), as torch's conversion rounds */
static inline uint16_t f32_to_bf16_rne(float f) {
    union {
        float f;
        uint32_t u;
    } v = {f};
    if (f != f) return 0x7FC0;
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}
/* n floats into a row of kind kvk (float16: to nearest even, as F16C and torch round) */
static inline void kv_store(char *dst, const float *src, int64_t n, int kvk) {
    if (kvk == KV_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    if (kvk == KV_BF16) {
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16_rne(src[i]);
        return;
    }
#if defined(__F16C__) /* (a build without F16C takes no float16 cache: tk_kv_kinds) */
    for (int64_t i = 0; i < n; i++)
        d[i] = (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(src[i]), _MM_FROUND_TO_NEAREST_INT), 0);
#endif
}
/* which kinds this build reads: bit k for kind k (float16 needs F16C) */
int64_t tk_kv_kinds(void) {
#if defined(__F16C__)
    return (1 << KV_F32) | (1 << KV_F16) | (1 << KV_BF16);
#else
    return (1 << KV_F32) | (1 << KV_BF16);
#endif
}
#if TK_AVX2
/* eight elements of a K/V row as float32 (a build without F16C takes no float16 cache: tk_kv_kinds) */
TK_INLINE __m256 kv_ld8(const char *p, int kvk) { return w4_scale8(p, kvk, 0); }
#endif

typedef struct {
    const float *q;
    const char *kc, *vc; /* the caches' bytes: elements of kind kvk */
    int64_t Hq, Hkv, D, bs, page_stride, tok_stride, head_stride, max_blocks, q_ld, o_ld;
    const int64_t *block_tables, *qstart, *qlen, *ctx, *rows;
    float scale;
    float *out;
    int kvk;
} attn_args;

/* scratch floats attend_heads_blocked takes for ng KV heads of a sequence of qlen queries and ctx positions */
static inline int64_t heads_scratch(int64_t ng, int64_t rep, int64_t qlen, int64_t ctx) {
    return ng * rep * qlen * ((ctx + 7) / 8 * 8 + 1 + 128);
}

/* one (sequence, KV head): every query of the sequence, every query head of the group; `p` holds ctx floats
 * per query head of the group */
TK_INLINE void attend_one(const attn_args *a, int64_t s, int64_t g, float *p, const int kvk) {
    int64_t rep = a->Hq / a->Hkv, D = a->D, bs = a->bs;
    int64_t q0 = a->qstart[s], qlen = a->qlen[s], ctx = a->ctx[s];
    const int64_t *bt = a->block_tables + a->rows[s] * a->max_blocks, es = kv_es(kvk);
    const char *kbase = a->kc + es * g * a->head_stride, *vbase = a->vc + es * g * a->head_stride;
    float tmp[KV_NARROW_MAX_D];
    for (int64_t i = 0; i < qlen; i++) {
        int64_t n = ctx - qlen + i + 1; /* keys 0 .. n-1 */
        const float *qi = a->q + (q0 + i) * a->q_ld + g * rep * D;
        float *oi = a->out + (q0 + i) * a->o_ld + g * rep * D;
        for (int64_t r = 0; r < rep; r++) {
            float *pr = p + r * ctx;
            float mx = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                const float *kj = kv_row(kbase + es * (bt[j / bs] * a->page_stride + (j % bs) * a->tok_stride), D,
                                         kvk, tmp);
                float sc = dot_f(qi + r * D, kj, D) * a->scale;
                pr[j] = sc;
                if (sc > mx) mx = sc;
            }
            float sum = 0.f;
            for (int64_t j = 0; j < n; j++) {
                float e = expf(pr[j] - mx);
                pr[j] = e;
                sum += e;
            }
            float inv = 1.f / sum;
            float *o = oi + r * D;
            memset(o, 0, sizeof(float) * D);
            for (int64_t j = 0; j < n; j++) {
                const float *vj = kv_row(vbase + es * (bt[j / bs] * a->page_stride + (j % bs) * a->tok_stride), D,
                                         kvk, tmp);
                axpy_f(o, pr[j] * inv, vj, D);
            }
        }
    }
}

/* S sequences: sequence s's qlen[s] queries start at row qstart[s] of q [T, Hq, D] and are the last qlen[s]
 * of its ctx[s] positions; its pages are row rows[s] of block_tables [*, max_blocks]. Rows of `out` that no
 * sequence names are left as they are. */
static int attend_all(const attn_args *ap, int64_t S, int64_t max_ctx, int nthreads);

int tk_paged_attention_f32(const float *q, int64_t Hq, int64_t D, const void *kc, const void *vc, int64_t Hkv,
                           int64_t bs, int64_t page_stride, int64_t tok_stride, int64_t head_stride,
                           const int64_t *block_tables, int64_t max_blocks, const int64_t *qstart,
                           const int64_t *qlen, const int64_t *ctx, const int64_t *rows, int64_t S, int64_t max_ctx,
                           float scale, float *out, int nthreads, int64_t kvk) {
    attn_args a = {q, (const char *)kc, (const char *)vc, Hq, Hkv, D, bs, page_stride, tok_stride, head_stride,
                   max_blocks, Hq * D, Hq * D, block_tables, qstart, qlen, ctx, rows, scale, out, (int)kvk};
    return attend_all(&a, S, max_ctx, nthreads);
}

#if TK_AVX2
/* exp of 8 floats (Cephes' polynomial after a 2^n range reduction; relative error ~2e-7, inputs <= 0 here) */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* the largest of v's lanes */
static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* the eight sums of a0..a7's lanes, as one vector */
static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* attention's prefetches go into L2: a prefetch into L1 waits for one of its few miss buffers, and on the Zen 4 VM
 * the prefetch instructions themselves stalled the passes (docs/benchmarks.md) */
#define ATT_HINT _MM_HINT_T1
#define AV_AHEAD 16 /* keys: the value pass prefetches the rows this far on */
#if TK_AVX512 /* the value pass's vectors: 16 floats with AVX-512, else 8 */
#define AV_W 16
#define AV_V __m512
#define AV_LOAD _mm512_loadu_ps
#define AV_STORE _mm512_storeu_ps
#define AV_SET1 _mm512_set1_ps
#define AV_ZERO _mm512_setzero_ps
#define AV_FMA _mm512_fmadd_ps
/* AV_W elements of a value row as float32 */
TK_INLINE __m512 av_kload(const char *p, int kvk) {
    if (kvk == KV_F32) return _mm512_loadu_ps((const float *)p);
    if (kvk == KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#else
#define AV_W 8
#define AV_V __m256
#define AV_LOAD _mm256_loadu_ps
#define AV_STORE _mm256_storeu_ps
#define AV_SET1 _mm256_set1_ps
#define AV_ZERO _mm256_setzero_ps
#define AV_FMA _mm256_fmadd_ps
#define av_kload kv_ld8
#endif
#define AV_DMULT AV_W /* av_heads takes D a multiple of this */
/* part of the value pass of nh (<= NH) query heads over one KV head: acc[h][d0 .. d0 + AV_W NC) += w[h][t] * v_t[d0 ..]
 * for keys t in [j0, j1), in order (nlim bounds the keys whose pages may be looked up to prefetch), so each value
 * row is read once for all the heads (heads past nh repeat the last one's weights, unstored). Each lane's sum is
 * the one attend_heads_blocked's pair-by-pair loop takes, in its order: the same bits, at either width. */
#define TK_DEF_AV(NH, NC)                                                                                      \
    TK_INLINE void av_##NH##x##NC(const float *const *w, int nh, int64_t j0, int64_t j1, int64_t nlim,         \
                                  const char *vbase, const int64_t *bt, int64_t bs, int64_t page_stride,      \
                                  int64_t tok_stride, int64_t d0, float *const *acc_io, const int kvk) {       \
        const int64_t es = kv_es(kvk);                                                                         \
        const float *wp[NH];                                                                                   \
        AV_V acc[NH][NC];                                                                                      \
        for (int h = 0; h < NH; h++) {                                                                         \
            wp[h] = w[h < nh ? h : nh - 1];                                                                    \
            for (int c = 0; c < NC; c++)                                                                       \
                acc[h][c] = h < nh ? AV_LOAD(acc_io[h] + d0 + AV_W * c) : AV_ZERO();                           \
        }                                                                                                      \
        for (int64_t page = j0 / bs, t = j0 % bs, j = j0; j < j1; page++, t = 0) {                              \
            const char *vp = vbase + es * (bt[page] * page_stride + d0);                                       \
            const char *nxt = (page + 1) * bs < nlim ? vbase + es * (bt[page + 1] * page_stride + d0) : vp;    \
            for (; t < bs && j < j1; t++, j++) {                                                               \
                const int64_t ta = t + AV_AHEAD;                                                               \
                const char *pf = ta < bs ? vp + es * ta * tok_stride : nxt + es * ((ta - bs) % bs * tok_stride); \
                for (int64_t l = 0; l < NC * AV_W * es; l += 64) _mm_prefetch(pf + l, ATT_HINT);               \
                const char *vj = vp + es * t * tok_stride;                                                     \
                AV_V v[NC];                                                                                    \
                for (int c = 0; c < NC; c++) v[c] = av_kload(vj + es * AV_W * c, kvk);                         \
                for (int h = 0; h < NH; h++) {                                                                 \
                    const AV_V wb = AV_SET1(wp[h][j]);                                                         \
                    for (int c = 0; c < NC; c++) acc[h][c] = AV_FMA(wb, v[c], acc[h][c]);                      \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int h = 0; h < nh; h++)                                                                           \
            for (int c = 0; c < NC; c++) AV_STORE(acc_io[h] + d0 + AV_W * c, acc[h][c]);                       \
    }
/* the tiles: NH heads of NC vectors, 16 sums in registers with AVX-512's 32, 8 with AVX2's 16 */
#define AV_TILE(NH, NC) AV_TILE_(NH, NC)
#define AV_TILE_(NH, NC) av_##NH##x##NC
#if TK_AVX512
#define AV_NC2 4
#define AV_NC4 4
#define AV_NC8 2
#define AV_MAXH 16 /* more heads: in sets of this many, one vector each */
TK_DEF_AV(16, 1)
#else
#define AV_NC2 4
#define AV_NC4 2
#define AV_NC8 1
#define AV_MAXH 8
#endif
#define TK_DEF_AV_(NH, NC) TK_DEF_AV(NH, NC) /* (NC expanded first) */
TK_DEF_AV_(2, AV_NC2)
TK_DEF_AV_(4, AV_NC4)
TK_DEF_AV_(8, AV_NC8)

/* keys [j0, j1) of the value pass of one query's rep heads over one KV head (D a multiple of AV_W): the widest
 * register tile that holds the heads at once, over D in pieces of its width */
TK_INLINE void av_heads(const float *const *w, int64_t rep, int64_t j0, int64_t j1, int64_t nlim, const char *vbase,
                        const int64_t *bt, int64_t bs, int64_t page_stride, int64_t tok_stride, int64_t D,
                        float *const *acc, const int kvk) {
#define AV_ARGS(nh, d0) w, nh, j0, j1, nlim, vbase, bt, bs, page_stride, tok_stride, d0, acc, kvk
    if (rep <= 2 && D % (AV_W * AV_NC2) == 0)
        for (int64_t d0 = 0; d0 < D; d0 += AV_W * AV_NC2) AV_TILE(2, AV_NC2)(AV_ARGS((int)rep, d0));
    else if (rep <= 4 && D % (AV_W * AV_NC4) == 0)
        for (int64_t d0 = 0; d0 < D; d0 += AV_W * AV_NC4) AV_TILE(4, AV_NC4)(AV_ARGS((int)rep, d0));
    else if (rep <= 8 && D % (AV_W * AV_NC8) == 0)
        for (int64_t d0 = 0; d0 < D; d0 += AV_W * AV_NC8) AV_TILE(8, AV_NC8)(AV_ARGS((int)rep, d0));
    else
        for (int64_t h0 = 0; h0 < rep; h0 += AV_MAXH)
            for (int64_t d0 = 0; d0 < D; d0 += AV_W)
                AV_TILE(AV_MAXH, 1)(w + h0, (int)(rep - h0 < AV_MAXH ? rep - h0 : AV_MAXH), j0, j1, nlim, vbase, bt,
                                    bs, page_stride, tok_stride, d0, acc + h0, kvk);
#undef AV_ARGS
}
#define AV_CHUNK 32 /* keys: the value pass takes every KV head over this many keys before the next ones */

#define ATT_AHEAD 32 /* keys: the scores pass prefetches the key rows this far on */

/* attend_one for KV heads [g0, g1) of sequence s, D a multiple of 8 (up to 128). Keys go in blocks of eight, and
 * for each block every KV head in turn: every (query, head) pair of the head scores the eight keys at once (one
 * horizontal reduction per block, not per key; the block stays in L1 across the pairs), so the token's rows of
 * all the heads, side by side in the page, are read together; the rows ATT_AHEAD keys on are prefetched. Then
 * each pair's softmax with a vector exp, and its output accumulated over the values: where two or more query
 * heads share a KV head (and D is a multiple of 16 with AVX-512), a query's heads at once in registers, AV_CHUNK
 * keys at a time for each KV head in turn (each value row read once for all the heads of its KV head, in pieces of
 * D that fit the registers, the chunk's rows of all the heads read together), else pair by pair. `p` holds heads_scratch(g1 - g0, ...) floats: the scores
 * [head][pair][ctx padded to 8], the pairs' 1 / sums, their sums over the values. */
TK_INLINE void attend_heads_blocked(const attn_args *a, int64_t s, int64_t g0, int64_t g1, float *p, const int kvk) {
    const int64_t rep = a->Hq / a->Hkv, D = a->D, bs = a->bs, nv = D / 8, hs = a->head_stride, es = kv_es(kvk);
    const int64_t q0 = a->qstart[s], qlen = a->qlen[s], ctx = a->ctx[s];
    const int64_t *bt = a->block_tables + a->rows[s] * a->max_blocks;
    const int64_t pairs = qlen * rep, cpad = (ctx + 7) / 8 * 8, ng = g1 - g0;
    float *invs = p + ng * pairs * cpad;
    int64_t kofs[8];
    int64_t pg = 0, off = 0; /* page index and slot of key j0: advanced, never divided */
    int64_t pga = ATT_AHEAD / bs, offa = ATT_AHEAD % bs; /* of key j0 + ATT_AHEAD */
    for (int64_t j0 = 0; j0 < ctx; j0 += 8) {
        for (int t = 0; t < 8 && j0 + ATT_AHEAD + t < ctx; t++) {
            const char *ka = a->kc + es * (bt[pga] * a->page_stride + offa * a->tok_stride);
            for (int64_t g = g0; g < g1; g++)
                for (int64_t l = 0; l < D * es; l += 64) _mm_prefetch(ka + es * g * hs + l, ATT_HINT);
            if (++offa == bs) {
                offa = 0;
                pga++;
            }
        }
        int64_t p2 = pg, o2 = off;
        for (int t = 0; t < 8; t++) {
            kofs[t] = bt[p2] * a->page_stride + o2 * a->tok_stride;
            if (j0 + t + 1 < ctx && ++o2 == bs) { /* past the context: the last key again (scores unused) */
                o2 = 0;
                p2++;
            }
        }
        for (int t = 0; t < 8; t++)
            if (++off == bs) {
                off = 0;
                pg++;
            }
        for (int64_t g = g0; g < g1; g++) {
            const char *kb = a->kc + es * g * hs;
            float *pgh = p + (g - g0) * pairs * cpad;
            for (int64_t pr = 0; pr < pairs; pr++) {
                int64_t i = pr / rep, r = pr % rep;
                const float *qi = a->q + (q0 + i) * a->q_ld + (g * rep + r) * D;
                __m256 acc[8];
                for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
                for (int64_t v = 0; v < nv; v++) {
                    __m256 qv = _mm256_loadu_ps(qi + 8 * v);
                    for (int t = 0; t < 8; t++)
                        acc[t] = _mm256_fmadd_ps(qv, kv_ld8(kb + es * (kofs[t] + 8 * v), kvk), acc[t]);
                }
                __m256 sc = _mm256_mul_ps(hsum8x8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]),
                                          _mm256_set1_ps(a->scale));
                _mm256_storeu_ps(pgh + pr * cpad + j0, sc);
            }
        }
    }
    for (int64_t hp = 0; hp < ng * pairs; hp++) { /* (head, pair): its softmax */
        int64_t i = (hp % pairs) / rep;
        int64_t n = ctx - qlen + i + 1; /* keys 0 .. n-1 */
        float *pp = p + hp * cpad;
        /* the largest score, eight lanes at a time (exact in any order: only a zero's sign may differ, and
         * x - 0 = x - -0) */
        __m256 vm = _mm256_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(pp + j));
        float mx = hmax256(vm);
        for (; j < n; j++) mx = pp[j] > mx ? pp[j] : mx;
        __m256 vmx = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
        j = 0;
        for (; j + 8 <= n; j += 8) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(pp + j), vmx));
            _mm256_storeu_ps(pp + j, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float sum = hsum256(vsum);
        for (; j < n; j++) {
            pp[j] = expf(pp[j] - mx);
            sum += pp[j];
        }
        invs[hp] = 1.f / sum;
    }
    if (rep > 1 && rep <= 64 && D % AV_DMULT == 0) {
        float *sums = invs + ng * pairs; /* [head][pair][D] */
        memset(sums, 0, sizeof(float) * (size_t)(ng * pairs * D));
        const float *w[64];
        float *acc[64];
        for (int64_t c0 = 0; c0 < ctx; c0 += AV_CHUNK)
            for (int64_t i = 0; i < qlen; i++) {
                int64_t n = ctx - qlen + i + 1, c1 = c0 + AV_CHUNK < n ? c0 + AV_CHUNK : n;
                for (int64_t g = g0; c0 < c1 && g < g1; g++) {
                    for (int64_t h = 0; h < rep; h++) {
                        int64_t hp = (g - g0) * pairs + i * rep + h;
                        w[h] = p + hp * cpad;
                        acc[h] = sums + hp * D;
                    }
                    av_heads(w, rep, c0, c1, ctx, a->vc + es * g * hs, bt, bs, a->page_stride, a->tok_stride, D, acc,
                             kvk);
                }
            }
        for (int64_t hp = 0; hp < ng * pairs; hp++) {
            int64_t g = g0 + hp / pairs, i = (hp % pairs) / rep, r = hp % rep;
            float *oi = a->out + (q0 + i) * a->o_ld + (g * rep + r) * D;
            const __m256 vinv = _mm256_set1_ps(invs[hp]);
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(oi + d, _mm256_mul_ps(_mm256_loadu_ps(sums + hp * D + d), vinv));
        }
        return;
    }
    for (int64_t hp = 0; hp < ng * pairs; hp++) {
        int64_t g = g0 + hp / pairs, i = (hp % pairs) / rep, r = hp % rep;
        int64_t n = ctx - qlen + i + 1;
        const float *pp = p + hp * cpad;
        const char *vbase = a->vc + es * g * hs;
        __m256 o[16];
        for (int64_t v = 0; v < nv; v++) o[v] = _mm256_setzero_ps();
        for (int64_t p0 = 0, page = 0; p0 < n; p0 += bs, page++) {
            const char *vp = vbase + es * bt[page] * a->page_stride;
            int64_t end = n - p0 < bs ? n - p0 : bs;
            for (int64_t t = 0; t < end; t++) {
                const char *vj = vp + es * t * a->tok_stride;
                __m256 w = _mm256_set1_ps(pp[p0 + t]);
                for (int64_t v = 0; v < nv; v++) o[v] = _mm256_fmadd_ps(w, kv_ld8(vj + es * 8 * v, kvk), o[v]);
            }
        }
        float *oi = a->out + (q0 + i) * a->o_ld + (g * rep + r) * D;
        __m256 vinv = _mm256_set1_ps(invs[hp]);
        for (int64_t v = 0; v < nv; v++) _mm256_storeu_ps(oi + 8 * v, _mm256_mul_ps(o[v], vinv));
    }
}

/* attend_one_blocked for a prefill chunk (PF_MIN_Q queries or more, D a multiple of 16): the group's keys first
 * transposed into blocks of PF_KB keys [D][PF_KB] (zero past the context), then four (query, head) pairs at a
 * time: their scores over PF_KB keys in 12 registers (per dimension three key loads and four query broadcasts
 * feed twelve FMAs, where the one-pair kernel's eight key loads feed eight), each pair's causal softmax, and
 * its output four pairs by 16 dimensions at a time over the values. Scores past a pair's last key are zeros,
 * so the four share one pass over the values. Decode steps and verify windows (fewer queries) keep the
 * one-pair kernel, and their bits. `p` holds (D + PF_PT) * ctx padded to PF_KB, and PF_PT * D, floats. */
#define PF_MIN_Q 16
#define PF_KB 24
#define PF_PT 16 /* pairs per tile: their scores kept, the values read once per tile */
#define PF_VC 64 /* values per chunk of the tile's pass */
static inline int64_t pf_pad(int64_t ctx) { return (ctx + PF_KB - 1) / PF_KB * PF_KB; }
static inline int pf_takes(const attn_args *a, int64_t s) { return a->qlen[s] >= PF_MIN_Q && a->D % 16 == 0; }

/* four pairs' scores over nblk blocks of keys (fewer pairs: the caller repeats the last one's query) */
TK_INLINE void pf_scores(const float *const qp[4], const float *kt, int64_t D, int64_t nblk, float scale,
                      float *const sp[4]) {
    const __m256 vs = _mm256_set1_ps(scale);
    const float *q0 = qp[0], *q1 = qp[1], *q2 = qp[2], *q3 = qp[3];
    for (int64_t b = 0; b < nblk; b++, kt += D * PF_KB) {
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
        __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
        const float *kd = kt;
        for (int64_t d = 0; d < D; d++, kd += PF_KB) {
            __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + 8), k2 = _mm256_loadu_ps(kd + 16);
            __m256 qb = _mm256_broadcast_ss(q0 + d);
            a00 = _mm256_fmadd_ps(qb, k0, a00);
            a01 = _mm256_fmadd_ps(qb, k1, a01);
            a02 = _mm256_fmadd_ps(qb, k2, a02);
            qb = _mm256_broadcast_ss(q1 + d);
            a10 = _mm256_fmadd_ps(qb, k0, a10);
            a11 = _mm256_fmadd_ps(qb, k1, a11);
            a12 = _mm256_fmadd_ps(qb, k2, a12);
            qb = _mm256_broadcast_ss(q2 + d);
            a20 = _mm256_fmadd_ps(qb, k0, a20);
            a21 = _mm256_fmadd_ps(qb, k1, a21);
            a22 = _mm256_fmadd_ps(qb, k2, a22);
            qb = _mm256_broadcast_ss(q3 + d);
            a30 = _mm256_fmadd_ps(qb, k0, a30);
            a31 = _mm256_fmadd_ps(qb, k1, a31);
            a32 = _mm256_fmadd_ps(qb, k2, a32);
        }
        int64_t j = b * PF_KB;
#define PF_STORE(r, x0, x1, x2)                                                                                \
    _mm256_storeu_ps(sp[r] + j, _mm256_mul_ps(x0, vs));                                                        \
    _mm256_storeu_ps(sp[r] + j + 8, _mm256_mul_ps(x1, vs));                                                    \
    _mm256_storeu_ps(sp[r] + j + 16, _mm256_mul_ps(x2, vs));
        PF_STORE(0, a00, a01, a02)
        PF_STORE(1, a10, a11, a12)
        PF_STORE(2, a20, a21, a22)
        PF_STORE(3, a30, a31, a32)
#undef PF_STORE
    }
}

/* four pairs' output dimensions [d0, d0 + 16), o[r] (8 floats apart... 16 per pair, row stride ldo) plus
 * keys [j0, j1) of the score rows sp (numerators, zeros past each pair's last key) times the values, keys in
 * order */
TK_INLINE void pf_values(const float *const sp[4], const char *vbase, const int64_t *bt, int64_t bs,
                         int64_t page_stride, int64_t tok_stride, int64_t j0, int64_t j1, int64_t d0, float *o,
                         int64_t ldo, const int kvk) {
    const int64_t es = kv_es(kvk);
    __m256 o00 = _mm256_loadu_ps(o), o01 = _mm256_loadu_ps(o + 8), o10 = _mm256_loadu_ps(o + ldo),
           o11 = _mm256_loadu_ps(o + ldo + 8), o20 = _mm256_loadu_ps(o + 2 * ldo),
           o21 = _mm256_loadu_ps(o + 2 * ldo + 8), o30 = _mm256_loadu_ps(o + 3 * ldo),
           o31 = _mm256_loadu_ps(o + 3 * ldo + 8);
    const float *s0 = sp[0], *s1 = sp[1], *s2 = sp[2], *s3 = sp[3];
    for (int64_t j = j0; j < j1;) {
        int64_t page = j / bs, off = j % bs;
        int64_t end = j + (bs - off < j1 - j ? bs - off : j1 - j);
        const char *vj = vbase + es * (bt[page] * page_stride + off * tok_stride + d0);
        for (; j < end; j++, vj += es * tok_stride) {
            __m256 v0 = kv_ld8(vj, kvk), v1 = kv_ld8(vj + 8 * es, kvk);
            __m256 w = _mm256_broadcast_ss(s0 + j);
            o00 = _mm256_fmadd_ps(w, v0, o00);
            o01 = _mm256_fmadd_ps(w, v1, o01);
            w = _mm256_broadcast_ss(s1 + j);
            o10 = _mm256_fmadd_ps(w, v0, o10);
            o11 = _mm256_fmadd_ps(w, v1, o11);
            w = _mm256_broadcast_ss(s2 + j);
            o20 = _mm256_fmadd_ps(w, v0, o20);
            o21 = _mm256_fmadd_ps(w, v1, o21);
            w = _mm256_broadcast_ss(s3 + j);
            o30 = _mm256_fmadd_ps(w, v0, o30);
            o31 = _mm256_fmadd_ps(w, v1, o31);
        }
    }
    _mm256_storeu_ps(o, o00), _mm256_storeu_ps(o + 8, o01), _mm256_storeu_ps(o + ldo, o10);
    _mm256_storeu_ps(o + ldo + 8, o11), _mm256_storeu_ps(o + 2 * ldo, o20), _mm256_storeu_ps(o + 2 * ldo + 8, o21);
    _mm256_storeu_ps(o + 3 * ldo, o30), _mm256_storeu_ps(o + 3 * ldo + 8, o31);
}

/* row pp's softmax numerators over keys [0, n), zeros on [n, upto); returns 1 / their sum */
TK_INLINE float pf_softmax(float *pp, int64_t n, int64_t upto) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        m0 = _mm256_max_ps(m0, _mm256_loadu_ps(pp + j));
        m1 = _mm256_max_ps(m1, _mm256_loadu_ps(pp + j + 8));
    }
    m0 = _mm256_max_ps(m0, m1);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m0), _mm256_extractf128_ps(m0, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float mx = _mm_cvtss_f32(h);
    for (; j < n; j++) mx = pp[j] > mx ? pp[j] : mx;
    __m256 vmx = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(pp + j), vmx));
        _mm256_storeu_ps(pp + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum256(vsum);
    for (; j < n; j++) {
        pp[j] = expf(pp[j] - mx);
        sum += pp[j];
    }
    for (j = n; j < upto; j++) pp[j] = 0.f;
    return 1.f / sum;
}

TK_INLINE void attend_prefill(const attn_args *a, int64_t s, int64_t g, float *p, const int kvk) {
    int64_t rep = a->Hq / a->Hkv, D = a->D, bs = a->bs;
    int64_t q0 = a->qstart[s], qlen = a->qlen[s], ctx = a->ctx[s];
    const int64_t *bt = a->block_tables + a->rows[s] * a->max_blocks, es = kv_es(kvk);
    const char *kbase = a->kc + es * g * a->head_stride, *vbase = a->vc + es * g * a->head_stride;
    int64_t cpad = pf_pad(ctx), pairs = qlen * rep;
    float *kt = p, *sc = p + D * cpad;
    for (int64_t j = 0; j < cpad; j++) { /* keys -> [block][D][PF_KB] */
        float *col = kt + (j / PF_KB) * D * PF_KB + j % PF_KB;
        if (j < ctx) {
            const char *kj = kbase + es * (bt[j / bs] * a->page_stride + (j % bs) * a->tok_stride);
            for (int64_t d = 0; d < D; d++) col[d * PF_KB] = kv_get(kj, d, kvk);
        } else {
            for (int64_t d = 0; d < D; d++) col[d * PF_KB] = 0.f;
        }
    }
    float *ob = sc + PF_PT * cpad; /* the tile's outputs [PF_PT][D] */
    for (int64_t t0 = 0; t0 < pairs; t0 += PF_PT) {
        int64_t nt = pairs - t0 < PF_PT ? pairs - t0 : PF_PT, nmicro = (nt + 3) / 4;
        const float *sp[PF_PT / 4][4];
        int64_t nm[PF_PT / 4]; /* each micro tile's last key + 1 */
        float inv[PF_PT];
        for (int64_t m = 0; m < nmicro; m++) {
            int64_t np = nt - 4 * m < 4 ? nt - 4 * m : 4;
            const float *qp[4];
            float *spw[4];
            for (int r = 0; r < 4; r++) { /* past the last pair: the last one again, its results dropped */
                int64_t pt = 4 * m + (r < np ? r : np - 1), pr = t0 + pt, i = pr / rep, h = g * rep + pr % rep;
                qp[r] = a->q + (q0 + i) * a->q_ld + h * D;
                spw[r] = sc + pt * cpad;
                sp[m][r] = spw[r];
                if (r == np - 1) nm[m] = ctx - qlen + i + 1; /* the latest query of the four */
            }
            pf_scores(qp, kt, D, pf_pad(nm[m]) / PF_KB, a->scale, spw);
            for (int r = 0; r < np; r++) {
                int64_t pr = t0 + 4 * m + r;
                inv[4 * m + r] = pf_softmax(spw[r], ctx - qlen + pr / rep + 1, nm[m]);
            }
        }
        memset(ob, 0, sizeof(float) * (size_t)(4 * nmicro * D));
        int64_t nlast = nm[nmicro - 1];
        for (int64_t c0 = 0; c0 < nlast; c0 += PF_VC) /* PF_VC values stay in L1 for the whole tile */
            for (int64_t m = 0; m < nmicro; m++) {
                int64_t c1 = c0 + PF_VC < nm[m] ? c0 + PF_VC : nm[m];
                for (int64_t d0 = 0; c0 < c1 && d0 < D; d0 += 16)
                    pf_values(sp[m], vbase, bt, bs, a->page_stride, a->tok_stride, c0, c1, d0, ob + 4 * m * D + d0, D,
                              kvk);
            }
        for (int64_t pt = 0; pt < nt; pt++) {
            int64_t pr = t0 + pt, i = pr / rep, h = g * rep + pr % rep;
            float *o = a->out + (q0 + i) * a->o_ld + h * D;
            __m256 vi = _mm256_set1_ps(inv[pt]);
            for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(ob + pt * D + d), vi));
        }
    }
}
#endif

/* NAME_f32, NAME_f16 and NAME_bf16: NAME's copies with the cache kind fixed (its loads with it), out of line */
#define TK_KV_COPIES(NAME, DECL, ...)                                                                          \
    static __attribute__((noinline)) void NAME##_f32 DECL { NAME(__VA_ARGS__, KV_F32); }                       \
    static __attribute__((noinline)) void NAME##_f16 DECL { NAME(__VA_ARGS__, KV_F16); }                       \
    static __attribute__((noinline)) void NAME##_bf16 DECL { NAME(__VA_ARGS__, KV_BF16); }
#define TK_KV_PICK(NAME, kvk) ((kvk) == KV_BF16 ? NAME##_bf16 : (kvk) == KV_F16 ? NAME##_f16 : NAME##_f32)
#if TK_AVX2
TK_KV_COPIES(attend_heads_blocked, (const attn_args *a, int64_t s, int64_t g0, int64_t g1, float *p), a, s, g0, g1, p)
TK_KV_COPIES(attend_prefill, (const attn_args *a, int64_t s, int64_t g, float *p), a, s, g, p)
#endif
TK_KV_COPIES(attend_one, (const attn_args *a, int64_t s, int64_t g, float *p), a, s, g, p)

/* the work of KV heads [g0, g1) of sequence s */
static inline void attend_item(const attn_args *a, int64_t s, int64_t g0, int64_t g1, float *p) {
#if TK_AVX2
    if (pf_takes(a, s)) {
        for (int64_t g = g0; g < g1; g++) TK_KV_PICK(attend_prefill, a->kvk)(a, s, g, p);
        return;
    }
    if (a->D % 8 == 0 && a->D <= 128) {
        TK_KV_PICK(attend_heads_blocked, a->kvk)(a, s, g0, g1, p);
        return;
    }
#endif
    for (int64_t g = g0; g < g1; g++) TK_KV_PICK(attend_one, a->kvk)(a, s, g, p);
}

#define ATT_SCRATCH_MAX (16 << 20) /* bytes a thread's scores may take before a sequence's heads are split */

/* A work item is a sequence's KV heads in one of `split` ranges: the whole sequence where one thread runs them all
 * or there are enough sequences to go round the threads (a token's rows of all the heads sit side by side in its
 * page, so one pass over the pages reads them in order), else split so every thread has work. */
static int attend_all(const attn_args *ap, int64_t S, int64_t max_ctx, int nthreads) {
    const attn_args a = *ap;
    if (a.kvk != KV_F32 && a.D > KV_NARROW_MAX_D) return 2; /* attend_one's row buffer (kv_kind's callers check) */
    int64_t Hkv = a.Hkv;
    int64_t rep = a.Hq / Hkv, max_q = 1, any_pf = 0;
    for (int64_t s = 0; s < S; s++) {
#if TK_AVX2
        if (pf_takes(&a, s)) {
            any_pf = 1;
            continue;
        }
#endif
        max_q = a.qlen[s] > max_q ? a.qlen[s] : max_q;
    }
    int64_t split = 1;
    if (nthreads > 1 && S > 0) {
        int64_t target = S == 1 ? nthreads : 2 * nthreads;
        split = (target + S - 1) / S;
    }
    int64_t mctx = max_ctx > 0 ? max_ctx : 1;
    for (; split < Hkv; split++) /* attend_heads_blocked's scratch for a range's heads within bounds */
        if (sizeof(float) * (size_t)heads_scratch((Hkv + split - 1) / split, rep, max_q, mctx) <= ATT_SCRATCH_MAX)
            break;
    if (split > Hkv) split = Hkv;
    const int64_t ngmax = (Hkv + split - 1) / split, work = S * split;
    size_t need = sizeof(float) * (size_t)heads_scratch(ngmax, rep, max_q, mctx);
#if TK_AVX2
    /* attend_prefill's transposed keys and four pairs' scores */
    size_t need_pf = sizeof(float) * (size_t)((a.D + PF_PT) * pf_pad(mctx) + PF_PT * a.D);
    if (any_pf && need_pf > need) need = need_pf;
#else
    (void)any_pf;
#endif
    need = (need + 63) / 64 * 64;
#define ITEM(w, p) attend_item(&a, (w) / split, (w) % split * Hkv / split, ((w) % split + 1) * Hkv / split, p)
    if (nthreads <= 1 || work < 2) {
        float *p = (float *)malloc(need);
        if (!p) return 1;
        for (int64_t w = 0; w < work; w++) ITEM(w, p);
        free(p);
        return 0;
    }
    float *buf = (float *)malloc(need * (size_t)nthreads);
    if (!buf) return 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t w = 0; w < work; w++) ITEM(w, buf + (need / sizeof(float)) * omp_get_thread_num());
#else
    for (int64_t w = 0; w < work; w++) ITEM(w, buf);
#endif
#undef ITEM
    free(buf);
    return 0;
}

/* this step's K/V into their slots: k, v [T, Hkv * D] contiguous; token t goes to page pages[t], slot
 * offsets[t] (the cache's token stride is Hkv * D, dense) */
void tk_write_kv_f32(const float *k, const float *v, void *kc, void *vc, int64_t T, int64_t HD,
                     int64_t page_stride, int64_t tok_stride, const int64_t *pages, const int64_t *offsets,
                     int64_t kvk) {
    const int64_t es = kv_es((int)kvk);
    for (int64_t t = 0; t < T; t++) {
        int64_t at = es * (pages[t] * page_stride + offsets[t] * tok_stride);
        kv_store((char *)kc + at, k + t * HD, HD, (int)kvk);
        kv_store((char *)vc + at, v + t * HD, HD, (int)kvk);
    }
}

/* RoPE (the half-split "rotate_half" convention) in place on heads [h0, h1) of rows x [T, *] (row stride ldx,
 * head h at h * D): x = x * cos + rotate_half(x) * sin, cos/sin [T, D]. Each product and the sum rounded on
 * their own (no FMA contraction), as torch's separate mul/add ops round them: bit-identical to
 * engines.model.apply_rope. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void tk_rope_f32(float *x, int64_t T, int64_t ldx, int64_t h0, int64_t h1, int64_t D, const float *cos,
                 const float *sin) {
    int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = h0; h < h1; h++) {
            float *v = x + t * ldx + h * D;
            for (int64_t d = 0; d < half; d++) {
                float a = v[d], b = v[d + half];
                float pa = a * c[d], qa = b * s[d];
                float pb = b * c[d + half], qb = a * s[d + half];
                v[d] = pa - qa;
                v[d + half] = pb + qb;
            }
        }
    }
}
#pragma GCC pop_options

/* ---- a Llama-family decoder stack in one call ---------------------------------------------------------------
 * For steps whose every sequence runs at most a few queries (decodes, verify windows, short chunks): the
 * whole forward of T tokens without returning to Python, so a tiny model's step costs its weight reads, not
 * ~100 framework ops of dispatch. Same math as engines.model.Transformer.forward over the paged pool (float
 * rounding aside: the GEMV sums in another order). Weights are float32 `wt [K, N]` (row stride ld) or
 * int8 `q [N, K]` with per-row scales (weight-only, or w8a8), or int4 with per-group scales and zeros (w4a8). */

typedef struct {
    const void *w; /* float32 wt [K, N] (row stride ld) or packed in panels (`panels`), or int8 q [N, K] */
    const float *scale; /* int8: float32 [N], or float16 bits [N, K / 32] where group is 32; NULL for float32 */
    const float *bias;  /* [N] or NULL */
    int64_t ld;
    int64_t w8a8; /* int8 weights: 1 quantises the activations too (tk_linear_w8a8), 0 keeps them float32 */
    const uint8_t *zero; /* int4 (tk_linear_w4a8): zero points packed [N, ceil(K / group / 2)] or NULL; w is
                          * packed [N, K / 2], scale [N, K / group] of type skind */
    int64_t group;
    const uint16_t *w16; /* float32: the same weight as bf16 bits (packed in panels), which the register tiles
                          * read instead where it is not NULL (tk_linear_f32_w16) */
    int64_t int4;        /* 1: int4 weights (tk_linear_w4a8; zero may then be NULL, 8 everywhere) */
    int64_t zoff;        /* int4: added to each packed zero nibble */
    int64_t skind;       /* int4: the scales' type as stored (0 float32, 1 float16, 2 bfloat16) */
    int64_t panels;      /* float32: 1 where w is packed in panels (tk_linear_f32_panels), not wt [K, N] */
    int64_t bf16;        /* 1: w is bfloat16 in pair panels, the activations rounded to bfloat16 (tk_linear_bf16) */
} tk_lin;

/* A mixture-of-experts block in place of a layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): the router's softmax
 * (float32) picks each token's top k experts, their weights renormalised to sum 1 where `renorm`; expert e
 * runs gate_up [H -> 2 I] and down [I -> H] on the tokens that chose it, nothing else of it is read. Qwen2-MoE's
 * shared expert (shared_I > 0) runs on every token, scaled by sigmoid(shared_gate [H -> 1]). */
typedef struct {
    int64_t E, k, renorm, I, shared_I;
    tk_lin router;         /* [H -> E] */
    const tk_lin *experts; /* [2 E]: expert e's gate_up at 2 e, its down at 2 e + 1 */
    tk_lin shared_gate_up, shared_down, shared_gate;
} tk_moe;

typedef struct {
    const float *in_norm, *post_norm; /* [H] */
    tk_lin qkv, o, gate_up, down;     /* qkv: [H -> (Hq + 2 Hkv) D], gate_up: [H -> 2 I] (gate then up) */
    void *kc, *vc;                    /* this layer's caches [pages, bs, Hkv, D] (token/head dense), of kv_kind */
    const tk_moe *moe;                /* not NULL: this layer's MLP is a mixture of experts (gate_up, down unused) */
    const float *q_norm, *k_norm;     /* [D] or NULL: Qwen3's RMSNorm of each q and k head before RoPE */
} tk_layer;

typedef struct {
    int64_t L, H, Hq, Hkv, D, I, bs, page_stride, tok_stride, head_stride;
    float eps, attn_scale;
    const float *embed; /* [V, H] at strides (embed_s0, embed_s1) */
    int64_t embed_s0, embed_s1;
    const float *final_norm; /* [H] */
    const float *inv_freq;   /* [D / 2] */
    const tk_layer *layers;
    int64_t kv_kind; /* the caches' elements: KV_F32, KV_F16 or KV_BF16 */
} tk_model;

/* returns 0, or 1 when a scratch allocation failed */
static int lin_apply(const tk_lin *l, const float *x, int64_t M, int64_t K, int64_t N, float *y, int nthreads) {
    if (l->bf16) return tk_linear_bf16(x, M, K, (const uint16_t *)l->w, N, l->bias, y, nthreads);
    if (l->int4)
        return tk_linear_w4a8(x, M, K, (const uint8_t *)l->w, l->scale, l->skind, l->zero, l->zoff, l->group, N,
                              l->bias, y, nthreads) ? 1 : 0;
    if (l->scale && l->group) /* int8 with a scale per 32 weights */
        return (l->w8a8 ? tk_linear_w8a8g : tk_linear_i8g)(x, M, K, (const int8_t *)l->w, (const uint16_t *)l->scale, N,
                                                           l->bias, y, nthreads) ? 1 : 0;
    if (l->scale && l->w8a8) return tk_linear_w8a8(x, M, K, (const int8_t *)l->w, l->scale, N, l->bias, y, nthreads);
    if (l->scale)
        tk_linear_i8(x, M, K, (const int8_t *)l->w, l->scale, N, l->bias, y, nthreads);
    else if (l->panels)
        return tk_linear_f32_panels(x, M, K, (const float *)l->w, l->w16, N, l->bias, y, nthreads);
    else
        tk_linear_f32_w16(x, M, K, (const float *)l->w, l->w16, l->ld, N, l->bias, y, nthreads);
    return 0;
}

/* out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)), as engines.model.RMSNorm rounds it */
static void rms_norm(const float *x, int64_t T, int64_t H, const float *w, float eps, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float ss = 0.f;
        int64_t h = 0;
#if TK_AVX2
        __m256 acc = _mm256_setzero_ps();
        for (; h + 8 <= H; h += 8) {
            __m256 v = _mm256_loadu_ps(xr + h);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        ss = hsum256(acc);
#endif
        for (; h < H; h++) ss += xr[h] * xr[h];
        float r = 1.f / sqrtf(ss / (float)H + eps);
        float *o = out + t * H;
        for (h = 0; h < H; h++) o[h] = w[h] * (xr[h] * r);
    }
}

static inline void add_into(float *x, const float *y, int64_t n) {
    int64_t i = 0;
#if TK_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) x[i] += y[i];
}

/* out[t] = silu(gu[t, :I]) * gu[t, I:], t < T */
static void silu_mul(const float *gu, int64_t T, int64_t I, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (int64_t c = 0; c < I; c++) o[c] = g[c] / (1.f + expf(-g[c])) * u[c];
    }
}

static __thread void *moe_scratch = 0;
static __thread size_t moe_scratch_cap = 0;

/* out [T, H] = the MoE block of h [T, H] (see tk_moe), as engines/moe.py computes it: each expert's tokens
 * gathered into one many-row projection (a decode token: its k experts' weights, one GEMV each), the
 * routing weight times the expert's output added into the token's row. Returns 0, or 1 when a scratch
 * allocation failed. */
static int moe_apply(const tk_moe *mo, const float *h, int64_t T, int64_t H, float *out, int nthreads) {
    const int64_t E = mo->E, k = mo->k, I = mo->I > mo->shared_I ? mo->I : mo->shared_I;
    size_t floats = (size_t)T * (size_t)(E + k + 2 * H + 3 * I + 1), ints = (size_t)T * (size_t)(k + 1) + 1;
    if (grow_scratch(&moe_scratch, &moe_scratch_cap, sizeof(float) * floats + sizeof(int64_t) * ints)) return 1;
    int64_t *chosen = (int64_t *)moe_scratch, *rows = chosen + T * k;
    float *logits = (float *)(rows + T + 1), *wts = logits + T * E, *xs = wts + T * k, *gu = xs + T * H,
          *act = gu + T * 2 * I, *ys = act + T * I, *gate = ys + T * H;
    if (lin_apply(&mo->router, h, T, H, E, logits, nthreads)) return 1;
    for (int64_t t = 0; t < T; t++) { /* softmax in float32, top k (the first of equal maxima), renormalised */
        float *l = logits + t * E, mx = l[0], sum = 0.f;
        for (int64_t e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        for (int64_t e = 0; e < E; e++) sum += (l[e] = expf(l[e] - mx));
        for (int64_t e = 0; e < E; e++) l[e] /= sum;
        float picked = 0.f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (l[e] >= 0.f && (best < 0 || l[e] > l[best])) best = e;
            chosen[t * k + j] = best;
            wts[t * k + j] = l[best];
            picked += l[best];
            l[best] = -1.f; /* taken */
        }
        if (mo->renorm)
            for (int64_t j = 0; j < k; j++) wts[t * k + j] /= picked;
    }
    memset(out, 0, sizeof(float) * (size_t)(T * H));
    for (int64_t e = 0; e < E; e++) {
        int64_t n = 0;
        for (int64_t i = 0; i < T * k; i++)
            if (chosen[i] == e) rows[n++] = i;
        if (!n) continue;
        const float *xe = h; /* a lone token reads h in place; more are gathered */
        if (T > 1) {
            for (int64_t r = 0; r < n; r++) memcpy(xs + r * H, h + rows[r] / k * H, sizeof(float) * (size_t)H);
            xe = xs;
        }
        if (lin_apply(&mo->experts[2 * e], xe, n, H, 2 * mo->I, gu, nthreads)) return 1;
        silu_mul(gu, n, mo->I, act);
        if (lin_apply(&mo->experts[2 * e + 1], act, n, mo->I, H, ys, nthreads)) return 1;
        for (int64_t r = 0; r < n; r++) {
            float w = wts[rows[r]], *o = out + rows[r] / k * H;
            const float *y = ys + r * H;
            for (int64_t c = 0; c < H; c++) o[c] += y[c] * w;
        }
    }
    if (mo->shared_I) {
        const int64_t Is = mo->shared_I;
        if (lin_apply(&mo->shared_gate_up, h, T, H, 2 * Is, gu, nthreads) ||
            lin_apply(&mo->shared_gate, h, T, H, 1, gate, nthreads))
            return 1;
        silu_mul(gu, T, Is, act);
        if (lin_apply(&mo->shared_down, act, T, Is, H, ys, nthreads)) return 1;
        for (int64_t t = 0; t < T; t++) {
            float g = 1.f / (1.f + expf(-gate[t])), *o = out + t * H;
            const float *y = ys + t * H;
            for (int64_t c = 0; c < H; c++) o[c] += g * y[c];
        }
    }
    return 0;
}

/* T tokens `ids` at `pos`; S sequences: sequence s's qlen[s] tokens start at row qstart[s] and are the last
 * qlen[s] of its ctx[s] positions, its pages row rows[s] of block_tables [*, max_blocks] (int64). Writes
 * this step's K/V into the pages, attends, and leaves the final-normed hidden states in out [T, H].
 * Returns 0, or 1 when a scratch allocation failed. */
int tk_forward_f32(const tk_model *m, int64_t T, const int64_t *ids, const int64_t *pos,
                   const int64_t *block_tables, int64_t max_blocks, const int64_t *qstart, const int64_t *qlen,
                   const int64_t *ctx, const int64_t *rows, int64_t S, int64_t max_ctx, float *out, int nthreads) {
    const int64_t H = m->H, D = m->D, Hq = m->Hq, Hkv = m->Hkv, I = m->I, half = D / 2;
    const int64_t nqkv = (Hq + 2 * Hkv) * D, nq = Hq * D, nkv = Hkv * D;
    int64_t width = nqkv > 2 * I ? nqkv : 2 * I;
    size_t floats = (size_t)T * (size_t)(3 * H + width + nq + I + 2 * D);
    float *buf = (float *)malloc(sizeof(float) * floats);
    int64_t *slot = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)(T > 0 ? T : 1));
    if (!buf || !slot) {
        free(buf);
        free(slot);
        return 1;
    }
    float *x = buf, *h = x + T * H, *y = h + T * H, *wide = y + T * H, *att = wide + T * width,
          *act = att + T * nq, *cs = act + T * I, *sn = cs + T * D;
    for (int64_t t = 0; t < T; t++) {
        const float *e = m->embed + ids[t] * m->embed_s0;
        for (int64_t c = 0; c < H; c++) x[t * H + c] = e[c * m->embed_s1];
        float p = (float)pos[t];
        for (int64_t d = 0; d < half; d++) {
            float f = p * m->inv_freq[d];
            cs[t * D + d] = cs[t * D + d + half] = cosf(f);
            sn[t * D + d] = sn[t * D + d + half] = sinf(f);
        }
    }
    /* each token's slot: page and offset from its sequence's table */
    for (int64_t s = 0; s < S; s++)
        for (int64_t i = 0; i < qlen[s]; i++) {
            int64_t t = qstart[s] + i, p = ctx[s] - qlen[s] + i;
            slot[2 * t] = block_tables[rows[s] * max_blocks + p / m->bs];
            slot[2 * t + 1] = p % m->bs;
        }
    int rc = 0;
    for (int64_t l = 0; l < m->L && !rc; l++) {
        const tk_layer *ly = m->layers + l;
        rms_norm(x, T, H, ly->in_norm, m->eps, h);
        if ((rc = lin_apply(&ly->qkv, h, T, H, nqkv, wide, nthreads))) break;
        if (ly->q_norm)
            for (int64_t t = 0; t < T; t++)
                for (int64_t hd = 0; hd < Hq + Hkv; hd++) {
                    float *v = wide + t * nqkv + hd * D;
                    rms_norm(v, 1, D, hd < Hq ? ly->q_norm : ly->k_norm, m->eps, v);
                }
        tk_rope_f32(wide, T, nqkv, 0, Hq + Hkv, D, cs, sn);
        const int kvk = (int)m->kv_kind;
        for (int64_t t = 0; t < T; t++) {
            int64_t at = kv_es(kvk) * (slot[2 * t] * m->page_stride + slot[2 * t + 1] * m->tok_stride);
            kv_store((char *)ly->kc + at, wide + t * nqkv + nq, nkv, kvk);
            kv_store((char *)ly->vc + at, wide + t * nqkv + nq + nkv, nkv, kvk);
        }
        attn_args a = {wide, (const char *)ly->kc, (const char *)ly->vc, Hq, Hkv, D, m->bs, m->page_stride,
                       m->tok_stride, m->head_stride, max_blocks, nqkv, nq, block_tables, qstart, qlen, ctx, rows,
                       m->attn_scale, att, kvk};
        if ((rc = attend_all(&a, S, max_ctx, nthreads)) || (rc = lin_apply(&ly->o, att, T, nq, H, y, nthreads)))
            break;
        add_into(x, y, T * H);
        rms_norm(x, T, H, ly->post_norm, m->eps, h);
        if (ly->moe) {
            if ((rc = moe_apply(ly->moe, h, T, H, y, nthreads))) break;
        } else {
            if ((rc = lin_apply(&ly->gate_up, h, T, H, 2 * I, wide, nthreads))) break;
            silu_mul(wide, T, I, act);
            if ((rc = lin_apply(&ly->down, act, T, I, H, y, nthreads))) break;
        }
        add_into(x, y, T * H);
    }
    if (!rc) rms_norm(x, T, H, m->final_norm, m->eps, out);
    free(buf);
    free(slot);
    return rc;
}

/* k greedy draft tokens per sequence in one call: tk_forward_f32 over the step's rows (the first pass may
 * catch up on several tokens per sequence), the head (a projection [H -> V] like the layers') over each
 * sequence's last row, argmax (the first maximum, as torch's), and the argmax fed back as the next pass's one token per
 * sequence, k times. qstart/qlen/ctx are scratch (overwritten). Bans (min_tokens: EOS and stop ids), when
 * ban_off is not NULL: sequence s may not pick ban_ids[ban_off[s] .. ban_off[s + 1]) at its passes t <
 * ban_until[s]. Writes out[s * k + t]; returns 0, or 1 on a failed allocation. */
/* one token drawn from softmax(l / temp) by the inverse CDF at u in [0, 1): the first token whose cumulative
 * mass exceeds u times the total (a token of zero probability, a banned one, never is); l is overwritten */
static int64_t sample_row(float *l, int64_t V, float temp, float u) {
    float mx = -INFINITY;
    for (int64_t v = 0; v < V; v++) {
        l[v] /= temp;
        if (l[v] > mx) mx = l[v];
    }
    double total = 0.0;
    for (int64_t v = 0; v < V; v++) {
        l[v] = expf(l[v] - mx);
        total += l[v];
    }
    const double cut = (double)u * total;
    double acc = 0.0;
    int64_t last = 0;
    for (int64_t v = 0; v < V; v++) {
        if (l[v] <= 0.f) continue;
        acc += l[v];
        last = v;
        if (acc > cut) return v;
    }
    return last; /* u * total rounded up to the total: the last token with mass */
}

/* k tokens per sequence, each fed back: greedy (the argmax) where temps is NULL or temps[s] is 0, else drawn from
 * softmax(logits / temps[s]) at the uniforms unif[s * k + t] (`sample_row`) */
int tk_draft_greedy_f32(const tk_model *m, const tk_lin *head, int64_t V, int64_t T,
                        const int64_t *ids, const int64_t *pos, const int64_t *block_tables, int64_t max_blocks,
                        int64_t *qstart, int64_t *qlen, int64_t *ctx, const int64_t *rows, int64_t S,
                        int64_t max_ctx, int64_t k, int64_t *out, const int64_t *ban_ids, const int64_t *ban_off,
                        const int64_t *ban_until, const float *temps, const float *unif, int nthreads) {
    const int64_t H = m->H;
    int64_t rows_max = T > S ? T : S;
    float *hid = (float *)malloc(sizeof(float) * (size_t)(rows_max * H));
    float *sel = (float *)malloc(sizeof(float) * (size_t)(S * H));
    float *logits = (float *)malloc(sizeof(float) * (size_t)(S * V));
    int64_t *cur = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * S + T));
    int rc = (!hid || !sel || !logits || !cur);
    if (!rc) {
        int64_t *tok = cur, *tpos = cur + S;
        const int64_t *pid = ids, *ppos = pos;
        for (int64_t t = 0; t < k && !rc; t++) {
            rc = tk_forward_f32(m, T, pid, ppos, block_tables, max_blocks, qstart, qlen, ctx, rows, S, max_ctx, hid,
                                nthreads);
            if (rc) break;
            for (int64_t s = 0; s < S; s++)
                memcpy(sel + s * H, hid + (qstart[s] + qlen[s] - 1) * H, sizeof(float) * (size_t)H);
            if ((rc = lin_apply(head, sel, S, H, V, logits, nthreads))) break;
            for (int64_t s = 0; s < S; s++) {
                float *l = logits + s * V;
                if (ban_off && t < ban_until[s])
                    for (int64_t b = ban_off[s]; b < ban_off[s + 1]; b++)
                        if (ban_ids[b] >= 0 && ban_ids[b] < V) l[ban_ids[b]] = -INFINITY;
                int64_t best = 0;
                if (temps && temps[s] > 0.f)
                    best = sample_row(l, V, temps[s], unif[s * k + t]);
                else
                    for (int64_t v = 1; v < V; v++)
                        if (l[v] > l[best]) best = v;
                tok[s] = best;
                out[s * k + t] = best;
                tpos[s] = ctx[s]; /* the draft's position: after the sequence's context */
                qstart[s] = s;
                qlen[s] = 1;
                ctx[s] += 1;
            }
            T = S;
            max_ctx += 1;
            pid = tok;
            ppos = tpos;
        }
    }
    free(hid);
    free(sel);
    free(logits);
    free(cur);
    return rc;
}
