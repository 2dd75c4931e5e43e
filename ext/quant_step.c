/*
 * quant_step.c - fs_decoder_step: every layer of a Llama decoder for m new positions
 * (contract and cache layout: quant_step.h).
 *
 * Portable C built without -march. The step's body is written once, always inlined, and
 * compiled three times: for the baseline ISA and, under a target attribute, for AVX2 and
 * AVX-512F; the glue picks one from its own CPUID dispatch (the same choice as the
 * products' backend, so FLASHSPEC_QUANT_KERNEL forces both). Sums keep LANES independent
 * partial sums, a shape the compiler vectorizes, folded in a fixed order; exp is a
 * branch-free polynomial, so silu and softmax vectorize too. The products (most of the
 * arithmetic) run the glue's kernels through the callback.
 */
#include "quant_step.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Independent partial sums a loop keeps (a zmm of floats); fold assumes 16. */
#define LANES 16
#define INLINE static inline __attribute__((always_inline))

/* exp's range where float32 results are normal: below, the polynomial's 2^n would not be. */
#define EXP_LO -87.3f
#define EXP_HI 88.7f
#define LOG2E 1.44269504088896341f
/* ln 2 split so n * LN2_HI is exact for |n| < 2^9 (Cody and Waite). */
#define LN2_HI 0.693145751953125f
#define LN2_LO 1.42860682030941723e-6f
/* Adding then subtracting 1.5 * 2^23 rounds a float of magnitude < 2^22 to an integer. */
#define ROUND_MAGIC 12582912.0f

/* e^x to about 1 ulp on [EXP_LO, EXP_HI], 0 below it (a masked score's -inf included), e^EXP_HI
 * above: e^x = 2^n e^r, |r| <= ln2 / 2, e^r by its Taylor polynomial to r^6 (remainder below
 * 2^-23 relative). */
INLINE float fast_exp(float x) {
    const float below = x < EXP_LO ? 0.0f : 1.0f;
    x = x < EXP_LO ? EXP_LO : x;
    x = x > EXP_HI ? EXP_HI : x;
    float n = (x * LOG2E + ROUND_MAGIC) - ROUND_MAGIC;
    float r = (x - n * LN2_HI) - n * LN2_LO;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale * below;
}

/* acc[0] + ... + acc[15] in a fixed order of halvings (registers, no loop). */
INLINE float fold(const float *acc) {
    float half[LANES / 2], quarter[LANES / 4];
    for (int j = 0; j < LANES / 2; j++) half[j] = acc[j] + acc[j + LANES / 2];
    for (int j = 0; j < LANES / 4; j++) quarter[j] = half[j] + half[j + LANES / 4];
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

INLINE float dot(const float *a, const float *b, size_t n) {
    float acc[LANES] = {0};
    size_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    for (; i < n; i++) acc[i % LANES] += a[i] * b[i];
    return fold(acc);
}

/* scores[j] = exp(scores[j] - top) in place; returns 1 / their sum. exp runs alone in its
 * loop (it vectorizes), the sum in LANES partial sums. Masked keys hold -inf (their exp is 0);
 * when every key is masked (top -inf: a dead query column) the weights are 0 and so is the
 * returned factor, so the query's output is zeros, never NaN. */
INLINE float exp_scores(float *scores, size_t n, float top) {
    if (top == -INFINITY) {
        memset(scores, 0, n * sizeof *scores);
        return 0.0f;
    }
    for (size_t j = 0; j < n; j++) scores[j] = fast_exp(scores[j] - top);
    float lanes[LANES] = {0};
    size_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] += scores[k + l];
    for (; k < n; k++) lanes[k % LANES] += scores[k];
    return 1.0f / fold(lanes);
}

INLINE float sum_squares(const float *a, size_t n) { return dot(a, a, n); }

/* out = w * (x * rsqrt(mean(x^2) + eps)), LlamaRMSNorm's order of operations. */
INLINE void rms_norm(const float *x, const float *w, size_t n, float eps, float *out) {
    float variance = sum_squares(x, n) / (float)n;
    float r = 1.0f / sqrtf(variance + eps);
    for (size_t j = 0; j < n; j++) out[j] = w[j] * (x[j] * r);
}

