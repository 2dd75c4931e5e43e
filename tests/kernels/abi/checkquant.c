/*
 * checkquant.c - check the asm quantized-matmul kernels (asm/quant_*.asm) against
 * the portable C kernels of ext/quant.c and the System V ABI, in the style of
 * checkasm.c.
 *
 * Build (tests/kernels/test_quant_abi.py does this):
 *   nasm -f elf64 -I asm/ asm/quant_avx2.asm   -o quant_avx2.o
 *   nasm -f elf64 -I asm/ asm/quant_avx512.asm -o quant_avx512.o
 *   nasm -f elf64 tests/kernels/abi/trampoline.asm      -o trampoline.o
 *   gcc -O2 -DFLASHSPEC_HAVE_ASM -DFLASHSPEC_HAVE_QUANT_ASM -I ext \
 *       tests/kernels/abi/checkquant.c ext/quant.c quant_avx2.o quant_avx512.o trampoline.o \
 *       -o checkquant -lm
 *
 * Usage: checkquant [--seed N | N] [--only NAME] [--bench] [--verbose]
 *   Without --bench: every check below for every backend this CPU supports (c
 *   always, avx2, avx512); prints "checkquant: N passed, M failed", exits 1 on a
 *   failure. --bench prints single-threaded ns per call and GB/s of weights.
 *
 * For each format (Q4_0, Q4_1, Q8_0, Q5_0 as the file stores it, and the repacked Q4_KR
 * and Q6_KR), kb in {1, 2, 3, 18}, n in {1..9, 16, 17, 33, 64} and m = 1..16 (one case
 * each), on random blocks (random fp16 d and m of both signs, random quants and Q5_0
 * high bits) and random x:
 *   - y within (4 kb + 16) 2^-24 sum|x w| of a float64 sum over the weights
 *     dequantized here (from the fp16 bits, Q4_1 with fmaf: gguf-py's values;
 *     Q4_KR / Q6_KR from their float32 scales as ext/quant.h defines them),
 *     and within twice that of the C kernel fs_qmm_<fmt>_c on the same job;
 *   - determinism: every row's bits equal to the m = 16 run's (so also to m = 1),
 *     and to a run over a sub-range of the n weight rows;
 *   - exactness of the weights: with one-hot x rows, y[i, j] == W[j, k_i] exactly
 *     (the harness's gguf-py dequantization, also checked against fs_dequant_*);
 *   - x, w and y each end at a PROT_NONE page (odd m: start right after one), so
 *     an over-read or over-write faults (caught: SIGSEGV + siglongjmp, reported);
 *     y's padding between rows (ldy > n) keeps its sentinel;
 *   - every asm call goes through tests/kernels/abi/trampoline.asm: rbx, rbp, r12-r15
 *     canaries, rsp, the direction flag, MXCSR and a missing vzeroupper, with the
 *     vector registers poisoned with NaN.
 */
#define _GNU_SOURCE
#include <cpuid.h>
#include <inttypes.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "quant.h"

#define HARNESS_NAME "checkquant"
#define MAX_REPORTS 40
#include "harness.h"

#if !defined(FLASHSPEC_HAVE_ASM) || !defined(FLASHSPEC_HAVE_QUANT_ASM)
#error "checkquant tests the asm kernels: build with -DFLASHSPEC_HAVE_ASM -DFLASHSPEC_HAVE_QUANT_ASM"
#endif

/* ---- trampoline.asm (its generic entry, under its own name) -------------- */

/* The trampoline shifts the arguments down one register: job arrives in rdi. */
void checkquant_call(fs_qmm_fn f, const fs_qjob *job) __asm__("checkasm_call_store");

/* ---- parameters ---------------------------------------------------------- */

#define QK 32
#define MAX_M FS_Q_MAX_ROWS
static const size_t kb_list[] = {1, 2, 3, 18};
static const size_t n_list[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33, 64};
#define N_KB (sizeof kb_list / sizeof kb_list[0])
#define N_N (sizeof n_list / sizeof n_list[0])
#define MAX_KB 18
#define MAX_N 64
#define MAX_K (MAX_KB * QK)
#define MAX_PAD 3
#define MAX_BLOCK_BYTES 40 /* Q6_KR */
#define Y_SENTINEL 0x5A5A5A5Au
#define MXCSR_FLAGS 0x3Fu /* IE DE ZE OE UE PE */

