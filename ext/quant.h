/*
 * quant.h - the contract every quantized-matmul backend implements.
 *
 * y[i, j] = sum_k x[i, k] * W[j, k]   for i < m, j < n
 *
 * W is kept exactly as a GGUF file stores it: row j (one output feature) is kb
 * consecutive blocks starting at w + j * row_bytes. x and y are float32; every
 * weight is used at exactly its dequantized float32 value, the value gguf-py's
 * `dequantize` (and so transformers' GGUF load) gives it:
 *
 *   Q4_0  18 B / 32:  fp16 d, 16 B nibbles       w = d * (q - 8)
 *   Q4_1  20 B / 32:  fp16 d, fp16 m, 16 B       w = d * q + m      (one rounding: fma)
 *   Q8_0  34 B / 32:  fp16 d, 32 x int8          w = d * q
 *   Q5_0  22 B / 32:  fp16 d, 32 high bits (le32), 16 B nibbles   w = d * (q - 16)
 *   Q4_K 144 B / 256: fp16 d, fp16 dmin, 12 B of 6-bit scales/mins, 128 B nibbles
 *                                               w = (d*sc) * q - (dmin*mn)
 *   Q6_K 210 B / 256: 128 B low nibbles, 64 B high 2-bit pairs, 16 x int8 scales, fp16 d
 *                                               w = (d*sc) * (q - 32)
 * and two layouts flashspec repacks the K formats into when it loads them (not GGML
 * types: ids 256 + the source type's), 32-element blocks the SIMD tiles of Q4_1 and
 * Q8_0 run with one changed load, because a K super-block's sub-scales would
 * otherwise be decoded for every weight row in the inner loop:
 *   Q4_KR 24 B / 32:  fp32 D = d*sc, fp32 M = -(dmin*mn), 16 B nibbles (Q4_1's order)
 *                                               w = D * q + M      (one rounding: fma)
 *   Q6_KR 40 B / 32:  fp32 D0, fp32 D1 (d*sc of each 16-half), 32 x int8 (q - 32)
 *                                               w = D_h * q        (one rounding)
 * D and M are exact in float32 (11 x 6 and 11 x 8 significant bits), so each
 * repacked weight rounds once, where and as gguf-py's does: the same value.
 * Q5_0 has SIMD kernels of its own, over the file's 22-byte blocks (no repack: a load
 * keeps them memory-mapped). fs_repack_q5_0 still turns it into Q8_0 (the same d, int8
 * q - 16; d * (q - 16) is exact either way), for callers that want that layout.
 * Nibbles: byte b of a 32-block holds element b in its low nibble and element
 * b + 16 in its high nibble (Q4_0/Q4_1/Q5_0, whose bit e of qh is bit 4 of element
 * e; the K formats as gguf-py lays them out).
 * The products named above are exact in float32 (fp16 has 11 significant bits)
 * except where a rounding is written; a backend must round exactly where
 * gguf-py does, so the weight values are bit-identical. Only the order of the
 * float32 sum over k differs between backends.
 *
 * Determinism: for one backend, y[i, j] depends only on row i of x and row j
 * of W - never on m, n, the thread split, or pointer alignment - so a row's
 * logits are the same whether it is verified alone or beside other rows.
 *
 * Accumulation is float32 (per-lane partial sums, folded in a fixed order).
 *
 * Asm entry points take one argument, a pointer to fs_qjob (System V: rdi);
 * the field offsets are fixed and named FS_QJOB_* below (the asm repeats
 * them). Backends may read x rows, weight blocks and the job; they write only
 * y[i * ldy + j] for i < m, j < n. m is 1..FS_Q_MAX_ROWS (the glue splits
 * larger m); n >= 1; kb >= 1. No alignment is promised for any pointer.
 */
#ifndef FLASHSPEC_QUANT_H
#define FLASHSPEC_QUANT_H

#include <stddef.h>
#include <stdint.h>

/* GGML type ids, as in the GGUF file's tensor info. */
#define FS_GGML_Q4_0 2
#define FS_GGML_Q4_1 3
#define FS_GGML_Q5_0 6
#define FS_GGML_Q8_0 8
#define FS_GGML_Q4_K 12
#define FS_GGML_Q6_K 14
/* flashspec's repacked K layouts (above): not GGML types, so outside GGML's id range. */
#define FS_REPACKED 256
#define FS_Q4_KR (FS_REPACKED + FS_GGML_Q4_K)
#define FS_Q6_KR (FS_REPACKED + FS_GGML_Q6_K)

/* Most x rows one kernel call takes (a plain step, a verification, a few batch rows). */
#define FS_Q_MAX_ROWS 16

typedef struct fs_qjob {
    const float *x;    /* offset  0: x[i * ldx + k], i < m, k < kb * block_elems */
    size_t ldx;        /* offset  8: floats between rows of x */
    const uint8_t *w;  /* offset 16: the first weight row of this job */
    size_t row_bytes;  /* offset 24: bytes between weight rows (kb * block_bytes) */
    size_t n;          /* offset 32: weight rows (outputs) in this job */
    size_t kb;         /* offset 40: blocks per weight row */
    float *y;          /* offset 48: y[i * ldy + j] */
    size_t ldy;        /* offset 56: floats between rows of y */
    size_t m;          /* offset 64: rows of x, 1..FS_Q_MAX_ROWS */
} fs_qjob;

#define FS_QJOB_X 0
#define FS_QJOB_LDX 8
#define FS_QJOB_W 16
#define FS_QJOB_ROW_BYTES 24
#define FS_QJOB_N 32
#define FS_QJOB_KB 40
#define FS_QJOB_Y 48
#define FS_QJOB_LDY 56
#define FS_QJOB_M 64

