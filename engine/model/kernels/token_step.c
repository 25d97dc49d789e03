/* One token through a whole Llama, on CPU: a draft model's step over one sequence; and one token
 * through an EAGLE-3 head (eagle_step), whose one layer attends over [embedding, hidden state].
 *
 * Why: a small draft's torch step is mostly dispatch cost of ~100 eager operations
 * (docs/performance-notes.md#draft-token-step). Here the whole step is one call: the matmuls are
 * one_sequence.c's kernel with M = 1, attention and the rest loops over head or hidden vectors.
 *
 * A draft's rounding may differ from its batched passes (only the target's verify pass and the
 * rejection sampler decide the output), so nothing here needs to match torch bit for bit; the
 * tests check it against the model's torch forward to float32 tolerance.
 *
 * Layout (the engine's): KV storage [layers, 2, kv_heads, kv_rows, head_dim] in float32 or bfloat16
 * (`kind`, as the embedding; bfloat16 values are rounded to nearest even when written), the row of
 * key position j given by key_rows[j] (or first_key_row + j when key_rows is NULL, a slotted
 * pool or consecutive blocks); the token's own key is written at write_row, which must be the
 * row of key position pos; cos/sin
 * tables [max_positions, head_dim] with the rotate-half sign folded into sin.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

void one_sequence_f32(const float *w, const float *x, float *y, int64_t N, int64_t K, int64_t M, int threads);
void one_sequence_bf16(const uint16_t *w, const float *x, float *y, int64_t N, int64_t K, int64_t M,
                       int threads);

enum WeightKind { WEIGHTS_F32 = 0, WEIGHTS_BF16 = 1 };

typedef const void *Weight; /* [N, K] row-major, float32 or bfloat16 (the model's kind) */

typedef struct {
    const float *attn_norm;  /* [hidden] */
    Weight qkv;              /* [(heads + 2 kv_heads) head_dim, hidden] */
    Weight o;                /* [hidden, heads head_dim] */
    const float *mlp_norm;   /* [hidden] */
    Weight gate_up;          /* [2 intermediate, hidden]: gate rows, then up rows */
    Weight down;             /* [hidden, intermediate] */
} StepLayer;

typedef struct {
    int64_t hidden, intermediate, layers, heads, kv_heads, head_dim;
    int64_t head_rows;        /* rows of lm_head (the vocabulary) */
    int64_t kv_rows;          /* rows of the KV storage per (layer, k|v, kv_head) */
    int64_t max_keys;         /* the most keys a step may attend to (the scratch is sized for it) */
    float eps, scale;
    int64_t kind;             /* enum WeightKind of every matmul weight */
    int64_t kv_kind;          /* enum WeightKind of the KV storage and the embedding */
    const void *embed;        /* [vocab, hidden] */
    const float *cos, *sin;   /* [max_positions, head_dim] */
    const float *final_norm;  /* [hidden] */
    const float *hidden_norm; /* [hidden]: an EAGLE-3 head's norm of the fed-back hidden state (else NULL) */
    Weight lm_head;           /* [head_rows, hidden] */
    const StepLayer *layer;   /* [layers] */
    void *kv;
    float *scratch;           /* see token_step_scratch_floats */
} StepModel;

int64_t token_step_scratch_floats(const StepModel *m, int64_t max_keys) {
    int64_t qkv = (m->heads + 2 * m->kv_heads) * m->head_dim;
    return 4 * m->hidden + qkv + m->heads * m->head_dim + 3 * m->intermediate + m->heads * max_keys;
}