typedef struct {
    const char *name;
    size_t block_bytes;
    fs_qmm_fn c_fn;
    void (*c_dequant)(const uint8_t *, size_t, float *);
} fmt_info;

enum { F_Q4_0, F_Q4_1, F_Q8_0, F_Q4_KR, F_Q6_KR, F_Q5_0, N_FMT };

static const fmt_info fmts[N_FMT] = {
    {"Q4_0", 18, fs_qmm_q4_0_c, fs_dequant_q4_0},
    {"Q4_1", 20, fs_qmm_q4_1_c, fs_dequant_q4_1},
    {"Q8_0", 34, fs_qmm_q8_0_c, fs_dequant_q8_0},
    {"Q4_KR", 24, fs_qmm_q4_kr_c, fs_dequant_q4_kr},
    {"Q6_KR", 40, fs_qmm_q6_kr_c, fs_dequant_q6_kr},
    {"Q5_0", 22, fs_qmm_q5_0_c, fs_dequant_q5_0},
};

typedef struct {
    const char *name;
    int is_asm;
    fs_qmm_fn fn[N_FMT];
    void (*probe)(uint64_t rounds); /* the FMA probe (ext/quant.h) */
} backend;

/* Uniform in [-1, 1) with 24 random bits: every value is an exact float. */
static float rnd_sym(void) { return (float)((int64_t)(rnd() >> 40) - (1 << 23)) * 0x1p-23f; }

/* ---- fp16 and the gguf-py weight values ---------------------------------- */

/* Exact IEEE binary16 -> binary32 (written here, independent of the kernels). */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1F, f = h & 0x3FF;
    if (e == 0x1F) return bitsf(sign | 0x7F800000u | (f << 13));
    if (e == 0) {
        float v = (float)f * 0x1p-24f; /* subnormal (or zero): exact */
        return sign ? -v : v;
    }
    return bitsf(sign | ((e + 112) << 23) | (f << 13));
}

/* A random fp16 scale: normal, random sign, magnitude in [2^-14, 2^-2). */
static uint16_t rnd_half_scale(void) {
    uint16_t e = (uint16_t)(1 + rnd() % 13), f = (uint16_t)(rnd() & 0x3FF);
    return (uint16_t)(((rnd() & 1) << 15) | (e << 10) | f);
}

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static void wr16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8); }
static float rdf(const uint8_t *p) {
    float f;
    memcpy(&f, p, sizeof f);
    return f;
}
static void wrf(uint8_t *p, float f) { memcpy(p, &f, sizeof f); }

/* A float32 scale as the repacked layouts hold them: an fp16 scale times a small integer. */
static float rnd_kr_scale(void) {
    return half_to_float(rnd_half_scale()) * (float)(int)(rnd() % 64);
}

/* gguf-py's dequantize of one block, as float32. */
static void ref_dequant_block(int f, const uint8_t *b, float *out) {
    float d = half_to_float(rd16(b));
    switch (f) {
    case F_Q4_0:
        for (int e = 0; e < 16; e++) {
            out[e] = d * (float)((b[2 + e] & 0xF) - 8);
            out[e + 16] = d * (float)((b[2 + e] >> 4) - 8);
        }
        break;
    case F_Q4_1: {
        float m = half_to_float(rd16(b + 2));
        for (int e = 0; e < 16; e++) {
            out[e] = fmaf(d, (float)(b[4 + e] & 0xF), m);
            out[e + 16] = fmaf(d, (float)(b[4 + e] >> 4), m);
        }
        break;
    }
    case F_Q8_0:
        for (int e = 0; e < 32; e++) out[e] = d * (float)(int8_t)b[2 + e];
        break;
    case F_Q4_KR: {
        float dk = rdf(b), m = rdf(b + 4);
        for (int e = 0; e < 16; e++) {
            out[e] = fmaf(dk, (float)(b[8 + e] & 0xF), m);
            out[e + 16] = fmaf(dk, (float)(b[8 + e] >> 4), m);
        }
        break;
    }
    case F_Q6_KR:
        for (int e = 0; e < 32; e++) out[e] = rdf(b + 4 * (e / 16)) * (float)(int8_t)b[8 + e];
        break;
    case F_Q5_0: {
        /* fp16 d, le32 qh (bit e: bit 4 of element e), nibbles as Q4_0's: w = d * (q - 16). */
        uint32_t qh = (uint32_t)rd16(b + 2) | (uint32_t)rd16(b + 4) << 16;
        for (int e = 0; e < 16; e++) {
            int lo = (b[6 + e] & 0xF) | (int)((qh >> e) & 1) << 4;
            int hi = (b[6 + e] >> 4) | (int)((qh >> (e + 16)) & 1) << 4;
            out[e] = d * (float)(lo - 16);
            out[e + 16] = d * (float)(hi - 16);
        }
        break;
    }
    }
}