/* x * cos + rotate_half(x) * sin, in place; rotate_half(x) = (-x[half:], x[:half]). */
INLINE void rope(float *x, const float *c, const float *s, size_t hd) {
    size_t half = hd / 2;
    for (size_t j = 0; j < half; j++) {
        float a = x[j], b = x[j + half];
        x[j] = a * c[j] - b * s[j];
        x[j + half] = b * c[j + half] + a * s[j + half];
    }
}

/* scores[j] = (q . keys[j]) * scaling for j < n, -inf where mask[j] == 0 (mask NULL: every
 * key visible); returns the largest (-inf when none is visible). */
typedef float (*score_fn)(const float *q, const float *keys, const uint8_t *mask, size_t n,
                          size_t hd, float scaling, float *scores);

/* A GQA group's attention at once (q, out: G rows of hd; scores: G * n floats); returns 0
 * when it does not take this shape (the caller then goes head by head). */
typedef int (*group_fn)(const float *q, size_t G, const float *keys, const float *values,
                        const uint8_t *mask, size_t n, size_t hd, float scaling, float *scores,
                        float *out);

/* A key's score as the mask leaves it. */
INLINE float masked(float s, const uint8_t *mask, size_t j) {
    return mask != NULL && mask[j] == 0 ? -INFINITY : s;
}

static float scores_portable(const float *q, const float *keys, const uint8_t *mask, size_t n,
                             size_t hd, float scaling, float *scores) {
    float top = -INFINITY;
    for (size_t j = 0; j < n; j++) {
        float s = masked(dot(q, keys + j * hd, hd) * scaling, mask, j);
        scores[j] = s;
        if (s > top) top = s;
    }
    return top;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_ISA_STEPS 1
#define KEYS_AT_ONCE 4

/* The same with a zmm of partial sums per key, KEYS_AT_ONCE keys in flight, folded in
 * registers (the portable fold of 16 lanes compiles to scalar adds). */
__attribute__((target("avx512f"))) static float scores_avx512(const float *q, const float *keys,
                                                              const uint8_t *mask, size_t n,
                                                              size_t hd, float scaling,
                                                              float *scores) {
    if (hd % LANES != 0) return scores_portable(q, keys, mask, n, hd, scaling, scores);
    float top = -INFINITY;
    size_t j = 0;
    for (; j + KEYS_AT_ONCE <= n; j += KEYS_AT_ONCE) {
        __m512 acc[KEYS_AT_ONCE];
        for (int t = 0; t < KEYS_AT_ONCE; t++) acc[t] = _mm512_setzero_ps();
        for (size_t e = 0; e < hd; e += LANES) {
            __m512 qe = _mm512_loadu_ps(q + e);
            for (int t = 0; t < KEYS_AT_ONCE; t++)
                acc[t] = _mm512_fmadd_ps(qe, _mm512_loadu_ps(keys + (j + (size_t)t) * hd + e),
                                         acc[t]);
        }
        for (int t = 0; t < KEYS_AT_ONCE; t++) {
            float s = masked(_mm512_reduce_add_ps(acc[t]) * scaling, mask, j + (size_t)t);
            scores[j + (size_t)t] = s;
            if (s > top) top = s;
        }
    }
    for (; j < n; j++) {
        __m512 acc = _mm512_setzero_ps();
        for (size_t e = 0; e < hd; e += LANES)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + e), _mm512_loadu_ps(keys + j * hd + e),
                                  acc);
        float s = masked(_mm512_reduce_add_ps(acc) * scaling, mask, j);
        scores[j] = s;
        if (s > top) top = s;
    }
    return top;
}

/* Query heads sharing one kv head that the grouped path takes at once (GQA groups). */
#define GROUP_MAX 8
/* zmm of value columns a pass of the grouped weighted sum keeps per head (64 columns). */
#define GROUP_COLS 4

/* A GQA group's attention in one pass over its kv head: the G query heads (q, out: G rows
 * of hd) read each key and each value once between them instead of once each, which is the
 * cache's traffic divided by G on a long context. G and C (zmm of columns a pass) are
 * constants where it is inlined, so the sums stay in registers. */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void
