/*
 * checkasm.c - check the asm residual kernels against the C reference and the
 * System V ABI, in the spirit of dav1d's checkasm.
 *
 * Build (tests/kernels/test_abi.py does this):
 *   nasm -f elf64 -I asm/ asm/residual_avx2.asm   -o avx2.o
 *   nasm -f elf64 -I asm/ asm/residual_avx512.asm -o avx512.o
 *   nasm -f elf64 tests/kernels/abi/trampoline.asm         -o trampoline.o
 *   gcc -O2 -DFLASHSPEC_HAVE_ASM -I ext tests/kernels/abi/checkasm.c ext/residual.c \
 *       avx2.o avx512.o trampoline.o -o checkasm
 *
 * Usage: checkasm [--seed N | N] [--only NAME] [--bench] [--verbose]
 *   Without --bench: runs every check for every backend this CPU supports
 *   (scalar always, avx2, avx512), prints "checkasm: N passed, M failed" and
 *   exits 1 if anything failed. --bench prints timings instead.
 *
 * What is checked, for each backend and each of n = 0..300, 1024, 4095, 4096,
 * 4097, 32000, 128256, 256000 and each pointer offset 0..15 floats:
 *   - store: out bit-identical to C max(p - q, 0); returned sum within 1e-5
 *     (relative) of the float64 sum of those d; *check close to the sum of
 *     p + q; guard regions around out untouched; p and q untouched, including
 *     the NaN poison around them (an over-read that got summed shows as NaN);
 *   - sum: the same, writing nothing; asm store and sum agree bit for bit;
 *   - address independence: sum, check and scan give the same bits for every
 *     pointer offset (the results are a function of the values only);
 *   - scale: x bit-identical to C x * s, guards untouched;
 *   - scan: for a dozen targets, the returned chunk start is consistent with
 *     the float64 prefix sums and the returned *before matches them to 1e-5;
 *   - every buffer ending exactly at a page followed by a PROT_NONE page, and
 *     starting right after one: a touched neighbour page faults, which is caught
 *     (SIGSEGV handler + siglongjmp) and reported as a failure;
 *   - non-finite p or q (NaN, +inf, -inf) at the first, middle, last, and
 *     tail-boundary positions makes *check non-finite;
 *   - every asm call goes through trampoline.asm, which reports clobbered
 *     callee-saved registers, rsp, the direction flag, MXCSR and a missing
 *     vzeroupper, and poisons the registers a kernel must not rely on.
 */
#define _GNU_SOURCE
#include <cpuid.h>
#include <immintrin.h>
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

#include "kernels.h"

#define HARNESS_NAME "checkasm"
#define MAX_REPORTS 40  /* failures printed in full; the rest are only counted */
#include "harness.h"

#ifndef FLASHSPEC_HAVE_ASM
#error "checkasm tests the asm kernels: build with -DFLASHSPEC_HAVE_ASM"
#endif

/* ---- trampoline.asm ---------------------------------------------------- */

double checkasm_call_store(fs_store_fn f, const float *p, const float *q, float *out,
                           size_t n, float *check);
double checkasm_call_sum(fs_sum_fn f, const float *p, const float *q, size_t n,
                         float *check);
void checkasm_call_scale(fs_scale_fn f, float *x, size_t n, float s);
size_t checkasm_call_scan(fs_scan_fn f, const float *p, const float *q, size_t n,
                          double target, double *before);

/* ---- test parameters ----------------------------------------------------- */

#define MAX_N 256000
static const size_t big_sizes[] = {1024, 4095, 4096, 4097, 32000, 128256, 256000};
#define N_BIG (sizeof big_sizes / sizeof big_sizes[0])
#define SMALL_N_MAX 300
#define MAX_OFF 16     /* pointer offsets 0..15 floats */
#define GUARD 256      /* guard floats on each side of a heap buffer */

#define SUM_RTOL 1e-5   /* returned sums vs the float64 reference */
#define CHECK_RTOL 1e-4 /* *check (plain float32 lanes, unblocked) vs float64 */

/* Bit patterns: out-of-range output guard (finite, so x * s changes it) and the
 * input poison around p and q (NaN, so a summed over-read poisons *check). */
#define OUT_SENTINEL 0x5A5A5A5Au
#define IN_POISON 0x7FA5A5A5u

/* Uniform in [0, 1) with 24 random bits: every value is an exact float. */
static float rnd_unit(void) { return (float)(rnd() >> 40) * 0x1p-24f; }

/* ---- bits and floats ----------------------------------------------------- */

static void fill_bits(float *x, size_t n, uint32_t pattern) {
    for (size_t i = 0; i < n; i++) x[i] = bitsf(pattern);
}

/* Index of the first element of x[0..n) whose bits differ from pattern, or n. */
static size_t find_not_bits(const float *x, size_t n, uint32_t pattern) {
    for (size_t i = 0; i < n; i++)
        if (fbits(x[i]) != pattern) return i;
    return n;
}

