/*
 * quant.c - portable C kernels for the quantized matmuls (the fallback, and the
 * reference the asm is checked against). Contract: quant.h.
 *
 * Every kernel has the same shape: for each weight row j, for each block,
 * dequantize the block once into a float buffer (the exact gguf-py values), then
 * for each x row i add x * w into LANES partial sums of (i, j); at the end of the
 * row the lanes are folded in one fixed order. Nothing depends on m or on which
 * rows share a call, so a row's result is the same alone or in a batch.
 *
 * Built with -ffp-contract=off: a product and a sum stay two roundings where
 * gguf-py rounds twice (Q6_K's (d*sc)*q), and one where the product is exact.
 */
#include <math.h>
#include <string.h>

#include "quant.h"

#define LANES 8
#define QK 32
#define QK_K 256
#define Q4_K_SCALE_BYTES 12

float fs_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal half: renormalise into a float32 normal */
            int e = -1;
            do {
                mant <<= 1;
                e++;
            } while ((mant & 0x400u) == 0);
            mant &= 0x3FFu;
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | (mant << 13);
        }
    } else if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13); /* inf, nan (payload kept) */
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float half_at(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8)); /* GGUF is little-endian */
    return fs_half_to_float(h);
}

/* ------------------------------------------------------------ dequantizers */

static void dq_q4_0(const uint8_t *b, float *w) {
    float d = half_at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < QK / 2; j++) {
        w[j] = d * (float)((int)(qs[j] & 0x0F) - 8);
        w[j + QK / 2] = d * (float)((int)(qs[j] >> 4) - 8);
    }
}

static void dq_q4_1(const uint8_t *b, float *w) {
    float d = half_at(b), m = half_at(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < QK / 2; j++) {
        w[j] = d * (float)(qs[j] & 0x0F) + m; /* d*q exact: one rounding, as fma */
        w[j + QK / 2] = d * (float)(qs[j] >> 4) + m;
    }
}

/* Element e (0..31) of a Q5_0 block as q - 16: its nibble and bit e of the high word. */
static int q5_0_value(const uint8_t *b, int e) {
    uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 |
                  (uint32_t)b[5] << 24;
    int lo = e < QK / 2 ? (b[6 + e] & 0x0F) : (b[6 + e - QK / 2] >> 4);
    return (lo | (int)((qh >> e) & 1u) << 4) - 16;
}

static void dq_q5_0(const uint8_t *b, float *w) {
    float d = half_at(b);
    for (int e = 0; e < QK; e++) w[e] = d * (float)q5_0_value(b, e); /* exact: 11 x 5 bits */
}

void fs_repack_q5_0(const uint8_t *in, size_t kb, uint8_t *out) {
    for (size_t s = 0; s < kb; s++, in += 22, out += 34) {
        out[0] = in[0], out[1] = in[1]; /* the same fp16 d */
        for (int e = 0; e < QK; e++) out[2 + e] = (uint8_t)(int8_t)q5_0_value(in, e);
    }
}

static void dq_q8_0(const uint8_t *b, float *w) {
    float d = half_at(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < QK; j++) w[j] = d * (float)qs[j];
}

static void q4_k_scale_min(const uint8_t *s, int sub, int *sc, int *mn) {
    if (sub < 4) {
        *sc = s[sub] & 0x3F;
        *mn = s[sub + 4] & 0x3F;
    } else {
        *sc = (s[sub + 4] & 0x0F) | ((s[sub - 4] >> 2) & 0x30);
        *mn = (s[sub + 4] >> 4) | ((s[sub] >> 2) & 0x30);
    }
}

static void dq_q4_k(const uint8_t *b, float *w) {
    float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *scales = b + 4, *qs = b + 4 + Q4_K_SCALE_BYTES;
    for (int sub = 0; sub < QK_K / QK; sub++) {
        int sc, mn;
        q4_k_scale_min(scales, sub, &sc, &mn);
        float ds = d * (float)sc, dm = dmin * (float)mn; /* both exact */
        const uint8_t *q = qs + (sub / 2) * QK;
        int shift = (sub & 1) ? 4 : 0;
        for (int j = 0; j < QK; j++)
            w[sub * QK + j] = ds * (float)((q[j] >> shift) & 0x0F) - dm;
    }
}

