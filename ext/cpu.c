/*
 * cpu.c - run-time ISA detection, done once at module init.
 *
 * A CPUID feature bit alone is not enough: the OS must also have enabled saving
 * of the wider register state (XCR0), or the first AVX instruction faults / the
 * upper halves are silently lost across context switches. So AVX2 needs
 * OSXSAVE + AVX + XCR0[2:1] and AVX-512 additionally XCR0[7:5].
 */
#include "kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>

#define LEAF_FEATURES 1u
#define LEAF_EXT_FEATURES 7u
#define ECX1_OSXSAVE (1u << 27)
#define ECX1_AVX (1u << 28)
#define EBX7_AVX2 (1u << 5)
#define EBX7_AVX512F (1u << 16)
#define ECX1_FMA (1u << 12)
#define ECX1_F16C (1u << 29)
#define EBX7_AVX512BW (1u << 30)
#define EBX7_AVX512VL (1u << 31)
/* XCR0 bits: 1 = SSE (XMM), 2 = AVX (YMM upper), 5..7 = opmask, ZMM0-15 upper, ZMM16-31. */
#define XCR0_YMM_MASK 0x6u
#define XCR0_ZMM_MASK 0xE6u

static unsigned long long read_xcr0(void) {
    unsigned eax, edx;
    /* "=A" would mean rdx:rax as one 128-bit pair on x86-64: read the halves apart. */
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}

void fs_cpu_detect(fs_cpu *c) {
    unsigned a, b, cx, d;
    *c = (fs_cpu){0};
    c->max_leaf = __get_cpuid_max(0, 0);
    if (c->max_leaf < LEAF_FEATURES) return;
    __cpuid(LEAF_FEATURES, a, b, cx, d);
    c->osxsave = (cx & ECX1_OSXSAVE) != 0;
    c->avx = (cx & ECX1_AVX) != 0;
    c->fma = (cx & ECX1_FMA) != 0;
    c->f16c = (cx & ECX1_F16C) != 0;
    if (c->osxsave) {
        unsigned long long xcr0 = read_xcr0();
        c->ymm_state = (xcr0 & XCR0_YMM_MASK) == XCR0_YMM_MASK;
        c->zmm_state = (xcr0 & XCR0_ZMM_MASK) == XCR0_ZMM_MASK;
    }
    if (c->max_leaf < LEAF_EXT_FEATURES) return;
    __cpuid_count(LEAF_EXT_FEATURES, 0, a, b, cx, d);
    c->avx2 = (b & EBX7_AVX2) != 0;
    c->avx512f = (b & EBX7_AVX512F) != 0;
    c->avx512bw = (b & EBX7_AVX512BW) != 0;
    c->avx512vl = (b & EBX7_AVX512VL) != 0;
}

#else

void fs_cpu_detect(fs_cpu *c) { *c = (fs_cpu){0}; }

#endif

int fs_cpu_has_avx2(const fs_cpu *c) {
    return c->osxsave && c->avx && c->ymm_state && c->avx2;
}

int fs_cpu_has_avx512(const fs_cpu *c) {
    return fs_cpu_has_avx2(c) && c->zmm_state && c->avx512f;
}
