/*
 * residual.c - the portable C backend ("scalar") and the C reference the asm
 * backends are checked against (tests/kernels/abi/checkasm.c).
 *
 * Semantics are those of kernels.h. IEEE order rules forbid a compiler from
 * vectorising a single running float sum, so the lanes are explicit (generic
 * vectors, below): the fallback stays quick on any target without ISA flags.
 */
#include "kernels.h"

#include <string.h>

#define SCAN_CHUNK 64

/*
 * GCC/Clang generic vectors: 16 bytes is SSE2 on every x86-64 and NEON on
 * aarch64, so this stays portable (no ISA flags) while giving the compiler
 * independent lanes it is allowed to reorder. Four accumulators hide add latency.
 */
typedef float v4f __attribute__((vector_size(16)));
typedef int v4i __attribute__((vector_size(16)));
#define VW 4                 /* floats per v4f */
#define UNROLL 4             /* independent accumulators */
#define STEP (VW * UNROLL)   /* floats per main-loop iteration */

static inline v4f load4(const float *x) {
    v4f v;
    memcpy(&v, x, sizeof v); /* unaligned load; compiles to movups / ldr q */
    return v;
}

static inline void store4(float *x, v4f v) { memcpy(x, &v, sizeof v); }

static inline v4f vmax0(v4f d) {
    const v4f zero = {0.0f, 0.0f, 0.0f, 0.0f};
    /* NaN compares false and so maps to 0, as vmaxps(d, 0) does; the check sum catches NaN. */
    v4i keep = d > zero; /* all-ones lanes where d > 0 */
    return (v4f)((v4i)d & keep);
}

static inline float pos_diff(float p, float q) {
    float d = p - q;
    return d > 0.0f ? d : 0.0f;
}

static inline double hsum4(v4f a) {
    return (double)a[0] + (double)a[1] + (double)a[2] + (double)a[3];
}

/*
 * The shared body of store and sum: one block of at most FS_BLOCK floats,
 * float32 lanes, folded into float64 at the end. `out` may be NULL.
 */
static inline double block(const float *restrict p, const float *restrict q,
                           float *restrict out, size_t n, v4f *chk) {
    v4f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, c = *chk;
    size_t i = 0;
    for (; i + STEP <= n; i += STEP) {
        v4f p0 = load4(p + i), p1 = load4(p + i + 4), p2 = load4(p + i + 8), p3 = load4(p + i + 12);
        v4f q0 = load4(q + i), q1 = load4(q + i + 4), q2 = load4(q + i + 8), q3 = load4(q + i + 12);
        v4f d0 = vmax0(p0 - q0), d1 = vmax0(p1 - q1), d2 = vmax0(p2 - q2), d3 = vmax0(p3 - q3);
        if (out) {
            store4(out + i, d0);
            store4(out + i + 4, d1);
            store4(out + i + 8, d2);
            store4(out + i + 12, d3);
        }
        a0 += d0;
        a1 += d1;
        a2 += d2;
        a3 += d3;
        c += (p0 + q0) + (p1 + q1) + (p2 + q2) + (p3 + q3);
    }
    double s = hsum4((a0 + a1) + (a2 + a3));
    float tail = 0.0f, tchk = 0.0f;
    for (; i < n; i++) {
        float d = pos_diff(p[i], q[i]);
        if (out) out[i] = d;
        tail += d;
        tchk += p[i] + q[i];
    }
    c[0] += tchk;
    *chk = c;
    return s + (double)tail;
}

static double reduce(const float *p, const float *q, float *out, size_t n, float *check) {
    v4f chk = {0};
    double total = 0.0;
    for (size_t i = 0; i < n; i += FS_BLOCK) {
        size_t len = n - i > FS_BLOCK ? FS_BLOCK : n - i;
        total += block(p + i, q + i, out ? out + i : NULL, len, &chk);
    }
    *check = (chk[0] + chk[1]) + (chk[2] + chk[3]);
    return total;
}

double fs_residual_store_scalar(const float *p, const float *q, float *out, size_t n,
                                float *check) {
    return reduce(p, q, out, n, check);
}

double fs_residual_sum_scalar(const float *p, const float *q, size_t n, float *check) {
    return reduce(p, q, NULL, n, check);
}

void fs_scale_scalar(float *x, size_t n, float s) {
    v4f sv = {s, s, s, s};
    size_t i = 0;
    for (; i + VW <= n; i += VW) store4(x + i, load4(x + i) * sv);
    for (; i < n; i++) x[i] *= s;
}

size_t fs_scan_scalar(const float *p, const float *q, size_t n, double target,
                      double *before) {
    double run = 0.0;
    size_t i = 0;
    while (i < n) {
        size_t len = n - i > SCAN_CHUNK ? SCAN_CHUNK : n - i;
        v4f dummy = {0};
        double chunk = block(p + i, q + i, NULL, len, &dummy);
        if (run + chunk > target) break;
        run += chunk;
        i += len;
    }
    *before = run;
    return i;
}
