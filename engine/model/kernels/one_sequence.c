/* y[m, n] = sum_k w[n, k] * x[m, k] for a pass over one sequence's few tokens (CPU, AVX2 + FMA).
 *
 * w: [N, K] row-major, float32 or bfloat16 (the upper half of a float32: widened exactly);
 * x: [M, K] float32; y: [M, N] float32; K a multiple of 8.
 *
 * Why: decoding reads every weight once per token, so its cost is the weights' bytes. oneDNN's
 * reordered-weight kernel pays extra per row as soon as a pass has a few (a speculative verify pass), and
 * cannot read bfloat16 weights on a CPU without bfloat16 instructions. Here each weight vector
 * is read once per group of up to MAX_GROUP (12) rows and multiplied into all of them.
 *
 * Every output is one dot product computed the same way whatever M is and whatever thread
 * computes it: eight lanes accumulate k = 8j + lane in order (fused multiply-adds), then a
 * fixed-order sum of the lanes. So a row's result does not depend on the other rows of the pass,
 * and bfloat16 weights give the same bits as their float32 copies.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "row_groups.h"

static inline float lanes_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 odd = _mm_movehdup_ps(s);
    s = _mm_add_ps(s, odd);
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehl_ps(odd, s)));
}

static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }

static inline __m256 load_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Rows [n0, n1) of y for a group of exactly M rows of x (M a compile-time constant), RW weight
 * rows at a time: each output's chain of fused multiply-adds is as above, but RW x M chains run
 * side by side, so a pass of one to three rows over weights in cache (a proposer's) is not held
 * to one FMA per FMA latency. A target's weights, streamed from memory, take column_blocks.c. */
#define GROUP(WT, NAME, M, RW)                                                              \
    static void NAME##_##M##_##RW(const WT *w, const float *x, float *y, int64_t n0, int64_t n1, \
                           int64_t N, int64_t K) {                                          \
        int64_t n = n0;                                                                     \
        for (; n + RW <= n1; n += RW) {                                                     \
            __m256 acc[RW][M];                                                              \
            for (int r = 0; r < RW; r++)                                                    \
                for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();                \
            for (int64_t k = 0; k < K; k += 8) {                                            \
                __m256 xv[M];                                                               \
                for (int m = 0; m < M; m++) xv[m] = _mm256_loadu_ps(x + m * K + k);         \
                for (int r = 0; r < RW; r++) {                                              \
                    __m256 wv = load_##NAME(w + (n + r) * K + k);                           \
                    for (int m = 0; m < M; m++) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]); \
                }                                                                           \
            }                                                                               \
            for (int r = 0; r < RW; r++)                                                    \
                for (int m = 0; m < M; m++) y[m * N + n + r] = lanes_sum(acc[r][m]);        \
        }                                                                                   \
        for (; n < n1; n++) {                                                               \
            const WT *row = w + n * K;                                                      \
            __m256 acc[M];                                                                  \
            for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();                       \
            for (int64_t k = 0; k < K; k += 8) {                                            \
                __m256 wv = load_##NAME(row + k);                                           \
                for (int m = 0; m < M; m++)                                                 \
                    acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);   \
            }                                                                               \
            for (int m = 0; m < M; m++) y[m * N + n] = lanes_sum(acc[m]);                   \
        }                                                                                   \
    }

#define KERNEL(WT, NAME)                                                                      \
    GROUP(WT, NAME, 1, 4) GROUP(WT, NAME, 2, 4) GROUP(WT, NAME, 3, 2)                         \
    GROUP(WT, NAME, 4, 1) GROUP(WT, NAME, 5, 1)                                               \
    GROUP(WT, NAME, 6, 1) GROUP(WT, NAME, 7, 1) GROUP(WT, NAME, 8, 1) GROUP(WT, NAME, 9, 1)   \
    GROUP(WT, NAME, 10, 1) GROUP(WT, NAME, 11, 1) GROUP(WT, NAME, 12, 1)                      \
    typedef void (*NAME##_group)(const WT *, const float *, float *, int64_t, int64_t,        \
                                 int64_t, int64_t);                                           \
    /* [M]: the group function for M rows */                                                  \
    static const NAME##_group NAME##_groups[MAX_GROUP + 1] = {                                \
        0, NAME##_1_4, NAME##_2_4, NAME##_3_2, NAME##_4_1, NAME##_5_1, NAME##_6_1,            \
        NAME##_7_1, NAME##_8_1, NAME##_9_1, NAME##_10_1, NAME##_11_1, NAME##_12_1};           \
    void one_sequence_##NAME(const WT *w, const float *x, float *y, int64_t N, int64_t K,     \
                             int64_t M, int threads) {                                        \
        _Pragma("omp parallel num_threads(threads)") {                                        \
            int t = omp_get_thread_num(), T = omp_get_num_threads();                          \
            int64_t per = (N + T - 1) / T, n0 = t * per, n1 = n0 + per < N ? n0 + per : N;    \
            FOR_EACH_ROW_GROUP(NAME##_groups, w, x, y, n0, n1, N, K, M);                      \
        }                                                                                     \
    }

#pragma GCC optimize("unroll-loops")
KERNEL(float, f32)
KERNEL(uint16_t, bf16)
