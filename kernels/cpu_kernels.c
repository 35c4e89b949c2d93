/* tandem's CPU kernels (plain C, built by kernels/cpu_kernels.py with the system C compiler at first use and
 * called through ctypes). Each has a PyTorch reference in kernels/cpu_kernels.py that the tests compare it to.
 *
 *   tk_linear_f32    y[M, N] = x[M, K] @ wt[K, N] (+ bias): the decode GEMV / skinny GEMM over a column-major
 *                    nn.Linear weight (engines.model.cpu_weight_layout stores weight.t() contiguous)
 *   tk_linear_i8     y[M, N] = (x[M, K] @ q[N, K]^T) * scale[N] (+ bias): weight-only int8, fp32 activations
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

int tk_has_avx2(void) { return TK_AVX2; }

/* ---- float32 linear over wt [K, N] (row stride ldw) ------------------------------------------------------ */

#if TK_AVX2
#define TK_DEF_LIN(MR, NV)                                                                                     \
    static void lin_##MR##_##NV(const float *x, int64_t ldx, int64_t K, const float *w, int64_t ldw, float *y, \
                                int64_t ldy, const float *bias) {                                            \
        __m256 acc[MR][NV];                                                                                    \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int v = 0; v < NV; v++) acc[r][v] = _mm256_setzero_ps();                                      \
        for (int64_t k = 0; k < K; k++) {                                                                      \
            const float *wr = w + k * ldw;                                                                     \
            __m256 wv[NV];                                                                                     \
            for (int v = 0; v < NV; v++) wv[v] = _mm256_loadu_ps(wr + 8 * v);                                  \
            for (int r = 0; r < MR; r++) {                                                                     \
                __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);                                              \
                for (int v = 0; v < NV; v++) acc[r][v] = _mm256_fmadd_ps(xb, wv[v], acc[r][v]);                \
            }                                                                                                  \
        }                                                                                                      \
        for (int r = 0; r < MR; r++)                                                                           \
            for (int v = 0; v < NV; v++) {                                                                     \
                __m256 o = acc[r][v];                                                                          \
                if (bias) o = _mm256_add_ps(o, _mm256_loadu_ps(bias + 8 * v));                                 \
                _mm256_storeu_ps(y + r * ldy + 8 * v, o);                                                      \
            }                                                                                                  \
    }
TK_DEF_LIN(1, 8)
TK_DEF_LIN(2, 6)
TK_DEF_LIN(3, 4)
TK_DEF_LIN(4, 3)
TK_DEF_LIN(1, 1)
TK_DEF_LIN(2, 1)
TK_DEF_LIN(3, 1)
TK_DEF_LIN(4, 1)

typedef void (*lin_fn)(const float *, int64_t, int64_t, const float *, int64_t, float *, int64_t, const float *);
static const lin_fn LIN_WIDE[5] = {0, lin_1_8, lin_2_6, lin_3_4, lin_4_3};
static const int LIN_NV[5] = {0, 8, 6, 4, 3};
static const lin_fn LIN_ONE[5] = {0, lin_1_1, lin_2_1, lin_3_1, lin_4_1};
#endif

/* columns [n0, n1) of rows [0, M) */
static void linear_cols(const float *x, int64_t M, int64_t K, const float *wt, int64_t ldw, const float *bias,
                        float *y, int64_t N, int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        int mr = (int)(M - m0 < 4 ? M - m0 : 4);
        const float *xm = x + m0 * K;
        float *ym = y + m0 * N;
        int64_t n = n0;
#if TK_AVX2
        int64_t width = 8 * LIN_NV[mr];
        for (; n + width <= n1; n += width)
            LIN_WIDE[mr](xm, K, K, wt + n, ldw, ym + n, N, bias ? bias + n : 0);
        for (; n + 8 <= n1; n += 8) LIN_ONE[mr](xm, K, K, wt + n, ldw, ym + n, N, bias ? bias + n : 0);
#endif
        for (; n < n1; n++)
            for (int r = 0; r < mr; r++) {
                float s = 0.f;
                for (int64_t k = 0; k < K; k++) s += xm[r * K + k] * wt[k * ldw + n];
                ym[r * N + n] = s + (bias ? bias[n] : 0.f);
            }
    }
}

void tk_linear_f32(const float *x, int64_t M, int64_t K, const float *wt, int64_t ldw, int64_t N,
                   const float *bias, float *y, int nthreads) {
    if (nthreads <= 1 || N < 128) {
        linear_cols(x, M, K, wt, ldw, bias, y, N, 0, N);
        return;
    }
    int64_t chunk = ((N + nthreads - 1) / nthreads + 63) / 64 * 64;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < nthreads; t++) {
        int64_t a = t * chunk, b = a + chunk < N ? a + chunk : N;
        if (a < b) linear_cols(x, M, K, wt, ldw, bias, y, N, a, b);
    }
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
#endif

/* rows [n0, n1) of the weight for every x row: two weight rows at a time (read from memory once; the
 * activation blocks of four rows reuse them from L1) */
