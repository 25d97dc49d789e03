/* A few tokens through a whole Llama, on CPU: a draft model's pass over a few rows (one or more
 * tokens of one or more sequences); and the same through an EAGLE-3 head (eagle_rows), whose one
 * layer attends over [embedding, hidden state].
 *
 * Why: a small draft's torch step is mostly dispatch cost of ~100 eager operations
 * (docs/performance-notes.md#draft-token-step). Here the whole pass is one call: the matmuls are
 * one_sequence.c's kernel with M = the pass's rows (each weight streamed once; each row's products
 * are the same bits whatever M is), attention and the rest loops over rows, heads or vectors.
 * Every row writes its K/V before any row attends, so rows of one sequence (consecutive
 * positions) see each other as a causal pass does.
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
void one_sequence_bf16(const uint16_t *w, const float *x, float *y, int64_t N, int64_t K, int64_t M, int threads);

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
    int64_t max_rows;         /* the most rows a pass may have (the scratch is sized for it) */
    int64_t norm_before_residual; /* an EAGLE-3 head's residual is hidden_norm(hidden) (else hidden) */
} StepModel;

/* One row of a pass: a token at position pos, its K/V written at write_row; it attends to key
 * positions 0..pos, at rows key_rows[j] (or first_key_row + j when key_rows is NULL). */
typedef struct {
    int64_t token, pos, write_row, first_key_row;
    const int64_t *key_rows;
} StepRow;

/* The scratch, per row: residual h [hidden], attention input x [2 hidden], qkv, attn, tmp, normed
 * [hidden], gate_up [2 intermediate], act [intermediate]; then scores [heads, max_keys]. */
typedef struct {
    float *h, *x, *qkv, *attn, *tmp, *normed, *gu, *act, *scores;
} Scratch;

static int64_t qkv_width(const StepModel *m) { return (m->heads + 2 * m->kv_heads) * m->head_dim; }

int64_t token_step_scratch_floats(const StepModel *m, int64_t max_keys) {
    const int64_t H = m->hidden, I = m->intermediate;
    return m->max_rows * (6 * H + qkv_width(m) + m->heads * m->head_dim + 3 * I) + m->heads * max_keys;
}

static Scratch scratch_of(const StepModel *m) {
    const int64_t R = m->max_rows, H = m->hidden;
    Scratch s;
    s.h = m->scratch;
    s.x = s.h + R * H;
    s.qkv = s.x + R * 2 * H;
    s.attn = s.qkv + R * qkv_width(m);
    s.tmp = s.attn + R * m->heads * m->head_dim;
    s.normed = s.tmp + R * H;
    s.gu = s.normed + R * H;
    s.act = s.gu + R * 2 * m->intermediate;
    s.scores = s.act + R * m->intermediate;
    return s;
}

