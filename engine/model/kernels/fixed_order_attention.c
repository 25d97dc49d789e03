/* Attention in one fixed order per query row, for row-count invariance (engine/model/invariance.py):
 * a row's bits depend only on its query and the keys it sees.
 *
 * q: [B, H, T, D] float32; k, v: [Hkv, B, L, D] float32 or bfloat16 (kv_bf16), the gathered
 * view's layout, each (KV head, sequence)'s [L, D] contiguous from element hk * head_stride +
 * b * batch_stride (a pool's slice read in place: no copy); visible: NULL (every key) or [B, T, L] bytes, 1 where the query sees the key;
 * out: [B, H, T, D] float32. Query head h reads KV head h / (H / Hkv); D a multiple of 8.
 *
 * Why: torch's batched matmuls block the key sum by the key count and take a gemv for one row,
 * so a verify row and the decode step of the same token (the same keys, plus masked ones) sum in
 * other orders. Here a row visits only the keys it sees, in key order, and everything is a function
 * of a key's rank m among them: each score is eight lanes of fused multiply-adds over d = 8i + lane
 * and a fixed sum of the lanes; the exponentials' sum runs in lane m % 8, in order, then a fixed
 * sum of the lanes; each output element is one chain of multiply-adds over the keys in order.
 * Masked keys and the other rows of the pass never enter, whatever B, T, L or the thread.
 *
 * Speed: a pair's bf16 keys and values are widened once for its G * T rows (where it has several);
 * KEYS keys are scored at once and each chunk of the output has its own accumulator, so
 * independent chains overlap without changing any one of them; the exponentials are vectorised.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define WIDEN_ROWS 4 /* rows of a pair from which its bf16 keys and values are widened first */
#define KEYS 4 /* keys scored at once: four independent chains of multiply-adds, so none waits on another */

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

/* e^x for x <= 0 in each lane (Cephes' expf: x = n ln 2 + r, a degree-5 polynomial in r, then
 * scaled by 2^n; within 2 ulp), the same operations whatever the lane, so a lane's value depends on
 * its input alone. Below -87.3 it gives the smallest normal float's neighbourhood, not 0. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}

/* The weighted sum of values for `chunks` (<= 8, a constant where inlined) chunks of 8 output
 * elements from element i0: each element one chain over the n seen keys in order, in registers. */
static inline __attribute__((always_inline)) void weigh_values(
        int chunks, const float *p, const int32_t *keys, int64_t n, const void *v, int bf16, int64_t base, int64_t D,
        int64_t i0, float *out) {
    __m256 acc[8];
    for (int c = 0; c < chunks; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t m = 0; m < n; m++) {
        const __m256 w = _mm256_set1_ps(p[m]);
        const int64_t at = base + (int64_t)keys[m] * D + i0;
        for (int c = 0; c < chunks; c++) acc[c] = _mm256_fmadd_ps(w, load8(v, bf16, at + 8 * c), acc[c]);
    }
    for (int c = 0; c < chunks; c++) _mm256_storeu_ps(out + i0 + 8 * c, acc[c]);
}

/* One query row: q [D] over the keys and values of one (KV head, sequence) [L, D] from element
 * `base`; seen [L] or NULL; keys [L] and scores [L + 8] scratch; out [D]. The m-th key the row
 * sees is the m-th of every pass that holds the row (a verify pass or its decode step), so each
 * quantity below is a function of m, never of j, L or the other rows. */