static void linear_i8_rows(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale,
                           const float *bias, float *y, int64_t N, int64_t n0, int64_t n1) {
    int64_t n = n0;
#if TK_AVX2
    float s0[4], s1[4];
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

void tk_linear_i8(const float *x, int64_t M, int64_t K, const int8_t *q, const float *scale, int64_t N,
                  const float *bias, float *y, int nthreads) {
    if (nthreads <= 1 || N < 128) {
        linear_i8_rows(x, M, K, q, scale, bias, y, N, 0, N);
        return;
    }
    int64_t chunk = ((N + nthreads - 1) / nthreads + 1) / 2 * 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < nthreads; t++) {
        int64_t a = t * chunk, b = a + chunk < N ? a + chunk : N;
        if (a < b) linear_i8_rows(x, M, K, q, scale, bias, y, N, a, b);
    }
}

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

typedef struct {
    const float *q, *kc, *vc;
    int64_t Hq, Hkv, D, bs, page_stride, tok_stride, head_stride, max_blocks;
    const int64_t *block_tables, *qstart, *qlen, *ctx, *rows;
    float scale;
    float *out;
} attn_args;

/* one (sequence, KV head): every query of the sequence, every query head of the group; `p` holds ctx floats
 * per query head of the group */
static void attend_one(const attn_args *a, int64_t s, int64_t g, float *p) {
    int64_t rep = a->Hq / a->Hkv, D = a->D, bs = a->bs;
    int64_t q0 = a->qstart[s], qlen = a->qlen[s], ctx = a->ctx[s];
    const int64_t *bt = a->block_tables + a->rows[s] * a->max_blocks;
    const float *kbase = a->kc + g * a->head_stride, *vbase = a->vc + g * a->head_stride;
    for (int64_t i = 0; i < qlen; i++) {
        int64_t n = ctx - qlen + i + 1; /* keys 0 .. n-1 */
        const float *qi = a->q + ((q0 + i) * a->Hq + g * rep) * D;
        float *oi = a->out + ((q0 + i) * a->Hq + g * rep) * D;
        for (int64_t r = 0; r < rep; r++) {
            float *pr = p + r * ctx;
            float mx = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                const float *kj = kbase + bt[j / bs] * a->page_stride + (j % bs) * a->tok_stride;
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
                const float *vj = vbase + bt[j / bs] * a->page_stride + (j % bs) * a->tok_stride;
                axpy_f(o, pr[j] * inv, vj, D);
            }
        }
    }
}

/* S sequences: sequence s's qlen[s] queries start at row qstart[s] of q [T, Hq, D] and are the last qlen[s]
 * of its ctx[s] positions; its pages are row rows[s] of block_tables [*, max_blocks]. Rows of `out` that no
 * sequence names are left as they are. */
int tk_paged_attention_f32(const float *q, int64_t Hq, int64_t D, const float *kc, const float *vc, int64_t Hkv,
                           int64_t bs, int64_t page_stride, int64_t tok_stride, int64_t head_stride,
                           const int64_t *block_tables, int64_t max_blocks, const int64_t *qstart,
                           const int64_t *qlen, const int64_t *ctx, const int64_t *rows, int64_t S, int64_t max_ctx,
                           float scale, float *out, int nthreads) {
    attn_args a = {q, kc, vc, Hq, Hkv, D, bs, page_stride, tok_stride, head_stride, max_blocks, block_tables,
                   qstart, qlen, ctx, rows, scale, out};
    int64_t rep = Hq / Hkv, work = S * Hkv;
    size_t need = sizeof(float) * (size_t)(rep * (max_ctx > 0 ? max_ctx : 1));
    if (nthreads <= 1 || work < 2) {
        float *p = (float *)malloc(need);
        if (!p) return 1;
        for (int64_t w = 0; w < work; w++) attend_one(&a, w / Hkv, w % Hkv, p);
        free(p);
        return 0;
    }
    float *buf = (float *)malloc(need * (size_t)nthreads);
    if (!buf) return 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t w = 0; w < work; w++)
        attend_one(&a, w / Hkv, w % Hkv, buf + (need / sizeof(float)) * omp_get_thread_num());
#else
    for (int64_t w = 0; w < work; w++) attend_one(&a, w / Hkv, w % Hkv, buf);
#endif
    free(buf);
    return 0;
}

/* this step's K/V into their slots: k, v [T, Hkv * D] contiguous; token t goes to page pages[t], slot
 * offsets[t] (the cache's token stride is Hkv * D, dense) */
void tk_write_kv_f32(const float *k, const float *v, float *kc, float *vc, int64_t T, int64_t HD,
                     int64_t page_stride, int64_t tok_stride, const int64_t *pages, const int64_t *offsets) {
    for (int64_t t = 0; t < T; t++) {
        int64_t at = pages[t] * page_stride + offsets[t] * tok_stride;
        memcpy(kc + at, k + t * HD, sizeof(float) * HD);
        memcpy(vc + at, v + t * HD, sizeof(float) * HD);
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