group_body(const float *q, const size_t G, const size_t C, const float *keys,
           const float *values, const uint8_t *mask, size_t n, size_t hd, float scaling,
           float *scores, float *out) {
    float top[GROUP_MAX], inv[GROUP_MAX];
    for (size_t h = 0; h < G; h++) top[h] = -INFINITY;
    for (size_t j = 0; j < n; j++) {
        __m512 acc[GROUP_MAX];
        for (size_t h = 0; h < G; h++) acc[h] = _mm512_setzero_ps();
        for (size_t e = 0; e < hd; e += LANES) {
            __m512 k = _mm512_loadu_ps(keys + j * hd + e);
            for (size_t h = 0; h < G; h++)
                acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * hd + e), k, acc[h]);
        }
        for (size_t h = 0; h < G; h++) {
            float s = masked(_mm512_reduce_add_ps(acc[h]) * scaling, mask, j);
            scores[h * n + j] = s;
            if (s > top[h]) top[h] = s;
        }
    }
    for (size_t h = 0; h < G; h++) inv[h] = exp_scores(scores + h * n, n, top[h]);
    for (size_t e0 = 0; e0 < hd; e0 += C * LANES) {
        __m512 acc[GROUP_MAX][GROUP_COLS];
        for (size_t h = 0; h < G; h++)
            for (size_t c = 0; c < C; c++) acc[h][c] = _mm512_setzero_ps();
        for (size_t j = 0; j < n; j++) {
            if (mask != NULL && mask[j] == 0) continue; /* weight 0: whatever the slot holds */
            __m512 v[GROUP_COLS];
            for (size_t c = 0; c < C; c++) v[c] = _mm512_loadu_ps(values + j * hd + e0 + c * LANES);
            for (size_t h = 0; h < G; h++) {
                __m512 p = _mm512_set1_ps(scores[h * n + j]);
                for (size_t c = 0; c < C; c++) acc[h][c] = _mm512_fmadd_ps(p, v[c], acc[h][c]);
            }
        }
        for (size_t h = 0; h < G; h++)
            for (size_t c = 0; c < C; c++)
                _mm512_storeu_ps(out + h * hd + e0 + c * LANES,
                                 _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inv[h])));
    }
}

/* group_body for G query heads (2..GROUP_MAX) and hd a multiple of 16; 0: not taken. */
__attribute__((target("avx512f"))) static int group_avx512(const float *q, size_t G,
                                                           const float *keys,
                                                           const float *values,
                                                           const uint8_t *mask, size_t n,
                                                           size_t hd, float scaling,
                                                           float *scores, float *out) {
    if (hd % LANES != 0 || G < 2 || G > GROUP_MAX) return 0;
    const int wide = hd % (GROUP_COLS * LANES) == 0 && G <= 4;
#define GROUP_CASE(g)                                                                       \
    case g:                                                                                 \
        if (wide)                                                                           \
            group_body(q, g, GROUP_COLS, keys, values, mask, n, hd, scaling, scores, out);  \
        else                                                                                \
            group_body(q, g, 1, keys, values, mask, n, hd, scaling, scores, out);           \
        return 1;
    switch (G) {
        GROUP_CASE(2)
        GROUP_CASE(3)
        GROUP_CASE(4)
        GROUP_CASE(5)
        GROUP_CASE(6)
        GROUP_CASE(7)
        GROUP_CASE(8)
    }
#undef GROUP_CASE
    return 0;
}
#endif

/* Columns of the values the weighted sum keeps in registers at once (4 zmm). */
#define OUT_COLS 64

/* out[hd] = softmax(q . keys[0..n) * scaling) @ values[0..n) over the keys the mask shows;
 * scores: n floats. */