/* The C definition the asm must match bit for bit (one subtract, one compare). */
static float ref_d(float p, float q) {
    float d = p - q;
    return d > 0.0f ? d : 0.0f;
}

/*
 * Inputs: mostly uniform [0, 1), with the cases that matter to max(p - q, 0)
 * mixed in: p == q, zeros, -0.0 - +0.0 (gives -0.0, which must become +0.0),
 * subnormals, negatives.
 */
static void gen_inputs(float *p, float *q, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float a = rnd_unit(), b = rnd_unit();
        switch (rnd() % 16) {
        case 0: b = a; break;
        case 1: a = 0.0f; break;
        case 2: a = -0.0f, b = 0.0f; break;
        case 3: a *= 0x1p-130f, b *= 0x1p-130f; break;
        case 4: b = 0.0f; break;
        case 5: a -= 0.5f; break;
        default: break;
        }
        p[i] = a;
        q[i] = b;
    }
}

/* ---- float64 reference --------------------------------------------------- */

typedef struct {
    float *d;      /* d[i] = ref_d(p[i], q[i]) */
    double *cum;   /* cum[k] = sum_{i<k} d[i] in float64, k = 0..n */
    double check;  /* sum of p + q in float64 */
    double check_abs; /* sum of |p + q|, the scale for the check tolerance */
} reference;

static reference ref;

static void compute_ref(const float *p, const float *q, size_t n) {
    double c = 0.0, ca = 0.0;
    ref.cum[0] = 0.0;
    for (size_t i = 0; i < n; i++) {
        ref.d[i] = ref_d(p[i], q[i]);
        ref.cum[i + 1] = ref.cum[i] + (double)ref.d[i];
        double pq = (double)p[i] + (double)q[i];
        c += pq;
        ca += fabs(pq);
    }
    ref.check = c;
    ref.check_abs = ca;
}

/* ---- backends and guarded calls ----------------------------------------- */

typedef struct {
    const char *name;
    fs_backend be;
    size_t chunk; /* scan chunk C of this backend */
    size_t lanes; /* floats per vector: where the masked tail starts */
    int is_asm;
} impl;

static sigjmp_buf fault_jmp;
static volatile sig_atomic_t in_call, fault_sig;

static void on_fault(int sig, siginfo_t *si, void *uc) {
    (void)si;
    (void)uc;
    if (!in_call) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    in_call = 0;
    fault_sig = sig;
    siglongjmp(fault_jmp, 1);
}

static void install_fault_handler(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, NULL);
    sigaction(SIGBUS, &sa, NULL);
}

static void check_abi(void) {
    uint32_t f = checkasm_fail;
    for (unsigned b = 0; b < N_ABI_FAIL; b++)
        if (f & (1u << b)) errf("ABI: %s", abi_fail_names[b]);
}

static void new_canaries(void) {
    for (int i = 0; i < 7; i++) checkasm_canary[i] = rnd();
}

/*
 * Each call_* runs one kernel (through the trampoline for asm), turning a fault
 * into a reported failure. Returns 0 when the call returned, -1 on a fault
 * (the outputs are then not checked).
 */
#define GUARDED(stmt)                                                        \
    do {                                                                     \
        checkasm_fail = 0;                                                   \
        new_canaries();                                                      \
        if (sigsetjmp(fault_jmp, 1)) {                                       \
            errf("fault: signal %d (touched memory outside the buffers?)", \
                 (int)fault_sig);                                            \
            return -1;                                                       \
        }                                                                    \
        in_call = 1;                                                         \
        stmt;                                                                \
        in_call = 0;                                                         \
        check_abi();                                                         \
        return 0;                                                            \
    } while (0)

static int call_store(const impl *im, const float *p, const float *q, float *out,
                      size_t n, float *check, double *ret) {
    checkasm_xmm0_live = 0;
    GUARDED(*ret = im->is_asm ? checkasm_call_store(im->be.store, p, q, out, n, check)
                              : im->be.store(p, q, out, n, check));
}

static int call_sum(const impl *im, const float *p, const float *q, size_t n,
                    float *check, double *ret) {
    checkasm_xmm0_live = 0;
    GUARDED(*ret = im->is_asm ? checkasm_call_sum(im->be.sum, p, q, n, check)
                              : im->be.sum(p, q, n, check));
}

static int call_scale(const impl *im, float *x, size_t n, float s) {
    checkasm_xmm0_live = sizeof(float);
    GUARDED(if (im->is_asm) checkasm_call_scale(im->be.scale, x, n, s);
            else im->be.scale(x, n, s));
}

static int call_scan(const impl *im, const float *p, const float *q, size_t n,
                     double target, double *before, size_t *ret) {
    checkasm_xmm0_live = sizeof(double);
    GUARDED(*ret = im->is_asm ? checkasm_call_scan(im->be.scan, p, q, n, target, before)
                              : im->be.scan(p, q, n, target, before));
}

/* ---- result checks (against `ref`, computed for the same p, q, n) -------- */

