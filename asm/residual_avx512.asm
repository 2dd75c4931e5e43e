; residual_avx512.asm - AVX-512F kernels for the residual pass (see ext/kernels.h).
;
; Build: nasm -f elf64 -I asm/ asm/residual_avx512.asm -o residual_avx512.o
;
; ISA: AVX-512F only, plus the VEX (AVX) encodings every AVX-512F CPU has for
; the final xmm/ymm horizontal reductions and vzeroupper. No VL/DQ/BW/CD:
;  - registers 16-31 appear only in 512-bit (EVEX.512) instructions, since an
;    xmm16..31/ymm16..31 operand would need AVX-512VL;
;  - zeroing uses vpxord (F), not vxorps zmm (DQ);
;  - the 256-bit high half comes out with vextractf64x4 (F), not vextractf32x8 (DQ);
;  - tail opmasks are loaded with kmovw (F) from a table, not built with BMI2.
;
; ABI: System V AMD64. All pointers may be unaligned (4-byte aligned floats).
; Nothing outside [ptr, ptr + n) is read or written: the tail of every loop is
; one opmask-predicated load/store, and masked-off lanes of an EVEX load/store
; never fault. Only caller-saved registers are used (rax, rcx, rdx, rsi, rdi,
; r8-r11, all vector and opmask registers), so nothing is saved or restored and
; there is no stack frame. Each function ends with vzeroupper.
;
;   double fs_residual_store_avx512(const float *p  rdi, const float *q  rsi,
;                                   float *out rdx, size_t n  rcx,
;                                   float *check r8)          -> xmm0
;   double fs_residual_sum_avx512  (const float *p  rdi, const float *q  rsi,
;                                   size_t n  rdx, float *check rcx)
;                                                              -> xmm0
;   void   fs_scale_avx512         (float *x rdi, size_t n rsi, float s xmm0)
;   size_t fs_scan_avx512          (const float *p  rdi, const float *q  rsi,
;                                   size_t n rdx, double target xmm0,
;                                   double *before rcx)       -> rax
;
; Resolved details of the contract (kept identical in ext/residual.c):
;  - d = vmaxps(p - q, +0.0) with the zero as the SECOND source, which returns
;    +0.0 when p - q is NaN or -0.0: bit-identical to C `d > 0.0f ? d : 0.0f`.
;    Non-finite input is reported through *check, never through d.
;  - scale computes x * s with x as the first source, like C `x[i] *= s`, so
;    even the NaN payload matches.
;  - The store and sum kernels perform the same additions in the same order, so
;    for equal input they return bit-identical sums and checks.
;  - Sums, checks and scan results depend on the values only, never on the
;    addresses: the residual and scan loops load p and q unaligned instead of
;    starting with an alignment prologue, which would shift the lane and block
;    layout (and so the rounding) with the address of p. Only fs_scale, whose
;    elements are independent, aligns its pointer first.
;  - Blocked sum: 4 accumulators x 16 lanes = 64 float32 lanes; each lane adds
;    at most FS_BLOCK / 64 = 64 terms before all 64 lanes are converted exactly
;    to float64 and added to a float64 vector running sum (8 + 8 lanes), which
;    is reduced to one double at the very end.
;  - *check is the float32 sum of p + q over 64 lanes, never blocked: it only has
;    to be finite for finite moderate input and non-finite otherwise.
;  - scan uses chunks of SCAN_CHUNK = 64 floats (the same C as ext/residual.c).
;    Each chunk sum is a float32 reduction of the chunk's d; the running sum is a
;    float64 scalar. The last chunk may be short (n % 64 floats). With n == 0,
;    or when no chunk crosses (also when target is NaN), returns n and stores
;    the whole running sum.
;
; Register plan, fs_residual_store_avx512 / fs_residual_sum_avx512
; (sum moves its n and check arguments to match store's plan):
;   rdi  p, advancing          rsi  q, advancing       rdx  out, advancing (store)
;   r8   check pointer         r9   floats after the current block
;   r10  floats of the current block left for the single-vector/masked tail
;   r11  unrolled iterations left in the block; later the tail-mask table
;   zmm0-3   p, then p + q      zmm4-7  q               zmm8-11  d
;   zmm12-13 float32 -> float64 fold temporaries
;   zmm16-19 d float32 accumulators (block-local)
;   zmm20-23 p + q float32 accumulators (the check)
;   zmm24-25 float64 running sum (low / high 8 lanes of a folded accumulator)
;   zmm31    +0.0               k1  tail mask
;
; Register plan, fs_scale_avx512:
;   rdi  x, advancing   rsi  floats left (after the prologue, for the tail)
;   rax  floats in the alignment prologue, then iterations left
;   r11  tail-mask table  zmm0  s broadcast   zmm1-4  x * s   k1  prologue/tail mask
;
; Register plan, fs_scan_avx512:
;   rdi  p   rsi  q   rdx  n   rcx  before pointer   rax  start of current chunk
;   r8   end of the last full chunk; later the tail-mask table
;   r9   floats in the short last chunk   r10/r11  p/q pointers in that chunk
;   zmm16-19 p -> d   zmm20-23 q   zmm0 chunk sum (-> xmm0 float32 -> float64)
;   zmm1 reduction temporary   xmm4 float64 running sum   xmm5 target
;   xmm6 running sum after this chunk   zmm31 +0.0   k1 tail mask

%include "macros.inc"

default rel

%define VEC_FLOATS      16                          ; floats in a zmm register
%define VEC_BYTES       (VEC_FLOATS * FLOAT_BYTES)
%define UNROLL          4                           ; vectors per loop iteration
%define STEP_FLOATS     (VEC_FLOATS * UNROLL)
%define STEP_BYTES      (STEP_FLOATS * FLOAT_BYTES)
%define LOG2_STEP       6                           ; log2(STEP_FLOATS)
%define SCAN_CHUNK      64                          ; floats per scan chunk
%define MASK16_BYTES    2                           ; a kmovw table entry

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
; tail_mask16[r] = the low r bits set: the opmask for the first r lanes.
tail_mask16:
%assign r 0
%rep VEC_FLOATS
    dw (1 << r) - 1
%assign r r + 1
%endrep

section .text

; HSUM_PS a, t: xmm<a>[0] = sum of the 16 floats of zmm<a>; zmm<t> clobbered.
; a and t must be 0..15 (the xmm/ymm steps are VEX-encoded).
%macro HSUM_PS 2
    vextractf64x4   ymm%2, zmm%1, HIGH_HALF
    vaddps          ymm%1, ymm%1, ymm%2
    vextractf128    xmm%2, ymm%1, HIGH_HALF
    vaddps          xmm%1, xmm%1, xmm%2
    vmovhlps        xmm%2, xmm%1, xmm%1
    vaddps          xmm%1, xmm%1, xmm%2
    vmovshdup       xmm%2, xmm%1
    vaddss          xmm%1, xmm%1, xmm%2
%endmacro

; HSUM_PD a, t: xmm<a>[0] = sum of the 8 doubles of zmm<a>; zmm<t> clobbered.
%macro HSUM_PD 2
    vextractf64x4   ymm%2, zmm%1, HIGH_HALF
    vaddpd          ymm%1, ymm%1, ymm%2
    vextractf128    xmm%2, ymm%1, HIGH_HALF
    vaddpd          xmm%1, xmm%1, xmm%2
    vunpckhpd       xmm%2, xmm%1, xmm%1
    vaddsd          xmm%1, xmm%1, xmm%2
%endmacro

; FOLD acc: add the 16 float32 lanes of zmm<acc>, each converted exactly, to the
; float64 running sum zmm24 (low 8) / zmm25 (high 8), and restart zmm<acc> at 0.
%macro FOLD 1
    vcvtps2pd       zmm12, ymm%1
    vextractf64x4   ymm13, zmm%1, HIGH_HALF
    vcvtps2pd       zmm13, ymm13
    vaddpd          zmm24, zmm24, zmm12
    vaddpd          zmm25, zmm25, zmm13
    vpxord          zmm%1, zmm%1, zmm%1
%endmacro

; RESIDUAL_VEC store, off, P, Q, D, DACC, CACC [, mask]
; One vector of the residual pass at byte offset off from rdi/rsi/rdx:
; D = max(P - Q, 0), CACC += P + Q, DACC += D, and out = D when store is 1.
; With a mask (e.g. k1) the loads zero and the store skips the masked-off lanes,
; which then add +0.0 to both sums.
%macro RESIDUAL_VEC 7-8
%if %0 == 8
    vmovups         zmm%3{%8}{z}, [rdi + %2]
    vmovups         zmm%4{%8}{z}, [rsi + %2]
%else
    vmovups         zmm%3, [rdi + %2]
    vmovups         zmm%4, [rsi + %2]
%endif
    vsubps          zmm%5, zmm%3, zmm%4
    vaddps          zmm%3, zmm%3, zmm%4
    vmaxps          zmm%5, zmm%5, zmm31
%if %1
%if %0 == 8
    vmovups         [rdx + %2]{%8}, zmm%5
%else
    vmovups         [rdx + %2], zmm%5
%endif
%endif
    vaddps          zmm%6, zmm%6, zmm%5
    vaddps          zmm%7, zmm%7, zmm%3
%endmacro

; RESIDUAL_BODY store: the whole store (1) or sum (0) kernel after the argument
; shuffle, following the register plan at the top of the file.
%macro RESIDUAL_BODY 1
    vpxord          zmm31, zmm31, zmm31
    vpxord          zmm16, zmm16, zmm16
    vpxord          zmm17, zmm17, zmm17
    vpxord          zmm18, zmm18, zmm18
    vpxord          zmm19, zmm19, zmm19
    vpxord          zmm20, zmm20, zmm20
    vpxord          zmm21, zmm21, zmm21
    vpxord          zmm22, zmm22, zmm22
    vpxord          zmm23, zmm23, zmm23
    vpxord          zmm24, zmm24, zmm24
    vpxord          zmm25, zmm25, zmm25

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
    RESIDUAL_VEC    %1, 0 * VEC_BYTES, 0, 4,  8, 16, 20
    RESIDUAL_VEC    %1, 1 * VEC_BYTES, 1, 5,  9, 17, 21
    RESIDUAL_VEC    %1, 2 * VEC_BYTES, 2, 6, 10, 18, 22
    RESIDUAL_VEC    %1, 3 * VEC_BYTES, 3, 7, 11, 19, 23
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
    RESIDUAL_VEC    %1, 0, 0, 4, 8, 16, 20
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
    lea             r11, [tail_mask16]
    kmovw           k1, [r11 + r10 * MASK16_BYTES]
    ; The pointers stay put: only the last block has a tail, so nothing follows.
    RESIDUAL_VEC    %1, 0, 1, 5, 9, 17, 21, k1

.fold:
    FOLD            16
    FOLD            17
    FOLD            18
    FOLD            19
    test            r9, r9
    jnz             .block

    vaddpd          zmm0, zmm24, zmm25
    HSUM_PD         0, 1
    vaddps          zmm20, zmm20, zmm21
    vaddps          zmm22, zmm22, zmm23
    vaddps          zmm2, zmm20, zmm22
    HSUM_PS         2, 3
    vmovss          [r8], xmm2
    vzeroupper
    ret
%endmacro

FS_FUNC fs_residual_store_avx512
    mov             r9, rcx
    RESIDUAL_BODY   1
FS_ENDFUNC

FS_FUNC fs_residual_sum_avx512
    mov             r8, rcx
    mov             r9, rdx
    RESIDUAL_BODY   0
FS_ENDFUNC

FS_FUNC fs_scale_avx512
    vbroadcastss    zmm0, xmm0
    ; Alignment prologue: one masked vector up to the next 64-byte boundary of x,
    ; so that no load or store of the loop splits a cache line (it halves the
    ; speed of L1-resident data otherwise). Each x[i] is scaled on its own, so
    ; this cannot change any result; the residual kernels get no such prologue
    ; because there it would make the sums depend on the address of p.
    mov             rax, rdi
    neg             rax
    shr             rax, LOG2_FLOAT
    and             eax, VEC_FLOATS - 1     ; floats to the boundary
    cmp             rax, rsi
    cmova           rax, rsi                ; never past n
    test            rax, rax
    jz              .aligned
    lea             r11, [tail_mask16]
    kmovw           k1, [r11 + rax * MASK16_BYTES]
    vmovups         zmm1{k1}{z}, [rdi]
    vmulps          zmm1, zmm1, zmm0
    vmovups         [rdi]{k1}, zmm1
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
    vmovups         zmm1, [rdi + 0 * VEC_BYTES]
    vmovups         zmm2, [rdi + 1 * VEC_BYTES]
    vmovups         zmm3, [rdi + 2 * VEC_BYTES]
    vmovups         zmm4, [rdi + 3 * VEC_BYTES]
    vmulps          zmm1, zmm1, zmm0
    vmulps          zmm2, zmm2, zmm0
    vmulps          zmm3, zmm3, zmm0
    vmulps          zmm4, zmm4, zmm0
    vmovups         [rdi + 0 * VEC_BYTES], zmm1
    vmovups         [rdi + 1 * VEC_BYTES], zmm2
    vmovups         [rdi + 2 * VEC_BYTES], zmm3
    vmovups         [rdi + 3 * VEC_BYTES], zmm4
    add             rdi, STEP_BYTES
    dec             rax
    jnz             .unrolled

.rest:
    cmp             rsi, VEC_FLOATS
    jb              .masked
.single:
    vmovups         zmm1, [rdi]
    vmulps          zmm1, zmm1, zmm0
    vmovups         [rdi], zmm1
    add             rdi, VEC_BYTES
    sub             rsi, VEC_FLOATS
    cmp             rsi, VEC_FLOATS
    jae             .single

.masked:
    test            rsi, rsi
    jz              .done
    lea             r11, [tail_mask16]
    kmovw           k1, [r11 + rsi * MASK16_BYTES]
    vmovups         zmm1{k1}{z}, [rdi]
    vmulps          zmm1, zmm1, zmm0
    vmovups         [rdi]{k1}, zmm1
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

FS_FUNC fs_scan_avx512
    vmovapd         xmm5, xmm0
    vxorpd          xmm4, xmm4, xmm4
    vpxord          zmm31, zmm31, zmm31
    xor             eax, eax
    mov             r8, rdx
    and             r8, -SCAN_CHUNK
    jz              .short

    align LOOP_ALIGN
.chunk:
    vmovups         zmm16, [rdi + rax * FLOAT_BYTES + 0 * VEC_BYTES]
    vmovups         zmm17, [rdi + rax * FLOAT_BYTES + 1 * VEC_BYTES]
    vmovups         zmm18, [rdi + rax * FLOAT_BYTES + 2 * VEC_BYTES]
    vmovups         zmm19, [rdi + rax * FLOAT_BYTES + 3 * VEC_BYTES]
    vmovups         zmm20, [rsi + rax * FLOAT_BYTES + 0 * VEC_BYTES]
    vmovups         zmm21, [rsi + rax * FLOAT_BYTES + 1 * VEC_BYTES]
    vmovups         zmm22, [rsi + rax * FLOAT_BYTES + 2 * VEC_BYTES]
    vmovups         zmm23, [rsi + rax * FLOAT_BYTES + 3 * VEC_BYTES]
    vsubps          zmm16, zmm16, zmm20
    vsubps          zmm17, zmm17, zmm21
    vsubps          zmm18, zmm18, zmm22
    vsubps          zmm19, zmm19, zmm23
    vmaxps          zmm16, zmm16, zmm31
    vmaxps          zmm17, zmm17, zmm31
    vmaxps          zmm18, zmm18, zmm31
    vmaxps          zmm19, zmm19, zmm31
    vaddps          zmm16, zmm16, zmm17
    vaddps          zmm18, zmm18, zmm19
    vaddps          zmm0, zmm16, zmm18
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
    vxorps          xmm0, xmm0, xmm0        ; VEX: clears all of zmm0
    cmp             r9, VEC_FLOATS
    jb              .short_masked
.short_single:
    vmovups         zmm16, [r10]
    vsubps          zmm16, zmm16, [r11]
    vmaxps          zmm16, zmm16, zmm31
    vaddps          zmm0, zmm0, zmm16
    add             r10, VEC_BYTES
    add             r11, VEC_BYTES
    sub             r9, VEC_FLOATS
    cmp             r9, VEC_FLOATS
    jae             .short_single
.short_masked:
    test            r9, r9
    jz              .short_sum
    lea             r8, [tail_mask16]
    kmovw           k1, [r8 + r9 * MASK16_BYTES]
    vmovups         zmm16{k1}{z}, [r10]
    vmovups         zmm20{k1}{z}, [r11]
    vsubps          zmm16, zmm16, zmm20
    vmaxps          zmm16, zmm16, zmm31
    vaddps          zmm0, zmm0, zmm16
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