static void gen_blocks(int f, uint8_t *w, size_t nblocks) {
    size_t bb = fmts[f].block_bytes;
    for (size_t i = 0; i < nblocks; i++) {
        uint8_t *b = w + i * bb;
        for (size_t k = 0; k < bb; k++) b[k] = (uint8_t)rnd();
        if (f == F_Q4_KR || f == F_Q6_KR) {
            wrf(b, rnd_kr_scale());
            wrf(b + 4, f == F_Q4_KR ? -rnd_kr_scale() : rnd_kr_scale());
            if (f == F_Q6_KR)
                for (size_t k = 8; k < bb; k++) b[k] = (uint8_t)(int8_t)((int)(rnd() % 64) - 32);
            continue;
        }
        wr16(b, rnd_half_scale());
        if (f == F_Q4_1) wr16(b + 2, rnd_half_scale());
    }
}

/* ---- guarded buffers ----------------------------------------------------- */

static size_t page;

typedef struct {
    uint8_t *base; /* first usable byte (right after the leading PROT_NONE page) */
    size_t bytes;  /* usable bytes, a multiple of the page size */
} gpage;

static gpage gpage_new(size_t bytes) {
    gpage g;
    g.bytes = (bytes + page - 1) / page * page;
    uint8_t *p = mmap(NULL, g.bytes + 2 * page, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(2);
    }
    mprotect(p, page, PROT_NONE);
    mprotect(p + page + g.bytes, page, PROT_NONE);
    g.base = p + page;
    return g;
}

/* Place len bytes at the end (at_start = 0) or start of the usable pages. */
static void *gplace(const gpage *g, size_t len, int at_start) {
    return at_start ? g->base : g->base + g->bytes - len;
}

static sigjmp_buf fault_jmp;
static volatile sig_atomic_t fault_armed;
static volatile void *fault_addr;

static void on_fault(int sig, siginfo_t *si, void *ctx) {
    (void)sig, (void)ctx;
    if (!fault_armed) {
        signal(SIGSEGV, SIG_DFL);
        return;
    }
    fault_addr = si->si_addr;
    siglongjmp(fault_jmp, 1);
}

static void install_fault_handler(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigaction(SIGSEGV, &sa, NULL);
    sigaction(SIGBUS, &sa, NULL);
}

/* ---- running one job ----------------------------------------------------- */

/* Run f on job; the asm goes through the trampoline. Returns 0, or -1 after
 * reporting a fault or an ABI violation. */
static int run_job(const backend *be, int f, const fs_qjob *job) {
    fs_qmm_fn fn = be->fn[f];
    if (sigsetjmp(fault_jmp, 1)) {
        fault_armed = 0;
        errf("%s: memory fault at %p (read or write past a buffer)", be->name, fault_addr);
        return -1;
    }
    fault_armed = 1;
    if (be->is_asm) {
        for (int r = 0; r < 7; r++) checkasm_canary[r] = rnd() | 1;
        checkasm_fail = 0;
        checkasm_xmm0_live = 0;
        /* Sticky exception flags already set: the check sees a kernel that
         * changes MXCSR's control bits, not the inexact results every sum has. */
        __builtin_ia32_ldmxcsr(__builtin_ia32_stmxcsr() | MXCSR_FLAGS);
        checkquant_call(fn, job);
    } else {
        fn(job);
    }
    fault_armed = 0;
    if (be->is_asm && checkasm_fail) {
        for (unsigned b = 0; b < N_ABI_FAIL; b++)
            if (checkasm_fail & (1u << b)) errf("%s: ABI: %s", be->name, abi_fail_names[b]);
        return -1;
    }
    return 0;
}

/* ---- the checks ---------------------------------------------------------- */

/* The FMA probe through the same trampoline as the kernels (canaries in the callee-saved
 * registers, MXCSR, vzeroupper): its only argument, the round count, rides in rdi where a
 * kernel's job pointer would, and 0 rounds must return at once. */