static void check_out(const float *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (fbits(out[i]) != fbits(ref.d[i])) {
            errf("out[%zu] = %a (0x%08x), want %a (0x%08x)", i, out[i], fbits(out[i]),
                 ref.d[i], fbits(ref.d[i]));
            return;
        }
}

static void check_sums(size_t n, double sum, float check, const char *what) {
    double want = ref.cum[n];
    if (want == 0.0 ? sum != 0.0 : !(fabs(sum - want) <= SUM_RTOL * want))
        errf("%s: sum %.17g, want %.17g (rel err %.3g)", what, sum, want,
             want ? fabs(sum - want) / want : 0.0);
    if (!(fabs((double)check - ref.check) <= CHECK_RTOL * ref.check_abs + 0x1p-126))
        errf("%s: check %.9g, want %.17g", what, (double)check, ref.check);
}

/* The guard region of a heap buffer: everything in [base, base + cap) but x[0..n). */
static void check_guard(const float *base, size_t cap, const float *x, size_t n,
                        uint32_t pattern, const char *what) {
    size_t lead = (size_t)(x - base);
    size_t i = find_not_bits(base, lead, pattern);
    if (i < lead) errf("%s: wrote %zu floats before the start", what, lead - i);
    const float *tail = x + n;
    size_t tail_n = cap - lead - n;
    i = find_not_bits(tail, tail_n, pattern);
    if (i < tail_n) errf("%s: wrote at index n + %zu, past the end", what, i);
}

static void check_inputs(const float *x, const float *src, size_t n, const char *what) {
    if (memcmp(x, src, n * sizeof *x)) errf("%s: input modified", what);
}

/*
 * Store and sum on the given buffers; out is checked against ref.d. The sum's
 * return value and check come back in *fp_sum / *fp_check (NaN after a fault).
 */
static void run_store_sum(const impl *im, const float *p, const float *q, float *out,
                          size_t n, double *fp_sum, float *fp_check) {
    float c_store = NAN, c_sum = NAN;
    double s_store = NAN, s_sum = NAN;
    int ok_store = call_store(im, p, q, out, n, &c_store, &s_store) == 0;
    if (ok_store) {
        check_out(out, n);
        check_sums(n, s_store, c_store, "store");
    }
    int ok_sum = call_sum(im, p, q, n, &c_sum, &s_sum) == 0;
    if (ok_sum) check_sums(n, s_sum, c_sum, "sum");
    if (ok_store && ok_sum && im->is_asm &&
        (memcmp(&s_store, &s_sum, sizeof s_sum) || fbits(c_store) != fbits(c_sum)))
        errf("store and sum disagree: %a/%a vs %a/%a", s_store, (double)c_store, s_sum,
             (double)c_sum);
    *fp_sum = s_sum;
    *fp_check = c_sum;
}

static void run_scale(const impl *im, float *x, const float *src, size_t n, float s) {
    if (call_scale(im, x, n, s)) return;
    for (size_t i = 0; i < n; i++) {
        float want = src[i] * s;
        if (fbits(x[i]) != fbits(want)) {
            errf("scale: x[%zu] = %a, want %a (x %a, s %a)", i, x[i], want, src[i], s);
            return;
        }
    }
}

static void check_scan_one(const impl *im, const float *p, const float *q, size_t n,
                           double target) {
    double before = NAN;
    size_t i = SIZE_MAX;
    if (call_scan(im, p, q, n, target, &before, &i)) return;
    size_t C = im->chunk;
    double total = ref.cum[n];
    double tol = SUM_RTOL * total + 0x1p-1000;
    if (i > n) {
        errf("scan(target %.17g): index %zu > n", target, i);
        return;
    }
    if (i != n && i % C) errf("scan(target %.17g): index %zu not a chunk start", target, i);
    if (!(fabs(before - ref.cum[i]) <= tol))
        errf("scan(target %.17g): before %.17g, want %.17g at index %zu", target, before,
             ref.cum[i], i);
    if (i == 0 && before != 0.0) errf("scan(target %.17g): before %.17g at 0", target, before);
    if (i > 0 && i < n && !(before <= target))
        errf("scan(target %.17g): before %.17g > target at %zu", target, before, i);
    if (i > 0 && !isnan(target) && !(ref.cum[i] <= target + tol))
        errf("scan(target %.17g): stopped late at %zu, prefix %.17g", target, i, ref.cum[i]);
    if (i < n) {
        size_t e = n - i > C ? i + C : n;
        if (!(ref.cum[e] > target - tol))
            errf("scan(target %.17g): stopped early at %zu, prefix to %zu is %.17g", target, i,
                 e, ref.cum[e]);
    } else if (!isnan(target) && !(total <= target + tol) && n > 0) {
        errf("scan(target %.17g): no crossing found but total %.17g", target, total);
    }
    if (isnan(target) && i != n) errf("scan(NaN target): index %zu, want n", i);
}