static void attend_row(const float *q, const void *k, const void *v, int bf16, int64_t base, const uint8_t *seen,
                       int64_t L, int64_t D, float scale, int32_t *keys, float *scores, float *out) {
    int64_t n = 0;
    for (int64_t j = 0; j < L; j++)
        if (!seen || seen[j]) keys[n++] = (int32_t)j;
    if (!n) {  /* a row that sees no key (padding): zeros */
        memset(out, 0, D * sizeof(float));
        return;
    }
    float top = -INFINITY;
    for (int64_t m = 0; m < n; m += KEYS) {  /* KEYS keys' chains at once, each over d in order */
        const int c_n = (int)(n - m < KEYS ? n - m : KEYS);
        __m256 acc[KEYS] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; i < D; i += 8) {
            const __m256 x = _mm256_loadu_ps(q + i);
            for (int c = 0; c < KEYS; c++)
                if (c < c_n) acc[c] = _mm256_fmadd_ps(x, load8(k, bf16, base + (int64_t)keys[m + c] * D + i), acc[c]);
        }
        for (int c = 0; c < c_n; c++) {
            scores[m + c] = lanes_total(acc[c]) * scale;
            top = scores[m + c] > top ? scores[m + c] : top;
        }
    }
    for (int64_t m = n; m < ((n + 7) & ~7); m++) scores[m] = -INFINITY;  /* the tail chunk's unused lanes: e^-inf... */
    __m256 total = _mm256_setzero_ps();  /* lane m % 8 sums the m-th exponentials in order */
    const __m256 shift = _mm256_set1_ps(top);
    for (int64_t m = 0; m < n; m += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + m), shift));
        if (n - m < 8) {  /* ...are zeroed, so they add nothing */
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - m)), lane)));
        }
        _mm256_storeu_ps(scores + m, e);
        total = _mm256_add_ps(total, e);
    }
    const __m256 sum = _mm256_set1_ps(lanes_total(total));
    for (int64_t m = 0; m < n; m += 8) _mm256_storeu_ps(scores + m, _mm256_div_ps(_mm256_loadu_ps(scores + m), sum));
    for (int64_t i0 = 0; i0 < D; i0 += 64) {
        switch ((int)((D - i0) / 8 < 8 ? (D - i0) / 8 : 8)) {
#define CASE(c) case c: weigh_values(c, scores, keys, n, v, bf16, base, D, i0, out); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        }
    }
}

/* Every (sequence, KV head) pair's G * T query rows; threads take near-equal runs of pairs, each
 * pair's bf16 keys and values widened once into scratch. 0, or -1 where scratch cannot be had. */
int fixed_order_attention(const float *q, const void *k, const void *v, int kv_bf16, const uint8_t *visible,
                          float *out, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t L, int64_t D,
                          int64_t head_stride, int64_t batch_stride, float scale, int threads) {
    const int64_t G = H / Hkv, pairs = B * Hkv;
    const int widen = kv_bf16 && G * T >= WIDEN_ROWS;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc((size_t)(L + 8) * sizeof(float));
        int32_t *keys = malloc((size_t)(L > 0 ? L : 1) * sizeof(int32_t));
        float *wide = widen ? malloc((size_t)2 * (size_t)(L > 0 ? L : 1) * (size_t)D * sizeof(float)) : NULL;
        if (!scores || !keys || (widen && !wide)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < pairs; pair++) {
            if (!scores || !keys || (widen && !wide)) continue;
            const int64_t hk = pair / B, b = pair % B, base = hk * head_stride + b * batch_stride;
            const void *kd = k, *vd = v;
            int64_t at = base;
            int bf16 = kv_bf16;
            if (widen) {  /* exact: a bf16 value is the top half of its float32 */
                for (int64_t i = 0; i < L * D; i += 8) {
                    _mm256_storeu_ps(wide + i, load8(k, 1, base + i));
                    _mm256_storeu_ps(wide + L * D + i, load8(v, 1, base + i));
                }
                kd = wide, vd = wide + L * D, at = 0, bf16 = 0;
            }
            for (int64_t g = 0; g < G * T; g++) {
                const int64_t h = hk * G + g / T, t = g % T, r = (b * H + h) * T + t;
                attend_row(q + r * D, kd, vd, bf16, at, visible ? visible + (b * T + t) * L : NULL, L, D, scale,
                           keys, scores, out + r * D);
            }
        }
        free(scores);
        free(keys);
        free(wide);
    }
    return failed ? -1 : 0;
}