static void check_probe(const backend *be) {
    static const uint64_t rounds[] = {0, 1, 1000};
    for (size_t i = 0; i < sizeof rounds / sizeof rounds[0]; i++) {
        begin_case("%s fma probe rounds=%" PRIu64, be->name, rounds[i]);
        if (!be->is_asm) {
            be->probe(rounds[i]);
            end_case();
            continue;
        }
        for (int r = 0; r < 7; r++) checkasm_canary[r] = rnd() | 1;
        checkasm_fail = 0;
        checkasm_xmm0_live = 0;
        __builtin_ia32_ldmxcsr(__builtin_ia32_stmxcsr() | MXCSR_FLAGS);
        checkquant_call((fs_qmm_fn)(void (*)(void))be->probe, (const fs_qjob *)(uintptr_t)rounds[i]);
        for (unsigned b = 0; b < N_ABI_FAIL; b++)
            if (checkasm_fail & (1u << b)) errf("%s: fma probe: ABI: %s", be->name, abi_fail_names[b]);
        end_case();
    }
}

static gpage gx, gw, gy;
static float src_x[MAX_M * (MAX_K + MAX_PAD)];
static uint8_t src_w[MAX_N * MAX_KB * MAX_BLOCK_BYTES];
static float deq[MAX_N][MAX_K];           /* gguf-py values of src_w */
static double ref64[MAX_M][MAX_N], refabs[MAX_M][MAX_N];
static float y_full[MAX_M][MAX_N], y_c[MAX_M][MAX_N], y_got[MAX_M][MAX_N];

typedef struct {
    const float *x;
    const uint8_t *w;
    float *y;
    size_t ldx, ldy, y_len;
} placed;

/* Copy the problem into the guarded pages: x rows 0..m-1 (ldx apart), the n
 * weight rows, y (m rows, ldy apart, sentinel-filled), each ending at a guard
 * page (or starting right after one). */
static placed place(int f, size_t m, size_t n, size_t kb, size_t ldx, size_t ldy, int at_start) {
    placed p;
    size_t k = kb * QK, rb = kb * fmts[f].block_bytes;
    size_t x_len = (m - 1) * ldx + k, w_len = n * rb;
    p.y_len = (m - 1) * ldy + n;
    float *x = gplace(&gx, x_len * sizeof(float), at_start);
    uint8_t *w = gplace(&gw, w_len, at_start);
    float *y = gplace(&gy, p.y_len * sizeof(float), at_start);
    for (size_t i = 0; i < m; i++) memcpy(x + i * ldx, src_x + i * (MAX_K + MAX_PAD), k * sizeof(float));
    for (size_t i = 0; i + 1 < m; i++)
        for (size_t t = k; t < ldx; t++) x[i * ldx + t] = bitsf(0x7FC0DEADu); /* NaN padding */
    memcpy(w, src_w, w_len);
    for (size_t t = 0; t < p.y_len; t++) y[t] = bitsf(Y_SENTINEL);
    p.x = x, p.w = w, p.y = y, p.ldx = ldx, p.ldy = ldy;
    return p;
}

static void collect(const placed *p, size_t m, size_t n, size_t j0, float out[MAX_M][MAX_N]) {
    for (size_t i = 0; i < m; i++)
        for (size_t j = 0; j < n; j++) out[i][j0 + j] = p->y[i * p->ldy + j];
    for (size_t i = 0; i + 1 < m; i++)
        for (size_t t = n; t < p->ldy; t++)
            if (fbits(p->y[i * p->ldy + t]) != Y_SENTINEL) {
                errf("wrote y padding at row %zu, column %zu (n = %zu, ldy = %zu)", i, t, n, p->ldy);
                return;
            }
}

static fs_qjob make_job(const placed *p, int f, size_t m, size_t n, size_t kb, size_t j0) {
    fs_qjob job;
    job.x = p->x;
    job.ldx = p->ldx;
    job.row_bytes = kb * fmts[f].block_bytes;
    job.w = p->w + j0 * job.row_bytes;
    job.n = n - j0;
    job.kb = kb;
    job.y = p->y;
    job.ldy = p->ldy;
    job.m = m;
    return job;
}

static double tol_bound(size_t kb, double sumabs) {
    return (double)(4 * kb + 16) * 0x1p-24 * sumabs + 1e-30;
}

