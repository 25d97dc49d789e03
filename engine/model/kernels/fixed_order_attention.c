/* Attention in one fixed order per query row, for row-count invariance in float32
 * (engine/model/invariance.py): a row's bits depend only on its query and the keys it sees.
 *
 * q: [B, H, T, D] float32; k, v: [Hkv, B, L, D] float32 or bfloat16 (kv_bf16), the gathered
 * view's layout; visible: NULL (every key) or [B, T, L] bytes, 1 where the query sees the key;
 * out: [B, H, T, D] float32. Query head h reads KV head h / (H / Hkv); D a multiple of 8.
 *
 * Why: torch's batched matmuls block the key sum by the key count and take a gemv for one row,
 * so a verify row and the decode step of the same token (the same keys, plus masked ones) sum in
 * other orders. Here a row visits only the keys it sees, in key order: each score is eight lanes
 * of fused multiply-adds over d = 8j + lane and a fixed sum of the lanes; the softmax's max, its
 * sum of exponentials and the weighted sum of values run over those keys in order. Masked keys
 * and the other rows of the pass never enter, whatever B, T, L or the thread.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float lanes_total(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256 load8(const void *base, int bf16, int64_t at) {
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at))), 16));
    return _mm256_loadu_ps((const float *)base + at);
}

/* One query row: q [D] over the keys and values of one (KV head, sequence) [L, D] from element
 * `base`; seen [L] or NULL; scores [L] scratch; out [D]. */
static void attend_row(const float *q, const void *k, const void *v, int bf16, int64_t base, const uint8_t *seen,
                       int64_t L, int64_t D, float scale, float *scores, float *out) {
    float top = -INFINITY, total = 0.f;
    for (int64_t j = 0; j < L; j++) {
        if (seen && !seen[j]) continue;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k, bf16, base + j * D + i), acc);
        scores[j] = lanes_total(acc) * scale;
        top = scores[j] > top ? scores[j] : top;
    }
    memset(out, 0, D * sizeof(float));
    if (top == -INFINITY) return;  /* a row that sees no key (padding): zeros */
    for (int64_t j = 0; j < L; j++) {
        if (seen && !seen[j]) continue;
        scores[j] = expf(scores[j] - top);
        total += scores[j];
    }
    for (int64_t j = 0; j < L; j++) {
        if (seen && !seen[j]) continue;
        __m256 p = _mm256_set1_ps(scores[j] / total);
        for (int64_t i = 0; i < D; i += 8)
            _mm256_storeu_ps(out + i, _mm256_fmadd_ps(p, load8(v, bf16, base + j * D + i), _mm256_loadu_ps(out + i)));
    }
}

/* Every (sequence, query head, query) row; threads take near-equal runs of rows. 0, or -1 where
 * scratch cannot be had. */
int fixed_order_attention(const float *q, const void *k, const void *v, int kv_bf16, const uint8_t *visible,
                          float *out, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t L, int64_t D, float scale,
                          int threads) {
    const int64_t G = H / Hkv, rows = B * H * T;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc((size_t)(L > 0 ? L : 1) * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!scores) continue;
            const int64_t b = r / (H * T), h = (r / T) % H, t = r % T;
            const int64_t base = ((h / G) * B + b) * L * D;
            attend_row(q + r * D, k, v, kv_bf16, base, visible ? visible + (b * T + t) * L : NULL, L, D, scale,
                       scores, out + r * D);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