static inline float lanes_total(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static void matmul(const StepModel *m, Weight w, const float *x, float *y, int64_t n, int64_t k, int threads) {
    if (m->kind == WEIGHTS_BF16)
        one_sequence_bf16((const uint16_t *)w, x, y, n, k, 1, threads);
    else
        one_sequence_f32((const float *)w, x, y, n, k, 1, threads);
}

static void rms_norm(const float *x, const float *w, float *out, int64_t n, float eps) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* rotate-half RoPE of one head vector in place: x * cos + swap_halves(x) * signed_sin */
static void rope(float *x, const float *cos, const float *sin, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* element offset of a head's row of K (which 0) or V (which 1) in the KV storage */
static inline int64_t kv_at(const StepModel *m, int64_t layer, int64_t which, int64_t head, int64_t row) {
    return (((layer * 2 + which) * m->kv_heads + head) * m->kv_rows + row) * m->head_dim;
}

/* 8 values of a float32 or bfloat16 array (kind), from element `at`, as float32 lanes */
static inline __m256 load8(const void *base, int64_t kind, int64_t at) {
    if (kind == WEIGHTS_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at))), 16));
    return _mm256_loadu_ps((const float *)base + at);
}

/* n float32 values into a float32 or bfloat16 array (kind) from element `at` */
static void store(void *base, int64_t kind, int64_t at, const float *x, int64_t n) {
    if (kind != WEIGHTS_BF16) {
        memcpy((float *)base + at, x, n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, sizeof bits);
        ((uint16_t *)base)[at + i] = (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    }
}

/* attn[hq] = softmax(q_hq . keys * scale) . values for every query head (threads split the
 * heads); qkv holds the roped q of every head; head_dim a multiple of 8; scores [heads, max_keys] */
static void attend(const StepModel *m, int64_t l, const float *qkv, float *attn, float *scores, int64_t n_keys,
                   const int64_t *key_rows, int64_t first_key_row, int threads) {
    const int64_t D = m->head_dim, Hq = m->heads, G = Hq / m->kv_heads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t hq = 0; hq < Hq; hq++) {
        const float *q = qkv + hq * D;
        float *s = scores + hq * m->max_keys, top = -INFINITY, total = 0.f;
        for (int64_t t = 0; t < n_keys; t++) {
            const int64_t k = kv_at(m, l, 0, hq / G, key_rows ? key_rows[t] : first_key_row + t);
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(m->kv, m->kv_kind, k + i), acc);
            s[t] = lanes_total(acc) * m->scale;
            top = s[t] > top ? s[t] : top;
        }
        for (int64_t t = 0; t < n_keys; t++) {
            s[t] = expf(s[t] - top);
            total += s[t];
        }
        float *out = attn + hq * D;
        memset(out, 0, D * sizeof(float));
        for (int64_t t = 0; t < n_keys; t++) {
            const int64_t v = kv_at(m, l, 1, hq / G, key_rows ? key_rows[t] : first_key_row + t);
            __m256 p = _mm256_set1_ps(s[t] / total);
            for (int64_t i = 0; i < D; i += 8)
                _mm256_storeu_ps(out + i, _mm256_fmadd_ps(p, load8(m->kv, m->kv_kind, v + i), _mm256_loadu_ps(out + i)));
        }
    }
}

/* One decoder layer l over one token: x [width] is its normed attention input, h [hidden] the
 * residual stream (updated in place); writes the token's K/V at write_row and attends to keys 0..pos. */
static void decoder_layer(const StepModel *m, int64_t l, float *h, const float *x, int64_t width, int64_t pos,
                          int64_t write_row, const int64_t *key_rows, int64_t first_key_row, int threads) {
    const int64_t H = m->hidden, I = m->intermediate, D = m->head_dim, Hq = m->heads, Hkv = m->kv_heads;
    float *tmp = m->scratch + 3 * H, *qkv = tmp + H, *attn = qkv + (Hq + 2 * Hkv) * D;
    float *gu = attn + Hq * D, *act = gu + 2 * I, *scores = act + I, *normed = m->scratch + H;
    const StepLayer *lw = &m->layer[l];
    const float *cos = m->cos + pos * D, *sin = m->sin + pos * D;
    matmul(m, lw->qkv, x, qkv, (Hq + 2 * Hkv) * D, width, threads);
    for (int64_t j = 0; j < Hq + Hkv; j++) rope(qkv + j * D, cos, sin, D);
    for (int64_t j = 0; j < Hkv; j++) {
        store(m->kv, m->kv_kind, kv_at(m, l, 0, j, write_row), qkv + (Hq + j) * D, D);
        store(m->kv, m->kv_kind, kv_at(m, l, 1, j, write_row), qkv + (Hq + Hkv + j) * D, D);
    }
    attend(m, l, qkv, attn, scores, pos + 1, key_rows, first_key_row, threads);
    matmul(m, lw->o, attn, tmp, H, Hq * D, threads);
    for (int64_t i = 0; i < H; i++) h[i] += tmp[i];
    rms_norm(h, lw->mlp_norm, normed, H, m->eps);
    matmul(m, lw->gate_up, normed, gu, 2 * I, H, threads);
    for (int64_t i = 0; i < I; i++) act[i] = gu[i] / (1.f + expf(-gu[i])) * gu[I + i];
    matmul(m, lw->down, act, tmp, H, I, threads);
    for (int64_t i = 0; i < H; i++) h[i] += tmp[i];
}