INLINE void attend(const float *q, const float *keys, const float *values, const uint8_t *mask,
                   size_t n, size_t hd, float scaling, float *scores, float *out,
                   score_fn score) {
    float inv = exp_scores(scores, n, score(q, keys, mask, n, hd, scaling, scores));
    /* Two interleaved sums over the keys (even, odd), OUT_COLS columns a pass: independent
     * chains of adds that stay in registers. */
    for (size_t e0 = 0; e0 < hd; e0 += OUT_COLS) {
        size_t w = hd - e0 < OUT_COLS ? hd - e0 : OUT_COLS;
        float even[OUT_COLS] = {0}, odd[OUT_COLS] = {0};
        size_t j = 0;
        if (w == OUT_COLS && mask == NULL) {
            for (; j + 2 <= n; j += 2) {
                const float *v0 = values + j * hd + e0, *v1 = v0 + hd;
                float p0 = scores[j], p1 = scores[j + 1];
                for (int e = 0; e < OUT_COLS; e++) {
                    even[e] += p0 * v0[e];
                    odd[e] += p1 * v1[e];
                }
            }
        }
        for (; j < n; j++) {
            if (mask != NULL && mask[j] == 0) continue; /* weight 0: whatever the slot holds */
            for (size_t e = 0; e < w; e++) even[e] += scores[j] * values[j * hd + e0 + e];
        }
        for (size_t e = 0; e < w; e++) out[e0 + e] = (even[e] + odd[e]) * inv;
    }
}

INLINE float silu(float x) { return x / (1.0f + fast_exp(-x)); }

/* Floats that hold one size_t (the live queries' indices lead the scratch). */
#define INDEX_FLOATS ((sizeof(size_t) + sizeof(float) - 1) / sizeof(float))

size_t fs_decoder_scratch(const fs_decoder *d, size_t m, size_t keys, size_t parts) {
    size_t qdim = d->heads * d->head_dim, kvdim = d->kv_heads * d->head_dim;
    size_t group = d->heads / d->kv_heads; /* a part's scores: one row a head of its group */
    return m * (INDEX_FLOATS + 2 * d->dim + 2 * qdim + 2 * kvdim + 2 * d->ffn) +
           keys * group * (parts ? parts : 1);
}

/* One layer's attention for the live queries: (query, head) pairs shared out over the parts. */
typedef struct {
    const fs_decoder *d;
    const float *q, *keys, *values; /* q [queries, qdim]; keys, values: the layer's planes */
    float *att, *scores;            /* att [queries, qdim]; scores: keys_per_part a part */
    const uint8_t *mask;            /* visible key columns, or NULL: see mask_row */
    const size_t *live;             /* query i is position live[i] of the batch * m */
    size_t queries, m, past, cap, keys_per_part, mask_stride;
    int per_query;                  /* mask rows: one a position (1) or one a batch row (0) */
    score_fn score;
    group_fn group; /* NULL: head by head */
} attn_job;

/* The mask row position j (row j / m's position j % m) reads: its own in a per-query mask (a
 * token tree's ancestors differ from query to query), else its batch row's. */
INLINE const uint8_t *mask_row(const uint8_t *mask, size_t stride, int per_query, size_t j,
                               size_t m) {
    return mask == NULL ? NULL : mask + (per_query ? j : j / m) * stride;
}

/* Pairs dealt round robin: in a prefill, later positions see more keys, and each part gets
 * some of every length. With a group function the pairs are (query, kv head), its query heads
 * at once; a shape it does not take goes head by head. Query i is position j = live[i]: row
 * j / m's position j % m, which sees that row's keys 0 .. past + j % m its mask row shows. */
INLINE void attn_body(void *arg, size_t part, size_t parts) {
    const attn_job *a = (const attn_job *)arg;
    const fs_decoder *d = a->d;
    const size_t hd = d->head_dim, qdim = d->heads * hd, group = d->heads / d->kv_heads;
    const size_t row_plane = d->kv_heads * a->cap * hd; /* one row's keys in a layer */
    const size_t queries = a->queries;
    float *scores = a->scores + part * a->keys_per_part;
    if (a->group != NULL && group > 1) {
        for (size_t p = part; p < queries * d->kv_heads; p += parts) {
            size_t i = p / d->kv_heads, g = p % d->kv_heads, j = a->live[i], b = j / a->m;
            size_t n = a->past + j % a->m + 1;
            const uint8_t *mask = mask_row(a->mask, a->mask_stride, a->per_query, j, a->m);
            const float *q = a->q + i * qdim + g * group * hd;
            size_t at = b * row_plane + g * a->cap * hd;
            const float *keys = a->keys + at, *values = a->values + at;
            float *out = a->att + i * qdim + g * group * hd;
            if (a->group(q, group, keys, values, mask, n, hd, d->scaling, scores, out)) continue;
            for (size_t h = 0; h < group; h++)
                attend(q + h * hd, keys, values, mask, n, hd, d->scaling, scores, out + h * hd,
                       a->score);
        }
        return;
    }
    for (size_t p = part; p < queries * d->heads; p += parts) {
        size_t i = p / d->heads, h = p % d->heads, g = h / group, j = a->live[i], b = j / a->m;
        const uint8_t *mask = mask_row(a->mask, a->mask_stride, a->per_query, j, a->m);
        size_t at = b * row_plane + g * a->cap * hd;
        attend(a->q + i * qdim + h * hd, a->keys + at, a->values + at, mask,
               a->past + j % a->m + 1, hd, d->scaling, scores, a->att + i * qdim + h * hd,
               a->score);
    }
}

