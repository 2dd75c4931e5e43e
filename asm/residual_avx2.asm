; residual_avx2.asm - AVX2 kernels for the residual pass (see ext/kernels.h).
;
; Build: nasm -f elf64 -I asm/ asm/residual_avx2.asm -o residual_avx2.o
;
; ISA: AVX and AVX2 only (VEX encodings, ymm0-15); no FMA, no AVX-512. AVX2
; proper is needed only for vbroadcastss from a register (fs_scale_avx2); the
; rest is AVX.
;
; ABI: System V AMD64. All pointers may be unaligned (4-byte aligned floats).
; Nothing outside [ptr, ptr + n) is read or written: the tail of every loop is
; one vmaskmovps load/store, whose masked-off lanes never fault. Only
; caller-saved registers are used (rax, rcx, rdx, rsi, rdi, r8-r11, all vector
; registers), so nothing is saved or restored and there is no stack frame. Each
; function ends with vzeroupper.
;
;   double fs_residual_store_avx2(const float *p  rdi, const float *q  rsi,
;                                 float *out rdx, size_t n  rcx,
;                                 float *check r8)            -> xmm0
;   double fs_residual_sum_avx2  (const float *p  rdi, const float *q  rsi,
;                                 size_t n  rdx, float *check rcx)
;                                                              -> xmm0
;   void   fs_scale_avx2         (float *x rdi, size_t n rsi, float s xmm0)
;   size_t fs_scan_avx2          (const float *p  rdi, const float *q  rsi,
;                                 size_t n rdx, double target xmm0,
;                                 double *before rcx)         -> rax
;
; Resolved details of the contract (kept identical in ext/residual.c):
;  - d = vmaxps(p - q, +0.0) with the zero as the SECOND source, which returns
;    +0.0 when p - q is NaN or -0.0: bit-identical to C `d > 0.0f ? d : 0.0f`.
;    Non-finite input is reported through *check, never through d.
;  - scale computes x * s with x as the first source, like C `x[i] *= s`.
;  - The store and sum kernels perform the same additions in the same order, so
;    for equal input they return bit-identical sums and checks.
;  - Sums, checks and scan results depend on the values only, never on the
;    addresses: the residual and scan loops load p and q unaligned instead of
;    starting with an alignment prologue, which would shift the lane and block
;    layout (and so the rounding) with the address of p. Only fs_scale, whose
;    elements are independent, aligns its pointer first.
;  - Blocked sum: 4 accumulators x 8 lanes = 32 float32 lanes; each lane adds at
;    most FS_BLOCK / 32 = 128 terms before all 32 lanes are converted exactly to
;    float64 and added to a 4-lane float64 running sum, reduced at the very end.
;  - *check is the float32 sum of p + q over 32 lanes, never blocked.
;  - scan uses chunks of SCAN_CHUNK = 32 floats (4 ymm). Each chunk sum is a
;    float32 reduction; the running sum is a float64 scalar. The last chunk may
;    be short (n % 32 floats). With n == 0, or when no chunk crosses (also when
;    target is NaN), returns n and stores the whole running sum.
;
; Register plan, fs_residual_store_avx2 / fs_residual_sum_avx2
; (sum moves its n and check arguments to match store's plan):
;   rdi  p, advancing          rsi  q, advancing       rdx  out, advancing (store)
;   r8   check pointer         r9   floats after the current block
;   r10  floats of the current block left for the single-vector/masked tail
;   r11  unrolled iterations left in the block; later the tail-mask window
;   rax  negated tail length (indexes the mask window)
;   ymm0/ymm3 p, then p + q    ymm1/ymm4 q    ymm2/ymm5 d  (two sets, alternating
;             between the unrolled vectors; renaming keeps them independent)
;   ymm6-9   d float32 accumulators (block-local)
;   ymm10-13 p + q float32 accumulators (the check)
;   ymm14    +0.0              ymm15 float64 running sum (4 lanes)
;   ymm3     tail mask (in the masked tail only)
;
; Register plan, fs_scale_avx2:
;   rdi  x, advancing   rsi  floats left (after the prologue, for the tail)
;   rax  floats in the alignment prologue, then iterations left, then the
;   negated tail length   rcx  negated prologue length   r11  tail-mask window
;   ymm0  s broadcast   ymm1-4  x * s   ymm5  prologue/tail mask
;
; Register plan, fs_scan_avx2:
;   rdi  p   rsi  q   rdx  n   rcx  before pointer   rax  start of current chunk
;   r8   end of the last full chunk   r9  floats in the short last chunk
;   r10/r11  p/q pointers in that chunk; then r11 the tail-mask window, r9 negated
;   ymm0-3  p -> d (ymm0: chunk sum -> xmm0 float32 -> float64)   ymm8-11  q
;   ymm1 reduction temporary   xmm4 float64 running sum   xmm5 target
;   xmm6 running sum after this chunk   ymm7 tail mask   ymm14 +0.0

%include "macros.inc"

default rel

%define VEC_FLOATS      8                           ; floats in a ymm register
%define VEC_BYTES       (VEC_FLOATS * FLOAT_BYTES)
%define UNROLL          4                           ; vectors per loop iteration
%define STEP_FLOATS     (VEC_FLOATS * UNROLL)
%define STEP_BYTES      (STEP_FLOATS * FLOAT_BYTES)
%define LOG2_STEP       5                           ; log2(STEP_FLOATS)
%define SCAN_CHUNK      32                          ; floats per scan chunk

%if (1 << LOG2_STEP) != STEP_FLOATS
%error LOG2_STEP does not match STEP_FLOATS
%endif
%if FS_BLOCK % STEP_FLOATS
%error FS_BLOCK must be a multiple of STEP_FLOATS: only the last block may have a tail
%endif
%if SCAN_CHUNK != UNROLL * VEC_FLOATS
%error the scan loop loads exactly UNROLL vectors per chunk
%endif

section .rodata
align CACHE_LINE
; A sliding window of lane masks: the VEC_FLOATS dwords starting r dwords
; before mask_window_mid are r all-ones lanes followed by zero lanes, i.e. the
; vmaskmovps mask for the first r lanes (0 <= r <= VEC_FLOATS).
mask_window:
    times VEC_FLOATS dd -1
mask_window_mid:
    times VEC_FLOATS dd 0

section .text

; TAIL_MASK ymmdst, negcount: ymm<dst> = vmaskmovps mask for the first r lanes,
; where the register negcount holds -r; clobbers r11.
%macro TAIL_MASK 2
    lea             r11, [mask_window_mid]
    vmovups         ymm%1, [r11 + %2 * FLOAT_BYTES]
%endmacro

; HSUM_PS a, t: xmm<a>[0] = sum of the 8 floats of ymm<a>; ymm<t> clobbered.
%macro HSUM_PS 2
    vextractf128    xmm%2, ymm%1, HIGH_HALF
    vaddps          xmm%1, xmm%1, xmm%2
    vmovhlps        xmm%2, xmm%1, xmm%1
    vaddps          xmm%1, xmm%1, xmm%2
    vmovshdup       xmm%2, xmm%1
    vaddss          xmm%1, xmm%1, xmm%2
%endmacro

; FOLD acc: add the 8 float32 lanes of ymm<acc>, each converted exactly, to the
; float64 running sum ymm15, and restart ymm<acc> at 0. Clobbers ymm0, ymm1.
%macro FOLD 1
    vcvtps2pd       ymm0, xmm%1
    vextractf128    xmm1, ymm%1, HIGH_HALF
    vcvtps2pd       ymm1, xmm1
    vaddpd          ymm15, ymm15, ymm0
    vaddpd          ymm15, ymm15, ymm1
    vxorps          ymm%1, ymm%1, ymm%1
%endmacro

; RESIDUAL_VEC store, off, P, Q, D, DACC, CACC [, MASK]
; One vector of the residual pass at byte offset off from rdi/rsi/rdx:
; D = max(P - Q, 0), CACC += P + Q, DACC += D, and out = D when store is 1.
; With a mask register the loads zero and the store skips the masked-off lanes,
; which then add +0.0 to both sums.
%macro RESIDUAL_VEC 7-8
%if %0 == 8
    vmaskmovps      ymm%3, ymm%8, [rdi + %2]
    vmaskmovps      ymm%4, ymm%8, [rsi + %2]
%else
    vmovups         ymm%3, [rdi + %2]
    vmovups         ymm%4, [rsi + %2]
%endif
    vsubps          ymm%5, ymm%3, ymm%4
    vaddps          ymm%3, ymm%3, ymm%4
    vmaxps          ymm%5, ymm%5, ymm14
%if %1
%if %0 == 8
    vmaskmovps      [rdx + %2], ymm%8, ymm%5
%else
    vmovups         [rdx + %2], ymm%5
%endif
%endif
    vaddps          ymm%6, ymm%6, ymm%5
    vaddps          ymm%7, ymm%7, ymm%3
%endmacro

; RESIDUAL_BODY store: the whole store (1) or sum (0) kernel after the argument
; shuffle, following the register plan at the top of the file.
%macro RESIDUAL_BODY 1
    vxorps          xmm14, xmm14, xmm14     ; VEX: clears the whole register
    vxorps          xmm6, xmm6, xmm6
    vxorps          xmm7, xmm7, xmm7
    vxorps          xmm8, xmm8, xmm8
    vxorps          xmm9, xmm9, xmm9
    vxorps          xmm10, xmm10, xmm10
    vxorps          xmm11, xmm11, xmm11
    vxorps          xmm12, xmm12, xmm12
    vxorps          xmm13, xmm13, xmm13
    vxorps          xmm15, xmm15, xmm15

.block:
    mov             r10, FS_BLOCK
    cmp             r9, r10
    cmovb           r10, r9                 ; this block: min(left, FS_BLOCK)
    sub             r9, r10
    mov             r11, r10
    shr             r11, LOG2_STEP
    and             r10, STEP_FLOATS - 1    ; nonzero only in the last block
    test            r11, r11
    jz              .rest

    align LOOP_ALIGN
.unrolled:
    RESIDUAL_VEC    %1, 0 * VEC_BYTES, 0, 1, 2, 6, 10
    RESIDUAL_VEC    %1, 1 * VEC_BYTES, 3, 4, 5, 7, 11
    RESIDUAL_VEC    %1, 2 * VEC_BYTES, 0, 1, 2, 8, 12
    RESIDUAL_VEC    %1, 3 * VEC_BYTES, 3, 4, 5, 9, 13
    add             rdi, STEP_BYTES
    add             rsi, STEP_BYTES
%if %1
    add             rdx, STEP_BYTES
%endif
    dec             r11
    jnz             .unrolled

.rest:
    cmp             r10, VEC_FLOATS
    jb              .masked
.single:
    RESIDUAL_VEC    %1, 0, 0, 1, 2, 6, 10
    add             rdi, VEC_BYTES
    add             rsi, VEC_BYTES
%if %1
    add             rdx, VEC_BYTES
%endif
    sub             r10, VEC_FLOATS
    cmp             r10, VEC_FLOATS
    jae             .single

.masked:
    test            r10, r10
    jz              .fold
    mov             rax, r10
    neg             rax
    TAIL_MASK       3, rax
    ; The pointers stay put: only the last block has a tail, so nothing follows.
    RESIDUAL_VEC    %1, 0, 0, 1, 2, 7, 11, 3

.fold:
    FOLD            6
    FOLD            7
    FOLD            8
    FOLD            9
    test            r9, r9
    jnz             .block

    vextractf128    xmm0, ymm15, HIGH_HALF
    vaddpd          xmm0, xmm0, xmm15
    vunpckhpd       xmm1, xmm0, xmm0
    vaddsd          xmm0, xmm0, xmm1
    vaddps          ymm10, ymm10, ymm11
    vaddps          ymm12, ymm12, ymm13
    vaddps          ymm2, ymm10, ymm12
    HSUM_PS         2, 3
    vmovss          [r8], xmm2
    vzeroupper
    ret
%endmacro

FS_FUNC fs_residual_store_avx2
    mov             r9, rcx
    RESIDUAL_BODY   1
FS_ENDFUNC

FS_FUNC fs_residual_sum_avx2
    mov             r8, rcx
    mov             r9, rdx
    RESIDUAL_BODY   0
FS_ENDFUNC

FS_FUNC fs_scale_avx2
    vbroadcastss    ymm0, xmm0
    ; Alignment prologue: one masked vector up to the next 32-byte boundary of x,
    ; so that no load or store of the loop splits a cache line. Each x[i] is
    ; scaled on its own, so this cannot change any result; the residual kernels
    ; get no such prologue because there it would make the sums depend on the
    ; address of p.
    mov             rax, rdi
    neg             rax
    shr             rax, LOG2_FLOAT
    and             eax, VEC_FLOATS - 1     ; floats to the boundary
    cmp             rax, rsi
    cmova           rax, rsi                ; never past n
    test            rax, rax
    jz              .aligned
    mov             rcx, rax
    neg             rcx
    TAIL_MASK       5, rcx
    vmaskmovps      ymm1, ymm5, [rdi]
    vmulps          ymm1, ymm1, ymm0
    vmaskmovps      [rdi], ymm5, ymm1
    lea             rdi, [rdi + rax * FLOAT_BYTES]
    sub             rsi, rax
.aligned:
    mov             rax, rsi
    shr             rax, LOG2_STEP
    and             rsi, STEP_FLOATS - 1
    test            rax, rax
    jz              .rest

    align LOOP_ALIGN
.unrolled:
    vmovups         ymm1, [rdi + 0 * VEC_BYTES]
    vmovups         ymm2, [rdi + 1 * VEC_BYTES]
    vmovups         ymm3, [rdi + 2 * VEC_BYTES]
    vmovups         ymm4, [rdi + 3 * VEC_BYTES]
    vmulps          ymm1, ymm1, ymm0
    vmulps          ymm2, ymm2, ymm0
    vmulps          ymm3, ymm3, ymm0
    vmulps          ymm4, ymm4, ymm0
    vmovups         [rdi + 0 * VEC_BYTES], ymm1
    vmovups         [rdi + 1 * VEC_BYTES], ymm2
    vmovups         [rdi + 2 * VEC_BYTES], ymm3
    vmovups         [rdi + 3 * VEC_BYTES], ymm4
    add             rdi, STEP_BYTES
    dec             rax
    jnz             .unrolled

.rest:
    cmp             rsi, VEC_FLOATS
    jb              .masked
.single:
    vmovups         ymm1, [rdi]
    vmulps          ymm1, ymm1, ymm0
    vmovups         [rdi], ymm1
    add             rdi, VEC_BYTES
    sub             rsi, VEC_FLOATS
    cmp             rsi, VEC_FLOATS
    jae             .single

.masked:
    test            rsi, rsi
    jz              .done
    mov             rax, rsi
    neg             rax
    TAIL_MASK       5, rax
    vmaskmovps      ymm1, ymm5, [rdi]
    vmulps          ymm1, ymm1, ymm0
    vmaskmovps      [rdi], ymm5, ymm1
.done:
    vzeroupper
    ret
FS_ENDFUNC

; SCAN_STEP: fold the float32 chunk sum in xmm0 into the running sum; jump to
; .found (running sum still excluding this chunk) once it exceeds the target.
%macro SCAN_STEP 0
    vcvtss2sd       xmm0, xmm0, xmm0
    vaddsd          xmm6, xmm4, xmm0
    vucomisd        xmm6, xmm5
    ja              .found                  ; strict >, and false for NaN
    vmovapd         xmm4, xmm6
%endmacro

FS_FUNC fs_scan_avx2
    vmovapd         xmm5, xmm0
    vxorpd          xmm4, xmm4, xmm4
    vxorps          xmm14, xmm14, xmm14
    xor             eax, eax
    mov             r8, rdx
    and             r8, -SCAN_CHUNK
    jz              .short

    align LOOP_ALIGN
.chunk:
    vmovups         ymm0, [rdi + rax * FLOAT_BYTES + 0 * VEC_BYTES]
    vmovups         ymm1, [rdi + rax * FLOAT_BYTES + 1 * VEC_BYTES]
    vmovups         ymm2, [rdi + rax * FLOAT_BYTES + 2 * VEC_BYTES]
    vmovups         ymm3, [rdi + rax * FLOAT_BYTES + 3 * VEC_BYTES]
    vmovups         ymm8, [rsi + rax * FLOAT_BYTES + 0 * VEC_BYTES]
    vmovups         ymm9, [rsi + rax * FLOAT_BYTES + 1 * VEC_BYTES]
    vmovups         ymm10, [rsi + rax * FLOAT_BYTES + 2 * VEC_BYTES]
    vmovups         ymm11, [rsi + rax * FLOAT_BYTES + 3 * VEC_BYTES]
    vsubps          ymm0, ymm0, ymm8
    vsubps          ymm1, ymm1, ymm9
    vsubps          ymm2, ymm2, ymm10
    vsubps          ymm3, ymm3, ymm11
    vmaxps          ymm0, ymm0, ymm14
    vmaxps          ymm1, ymm1, ymm14
    vmaxps          ymm2, ymm2, ymm14
    vmaxps          ymm3, ymm3, ymm14
    vaddps          ymm0, ymm0, ymm1
    vaddps          ymm2, ymm2, ymm3
    vaddps          ymm0, ymm0, ymm2
    HSUM_PS         0, 1
    SCAN_STEP
    add             rax, SCAN_CHUNK
    cmp             rax, r8
    jb              .chunk

.short:
    mov             r9, rdx
    sub             r9, rax                 ; floats in the short last chunk
    jz              .none
    lea             r10, [rdi + rax * FLOAT_BYTES]
    lea             r11, [rsi + rax * FLOAT_BYTES]
    vxorps          xmm0, xmm0, xmm0
    cmp             r9, VEC_FLOATS
    jb              .short_masked
.short_single:
    vmovups         ymm2, [r10]
    vmovups         ymm8, [r11]
    vsubps          ymm2, ymm2, ymm8
    vmaxps          ymm2, ymm2, ymm14
    vaddps          ymm0, ymm0, ymm2
    add             r10, VEC_BYTES
    add             r11, VEC_BYTES
    sub             r9, VEC_FLOATS
    cmp             r9, VEC_FLOATS
    jae             .short_single
.short_masked:
    test            r9, r9
    jz              .short_sum
    neg             r9
    mov             r8, r11                 ; TAIL_MASK needs r11
    TAIL_MASK       7, r9
    vmaskmovps      ymm2, ymm7, [r10]
    vmaskmovps      ymm8, ymm7, [r8]
    vsubps          ymm2, ymm2, ymm8
    vmaxps          ymm2, ymm2, ymm14
    vaddps          ymm0, ymm0, ymm2
.short_sum:
    HSUM_PS         0, 1
    SCAN_STEP

.none:
    mov             rax, rdx
.found:
    vmovsd          [rcx], xmm4
    vzeroupper
    ret
FS_ENDFUNC

section .note.GNU-stack noalloc noexec nowrite progbits