/* Element e (0..255) of a Q6_K super-block as q - 32 (gguf-py's element order). */
static int q6_k_value(const uint8_t *b, int e) {
    const uint8_t *ql = b, *qh = b + QK_K / 2;
    int half = e / 128, t = e % 128;
    int lo = t < 64 ? (ql[half * 64 + t] & 0x0F) : (ql[half * 64 + t - 64] >> 4);
    int hi = (qh[half * 32 + (t & 31)] >> (2 * (t >> 5))) & 0x03;
    return (lo | (hi << 4)) - 32;
}

static void dq_q6_k(const uint8_t *b, float *w) {
    const int8_t *scales = (const int8_t *)(b + QK_K / 2 + QK_K / 4);
    float d = half_at(b + QK_K / 2 + QK_K / 4 + QK_K / 16);
    for (int e = 0; e < QK_K; e++) {
        float ds = d * (float)scales[e / 16];     /* exact: 11 x 8 bits */
        w[e] = ds * (float)q6_k_value(b, e);      /* rounds here, as gguf-py */
    }
}

/* The repacked K layouts (quant.h): 32-element blocks with float32 scales. */
#define Q4_KR_BYTES 24
#define Q6_KR_BYTES 40
#define KR_SCALES 8 /* bytes of float32 scale words before the quants */

static float float_at(const uint8_t *p) {
    float f;
    memcpy(&f, p, sizeof f); /* GGUF and x86 are little-endian */
    return f;
}

static void put_float(uint8_t *p, float f) { memcpy(p, &f, sizeof f); }

static void dq_q4_kr(const uint8_t *b, float *w) {
    float d = float_at(b), m = float_at(b + 4);
    const uint8_t *qs = b + KR_SCALES;
    for (int j = 0; j < QK / 2; j++) {
        w[j] = d * (float)(qs[j] & 0x0F) + m; /* d*q exact: one rounding, as fma */
        w[j + QK / 2] = d * (float)(qs[j] >> 4) + m;
    }
}

static void dq_q6_kr(const uint8_t *b, float *w) {
    const int8_t *qs = (const int8_t *)(b + KR_SCALES);
    for (int h = 0; h < 2; h++) {
        float d = float_at(b + 4 * h);
        for (int j = 0; j < QK / 2; j++) w[h * QK / 2 + j] = d * (float)qs[h * QK / 2 + j];
    }
}

void fs_repack_q4_k(const uint8_t *in, size_t kb, uint8_t *out) {
    for (size_t s = 0; s < kb; s++, in += 144) {
        float d = half_at(in), dmin = half_at(in + 2);
        const uint8_t *scales = in + 4, *qs = in + 4 + Q4_K_SCALE_BYTES;
        for (int sub = 0; sub < QK_K / QK; sub++, out += Q4_KR_BYTES) {
            int sc, mn;
            q4_k_scale_min(scales, sub, &sc, &mn);
            put_float(out, d * (float)sc);           /* exact: 11 x 6 bits */
            put_float(out + 4, -(dmin * (float)mn)); /* exact, and so is the sign */
            const uint8_t *q = qs + (sub / 2) * QK;
            int shift = (sub & 1) ? 4 : 0;
            for (int j = 0; j < QK / 2; j++) {
                int lo = (q[j] >> shift) & 0x0F, hi = (q[j + QK / 2] >> shift) & 0x0F;
                out[KR_SCALES + j] = (uint8_t)(lo | (hi << 4));
            }
        }
    }
}

void fs_repack_q6_k(const uint8_t *in, size_t kb, uint8_t *out) {
    for (size_t s = 0; s < kb; s++, in += 210) {
        const int8_t *scales = (const int8_t *)(in + QK_K / 2 + QK_K / 4);
        float d = half_at(in + QK_K / 2 + QK_K / 4 + QK_K / 16);
        for (int sub = 0; sub < QK_K / QK; sub++, out += Q6_KR_BYTES) {
            put_float(out, d * (float)scales[2 * sub]); /* exact: 11 x 8 bits */
            put_float(out + 4, d * (float)scales[2 * sub + 1]);
            for (int j = 0; j < QK; j++)
                out[KR_SCALES + j] = (uint8_t)(int8_t)q6_k_value(in, sub * QK + j);
        }
    }
}

typedef void (*dq_fn)(const uint8_t *, float *);