static void run_scan(const impl *im, const float *p, const float *q, size_t n) {
    static const double fracs[] = {1e-7, 0.01, 0.3, 0.5, 0.7, 0.99, 1.0 - 1e-7, 1.0, 1.5};
    double total = ref.cum[n];
    check_scan_one(im, p, q, n, -1.0);
    check_scan_one(im, p, q, n, 0.0);
    check_scan_one(im, p, q, n, NAN);
    check_scan_one(im, p, q, n, INFINITY);
    for (size_t k = 0; k < sizeof fracs / sizeof fracs[0]; k++)
        check_scan_one(im, p, q, n, fracs[k] * total);
    if (n) {
        /* Targets sitting exactly on a prefix sum: at a chunk start and anywhere. */
        size_t chunks = (n + im->chunk - 1) / im->chunk;
        check_scan_one(im, p, q, n, ref.cum[(rnd() % chunks) * im->chunk]);
        check_scan_one(im, p, q, n, ref.cum[rnd() % (n + 1)]);
    }
}

/* ---- heap buffers with guards -------------------------------------------- */

typedef struct {
    float *base;
    size_t cap;
} gbuf;

static gbuf gbuf_new(void) {
    gbuf g;
    g.cap = GUARD + MAX_OFF + MAX_N + GUARD;
    g.base = aligned_alloc(64, g.cap * sizeof(float));
    if (!g.base) {
        perror("aligned_alloc");
        exit(2);
    }
    return g;
}

static gbuf gp, gq, gout;
static float *src_p, *src_q;

static void test_heap(const impl *im, size_t n, unsigned off) {
    /* Distinct offsets so that p, q and out are misaligned relative to each other. */
    if (n > MAX_N) abort(); /* tells gcc the copies below are bounded */
    unsigned op = off, oq = (off * 7 + 3) % MAX_OFF, oo = (off * 5 + 11) % MAX_OFF;
    float *p = gp.base + GUARD + op, *q = gq.base + GUARD + oq, *out = gout.base + GUARD + oo;
    size_t fill = n + MAX_OFF + GUARD; /* only what this case can reach */
    fill_bits(gp.base, GUARD + fill, IN_POISON);
    fill_bits(gq.base, GUARD + fill, IN_POISON);
    memcpy(p, src_p, n * sizeof *p);
    memcpy(q, src_q, n * sizeof *q);

    /*
     * Results must not depend on where the data lies: the same values at other
     * addresses give the same bits (an alignment prologue that shifted the lane
     * or block layout with the address of p would break this).
     */
    static double first_sum, first_before;
    static float first_check;
    static size_t first_index;
    double fp_sum = NAN, fp_before = NAN;
    float fp_check = NAN;
    size_t fp_index = SIZE_MAX;

    begin_case("%s store/sum n=%zu off=%u/%u/%u", im->name, n, op, oq, oo);
    fill_bits(gout.base, GUARD + fill, OUT_SENTINEL);
    run_store_sum(im, p, q, out, n, &fp_sum, &fp_check);
    check_guard(gout.base, GUARD + fill, out, n, OUT_SENTINEL, "out");
    check_guard(gp.base, GUARD + fill, p, n, IN_POISON, "p");
    check_guard(gq.base, GUARD + fill, q, n, IN_POISON, "q");
    check_inputs(p, src_p, n, "p");
    check_inputs(q, src_q, n, "q");
    end_case();

    begin_case("%s scan n=%zu off=%u/%u", im->name, n, op, oq);
    run_scan(im, p, q, n);
    end_case();

    begin_case("%s address independence n=%zu off=%u/%u", im->name, n, op, oq);
    call_scan(im, p, q, n, 0.5 * ref.cum[n], &fp_before, &fp_index);
    if (off == 0) {
        first_sum = fp_sum, first_check = fp_check;
        first_before = fp_before, first_index = fp_index;
    } else if (memcmp(&fp_sum, &first_sum, sizeof fp_sum) ||
               fbits(fp_check) != fbits(first_check) || fp_index != first_index ||
               memcmp(&fp_before, &first_before, sizeof fp_before)) {
        errf("results differ from offset 0: sum %a vs %a, check %a vs %a, scan %zu/%a vs "
             "%zu/%a", fp_sum, first_sum, (double)fp_check, (double)first_check, fp_index,
             fp_before, first_index, first_before);
    }
    end_case();

    /* Scale in place on a copy of p, with a scale chosen per case. */
    static const float scales[] = {0.5f, 3.0f, 1.0f / 3.0f, 0x1p-100f, 7.25e3f, -1.5f};
    float s = scales[(n + off) % (sizeof scales / sizeof scales[0])];
    begin_case("%s scale n=%zu off=%u s=%a", im->name, n, oo, s);
    fill_bits(gout.base, GUARD + fill, OUT_SENTINEL);
    memcpy(out, src_p, n * sizeof *out);
    run_scale(im, out, src_p, n, s);
    check_guard(gout.base, GUARD + fill, out, n, OUT_SENTINEL, "x");
    end_case();
}