static void attn_baseline(void *arg, size_t part, size_t parts) { attn_body(arg, part, parts); }

INLINE void step_body(const fs_decoder *d, float *hidden, size_t batch, size_t m,
                      const float *cos, const float *sin, float *kv, size_t cap, size_t past,
                      const uint8_t *mask, size_t mask_stride, int per_query,
                      float *scratch, const fs_step_env *env, score_fn score,
                      fs_part_fn attn_part, group_fn group_attend) {
    const size_t positions = batch * m;
    const fs_products_fn products = env->products;
    void *const ctx = env->ctx;
    const size_t dim = d->dim, hd = d->head_dim, ffn = d->ffn;
    const size_t qdim = d->heads * hd, kvdim = d->kv_heads * hd;
    const size_t row_plane = d->kv_heads * cap * hd; /* one row's keys (or values) */
    const size_t plane = batch * row_plane;           /* one layer's keys (or values) */
    /* The live positions: those whose own column their mask row shows (in a tree's
     * per-query mask, the diagonal). A dead one (padding, a draft a row did not make) is in
     * no product and no attention; its hidden row is left as it came and its cache slots are
     * zeroed (a forward that reads masked slots with additive masks must not meet garbage),
     * so the products run over live rows only. */
    size_t *live = (size_t *)(void *)scratch;
    size_t rows = 0;
    for (size_t j = 0; j < positions; j++)
        if (mask == NULL || mask_row(mask, mask_stride, per_query, j, m)[past + j % m] != 0)
            live[rows++] = j;
    float *x = scratch + positions * INDEX_FLOATS; /* [rows, dim] normed input of a block */
    float *q = x + rows * dim;                      /* [rows, qdim] */
    float *k = q + rows * qdim;                     /* [rows, kvdim] */
    float *v = k + rows * kvdim;                    /* [rows, kvdim] */
    float *att = v + rows * kvdim;                  /* [rows, qdim] */
    float *delta = att + rows * qdim; /* [rows, dim] a block's output before the residual */
    float *gate = delta + rows * dim; /* [rows, ffn] */
    float *up = gate + rows * ffn;    /* [rows, ffn] */
    float *scores = up + rows * ffn;  /* [max_parts, group, past + m] */
    const size_t group = d->heads / d->kv_heads;
    /* multiply-adds of one layer's attention: scores and weighted sum */
    const double attn_work =
        2.0 * (double)rows * (double)d->heads * (double)(past + m) * (double)hd;

    for (size_t l = 0; l < d->layers; l++) {
        const fs_dlayer *L = &d->layer[l];
        float *keys = kv + 2 * l * plane, *values = keys + plane;
        if (rows < positions) {
            for (size_t j = 0, i = 0; j < positions; j++) {
                if (i < rows && live[i] == j) {
                    i++;
                    continue;
                }
                const size_t column = past + j % m, at = (j / m) * row_plane;
                for (size_t g = 0; g < d->kv_heads; g++) {
                    memset(keys + at + (g * cap + column) * hd, 0, hd * sizeof(float));
                    memset(values + at + (g * cap + column) * hd, 0, hd * sizeof(float));
                }
            }
        }
        if (rows == 0) continue;

        for (size_t i = 0; i < rows; i++)
            rms_norm(hidden + live[i] * dim, L->in_norm, dim, d->eps, x + i * dim);
        const fs_qweight *qkv[3] = {&L->q, &L->k, &L->v};
        float *qkv_out[3] = {q, k, v};
        products(ctx, 3, qkv, x, rows, qkv_out);
        for (size_t i = 0; i < rows; i++) {
            const size_t j = live[i];
            const float *c = cos + j * hd, *s = sin + j * hd;
            const size_t column = past + j % m, at = (j / m) * row_plane;
            for (size_t h = 0; h < d->heads; h++) rope(q + i * qdim + h * hd, c, s, hd);
            for (size_t g = 0; g < d->kv_heads; g++) {
                float *kr = keys + at + (g * cap + column) * hd;
                memcpy(kr, k + i * kvdim + g * hd, hd * sizeof *kr);
                rope(kr, c, s, hd);
                memcpy(values + at + (g * cap + column) * hd, v + i * kvdim + g * hd,
                       hd * sizeof(float));
            }
        }
        attn_job job = {d,    q,    keys, values, att, scores, mask,
                        live, rows, m,    past,   cap, (past + m) * group,
                        mask_stride, per_query, score, group_attend};
        env->parallel(ctx, attn_part, &job, attn_work);
        const fs_qweight *o[1] = {&L->o};
        products(ctx, 1, o, att, rows, &delta);
        for (size_t i = 0; i < rows; i++)
            for (size_t e = 0; e < dim; e++) hidden[live[i] * dim + e] += delta[i * dim + e];

        for (size_t i = 0; i < rows; i++)
            rms_norm(hidden + live[i] * dim, L->post_norm, dim, d->eps, x + i * dim);
        const fs_qweight *gate_up[2] = {&L->gate, &L->up};
        float *gate_up_out[2] = {gate, up};
        products(ctx, 2, gate_up, x, rows, gate_up_out);
        for (size_t e = 0; e < rows * ffn; e++) gate[e] = silu(gate[e]) * up[e];
        const fs_qweight *down[1] = {&L->down};
        products(ctx, 1, down, gate, rows, &delta);
        for (size_t i = 0; i < rows; i++)
            for (size_t e = 0; e < dim; e++) hidden[live[i] * dim + e] += delta[i * dim + e];
    }
}

