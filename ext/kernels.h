/*
 * kernels.h - the contract every residual backend implements.
 *
 * Three backends implement these four entry points with identical semantics:
 *   scalar  ext/residual.c          portable C (the fallback, and the C reference)
 *   avx2    asm/residual_avx2.asm   NASM, AVX2 (no FMA or other extension needed)
 *   avx512  asm/residual_avx512.asm NASM, AVX-512F
 *
 * All take unaligned float32 pointers, System V AMD64 calling convention
 * (the asm ones). n may be 0. Nothing is read or written outside [ptr, ptr+n).
 *
 * Accuracy scheme (shared by every backend so that V = 256,000 rows still sum to
 * 1 within 1e-5): d_i = max(p_i - q_i, 0) is accumulated in float32 lanes inside
 * blocks of at most FS_BLOCK elements; at each block end the lanes are folded
 * into a float64 running sum. No float32 lane therefore ever adds more than
 * FS_BLOCK / lanes terms, bounding the relative error independent of V.
 */
#ifndef FLASHSPEC_KERNELS_H
#define FLASHSPEC_KERNELS_H

#include <stddef.h>

/* Floats per float32 accumulation block before folding into the float64 sum. */
#define FS_BLOCK 4096

/*
 * fs_residual_store_<isa>: out[i] = max(p[i] - q[i], 0) for i < n.
 * Returns sum_i out[i] (blocked float32 -> float64, see above).
 * *check receives a float32 sum of (p[i] + q[i]); it is finite whenever every
 * p[i] and q[i] is finite and moderate, and non-finite (inf or NaN) whenever any
 * of them is inf or NaN. The caller uses it to detect non-finite input inside
 * the pass that already reads the data. out may not overlap p or q partially
 * (the caller rejects that); out == p or out == q exactly is not used either.
 */
typedef double (*fs_store_fn)(const float *p, const float *q, float *out,
                              size_t n, float *check);

/* fs_residual_sum_<isa>: the same reduction and check, writing nothing. */
typedef double (*fs_sum_fn)(const float *p, const float *q, size_t n,
                            float *check);

/* fs_scale_<isa>: x[i] *= s for i < n. */
typedef void (*fs_scale_fn)(float *x, size_t n, float s);

/*
 * fs_scan_<isa>: coarse inverse-CDF search over d_i = max(p_i - q_i, 0).
 * Walks d in chunks of a backend-chosen size C (a multiple of its vector width).
 * Returns the start index i of the first chunk with
 *     before + sum(d[i .. min(i + C, n))) > target
 * and stores in *before the float64 sum of d[0 .. i) as the backend computed it
 * (chunk sums in float32, running sum in float64). If no chunk crosses target,
 * returns n with *before = the whole sum. The caller finishes with a scalar scan
 * from i, so correctness never depends on C; speed does.
 */
typedef size_t (*fs_scan_fn)(const float *p, const float *q, size_t n,
                             double target, double *before);

typedef struct fs_backend {
    const char *name;
    fs_store_fn store;
    fs_sum_fn sum;
    fs_scale_fn scale;
    fs_scan_fn scan;
} fs_backend;

double fs_residual_store_scalar(const float *p, const float *q, float *out,
                                size_t n, float *check);
double fs_residual_sum_scalar(const float *p, const float *q, size_t n,
                              float *check);
void fs_scale_scalar(float *x, size_t n, float s);
size_t fs_scan_scalar(const float *p, const float *q, size_t n, double target,
                      double *before);

#ifdef FLASHSPEC_HAVE_ASM
double fs_residual_store_avx2(const float *p, const float *q, float *out,
                              size_t n, float *check);
double fs_residual_sum_avx2(const float *p, const float *q, size_t n,
                            float *check);
void fs_scale_avx2(float *x, size_t n, float s);
size_t fs_scan_avx2(const float *p, const float *q, size_t n, double target,
                    double *before);

double fs_residual_store_avx512(const float *p, const float *q, float *out,
                                size_t n, float *check);
double fs_residual_sum_avx512(const float *p, const float *q, size_t n,
                              float *check);
void fs_scale_avx512(float *x, size_t n, float s);
size_t fs_scan_avx512(const float *p, const float *q, size_t n, double target,
                      double *before);
#endif

/* cpu.c: feature detection, done once at module init. */
typedef struct fs_cpu {
    int osxsave;     /* CPUID.1:ECX.OSXSAVE[27] */
    int avx;         /* CPUID.1:ECX.AVX[28] */
    int avx2;        /* CPUID.7.0:EBX.AVX2[5] */
    int avx512f;     /* CPUID.7.0:EBX.AVX512F[16] */
    int fma;         /* CPUID.1:ECX.FMA[12] */
    int f16c;        /* CPUID.1:ECX.F16C[29] */
    int avx512bw;    /* CPUID.7.0:EBX.AVX512BW[30] */
    int avx512vl;    /* CPUID.7.0:EBX.AVX512VL[31] */
    int ymm_state;   /* XCR0 & 0x6 == 0x6 (OS saves SSE + AVX state) */
    int zmm_state;   /* XCR0 & 0xE6 == 0xE6 (OS saves opmask + ZMM state too) */
    unsigned max_leaf;
} fs_cpu;

void fs_cpu_detect(fs_cpu *out);
int fs_cpu_has_avx2(const fs_cpu *c);
int fs_cpu_has_avx512(const fs_cpu *c);

#endif