static void compute_ref(int f, size_t n, size_t kb) {
    size_t k = kb * QK;
    for (size_t j = 0; j < n; j++)
        for (size_t b = 0; b < kb; b++)
            ref_dequant_block(f, src_w + (j * kb + b) * fmts[f].block_bytes, &deq[j][b * QK]);
    for (size_t i = 0; i < MAX_M; i++)
        for (size_t j = 0; j < n; j++) {
            double s = 0, a = 0;
            for (size_t t = 0; t < k; t++) {
                double v = (double)src_x[i * (MAX_K + MAX_PAD) + t] * (double)deq[j][t];
                s += v;
                a += fabs(v);
            }
            ref64[i][j] = s, refabs[i][j] = a;
        }
}

/* C's dequantizer must give the harness's (gguf-py) values bit for bit. */
static void check_c_dequant(int f, size_t n, size_t kb) {
    static float row[MAX_K];
    begin_case("c %s dequant kb=%zu", fmts[f].name, kb);
    for (size_t j = 0; j < n && !case_errors; j++) {
        fmts[f].c_dequant(src_w + j * kb * fmts[f].block_bytes, kb, row);
        for (size_t t = 0; t < kb * QK; t++)
            if (fbits(row[t]) != fbits(deq[j][t])) {
                errf("fs_dequant row %zu element %zu: %a, gguf-py value %a", j, t, row[t], deq[j][t]);
                break;
            }
    }
    end_case();
}

static void test_shape(const backend *be, int f, size_t n, size_t kb) {
    size_t ldx = kb * QK + rnd() % (MAX_PAD + 1), ldy = n + rnd() % (MAX_PAD + 1);
    /* The m = 16 run: every later run must reproduce its bits row by row. */
    for (size_t m = MAX_M; m >= 1; m--) {
        begin_case("%s %s kb=%zu n=%zu m=%zu", be->name, fmts[f].name, kb, n, m);
        int at_start = (int)(m & 1);
        placed p = place(f, m, n, kb, ldx, ldy, at_start);
        fs_qjob job = make_job(&p, f, m, n, kb, 0);
        if (run_job(be, f, &job) == 0) {
            collect(&p, m, n, 0, y_got);
            /* The C kernel on the same job, same buffers. */
            placed pc = place(f, m, n, kb, ldx, ldy, at_start);
            fs_qjob jc = make_job(&pc, f, m, n, kb, 0);
            backend cb = {"c-ref", 0, {NULL}};
            for (int g = 0; g < N_FMT; g++) cb.fn[g] = fmts[g].c_fn;
            if (run_job(&cb, f, &jc) == 0) collect(&pc, m, n, 0, y_c);
            for (size_t i = 0; i < m && case_errors < 4; i++)
                for (size_t j = 0; j < n; j++) {
                    double got = y_got[i][j], tol = tol_bound(kb, refabs[i][j]);
                    if (!(fabs(got - ref64[i][j]) <= tol)) {
                        errf("y[%zu,%zu] = %.9g, float64 reference %.9g (tolerance %.3g)", i, j,
                             got, ref64[i][j], tol);
                        break;
                    }
                    if (!(fabs(got - (double)y_c[i][j]) <= 2 * tol)) {
                        errf("y[%zu,%zu] = %.9g, C kernel %.9g (tolerance %.3g)", i, j, got,
                             (double)y_c[i][j], 2 * tol);
                        break;
                    }
                    if (m == MAX_M)
                        y_full[i][j] = y_got[i][j];
                    else if (fbits(y_got[i][j]) != fbits(y_full[i][j])) {
                        errf("not deterministic: y[%zu,%zu] = %a at m=%zu, %a at m=%d", i, j,
                             y_got[i][j], m, y_full[i][j], MAX_M);
                        break;
                    }
                }
            /* A sub-range of the weight rows gives the same bits. */
            if (n > 1 && !case_errors) {
                size_t j0 = 1 + rnd() % (n - 1);
                placed ps = place(f, m, n - j0, kb, ldx, ldy, at_start);
                /* place() copied rows 0..n-j0-1: point w back so that row j0 is first. */
                memcpy((uint8_t *)ps.w, src_w + j0 * kb * fmts[f].block_bytes,
                       (n - j0) * kb * fmts[f].block_bytes);
                fs_qjob js = make_job(&ps, f, m, n - j0, kb, 0);
                if (run_job(be, f, &js) == 0) {
                    collect(&ps, m, n - j0, 0, y_c);
                    for (size_t i = 0; i < m; i++)
                        for (size_t j = 0; j < n - j0; j++)
                            if (fbits(y_c[i][j]) != fbits(y_full[i][j0 + j])) {
                                errf("not deterministic: y[%zu,%zu] = %a with rows %zu.., %a with rows 0..",
                                     i, j0 + j, y_c[i][j], j0, y_full[i][j0 + j]);
                                i = m;
                                break;
                            }
                }
            }
        }
        end_case();
    }
}

