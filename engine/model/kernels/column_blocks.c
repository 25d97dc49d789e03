/* y[m, n] = sum_k w[n, k] * x[m, k] for a target's passes over one sequence's few tokens, on
 * weights that stream from memory every pass (CPU, AVX2 + FMA).
 *
 * w is laid out in blocks of 16 output columns, P[b][k][0..15] = w[16 b + ., k] (to_column_blocks in
 * one_sequence.py lays it out). float32: the 16 in column order. bfloat16: the 32-bit word j
 * holds column 16 b + j in its low half and 16 b + 8 + j in its high half, so a shift and a
 * mask widen both exactly. x: [M, K] float32; y: [M, N] float32, N a multiple of 16.
 *
 * Why: the row kernel (one_sequence.c) takes each output as a dot product over k. At one row
 * that is one chain of fused multiply-adds, each waiting for the last; at six rows it loads a
 * vector of x for every multiply-add. Here x[m, k] is broadcast into 16 columns at once, a group
 * of rows keeps 6-12 accumulators in flight, each weight vector is loaded once per group, and a
 * block's weights stream as one contiguous run (docs/performance-notes.md#column-blocks).
 *
 * Every output is one chain of fused multiply-adds over k = 0, 1, ..., K - 1, starting from zero,
 * whatever M, the group or the thread: a row's bits do not depend on the pass, and bfloat16
 * weights give the bits of their float32 copies.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "row_groups.h"

/* The 16 columns of block row p as two vectors: columns 0-7 (lo) and 8-15 (hi). */
static inline void widen_f32(const float *p, __m256 *lo, __m256 *hi) {
    *lo = _mm256_loadu_ps(p);
    *hi = _mm256_loadu_ps(p + 8);
}

static inline void widen_bf16(const uint16_t *p, __m256 *lo, __m256 *hi) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline __m256 half_f32(const float *p, int h) { return _mm256_loadu_ps(p + 8 * h); }

static inline __m256 half_bf16(const uint16_t *p, int h) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_castsi256_ps(h ? _mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u))
                                 : _mm256_slli_epi32(v, 16));
}

/* NB blocks from block b, for M rows (both compile-time): 2 M NB accumulators (at most 12). */
#define BLOCKS(WT, NAME, M, NB)                                                                   \
    static inline void NAME##_blocks_##M##_##NB(const WT *P, const float *x, float *y, int64_t b, \
                                                int64_t N, int64_t K) {                          \
        __m256 lo[NB][M], hi[NB][M];                                                              \
        for (int j = 0; j < NB; j++)                                                              \
            for (int m = 0; m < M; m++) lo[j][m] = hi[j][m] = _mm256_setzero_ps();                \
        for (int64_t k = 0; k < K; k++) {                                                         \
            for (int j = 0; j < NB; j++) {                                                        \
                __m256 wl, wh;                                                                    \
                widen_##NAME(P + ((b + j) * K + k) * 16, &wl, &wh);                               \
                for (int m = 0; m < M; m++) {                                                     \
                    __m256 xb = _mm256_broadcast_ss(x + m * K + k);                               \
                    lo[j][m] = _mm256_fmadd_ps(wl, xb, lo[j][m]);                                 \
                    hi[j][m] = _mm256_fmadd_ps(wh, xb, hi[j][m]);                                 \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int j = 0; j < NB; j++)                                                              \
            for (int m = 0; m < M; m++) {                                                         \
                _mm256_storeu_ps(y + m * N + (b + j) * 16, lo[j][m]);                             \
                _mm256_storeu_ps(y + m * N + (b + j) * 16 + 8, hi[j][m]);                         \
            }                                                                                     \
    }

/* Blocks [b0, b1) for M rows, NB blocks at a time; the last n < NB blocks as n at a time
 * (TAIL: one TAIL_CASE for each such n). */
#define GROUP(WT, NAME, M, NB, TAIL)                                                              \
    static void NAME##_group_##M(const WT *P, const float *x, float *y, int64_t b0, int64_t b1,   \
                                 int64_t N, int64_t K) {                                          \
        int64_t b = b0;                                                                           \
        for (; b + NB <= b1; b += NB) NAME##_blocks_##M##_##NB(P, x, y, b, N, K);                 \
        switch (b1 - b) { TAIL }                                                                  \
    }
#define TAIL_CASE(NAME, M, n) case n: NAME##_blocks_##M##_##n(P, x, y, b, N, K); break;

/* 7-12 rows: a block's two halves in turn (M accumulators each); the second reads the block's
 * weights from cache. */
#define HALVES(WT, NAME, M)                                                                       \
    static void NAME##_group_##M(const WT *P, const float *x, float *y, int64_t b0, int64_t b1,   \
                                 int64_t N, int64_t K) {                                          \
        for (int64_t b = b0; b < b1; b++)                                                         \
            for (int h = 0; h < 2; h++) {                                                         \
                __m256 acc[M];                                                                    \
                for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();                         \
                for (int64_t k = 0; k < K; k++) {                                                 \
                    __m256 w = half_##NAME(P + (b * K + k) * 16, h);                              \
                    for (int m = 0; m < M; m++)                                                   \
                        acc[m] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + m * K + k), acc[m]);  \
                }                                                                                 \
                for (int m = 0; m < M; m++) _mm256_storeu_ps(y + m * N + b * 16 + 8 * h, acc[m]); \
            }                                                                                     \
    }

