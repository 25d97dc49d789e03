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
 * two query heads of one KV head at one position share each key's and value's loads; KEYS keys
 * are scored at once and each chunk of the output has its own accumulator, so independent chains
 * overlap without changing any one of them; the exponentials are vectorised.
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

/* The weighted sums of values of R rows (R, chunks constants where inlined; R * chunks <= 8) for
 * `chunks` chunks of 8 output elements from element i0: each element one chain over the n seen
 * keys in order, in registers; p[r] the row's weights by rank. */
static inline __attribute__((always_inline)) void weigh_values(
        int R, int chunks, float *const *p, const int32_t *keys, int64_t n, const void *v, int bf16, int64_t base,
        int64_t D, int64_t i0, float *const *out) {
    __m256 acc[2][8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < chunks; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t m = 0; m < n; m++) {
        const int64_t at = base + (int64_t)keys[m] * D + i0;
        __m256 w[2];
        for (int r = 0; r < R; r++) w[r] = _mm256_set1_ps(p[r][m]);
        for (int c = 0; c < chunks; c++) {
            const __m256 value = load8(v, bf16, at + 8 * c);
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(w[r], value, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < chunks; c++) _mm256_storeu_ps(out[r] + i0 + 8 * c, acc[r][c]);
}

/* R (1 or 2, a constant where inlined) query rows that see the same keys (query heads of one KV
 * head at one position): q[r] [D] over the keys and values of one (KV head, sequence) [L, D] from
 * element `base`; seen [L] or NULL; keys [L] and scores[r] [L + 8] scratch; out[r] [D]. Each key
 * and value vector is loaded once for the R rows; each row's operations are those it runs alone.
 * The m-th key a row sees is the m-th of every pass that holds the row (a verify pass or its
 * decode step), so each quantity below is a function of m, never of j, L or the other rows. */
static inline __attribute__((always_inline)) void attend_rows(
        int R, const float *const *q, const void *k, const void *v, int bf16, int64_t base, const uint8_t *seen,
        int64_t L, int64_t D, float scale, int32_t *keys, float *const *scores, float *const *out) {
    int64_t n = 0;
    for (int64_t j = 0; j < L; j++)
        if (!seen || seen[j]) keys[n++] = (int32_t)j;
    if (!n) {  /* rows that see no key (padding): zeros */
        for (int r = 0; r < R; r++) memset(out[r], 0, D * sizeof(float));
        return;
    }
    float top[2] = {-INFINITY, -INFINITY};
    for (int64_t m = 0; m < n; m += KEYS) {  /* KEYS keys' chains at once, each over d in order */
        const int c_n = (int)(n - m < KEYS ? n - m : KEYS);
        __m256 acc[2][KEYS];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < KEYS; c++) acc[r][c] = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += 8) {
            __m256 x[2];
            for (int r = 0; r < R; r++) x[r] = _mm256_loadu_ps(q[r] + i);
            for (int c = 0; c < KEYS; c++) {
                if (c >= c_n) continue;
                const __m256 key = load8(k, bf16, base + (int64_t)keys[m + c] * D + i);
                for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(x[r], key, acc[r][c]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < c_n; c++) {
                scores[r][m + c] = lanes_total(acc[r][c]) * scale;
                top[r] = scores[r][m + c] > top[r] ? scores[r][m + c] : top[r];
            }
    }
    for (int r = 0; r < R; r++) {
        float *s = scores[r];
        for (int64_t m = n; m < ((n + 7) & ~7); m++) s[m] = -INFINITY;  /* the tail chunk's unused lanes: e^-inf... */
        __m256 total = _mm256_setzero_ps();  /* lane m % 8 sums the m-th exponentials in order */
        const __m256 shift = _mm256_set1_ps(top[r]);
        for (int64_t m = 0; m < n; m += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + m), shift));
            if (n - m < 8) {  /* ...are zeroed, so they add nothing */
                const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - m)), lane)));
            }
            _mm256_storeu_ps(s + m, e);
            total = _mm256_add_ps(total, e);
        }
        const __m256 sum = _mm256_set1_ps(lanes_total(total));
        for (int64_t m = 0; m < n; m += 8) _mm256_storeu_ps(s + m, _mm256_div_ps(_mm256_loadu_ps(s + m), sum));
    }
    const int step = 8 / R;  /* chunks a pass over the values takes: R * step accumulators */
    for (int64_t i0 = 0; i0 < D; i0 += 8 * step) {
        const int chunks = (int)((D - i0) / 8 < step ? (D - i0) / 8 : step);
        switch (chunks) {
#define CASE(c) case c: weigh_values(R, c, scores, keys, n, v, bf16, base, D, i0, out); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
        }
    }
}

/* attend_rows with R a constant in each case. */
static void attend_group(int R, const float *const *q, const void *k, const void *v, int bf16, int64_t base,
                         const uint8_t *seen, int64_t L, int64_t D, float scale, int32_t *keys, float *const *scores,
                         float *const *out) {
    if (R == 2)
        attend_rows(2, q, k, v, bf16, base, seen, L, D, scale, keys, scores, out);
    else
        attend_rows(1, q, k, v, bf16, base, seen, L, D, scale, keys, scores, out);
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
        float *scores = malloc((size_t)2 * (size_t)(L + 8) * sizeof(float));
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
            for (int64_t t = 0; t < T; t++) {  /* the query heads of this KV head at position t see the same keys */
                const uint8_t *seen = visible ? visible + (b * T + t) * L : NULL;
                for (int64_t g = 0; g < G; g += 2) {
                    const int R = G - g >= 2 ? 2 : 1;
                    const float *qs[2];
                    float *outs[2], *ss[2] = {scores, scores + L + 8};
                    for (int r = 0; r < R; r++) {
                        const int64_t row = (b * H + hk * G + g + r) * T + t;
                        qs[r] = q + row * D, outs[r] = out + row * D;
                    }
                    attend_group(R, qs, kd, vd, bf16, at, seen, L, D, scale, keys, ss, outs);
                }
            }
        }
        free(scores);
        free(keys);
        free(wide);
    }
    return failed ? -1 : 0;
}
