/*
 * quant_step.h - a whole Llama decoder step over quantized layers, in C.
 *
 * Once the products read GGUF blocks (quant.h), a small model's step is mostly the
 * ~1,100 torch operations around them: norms, RoPE, the cache's concatenation, attention,
 * residuals. fs_decoder_step runs all of a Llama decoder's layers for m new positions in
 * one call, the operations in the order transformers' LlamaDecoderLayer writes them:
 *
 *   x = rms(h) * w_in;  q, k, v = x Wq^T, x Wk^T, x Wv^T;  rope(q), rope(k) with the given
 *   cos/sin;  k, v appended to the cache;  a = softmax(q k^T * scaling, causal) v  (grouped
 *   query heads: head i reads kv head i / (heads / kv_heads));  h += a Wo^T;
 *   x = rms(h) * w_post;  h += (silu(x Wg^T) * (x Wu^T)) Wd^T
 *
 * Only the order of float32 sums differs from torch (as between kernel backends), so the
 * logits agree to rounding and greedy decoding follows the tie rule of flashspec._greedy.
 *
 * The cache is one float32 array kv[layers][2][batch][kv_heads][cap][head_dim] (2: keys,
 * values); the step writes columns past .. past + m - 1 of every row and layer and reads
 * 0 .. past + m - 1. A row's position i (column past + i) sees its keys 0 .. past + i that its
 * mask shows (all of them without a mask): the ragged layout of flashspec._layout, whose dead
 * columns (padding, rejected drafts) the row's mask hides, or a token tree, whose mask has a
 * row for each position (its ancestors). Positions are the caller's: the rotary tables come
 * per row and position.
 * The products and the attention's parallel loop go through callbacks, so the glue
 * (ext/_quant.c) keeps the choice of backend and the thread pool. No Python here.
 */
#ifndef FLASHSPEC_QUANT_STEP_H
#define FLASHSPEC_QUANT_STEP_H

#include <stddef.h>
#include <stdint.h>

/* One quantized weight: n rows (outputs) of k inputs, GGUF blocks as in quant.h. */
typedef struct fs_qweight {
    const uint8_t *w;
    int format;       /* the glue's format index (its table of formats and kernels) */
    size_t n, k;
    size_t kb;        /* blocks per row */
    size_t row_bytes; /* bytes per row */
} fs_qweight;

typedef struct fs_dlayer {
    const float *in_norm;   /* [dim] input_layernorm.weight */
    const float *post_norm; /* [dim] post_attention_layernorm.weight */
    fs_qweight q, k, v, o, gate, up, down;
} fs_dlayer;

typedef struct fs_decoder {
    size_t layers, dim, heads, kv_heads, head_dim, ffn;
    float eps;     /* the norms' variance_epsilon */
    float scaling; /* the attention's score scale (head_dim ** -0.5 for Llama) */
    const fs_dlayer *layer;
} fs_decoder;

/* y[i][m, w[i]->n] = x[m, w[i]->k] @ W[i]^T for i < count (products of one input, run
 * as one parallel task: q, k, v; gate, up), rows contiguous. */
typedef void (*fs_products_fn)(void *ctx, size_t count, const fs_qweight *const *w,
                               const float *x, size_t m, float *const *y);

/* One share of a parallel loop: body(arg, part, parts) for part < parts. */
typedef void (*fs_part_fn)(void *arg, size_t part, size_t parts);
/* Runs body over the glue's threads (the caller's included) when `work` multiply-adds are
 * worth waking them, else body(arg, 0, 1) on the caller; returns the parts it used. */
typedef size_t (*fs_parallel_fn)(void *ctx, fs_part_fn body, void *arg, double work);

/* What the step calls back into: products and parallel loops, with their context. */
#define FS_MAX_PRODUCTS 3
typedef struct fs_step_env {
    fs_products_fn products;
    fs_parallel_fn parallel;
    void *ctx;
    size_t max_parts; /* the most parts parallel() uses (scratch holds a score row each) */
} fs_step_env;

/* Floats of scratch fs_decoder_step needs for m product rows (batch x positions) over `keys`
 * cached positions. */
size_t fs_decoder_scratch(const fs_decoder *d, size_t m, size_t keys, size_t parts);

/* Which compilation of the step to run (quant_step.c); the caller checks the CPU has it. */
#define FS_STEP_BASELINE 0
#define FS_STEP_AVX2 1
#define FS_STEP_AVX512 2

/*
 * hidden[batch, m, dim]: the embeddings in, the last layer's output out (before the final
 * norm). cos, sin[batch, m, head_dim]: the rotary tables of every row's m positions
 * (attention scaling included). kv: the cache above, cap columns per head; past + m <= cap.
 * mask (mask_stride >= past + m): nonzero where a key column is visible, or NULL (every
 * column of every row). per_query 0: mask[batch, mask_stride], one row for all m positions of
 * a batch row (the ragged layout's dead columns). per_query 1: mask[batch * m, mask_stride],
 * a row for each position (row j is batch row j / m's position j % m): a token tree, each node
 * seeing the committed columns and its ancestors'. Either way position i still sees no key
 * past its own column past + i (a per-query mask can only hide more). A position whose own
 * column its mask row hides (a dead one: padding, a draft its row did not make) is skipped:
 * no product or attention reads it, its hidden row is left as it came, and its cache slots
 * are zeroed (a per-query mask must hide a dead position's column from the other queries
 * too, as a batch row's mask does by construction: a query that shows it reads those zeros).
 * A live query whose columns are all hidden gets zeros from attention.
 * scratch: fs_decoder_scratch(d, batch * m, past + m, env->max_parts) floats.
 * isa: FS_STEP_*, an ISA the CPU has (and the OS saves the registers of).
 */
void fs_decoder_step(const fs_decoder *d, float *hidden, size_t batch, size_t m,
                     const float *cos, const float *sin, float *kv, size_t cap, size_t past,
                     const uint8_t *mask, size_t mask_stride, int per_query, float *scratch,
                     const fs_step_env *env, int isa);

#endif