/* ---- page-boundary buffers ----------------------------------------------- */

typedef struct {
    char *lo, *hi; /* the accessible bytes, each side followed by a PROT_NONE page */
} pbuf;

static pbuf pbuf_new(size_t bytes) {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    size_t data = (bytes + pg - 1) / pg * pg;
    char *m = mmap(NULL, data + 2 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (m == MAP_FAILED || mprotect(m, pg, PROT_NONE) ||
        mprotect(m + pg + data, pg, PROT_NONE)) {
        perror("mmap/mprotect");
        exit(2);
    }
    return (pbuf){m + pg, m + pg + data};
}

static pbuf pp, pq, pout;

static void test_pages(const impl *im, size_t n) {
    for (int at_end = 0; at_end <= 1; at_end++) {
        const char *where = at_end ? "ending at a PROT_NONE page" : "after a PROT_NONE page";
        float *p = at_end ? (float *)pp.hi - n : (float *)pp.lo;
        float *q = at_end ? (float *)pq.hi - n : (float *)pq.lo;
        float *out = at_end ? (float *)pout.hi - n : (float *)pout.lo;
        memcpy(p, src_p, n * sizeof *p);
        memcpy(q, src_q, n * sizeof *q);

        double fp_sum;
        float fp_check;
        begin_case("%s store/sum n=%zu %s", im->name, n, where);
        run_store_sum(im, p, q, out, n, &fp_sum, &fp_check);
        end_case();

        begin_case("%s scan n=%zu %s", im->name, n, where);
        check_scan_one(im, p, q, n, 0.5 * ref.cum[n]);
        check_scan_one(im, p, q, n, INFINITY);
        end_case();

        begin_case("%s scale n=%zu %s", im->name, n, where);
        memcpy(out, src_p, n * sizeof *out);
        run_scale(im, out, src_p, n, 0.75f);
        end_case();
    }
}

/* ---- non-finite input ---------------------------------------------------- */

static void test_nonfinite(const impl *im) {
    size_t lanes = im->lanes;
    static const size_t sizes[] = {1,  2,  3,  7,   8,   9,   15,   16,   17,   31,   32,
                                   33, 63, 64, 65,  100, 255, 256,  4095, 4096, 4097, 32000};
    const float bad[] = {NAN, INFINITY, -INFINITY};
    const char *bad_name[] = {"NaN", "+inf", "-inf"};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t n = sizes[si];
        /* first, middle, last, and the first lane after the last full vector */
        size_t pos[] = {0, n / 2, n - 1, n - n % lanes < n ? n - n % lanes : n - 1};
        gen_inputs(src_p, src_q, n);
        for (size_t pi = 0; pi < 4; pi++)
            for (int side = 0; side < 2; side++)
                for (int b = 0; b < 3; b++) {
                    unsigned off = (unsigned)(pi * 3 + side + b) % MAX_OFF;
                    float *p = gp.base + GUARD + off, *q = gq.base + GUARD + off;
                    float *out = gout.base + GUARD + (off + 5) % MAX_OFF;
                    size_t fill = n + MAX_OFF + GUARD;
                    fill_bits(gp.base, GUARD + fill, IN_POISON);
                    fill_bits(gq.base, GUARD + fill, IN_POISON);
                    fill_bits(gout.base, GUARD + fill, OUT_SENTINEL);
                    memcpy(p, src_p, n * sizeof *p);
                    memcpy(q, src_q, n * sizeof *q);
                    (side ? q : p)[pos[pi]] = bad[b];
                    compute_ref(p, q, n);
                    begin_case("%s non-finite n=%zu %s=%s at %zu", im->name, n,
                               side ? "q" : "p", bad_name[b], pos[pi]);
                    float c = 0.0f;
                    double s;
                    if (call_store(im, p, q, out, n, &c, &s) == 0) {
                        if (isfinite(c)) errf("store: check %g is finite", (double)c);
                        check_out(out, n);
                    }
                    check_guard(gout.base, GUARD + fill, out, n, OUT_SENTINEL, "out");
                    c = 0.0f;
                    if (call_sum(im, p, q, n, &c, &s) == 0 && isfinite(c))
                        errf("sum: check %g is finite", (double)c);
                    end_case();
                }
    }
}

/* ---- benchmark ----------------------------------------------------------- */

/*
 * The naive strict-order loops: one float64 running sum, one float check.
 * BRANCHLESS picks how max(d, 0) is computed: gcc -O2 turns the plain C
 * `d > 0 ? d : 0` into a compare and a branch, which random data mispredicts
 * about half the time once the pattern is too long for the predictor to learn
 * (n > ~8K here), so that version ("naive-br") mostly measures mispredictions.
 * The baseline for speed-ups ("naive") uses maxss and is bound only by the
 * strict-order add chain.
 */
static inline float naive_d(float p, float q, int branchless) {
    if (branchless) return _mm_cvtss_f32(_mm_max_ss(_mm_set_ss(p - q), _mm_setzero_ps()));
    return ref_d(p, q);
}

