/*
 * harness.h - what the checkasm-style harnesses share (tests/kernels/abi/checkasm.c for the residual
 * kernels, tests/kernels/abi/checkquant.c for the quantized matmuls): the ABI trampoline's state
 * (trampoline.asm), per-case failure reporting, a seeded xoshiro256** generator, and float
 * bit views. Header-only, included once by each harness after it defines HARNESS_NAME (the
 * prefix of its messages) and MAX_REPORTS (failures printed in full).
 */
#ifndef FLASHSPEC_ABI_HARNESS_H
#define FLASHSPEC_ABI_HARNESS_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifndef HARNESS_NAME
#error "define HARNESS_NAME (the harness's name in its messages) before including harness.h"
#endif
#ifndef MAX_REPORTS
#error "define MAX_REPORTS before including harness.h"
#endif

/* ---- trampoline.asm ------------------------------------------------------- */

extern uint64_t checkasm_canary[7];
extern uint32_t checkasm_fail;
extern uint32_t checkasm_xmm0_live;
extern uint32_t checkasm_check_xinuse;
extern uint32_t checkasm_have_avx512;

/* Bits of checkasm_fail, as trampoline.asm sets them. */
static const char *const abi_fail_names[] = {
    "rbx clobbered", "rbp clobbered", "r12 clobbered", "r13 clobbered",
    "r14 clobbered", "r15 clobbered", "rsp not restored", "direction flag left set",
    "upper ymm/zmm state dirty (missing vzeroupper)", "MXCSR changed",
};
#define N_ABI_FAIL (sizeof abi_fail_names / sizeof abi_fail_names[0])

/* ---- reporting ----------------------------------------------------------- */

static unsigned long n_pass, n_fail, n_reports;
static unsigned case_errors;
static char case_name[200];
static int verbose;

static void begin_case(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(case_name, sizeof case_name, fmt, ap);
    va_end(ap);
    case_errors = 0;
}

static void end_case(void) {
    if (case_errors)
        n_fail++;
    else
        n_pass++;
}

static void errf(const char *fmt, ...) {
    case_errors++;
    if (++n_reports > MAX_REPORTS) {
        if (n_reports == MAX_REPORTS + 1) fprintf(stderr, HARNESS_NAME ": (further failures not shown)\n");
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL %s: ", case_name);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* ---- RNG: xoshiro256**, seeded with splitmix64 --------------------------- */

static uint64_t rng_s[4];

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void rng_seed(uint64_t seed) {
    for (int i = 0; i < 4; i++) rng_s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rnd(void) {
    uint64_t r = rotl(rng_s[1] * 5, 7) * 9, t = rng_s[1] << 17;
    rng_s[2] ^= rng_s[0];
    rng_s[3] ^= rng_s[1];
    rng_s[1] ^= rng_s[2];
    rng_s[0] ^= rng_s[3];
    rng_s[2] ^= t;
    rng_s[3] = rotl(rng_s[3], 45);
    return r;
}

/* ---- bits and floats ----------------------------------------------------- */

static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bitsf(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#endif