#define KERNEL(WT, NAME)                                                                          \
    BLOCKS(WT, NAME, 1, 1) BLOCKS(WT, NAME, 1, 2) BLOCKS(WT, NAME, 1, 3) BLOCKS(WT, NAME, 1, 4)   \
    BLOCKS(WT, NAME, 1, 5) BLOCKS(WT, NAME, 1, 6) BLOCKS(WT, NAME, 2, 1) BLOCKS(WT, NAME, 2, 2)   \
    BLOCKS(WT, NAME, 3, 1) BLOCKS(WT, NAME, 4, 1)                                                 \
    BLOCKS(WT, NAME, 5, 1) BLOCKS(WT, NAME, 6, 1)                                                 \
    GROUP(WT, NAME, 1, 6, TAIL_CASE(NAME, 1, 1) TAIL_CASE(NAME, 1, 2) TAIL_CASE(NAME, 1, 3)       \
          TAIL_CASE(NAME, 1, 4) TAIL_CASE(NAME, 1, 5))                                            \
    GROUP(WT, NAME, 2, 2, TAIL_CASE(NAME, 2, 1))                                                  \
    GROUP(WT, NAME, 3, 1, ) GROUP(WT, NAME, 4, 1, ) GROUP(WT, NAME, 5, 1, ) GROUP(WT, NAME, 6, 1, ) \
    HALVES(WT, NAME, 7) HALVES(WT, NAME, 8) HALVES(WT, NAME, 9) HALVES(WT, NAME, 10)              \
    HALVES(WT, NAME, 11) HALVES(WT, NAME, 12)                                                     \
    typedef void (*NAME##_group)(const WT *, const float *, float *, int64_t, int64_t, int64_t,   \
                                 int64_t);                                                        \
    static const NAME##_group NAME##_groups[MAX_GROUP + 1] = {                                    \
        0, NAME##_group_1, NAME##_group_2, NAME##_group_3, NAME##_group_4, NAME##_group_5,        \
        NAME##_group_6, NAME##_group_7, NAME##_group_8, NAME##_group_9, NAME##_group_10,          \
        NAME##_group_11, NAME##_group_12};                                                        \
    /* A pass of M rows reads the weights ceil(M / MAX_GROUP) times, in near-equal groups;      \
     * threads take near-equal runs of blocks. */                                                \
    void column_blocks_##NAME(const WT *P, const float *x, float *y, int64_t N, int64_t K,        \
                              int64_t M, int threads) {                                           \
        int64_t blocks = N / 16;                                                                  \
        _Pragma("omp parallel num_threads(threads)") {                                            \
            int t = omp_get_thread_num(), T = omp_get_num_threads();                              \
            int64_t b0 = blocks * t / T, b1 = blocks * (t + 1) / T;                               \
            FOR_EACH_ROW_GROUP(NAME##_groups, P, x, y, b0, b1, N, K, M);                          \
        }                                                                                         \
    }

#pragma GCC optimize("unroll-loops")
KERNEL(float, f32)
KERNEL(uint16_t, bf16)