static inline double naive_store_impl(const float *p, const float *q, float *out, size_t n,
                                      float *check, int branchless) {
    double s = 0.0;
    float c = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float d = naive_d(p[i], q[i], branchless);
        out[i] = d;
        s += d;
        c += p[i] + q[i];
    }
    *check = c;
    return s;
}

static inline double naive_sum_impl(const float *p, const float *q, size_t n, float *check,
                                    int branchless) {
    double s = 0.0;
    float c = 0.0f;
    for (size_t i = 0; i < n; i++) {
        s += naive_d(p[i], q[i], branchless);
        c += p[i] + q[i];
    }
    *check = c;
    return s;
}

static void naive_scale(float *x, size_t n, float s) {
    for (size_t i = 0; i < n; i++) x[i] *= s;
}

static inline size_t naive_scan_impl(const float *p, const float *q, size_t n, double target,
                                     double *before, int branchless) {
    double run = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = naive_d(p[i], q[i], branchless);
        if (run + d > target) {
            *before = run;
            return i;
        }
        run += d;
    }
    *before = run;
    return n;
}

static double naive_store(const float *p, const float *q, float *out, size_t n, float *check) {
    return naive_store_impl(p, q, out, n, check, 1);
}
static double naive_sum(const float *p, const float *q, size_t n, float *check) {
    return naive_sum_impl(p, q, n, check, 1);
}
static size_t naive_scan(const float *p, const float *q, size_t n, double target,
                         double *before) {
    return naive_scan_impl(p, q, n, target, before, 1);
}
static double naive_br_store(const float *p, const float *q, float *out, size_t n,
                             float *check) {
    return naive_store_impl(p, q, out, n, check, 0);
}
static double naive_br_sum(const float *p, const float *q, size_t n, float *check) {
    return naive_sum_impl(p, q, n, check, 0);
}
static size_t naive_br_scan(const float *p, const float *q, size_t n, double target,
                            double *before) {
    return naive_scan_impl(p, q, n, target, before, 0);
}

/* A C AVX2-intrinsics version with 4 accumulators per quantity, same blocking. */
#define IV 8
__attribute__((target("avx2"))) static double fold_ps(__m256 a) {
    __m256d w = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(a)),
                              _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(w), _mm256_extractf128_pd(w, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

__attribute__((target("avx2"))) static float hsum_ps(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/*
 * One vector of the intrinsics pass, written so that each loaded register dies
 * at once: with 4 + 4 accumulators and a zero live, gcc then keeps everything in
 * the 16 ymm registers instead of spilling accumulators to the stack.
 */
#define INTRIN_VEC(k, a, c)                                                     \
    do {                                                                        \
        __m256 pk = _mm256_loadu_ps(p + i + (k) * IV);                          \
        __m256 qk = _mm256_loadu_ps(q + i + (k) * IV);                          \
        __m256 dk = _mm256_max_ps(_mm256_sub_ps(pk, qk), z);                    \
        if (STORE) _mm256_storeu_ps(out + i + (k) * IV, dk);                    \
        a = _mm256_add_ps(a, dk);                                               \
        c = _mm256_add_ps(c, _mm256_add_ps(pk, qk));                            \
    } while (0)

#define INTRIN_PASS_BODY                                                        \
    const __m256 z = _mm256_setzero_ps();                                       \
    __m256 c0 = z, c1 = z, c2 = z, c3 = z;                                      \
    double total = 0.0;                                                         \
    float tail_c = 0.0f;                                                        \
    size_t i = 0;                                                               \
    while (i < n) {                                                             \
        size_t end = n - i > FS_BLOCK ? i + FS_BLOCK : n;                       \
        __m256 a0 = z, a1 = z, a2 = z, a3 = z;                                  \
        for (; i + 4 * IV <= end; i += 4 * IV) {                                \
            INTRIN_VEC(0, a0, c0);                                              \
            INTRIN_VEC(1, a1, c1);                                              \
            INTRIN_VEC(2, a2, c2);                                              \
            INTRIN_VEC(3, a3, c3);                                              \
        }                                                                       \
        double t = fold_ps(a0) + fold_ps(a1) + fold_ps(a2) + fold_ps(a3);       \
        for (; i < end; i++) {                                                  \
            float d = ref_d(p[i], q[i]);                                        \
            if (STORE) out[i] = d;                                              \
            t += d;                                                             \
            tail_c += p[i] + q[i];                                              \
        }                                                                       \
        total += t;                                                             \
    }                                                                           \
    *check = hsum_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3))) + tail_c; \
    return total;

__attribute__((target("avx2"))) static double intrin_store(const float *p, const float *q,
                                                          float *out, size_t n,
                                                          float *check) {
#define STORE 1
    INTRIN_PASS_BODY
#undef STORE
}

__attribute__((target("avx2"))) static double intrin_sum(const float *p, const float *q,
                                                        size_t n, float *check) {
#define STORE 0
    float *out = NULL;
    INTRIN_PASS_BODY
#undef STORE
}

