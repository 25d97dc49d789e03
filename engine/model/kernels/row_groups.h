/* How the one-sequence kernels (one_sequence.c, column_blocks.c) cut a pass of M rows. */
#ifndef ROW_GROUPS_H
#define ROW_GROUPS_H

#include <stdint.h>

/* The most rows a group multiplies into per weight read: a pass of M rows reads each weight
 * ceil(M / MAX_GROUP) times. 12 accumulators and the weight vector fit AVX2's 16 registers
 * (docs/performance-notes.md#one-sequence-row-groups). */
#define MAX_GROUP 12

/* Calls table[g](w, x + m0 * K, y + m0 * N, lo, hi, N, K) for each group of g rows from row m0:
 * ceil(M / MAX_GROUP) groups of near-equal size, in order; none if the range [lo, hi) is empty. */
#define FOR_EACH_ROW_GROUP(table, w, x, y, lo, hi, N, K, M)                                     \
    do {                                                                                        \
        int64_t groups_ = ((M) + MAX_GROUP - 1) / MAX_GROUP;                                    \
        for (int64_t i_ = 0, m0_ = 0; i_ < groups_ && (lo) < (hi); i_++) {                      \
            int64_t g_ = ((M) - m0_) / (groups_ - i_);                                          \
            (table)[g_]((w), (x) + m0_ * (K), (y) + m0_ * (N), (lo), (hi), (N), (K));           \
            m0_ += g_;                                                                          \
        }                                                                                       \
    } while (0)

#endif