#define STEP_ARGS                                                                          \
    const fs_decoder *d, float *hidden, size_t batch, size_t m, const float *cos,          \
        const float *sin, float *kv, size_t cap, size_t past, const uint8_t *mask,         \
        size_t mask_stride, int per_query, float *scratch, const fs_step_env *env
#define STEP_CALL(score, attn, grouped)                                                    \
    step_body(d, hidden, batch, m, cos, sin, kv, cap, past, mask, mask_stride, per_query,  \
              scratch, env, score, attn, grouped)
#define STEP_PASS                                                                          \
    d, hidden, batch, m, cos, sin, kv, cap, past, mask, mask_stride, per_query, scratch, env

static void step_baseline(STEP_ARGS) { STEP_CALL(scores_portable, attn_baseline, NULL); }

#ifdef HAVE_ISA_STEPS
__attribute__((target("avx2"))) static void attn_avx2(void *arg, size_t part, size_t parts) {
    attn_body(arg, part, parts);
}
__attribute__((target("avx512f"))) static void attn_avx512(void *arg, size_t part,
                                                           size_t parts) {
    attn_body(arg, part, parts);
}
__attribute__((target("avx2"))) static void step_avx2(STEP_ARGS) {
    STEP_CALL(scores_portable, attn_avx2, NULL);
}
__attribute__((target("avx512f"))) static void step_avx512(STEP_ARGS) {
    STEP_CALL(scores_avx512, attn_avx512, group_avx512);
}
#endif

void fs_decoder_step(STEP_ARGS, int isa) {
#ifdef HAVE_ISA_STEPS
    if (isa == FS_STEP_AVX512) {
        step_avx512(STEP_PASS);
        return;
    }
    if (isa == FS_STEP_AVX2) {
        step_avx2(STEP_PASS);
        return;
    }
#endif
    (void)isa;
    step_baseline(STEP_PASS);
}