__attribute__((target("avx2"))) static void intrin_scale(float *x, size_t n, float s) {
    __m256 v = _mm256_set1_ps(s);
    size_t i = 0;
    for (; i + 4 * IV <= n; i += 4 * IV) {
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), v));
        _mm256_storeu_ps(x + i + IV, _mm256_mul_ps(_mm256_loadu_ps(x + i + IV), v));
        _mm256_storeu_ps(x + i + 2 * IV, _mm256_mul_ps(_mm256_loadu_ps(x + i + 2 * IV), v));
        _mm256_storeu_ps(x + i + 3 * IV, _mm256_mul_ps(_mm256_loadu_ps(x + i + 3 * IV), v));
    }
    for (; i < n; i++) x[i] *= s;
}

__attribute__((target("avx2"))) static size_t intrin_scan(const float *p, const float *q,
                                                         size_t n, double target,
                                                         double *before) {
    const __m256 z = _mm256_setzero_ps();
    double run = 0.0;
    size_t i = 0;
    for (; i + 4 * IV <= n; i += 4 * IV) {
        __m256 d0 = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(q + i)), z);
        __m256 d1 = _mm256_max_ps(
            _mm256_sub_ps(_mm256_loadu_ps(p + i + IV), _mm256_loadu_ps(q + i + IV)), z);
        __m256 d2 = _mm256_max_ps(
            _mm256_sub_ps(_mm256_loadu_ps(p + i + 2 * IV), _mm256_loadu_ps(q + i + 2 * IV)), z);
        __m256 d3 = _mm256_max_ps(
            _mm256_sub_ps(_mm256_loadu_ps(p + i + 3 * IV), _mm256_loadu_ps(q + i + 3 * IV)), z);
        double c = hsum_ps(_mm256_add_ps(_mm256_add_ps(d0, d1), _mm256_add_ps(d2, d3)));
        if (run + c > target) {
            *before = run;
            return i;
        }
        run += c;
    }
    double c = 0.0;
    for (size_t j = i; j < n; j++) c += ref_d(p[j], q[j]);
    if (i < n && run + c > target) {
        *before = run;
        return i;
    }
    *before = run + c;
    return n;
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#define BENCH_BATCHES 101
#define BENCH_BATCH_FLOATS 200000 /* calls per batch ~ this / n, at least 1 */

enum { OP_STORE, OP_SCALE, OP_SUM, OP_SCAN, OP_STORE_SCALE, OP_SUM_SCAN, N_OPS };
static const char *const op_names[] = {"store", "scale", "sum", "scan", "store+scale",
                                       "sum+scan"};

static volatile double bench_sink;

/* Median over batches of the ns one call (or call pair) of `op` takes. */
static double bench_op(const fs_backend *be, int op, const float *p, const float *q,
                       float *out, size_t n) {
    size_t reps = BENCH_BATCH_FLOATS / n ? BENCH_BATCH_FLOATS / n : 1;
    double t[BENCH_BATCHES];
    float c;
    double before, target = 0.5 * be->sum(p, q, n, &c);
    be->store(p, q, out, n, &c);
    for (int b = 0; b < BENCH_BATCHES; b++) {
        double acc = 0.0, t0 = now_ns();
        for (size_t r = 0; r < reps; r++) {
            switch (op) {
            case OP_STORE: acc += be->store(p, q, out, n, &c); break;
            case OP_SCALE: be->scale(out, n, 1.0f); break;
            case OP_SUM: acc += be->sum(p, q, n, &c); break;
            case OP_SCAN: acc += (double)be->scan(p, q, n, target, &before); break;
            case OP_STORE_SCALE: {
                double s = be->store(p, q, out, n, &c);
                be->scale(out, n, (float)(1.0 / s));
                acc += s;
                break;
            }
            case OP_SUM_SCAN: {
                double s = be->sum(p, q, n, &c);
                acc += (double)be->scan(p, q, n, 0.5 * s, &before);
                break;
            }
            }
        }
        t[b] = (now_ns() - t0) / (double)reps;
        bench_sink = acc;
    }
    qsort(t, BENCH_BATCHES, sizeof t[0], cmp_double);
    return t[BENCH_BATCHES / 2];
}