static int bad_args(const StepModel *m, int64_t pos, int64_t write_row) {
    return pos < 0 || pos + 1 > m->max_keys || write_row < 0 || write_row >= m->kv_rows || m->kv_heads <= 0 ||
           m->heads % m->kv_heads != 0 || m->head_dim % 8 != 0;
}

/* logits [head_rows] of the residual stream h (through the final norm and lm_head) */
static void output_layer(const StepModel *m, const float *h, float *logits, int threads) {
    float *normed = m->scratch + m->hidden;
    rms_norm(h, m->final_norm, normed, m->hidden, m->eps);
    matmul(m, m->lm_head, normed, logits, m->head_rows, m->hidden, threads);
}

/* the embedding row of `token` as float32 into out [hidden] */
static void embed_row(const StepModel *m, int64_t token, float *out) {
    for (int64_t i = 0; i < m->hidden; i += 8) _mm256_storeu_ps(out + i, load8(m->embed, m->kv_kind, token * m->hidden + i));
}

/* Runs `token` at position `pos`: writes its K/V at write_row, attends to keys 0..pos.
 * logits: NULL skips the output layer (a token of a chunk before its last); otherwise
 * [head_rows] scores.
 * Returns 0, or -1 if an argument is out of range. */
int token_step(const StepModel *m, int64_t token, int64_t pos, int64_t write_row, const int64_t *key_rows,
               int64_t first_key_row, float *logits, int threads) {
    if (bad_args(m, pos, write_row)) return -1;
    float *h = m->scratch, *x = h + m->hidden;
    embed_row(m, token, h);
    for (int64_t l = 0; l < m->layers; l++) {
        rms_norm(h, m->layer[l].attn_norm, x, m->hidden, m->eps);
        decoder_layer(m, l, h, x, m->hidden, pos, write_row, key_rows, first_key_row, threads);
    }
    if (logits != NULL) output_layer(m, h, logits, threads);
    return 0;
}

/* An EAGLE-3 head's step: its layer's attention input is [norm(embedding of token), hidden_norm(hidden)]
 * (2 hidden wide) and its residual the hidden state. hidden [hidden] float32 is the previous step's
 * pre-norm output on entry and this step's on return; logits [head_rows]. Returns 0, or -1. */
int eagle_step(const StepModel *m, int64_t token, int64_t pos, int64_t write_row, const int64_t *key_rows,
               int64_t first_key_row, float *hidden, float *logits, int threads) {
    const int64_t H = m->hidden;
    if (bad_args(m, pos, write_row) || m->hidden_norm == NULL || m->layers != 1) return -1;
    float *h = m->scratch, *x = h + H, *embedded = x + 2 * H;
    embed_row(m, token, embedded);
    rms_norm(embedded, m->layer[0].attn_norm, x, H, m->eps);
    rms_norm(hidden, m->hidden_norm, x + H, H, m->eps);
    memcpy(h, hidden, H * sizeof(float));
    decoder_layer(m, 0, h, x, 2 * H, pos, write_row, key_rows, first_key_row, threads);
    memcpy(hidden, h, H * sizeof(float));
    output_layer(m, h, logits, threads);
    return 0;
}