static void dequant_row(dq_fn dq, size_t elems, size_t bytes, const uint8_t *row, size_t kb,
                        float *out) {
    for (size_t b = 0; b < kb; b++) dq(row + b * bytes, out + b * elems);
}

void fs_dequant_q4_0(const uint8_t *row, size_t kb, float *out) {
    dequant_row(dq_q4_0, QK, 18, row, kb, out);
}
void fs_dequant_q4_1(const uint8_t *row, size_t kb, float *out) {
    dequant_row(dq_q4_1, QK, 20, row, kb, out);
}
void fs_dequant_q8_0(const uint8_t *row, size_t kb, float *out) {
    dequant_row(dq_q8_0, QK, 34, row, kb, out);
}
void fs_dequant_q4_k(const uint8_t *row, size_t kb, float *out) {
    dequant_row(dq_q4_k, QK_K, 144, row, kb, out);
}
void fs_dequant_q6_k(const uint8_t *row, size_t kb, float *out) {
    dequant_row(dq_q6_k, QK_K, 210, row, kb, out);
}
void fs_dequant_q5_0(const uint8_t *row, size_t kb, float *out) {
    dequant_row(dq_q5_0, QK, 22, row, kb, out);
}
void fs_dequant_q4_kr(const uint8_t *row, size_t kb, float *out) {
    dequant_row(dq_q4_kr, QK, Q4_KR_BYTES, row, kb, out);
}
void fs_dequant_q6_kr(const uint8_t *row, size_t kb, float *out) {
    dequant_row(dq_q6_kr, QK, Q6_KR_BYTES, row, kb, out);
}

/* ----------------------------------------------------------------- kernels */

static void qmm(const fs_qjob *job, dq_fn dq, size_t elems, size_t bytes) {
    float w[QK_K];
    float acc[FS_Q_MAX_ROWS][LANES];
    size_t m = job->m;
    for (size_t j = 0; j < job->n; j++) {
        const uint8_t *row = job->w + j * job->row_bytes;
        memset(acc, 0, sizeof acc);
        for (size_t b = 0; b < job->kb; b++) {
            dq(row + b * bytes, w);
            for (size_t i = 0; i < m; i++) {
                const float *x = job->x + i * job->ldx + b * elems;
                float *a = acc[i];
                for (size_t e = 0; e < elems; e += LANES)
                    for (int l = 0; l < LANES; l++) a[l] += x[e + l] * w[e + l];
            }
        }
        for (size_t i = 0; i < m; i++) {
            const float *a = acc[i];
            float s = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
            job->y[i * job->ldy + j] = s;
        }
    }
}

void fs_qmm_q4_0_c(const fs_qjob *job) { qmm(job, dq_q4_0, QK, 18); }
void fs_qmm_q4_1_c(const fs_qjob *job) { qmm(job, dq_q4_1, QK, 20); }
void fs_qmm_q8_0_c(const fs_qjob *job) { qmm(job, dq_q8_0, QK, 34); }
void fs_qmm_q4_k_c(const fs_qjob *job) { qmm(job, dq_q4_k, QK_K, 144); }
void fs_qmm_q6_k_c(const fs_qjob *job) { qmm(job, dq_q6_k, QK_K, 210); }
void fs_qmm_q5_0_c(const fs_qjob *job) { qmm(job, dq_q5_0, QK, 22); }
void fs_qmm_q4_kr_c(const fs_qjob *job) { qmm(job, dq_q4_kr, QK, Q4_KR_BYTES); }
void fs_qmm_q6_kr_c(const fs_qjob *job) { qmm(job, dq_q6_kr, QK, Q6_KR_BYTES); }

void fs_fma_probe_c(uint64_t rounds) {
    /* Zeros through a volatile: the compiler cannot fold the chains away or assume their
     * values; a sink keeps their results live. */
    volatile float zero = 0.0f;
    const float a = zero, b = zero;
    float acc[FS_FMA_PROBE_LANES_C] = {0};
    for (uint64_t r = 0; r < rounds; r++)
        for (int i = 0; i < FS_FMA_PROBE_LANES_C; i++) acc[i] = acc[i] + a * b;
    float sum = 0.0f;
    for (int i = 0; i < FS_FMA_PROBE_LANES_C; i++) sum += acc[i];
    zero = sum;
}