/* One-hot x rows: y[i, j] must be exactly the weight W[j, k_i]. */
static void test_exact(const backend *be, int f, size_t n, size_t kb) {
    size_t k = kb * QK, m = MAX_M;
    static size_t hot[MAX_M];
    begin_case("%s %s exact weights kb=%zu n=%zu", be->name, fmts[f].name, kb, n);
    float save[MAX_M * (MAX_K + MAX_PAD)];
    memcpy(save, src_x, sizeof save);
    for (size_t i = 0; i < m; i++) {
        hot[i] = i < 2 ? (i ? k - 1 : 0) : rnd() % k;
        for (size_t t = 0; t < k; t++) src_x[i * (MAX_K + MAX_PAD) + t] = t == hot[i] ? 1.0f : 0.0f;
    }
    placed p = place(f, m, n, kb, k, n, 0);
    fs_qjob job = make_job(&p, f, m, n, kb, 0);
    if (run_job(be, f, &job) == 0) {
        collect(&p, m, n, 0, y_got);
        for (size_t i = 0; i < m && !case_errors; i++)
            for (size_t j = 0; j < n; j++)
                if (!(y_got[i][j] == deq[j][hot[i]])) {
                    errf("W[%zu,%zu] came out as %a, gguf-py value %a", j, hot[i], y_got[i][j],
                         deq[j][hot[i]]);
                    break;
                }
    }
    memcpy(src_x, save, sizeof save);
    end_case();
}

/* ---- bench --------------------------------------------------------------- */

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void bench(const backend *bes, size_t nb) {
    static const size_t ms[] = {1, 2, 5, 8, 16};
    struct { int f; size_t n, kb; } mats[] = {{F_Q4_1, 1536, 18}, {F_Q5_0, 1536, 18},
                                              {F_Q8_0, 49152, 18}};
    printf("checkquant bench: single thread, median ns per call (x %.2f of m=1), GB/s of weights\n", 1.0);
    for (size_t mi = 0; mi < sizeof mats / sizeof mats[0]; mi++) {
        int f = mats[mi].f;
        size_t n = mats[mi].n, kb = mats[mi].kb, k = kb * QK, rb = kb * fmts[f].block_bytes;
        uint8_t *w = malloc(n * rb);
        float *x = malloc(MAX_M * k * sizeof(float)), *y = malloc(MAX_M * n * sizeof(float));
        gen_blocks(f, w, n * kb);
        for (size_t t = 0; t < MAX_M * k; t++) x[t] = rnd_sym();
        printf("%s %zu x %zu (%.1f MB)\n", fmts[f].name, n, k, n * rb / 1e6);
        for (size_t b = 0; b < nb; b++) {
            printf("  %-7s", bes[b].name);
            double base = 0;
            for (size_t q = 0; q < sizeof ms / sizeof ms[0]; q++) {
                fs_qjob job = {x, k, w, rb, n, kb, y, n, ms[q]};
                double t[9];
                size_t reps = n * rb > 4000000 ? 3 : 30;
                bes[b].fn[f](&job);
                for (int r = 0; r < 9; r++) {
                    double t0 = now_ns();
                    for (size_t s = 0; s < reps; s++) bes[b].fn[f](&job);
                    t[r] = (now_ns() - t0) / (double)reps;
                }
                qsort(t, 9, sizeof t[0], cmp_double);
                double ns = t[4];
                if (q == 0) base = ns;
                printf("  m=%-2zu %9.0f ns (%4.2fx) %5.1f GB/s", ms[q], ns, ns / base, n * rb / ns);
                fflush(stdout);
            }
            printf("\n");
        }
        free(w), free(x), free(y);
    }
}

/* ---- main ---------------------------------------------------------------- */

static int xgetbv_xinuse_supported(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(0xD, 1, &a, &b, &c, &d)) return 0;
    return (a >> 2) & 1;
}