static inline float lanes_total(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* y [rows, n] = x [rows, k] @ w [n, k].T (a proposer's weights: small, they stay in cache between passes) */
static void matmul(const StepModel *m, Weight w, const float *x, float *y, int64_t n, int64_t k, int64_t rows,
                   int threads) {
    if (m->kind == WEIGHTS_BF16)
        one_sequence_bf16((const uint16_t *)w, x, y, n, k, rows, threads);
    else
        one_sequence_f32((const float *)w, x, y, n, k, rows, threads);
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

/* The first half of decoder layer l over a pass's n rows: x [n, width] is their normed attention
 * input (row stride width); their q (roped) goes to s->qkv, their K/V into the cache. */
static void write_kv(const StepModel *m, int64_t l, const Scratch *s, int64_t width, const StepRow *rows, int64_t n,
                     int threads) {
    const int64_t D = m->head_dim, Hq = m->heads, Hkv = m->kv_heads, Q = qkv_width(m);
    matmul(m, m->layer[l].qkv, s->x, s->qkv, Q, width, n, threads);
    for (int64_t r = 0; r < n; r++) {
        float *qkv = s->qkv + r * Q;
        const float *cos = m->cos + rows[r].pos * D, *sin = m->sin + rows[r].pos * D;
        for (int64_t j = 0; j < Hq + Hkv; j++) rope(qkv + j * D, cos, sin, D);
        for (int64_t j = 0; j < Hkv; j++) {
            store(m->kv, m->kv_kind, kv_at(m, l, 0, j, rows[r].write_row), qkv + (Hq + j) * D, D);
            store(m->kv, m->kv_kind, kv_at(m, l, 1, j, rows[r].write_row), qkv + (Hq + Hkv + j) * D, D);
        }
    }
}

/* The rest of decoder layer l for n rows whose q write_kv left in s->qkv: attention over their
 * keys, then the MLP; s->h [n, hidden], their residual streams, updated in place. */
static void finish_layer(const StepModel *m, int64_t l, const Scratch *s, const StepRow *rows, int64_t n,
                         int threads) {
    const int64_t H = m->hidden, I = m->intermediate, Q = qkv_width(m), A = m->heads * m->head_dim;
    const StepLayer *lw = &m->layer[l];
    for (int64_t r = 0; r < n; r++)
        attend(m, l, s->qkv + r * Q, s->attn + r * A, s->scores, rows[r].pos + 1, rows[r].key_rows,
               rows[r].first_key_row, threads);
    matmul(m, lw->o, s->attn, s->tmp, H, A, n, threads);
    for (int64_t i = 0; i < n * H; i++) s->h[i] += s->tmp[i];
    for (int64_t r = 0; r < n; r++) rms_norm(s->h + r * H, lw->mlp_norm, s->normed + r * H, H, m->eps);
    matmul(m, lw->gate_up, s->normed, s->gu, 2 * I, H, n, threads);
    for (int64_t r = 0; r < n; r++) {
        const float *gate = s->gu + r * 2 * I, *up = gate + I;
        float *act = s->act + r * I;
        for (int64_t i = 0; i < I; i++) act[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
    matmul(m, lw->down, s->act, s->tmp, H, I, n, threads);
    for (int64_t i = 0; i < n * H; i++) s->h[i] += s->tmp[i];
}

/* Decoder layer l over a pass's n rows: x [n, width] their normed attention input, s->h [n, hidden]
 * their residual streams (updated in place). Every row's K/V is written before any row attends. */
static void decoder_layer(const StepModel *m, int64_t l, const Scratch *s, int64_t width, const StepRow *rows,
                          int64_t n, int threads) {
    write_kv(m, l, s, width, rows, n, threads);
    finish_layer(m, l, s, rows, n, threads);
}

/* -1 if a pass's rows or outputs are out of range, else 0 */
static int bad_args(const StepModel *m, const StepRow *rows, int64_t n, const int64_t *out_rows, int64_t n_out) {
    if (n < 1 || n > m->max_rows || n_out < 0 || n_out > n || m->kv_heads <= 0 || m->heads % m->kv_heads != 0 ||
        m->head_dim % 8 != 0)
        return -1;
    for (int64_t r = 0; r < n; r++)
        if (rows[r].pos < 0 || rows[r].pos + 1 > m->max_keys || rows[r].write_row < 0 ||
            rows[r].write_row >= m->kv_rows)
            return -1;
    for (int64_t j = 0; j < n_out; j++)
        if (out_rows[j] < (j ? out_rows[j - 1] + 1 : 0) || out_rows[j] >= n) return -1;  /* increasing */
    return 0;
}

/* logits [n_out, head_rows] of rows out_rows' residual streams (through the final norm and lm_head) */
static void output_layer(const StepModel *m, const Scratch *s, const int64_t *out_rows, int64_t n_out,
                         float *logits, int threads) {
    const int64_t H = m->hidden;
    if (n_out == 0) return;
    for (int64_t j = 0; j < n_out; j++) rms_norm(s->h + out_rows[j] * H, m->final_norm, s->normed + j * H, H, m->eps);
    matmul(m, m->lm_head, s->normed, logits, m->head_rows, H, n_out, threads);
}

/* the embedding row of `token` as float32 into out [hidden] */
static void embed_row(const StepModel *m, int64_t token, float *out) {
    for (int64_t i = 0; i < m->hidden; i += 8) _mm256_storeu_ps(out + i, load8(m->embed, m->kv_kind, token * m->hidden + i));
}

/* A pass of n rows through the model (rows of one sequence consecutive, in position order);
 * logits [n_out, head_rows] of the rows out_rows (n_out 0: no output layer).
 * Returns 0, or -1 if an argument is out of range. */
int token_rows(const StepModel *m, const StepRow *rows, int64_t n, const int64_t *out_rows, int64_t n_out,
               float *logits, int threads) {
    if (bad_args(m, rows, n, out_rows, n_out)) return -1;
    const Scratch s = scratch_of(m);
    const int64_t H = m->hidden;
    for (int64_t r = 0; r < n; r++) embed_row(m, rows[r].token, s.h + r * H);
    for (int64_t l = 0; l < m->layers; l++) {
        for (int64_t r = 0; r < n; r++) rms_norm(s.h + r * H, m->layer[l].attn_norm, s.x + r * H, H, m->eps);
        decoder_layer(m, l, &s, H, rows, n, threads);
    }
    output_layer(m, &s, out_rows, n_out, logits, threads);
    return 0;
}

/* An EAGLE-3 head's pass: its layer's attention input is [norm(embedding of token), hidden_norm(hidden)]
 * (2 hidden wide) and its residual the hidden state (hidden_norm(hidden) with norm_before_residual).
 * hidden [n, hidden] float32 holds each row's hidden state on entry (the target's fused features, or
 * the head's previous output); rows out_rows (increasing) get their pre-norm output there and their
 * logits [n_out, head_rows]. The other rows only write their K/V: nothing of theirs past it is read
 * (a catch-up's rows but its last), so the rest of the layer runs for the out rows alone. Returns 0,
 * or -1. */
int eagle_rows(const StepModel *m, const StepRow *rows, int64_t n, float *hidden, const int64_t *out_rows,
               int64_t n_out, float *logits, int threads) {
    const int64_t H = m->hidden, Q = qkv_width(m);
    if (bad_args(m, rows, n, out_rows, n_out) || m->hidden_norm == NULL || m->layers != 1) return -1;
    const Scratch s = scratch_of(m);
    for (int64_t r = 0; r < n; r++) {
        float *x = s.x + r * 2 * H;
        embed_row(m, rows[r].token, s.tmp);
        rms_norm(s.tmp, m->layer[0].attn_norm, x, H, m->eps);
        rms_norm(hidden + r * H, m->hidden_norm, x + H, H, m->eps);
    }
    write_kv(m, 0, &s, 2 * H, rows, n, threads);
    StepRow out[n];
    for (int64_t j = 0; j < n_out; j++) {  /* the out rows, packed to the front (out_rows[j] >= j) */
        const int64_t r = out_rows[j];
        out[j] = rows[r];
        memmove(s.qkv + j * Q, s.qkv + r * Q, Q * sizeof(float));
        memcpy(s.h + j * H, m->norm_before_residual ? s.x + r * 2 * H + H : hidden + r * H, H * sizeof(float));
    }
    finish_layer(m, 0, &s, out, n_out, threads);
    int64_t packed[n];
    for (int64_t j = 0; j < n_out; j++) {
        memcpy(hidden + out_rows[j] * H, s.h + j * H, H * sizeof(float));
        packed[j] = j;
    }
    output_layer(m, &s, packed, n_out, logits, threads);
    return 0;
}

/* Sequence r's token from one step's logits row: the argmax of the first `candidates` (the lowest
 * id among equal maxima) when temperature <= 0, q one-hot there; else drawn from q = softmax(row /
 * temperature) by the inverse CDF at `uniform` (the first id whose running mass exceeds uniform x
 * the total, as engine/sampling.py's draw), q [candidates] written normalised. */
static int64_t pick(const float *row, int64_t candidates, float temperature, float uniform, float *q) {
    int64_t best = 0;
    for (int64_t i = 1; i < candidates; i++)
        if (row[i] > row[best]) best = i;
    if (temperature <= 0.0f) {
        if (q) {
            memset(q, 0, candidates * sizeof(float));
            q[best] = 1.0f;
        }
        return best;
    }
    const float top = row[best], inv = 1.0f / temperature;
    double total = 0.0;
    for (int64_t i = 0; i < candidates; i++) {
        q[i] = expf((row[i] - top) * inv);
        total += q[i];
    }
    const double target = (double)uniform * total;
    double mass = 0.0;
    int64_t drawn = candidates - 1;
    for (int64_t i = 0; i < candidates; i++) {
        mass += q[i];
        if (mass > target) {
            drawn = i;
            break;
        }
    }
    const float scale = (float)(1.0 / total);
    for (int64_t i = 0; i < candidates; i++) q[i] *= scale;
    return drawn;
}

/* Drafting as one call: `steps` tokens for each of n sequences, one pass of n rows a step (an
 * EAGLE-3 head's when hidden is not NULL, else a draft model's). rows[r] is sequence r's first
 * step: its token (the draft's first proposal), position and keys; step j writes K/V at
 * write_rows[r * steps + j] for position rows[r].pos + j. A step's token comes from its first
 * `candidates` logits (pick: greedy when temperatures is NULL or temperatures[r] <= 0, else drawn
 * at uniforms[r * steps + j]), as a target id through draft_to_target when it is not NULL;
 * tokens [n, steps]; q [n, steps, candidates] the distributions drawn from (NULL: greedy only,
 * none kept). logits: [n, head_rows] of scratch. Returns 0, or -1 as the passes do. */
int draft_rows(const StepModel *m, const StepRow *rows, int64_t n, float *hidden, int64_t steps,
               const int64_t *write_rows, const int64_t *draft_to_target, int64_t candidates,
               const float *temperatures, const float *uniforms, int64_t *tokens, float *q, float *logits,
               int threads) {
    if (n < 1 || n > m->max_rows || steps < 1 || candidates < 1 || candidates > m->head_rows ||
        (temperatures && (!uniforms || !q)))
        return -1;
    StepRow step[n];
    int64_t out_rows[n];
    for (int64_t r = 0; r < n; r++) {
        step[r] = rows[r];
        out_rows[r] = r;
    }
    for (int64_t j = 0; j < steps; j++) {
        for (int64_t r = 0; r < n; r++) step[r].write_row = write_rows[r * steps + j];
        int status = hidden ? eagle_rows(m, step, n, hidden, out_rows, n, logits, threads)
                            : token_rows(m, step, n, out_rows, n, logits, threads);
        if (status) return status;
        for (int64_t r = 0; r < n; r++) {
            const int64_t at = r * steps + j;
            const int64_t id = pick(logits + r * m->head_rows, candidates, temperatures ? temperatures[r] : 0.0f,
                                    temperatures ? uniforms[at] : 0.0f, q ? q + at * candidates : NULL);
            const int64_t token = draft_to_target ? draft_to_target[id] : id;
            tokens[at] = token;
            step[r].token = token;
            step[r].pos += 1;
        }
    }
    return 0;
}