typedef void (*fs_qmm_fn)(const fs_qjob *job);

/* One format's geometry and the kernel of each backend (NULL: not written for it). */
typedef struct fs_qformat {
    int ggml_type;
    const char *name;        /* "Q4_0", ... */
    size_t block_elems;      /* 32 or 256 */
    size_t block_bytes;      /* 18, 20, 34, 144, 210, 24, 40, 22 */
} fs_qformat;

/* fp16 bits -> float32, exactly (subnormals, inf and nan included). */
float fs_half_to_float(uint16_t h);

/* Portable C kernels: the fallback and the reference the asm is checked against. */
void fs_qmm_q4_0_c(const fs_qjob *job);
void fs_qmm_q4_1_c(const fs_qjob *job);
/* The C fallback's multiply-add rate: rounds x FS_FMA_PROBE_LANES_C independent a * b + c. */
#define FS_FMA_PROBE_LANES_C 8
void fs_fma_probe_c(uint64_t rounds);
void fs_qmm_q8_0_c(const fs_qjob *job);
void fs_qmm_q4_k_c(const fs_qjob *job);
void fs_qmm_q6_k_c(const fs_qjob *job);
void fs_qmm_q4_kr_c(const fs_qjob *job);
void fs_qmm_q5_0_c(const fs_qjob *job);
void fs_qmm_q6_kr_c(const fs_qjob *job);

/*
 * fs_dequant_row_<fmt>: out[k] = W[row, k] for k < kb * block_elems, the exact
 * values above (used for embedding lookups and for large m, where a tile is
 * dequantized and handed to a BLAS).
 */
void fs_dequant_q4_0(const uint8_t *row, size_t kb, float *out);
void fs_dequant_q4_1(const uint8_t *row, size_t kb, float *out);
void fs_dequant_q8_0(const uint8_t *row, size_t kb, float *out);
void fs_dequant_q4_k(const uint8_t *row, size_t kb, float *out);
void fs_dequant_q6_k(const uint8_t *row, size_t kb, float *out);
void fs_dequant_q4_kr(const uint8_t *row, size_t kb, float *out);
void fs_dequant_q5_0(const uint8_t *row, size_t kb, float *out);
void fs_dequant_q6_kr(const uint8_t *row, size_t kb, float *out);

/*
 * fs_repack_<fmt>: one row's kb blocks at `in` into the layout a SIMD kernel
 * runs (Q4_K -> 8 kb Q4_KR blocks, Q6_K -> 8 kb Q6_KR, Q5_0 -> kb Q8_0) at
 * `out`, whose dequantized values are bit-identical.
 */
void fs_repack_q4_k(const uint8_t *in, size_t kb, uint8_t *out);
void fs_repack_q6_k(const uint8_t *in, size_t kb, uint8_t *out);
void fs_repack_q5_0(const uint8_t *in, size_t kb, uint8_t *out);

#ifdef FLASHSPEC_HAVE_ASM
/*
 * asm/quant_avx2.asm and asm/quant_avx512.asm (linked into flashspec._quant only,
 * which setup.py builds with FLASHSPEC_HAVE_QUANT_ASM as well). ISA they need:
 *   _avx2    AVX2 + FMA + F16C (VEX only)
 *   _avx512  AVX-512F (no BW/DQ/VL: every EVEX instruction has a zmm operand)
 *            plus VEX AVX2 + F16C on xmm for the fp16 scales (vpbroadcastw/d,
 *            vcvtph2ps xmm) and the OS's ZMM state (XGETBV: opmask, ZMM_Hi256,
 *            Hi16_ZMM); _quant.c's check (avx512 + fma + f16c) covers all of it
 * They handle any m (passes of at most 12 x rows), n >= 1 and kb >= 0, save rbx,
 * rbp, r12-r15. Checked by tests/kernels/abi/checkquant.c (tests/kernels/test_quant_abi.py).
 */
void fs_qmm_q4_0_avx2(const fs_qjob *job);
void fs_qmm_q4_1_avx2(const fs_qjob *job);
void fs_qmm_q8_0_avx2(const fs_qjob *job);
void fs_qmm_q4_0_avx512(const fs_qjob *job);
void fs_qmm_q4_1_avx512(const fs_qjob *job);
void fs_qmm_q8_0_avx512(const fs_qjob *job);
void fs_qmm_q4_kr_avx2(const fs_qjob *job);
void fs_qmm_q6_kr_avx2(const fs_qjob *job);
void fs_qmm_q4_kr_avx512(const fs_qjob *job);
void fs_qmm_q6_kr_avx512(const fs_qjob *job);
void fs_qmm_q5_0_avx2(const fs_qjob *job);
void fs_qmm_q5_0_avx512(const fs_qjob *job);
/* The float32 multiply-add peak of one core (flashspec.bench.quant's floor of a product of
 * m rows: each row needs one multiply-add per weight, whatever the format): rounds x
 * CHAINS independent FMAs of 8 (ymm) or 16 (zmm) lanes. */
#define FS_FMA_PROBE_CHAINS_AVX2 12
#define FS_FMA_PROBE_CHAINS_AVX512 16
void fs_fma_probe_avx2(uint64_t rounds);
void fs_fma_probe_avx512(uint64_t rounds);
/* Q4_K / Q6_K as the file stores them run the C kernel; a load repacks them (above).
 * Q5_0 runs as the file stores it (22-byte blocks, memory-mapped). */
#endif

#endif