int main(int argc, char **argv) {
    uint64_t seed = (uint64_t)time(NULL);
    const char *only = NULL;
    int do_bench = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--bench"))
            do_bench = 1;
        else if (!strcmp(argv[i], "--verbose"))
            verbose = 1;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            only = argv[++i];
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            seed = strtoull(argv[++i], NULL, 0);
        else if (argv[i][0] >= '0' && argv[i][0] <= '9')
            seed = strtoull(argv[i], NULL, 0);
        else {
            fprintf(stderr, "usage: %s [--seed N | N] [--only NAME] [--bench] [--verbose]\n", argv[0]);
            return 2;
        }
    }
    for (int f = 0; f < N_FMT; f++)
        if (fmts[f].block_bytes > MAX_BLOCK_BYTES) {
            fprintf(stderr, "%s: raise MAX_BLOCK_BYTES to %zu\n", fmts[f].name, fmts[f].block_bytes);
            return 2;
        }
    page = (size_t)sysconf(_SC_PAGESIZE);
    __builtin_cpu_init();
    int have_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    unsigned a, b, c, d;
    int have_f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    have_avx2 = have_avx2 && have_f16c;
    int have_avx512 = have_avx2 && __builtin_cpu_supports("avx512f");
    checkasm_have_avx512 = (uint32_t)have_avx512;
    checkasm_check_xinuse = (uint32_t)(have_avx2 && xgetbv_xinuse_supported());

    backend all[] = {
        {"c", 0, {fs_qmm_q4_0_c, fs_qmm_q4_1_c, fs_qmm_q8_0_c, fs_qmm_q4_kr_c, fs_qmm_q6_kr_c,
                  fs_qmm_q5_0_c}, fs_fma_probe_c},
        {"avx2", 1, {fs_qmm_q4_0_avx2, fs_qmm_q4_1_avx2, fs_qmm_q8_0_avx2, fs_qmm_q4_kr_avx2,
                     fs_qmm_q6_kr_avx2, fs_qmm_q5_0_avx2}, fs_fma_probe_avx2},
        {"avx512", 1, {fs_qmm_q4_0_avx512, fs_qmm_q4_1_avx512, fs_qmm_q8_0_avx512,
                       fs_qmm_q4_kr_avx512, fs_qmm_q6_kr_avx512, fs_qmm_q5_0_avx512},
         fs_fma_probe_avx512},
    };
    int supported[] = {1, have_avx2, have_avx512};
    backend bes[3];
    size_t nb = 0;
    for (size_t k = 0; k < 3; k++) {
        if (!supported[k]) {
            printf("checkquant: %s not supported by this CPU, skipped\n", all[k].name);
            continue;
        }
        if (only && strcmp(only, all[k].name)) continue;
        bes[nb++] = all[k];
    }
    rng_seed(seed);
    if (do_bench) {
        bench(bes, nb);
        return 0;
    }
    printf("checkquant: seed %" PRIu64 "%s%s\n", seed, only ? ", only " : "", only ? only : "");
    printf("checkquant: testing");
    for (size_t k = 0; k < nb; k++) printf(" %s", bes[k].name);
    printf(" (xinuse check %s)\n", checkasm_check_xinuse ? "on" : "off");

    install_fault_handler();
    gx = gpage_new(sizeof src_x);
    gw = gpage_new(sizeof src_w);
    gy = gpage_new(MAX_M * (MAX_N + MAX_PAD) * sizeof(float));
    for (size_t k = 0; k < nb; k++) check_probe(&bes[k]);

    for (int f = 0; f < N_FMT; f++)
        for (size_t ki = 0; ki < N_KB; ki++)
            for (size_t ni = 0; ni < N_N; ni++) {
                size_t kb = kb_list[ki], n = n_list[ni];
                unsigned long before = n_fail;
                gen_blocks(f, src_w, n * kb);
                for (size_t t = 0; t < sizeof src_x / sizeof src_x[0]; t++) src_x[t] = rnd_sym();
                compute_ref(f, n, kb);
                if (!only || !strcmp(only, "c")) check_c_dequant(f, n, kb);
                for (size_t k = 0; k < nb; k++) {
                    test_shape(&bes[k], f, n, kb);
                    test_exact(&bes[k], f, n, kb);
                }
                if (verbose || n_fail != before)
                    printf("checkquant: %s kb=%zu n=%zu done, %lu failed so far\n", fmts[f].name, kb,
                           n, n_fail);
            }
    printf("checkquant: %lu passed, %lu failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