static void bench(const impl *impls, size_t n_impls) {
    static const size_t sizes[] = {1024, 32000, 128256};
    fs_backend naive = {"naive", naive_store, naive_sum, naive_scale, naive_scan};
    fs_backend naive_br = {"naive-br", naive_br_store, naive_br_sum, naive_scale, naive_br_scan};
    fs_backend intrin = {"c-avx2x4", intrin_store, intrin_sum, intrin_scale, intrin_scan};
    const fs_backend *bes[8];
    size_t nb = 0;
    bes[nb++] = &naive;
    bes[nb++] = &naive_br;
    if (__builtin_cpu_supports("avx2")) bes[nb++] = &intrin;
    for (size_t k = 0; k < n_impls; k++) bes[nb++] = &impls[k].be;

    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t n = sizes[si];
        float *p = gp.base + GUARD, *q = gq.base + GUARD, *out = gout.base + GUARD;
        rng_seed(n);
        for (size_t i = 0; i < n; i++) {
            p[i] = rnd_unit() / (float)n;
            q[i] = rnd_unit() / (float)n;
        }
        printf("n = %zu: median ns per call (speed-up vs naive)\n", n);
        printf("  %-10s", "backend");
        for (int op = 0; op < N_OPS; op++) printf(" %18s", op_names[op]);
        printf("\n");
        double base[N_OPS];
        for (size_t b = 0; b < nb; b++) {
            printf("  %-10s", bes[b]->name);
            for (int op = 0; op < N_OPS; op++) {
                double ns = bench_op(bes[b], op, p, q, out, n);
                if (b == 0) base[op] = ns;
                printf(" %10.0f (%5.1fx)", ns, base[op] / ns);
            }
            printf("\n");
            fflush(stdout);
        }
    }
}

/* ---- main ---------------------------------------------------------------- */

static int xgetbv_xinuse_supported(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(0xD, 1, &a, &b, &c, &d)) return 0;
    return (a >> 2) & 1; /* CPUID.(0DH,1):EAX[2]: XGETBV with ECX = 1 */
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
            fprintf(stderr, "usage: %s [--seed N | N] [--only NAME] [--bench] [--verbose]\n",
                    argv[0]);
            return 2;
        }
    }

    __builtin_cpu_init();
    int have_avx2 = __builtin_cpu_supports("avx2");
    int have_avx512 = __builtin_cpu_supports("avx512f");
    checkasm_have_avx512 = (uint32_t)have_avx512;
    checkasm_check_xinuse = (uint32_t)(have_avx2 && xgetbv_xinuse_supported());

    impl all[] = {
        {"scalar", {"scalar", fs_residual_store_scalar, fs_residual_sum_scalar,
                    fs_scale_scalar, fs_scan_scalar}, 64, 8, 0},
        {"avx2", {"avx2", fs_residual_store_avx2, fs_residual_sum_avx2, fs_scale_avx2,
                  fs_scan_avx2}, 32, 8, 1},
        {"avx512", {"avx512", fs_residual_store_avx512, fs_residual_sum_avx512,
                    fs_scale_avx512, fs_scan_avx512}, 64, 16, 1},
    };
    int supported[] = {1, have_avx2, have_avx512};
    impl impls[3];
    size_t n_impls = 0;
    for (size_t k = 0; k < 3; k++) {
        if (!supported[k]) {
            printf("checkasm: %s not supported by this CPU, skipped\n", all[k].name);
            continue;
        }
        if (only && strcmp(only, all[k].name)) continue;
        impls[n_impls++] = all[k];
    }

    gp = gbuf_new();
    gq = gbuf_new();
    gout = gbuf_new();
    src_p = malloc(MAX_N * sizeof *src_p);
    src_q = malloc(MAX_N * sizeof *src_q);
    ref.d = malloc(MAX_N * sizeof *ref.d);
    ref.cum = malloc((MAX_N + 1) * sizeof *ref.cum);
    if (!src_p || !src_q || !ref.d || !ref.cum) {
        perror("malloc");
        return 2;
    }

    if (do_bench) {
        bench(impls, n_impls);
        return 0;
    }

    printf("checkasm: seed %" PRIu64 "%s%s\n", seed, only ? ", only " : "", only ? only : "");
    printf("checkasm: testing");
    for (size_t k = 0; k < n_impls; k++) printf(" %s", impls[k].name);
    printf(" (xinuse check %s)\n", checkasm_check_xinuse ? "on" : "off");
    rng_seed(seed);
    install_fault_handler();
    pp = pbuf_new(MAX_N * sizeof(float));
    pq = pbuf_new(MAX_N * sizeof(float));
    pout = pbuf_new(MAX_N * sizeof(float));

    size_t sizes[SMALL_N_MAX + 1 + N_BIG];
    size_t n_sizes = 0;
    for (size_t n = 0; n <= SMALL_N_MAX; n++) sizes[n_sizes++] = n;
    for (size_t k = 0; k < N_BIG; k++) sizes[n_sizes++] = big_sizes[k];

    for (size_t si = 0; si < n_sizes; si++) {
        size_t n = sizes[si];
        gen_inputs(src_p, src_q, n);
        compute_ref(src_p, src_q, n);
        unsigned long before = n_fail;
        for (size_t k = 0; k < n_impls; k++) {
            for (unsigned off = 0; off < MAX_OFF; off++) test_heap(&impls[k], n, off);
            test_pages(&impls[k], n);
        }
        if (verbose || n_fail != before)
            printf("checkasm: n=%zu done, %lu failed so far\n", n, n_fail);
    }
    for (size_t k = 0; k < n_impls; k++)
        test_nonfinite(&impls[k]);

    printf("checkasm: %lu passed, %lu failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
