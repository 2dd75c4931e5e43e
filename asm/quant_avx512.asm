; quant_avx512.asm - AVX-512 kernels for exact GGUF quantized matmuls (see ext/quant.h).
;
; Build: nasm -f elf64 -I asm/ asm/quant_avx512.asm -o quant_avx512.o
;
;   void fs_qmm_q4_0_avx512(const fs_qjob *job  rdi)
;   void fs_qmm_q4_1_avx512(const fs_qjob *job  rdi)
;   void fs_qmm_q8_0_avx512(const fs_qjob *job  rdi)
;   void fs_qmm_q5_0_avx512(const fs_qjob *job  rdi)
;   void fs_qmm_q4_kr_avx512(const fs_qjob *job  rdi)
;   void fs_qmm_q6_kr_avx512(const fs_qjob *job  rdi)
;   void fs_fma_probe_avx512(uint64_t rounds  rdi)
;
;   y[i * ldy + j] = sum_k x[i * ldx + k] * W[j, k]   for i < m, j < n
;
; ISA: AVX-512F (EVEX, zmm0-31; no BW, DQ or VL: every EVEX instruction has a zmm
; operand; Q5_0 uses opmasks k1/k2, loaded by kmovw, which is AVX-512F) plus a few
; VEX instructions on xmm0/xmm1 for the fp16 scales and the
; final fold: vpbroadcastw xmm, m (AVX2), vmovd/vmovq (AVX: a scale's load, its
; float32 store to the frame), vcvtph2ps xmm, xmm (F16C: a zmm vcvtph2ps is twice
; the work for one value), vmovshdup/vaddps/vaddss/vmovhlps/vextractf128/vmovss
; (AVX). The dispatcher must check AVX512F, AVX2,
; F16C and the OS's ZMM state (XGETBV); ext/_quant.c checks AVX512F + AVX2 + ZMM
; state (fs_cpu_has_avx512) and FMA + F16C.
;
; ABI: System V AMD64. rbx, rbp, r12-r15 are saved and restored (the register plan
; needs every GPR); a 104-byte frame holds the pass state and, per tile row, its
; block's scales as float32 (SCALES_TO_SLOT). No alignment is assumed
; for any pointer. Reads stay inside x rows [0, kb * 32) and the n * kb weight
; blocks (each block is read as its fp16 d word, Q4_1's d and m as one dword,
; Q5_0's qh as two words, the repacked layouts' float32 scale dwords, and 16-byte
; loads of quants: one for Q4 and Q5_0, two for Q8_0 and Q6_KR, all inside its
; 18/20/34/22/24/40 bytes: Q5_0's nibbles are its last 16), so the last block may
; end a mapping.
; Writes go only to y[i * ldy + j]. Ends with vzeroupper. MXCSR is not touched.
; Software prefetches (prefetcht0) run one tile ahead of the weight rows being
; read and may name addresses past the last row: a prefetch never faults.
;
; Exactness: each weight is formed in a register as gguf-py's float32 value:
;   Q8_0  w = float(q) * d                 (exact)
;   Q4_0  w = T[q], T[q] = d * float(q - 8)         (exact)
;   Q5_0  w = T[q], T[q] = d * float(q - 16)        (exact; q = 0..31)
;   Q4_1  w = T[q], T[q] = fma(d, float(q), m)      (d * q exact: one rounding,
;                                                    as gguf-py's d*q + m)
;   Q4_KR w = T[q], T[q] = fma(D, float(q), M)      (the same, float32 D and M)
;   Q6_KR w = float(q) * D_h                        (one rounding, as gguf-py's)
; with d and m widened by vcvtph2ps (exact); D, M are read as they are. For Q4 the 16 levels T[0..15] of a
; block are computed once (one zmm) and each element looks its weight up with
; vpermps, which reads only bits 0-3 of each index dword: byte b as a dword gives
; element b (low nibble), byte b >> 4 element b + 16. For Q5_0 the 32 levels are two
; zmm (T[0..15], T[16..31]) and vpermi2ps looks up 5-bit indices: the nibble (bits
; 4-7 of the low ones cleared) with bit 4 set, by an opmask from qh, where element e's
; bit of qh is. x is never quantized.
;
; Accumulation and determinism: one zmm accumulator per (x row i, weight row j).
; Per block, lane l adds x[32b + l] * w[32b + l], then x[32b + 16 + l] * w[32b +
; 16 + l] (two FMAs, that order). After the last block the 16 lanes are folded in
; one fixed order: lanes l + (l + 8), then 4 + 4, then 2 + 2, then 1 + 1. Every
; accumulator runs the same instruction sequence whatever the tile shape, so
; y[i, j] depends on x row i and weight row j only (not on m, n or alignment).
;
; Tiles: TR weight rows x M x rows with TR * (M + 2) <= 28 (TR * M accumulators,
; 2 * TR weight registers, zmm0-3): M 1: 8 rows, 2: 7, 3: 5, 4-5: 4, 6-7: 3,
; 8-12: 2. m <= 12 is one pass (M = m); a larger m runs passes of 8 x rows
; (m = 13..16: 8 + the rest), each dequantizing the weights again: measured
; faster than one 16-row pass (TR = 1, whose FMAs each need an x load). n % TR
; rows run as single-row tiles. Per block the TR rows are dequantized once into
; zmm4.. (two registers a row), then each x row's 32 floats are loaded once
; (zmm0/zmm1) and FMAed into its TR accumulators: 2 * M x loads for 2 * TR * M
; FMAs (a zmm load and a zmm FMA each take one cycle on Zen 4, so FMAs taking x
; from memory would be load-bound). A single-row tile takes x from memory.
;
; Register plan (GPRs: see also quant.inc):
;   rdi  job                  rax  blocks left, then the y store pointer
;   rsi  weight row 0 of the tile, current block    rdx  weight row 5 (TR > 5)
;   rcx  row_bytes            r8   3 * row_bytes
;   r9 / r10 / r11            x rows 0 / 4 / 8 of the pass, current block
;   rbx (TR > 5) / rdx (TR <= 5)  prefetch pointer into the next tile
;   rbp  ldx * 4              r12  3 * ldx * 4
;   r13  weight rows left     r14  &y[pass row 0, j0]   r15  weight row j0, block 0
;   zmm0, zmm1  d / m (dequantizing), then x[0..15] / x[16..31] of an x row; fold
;               temporaries (xmm0 = the output)
;   zmm2        Q4 levels: float(q - bias) in lane q (ISA_SETUP); Q5_0: float(q - 16)
;               for q = 0..15 (lane q)
;   zmm3        Q5_0: float(q - 16) for q = 16..31 (lane q - 16); else free
;   k1, k2      Q5_0: qh bits 0-15 / 16-31 (elements 0-15 / 16-31)
;   zmm4 + 2r, zmm5 + 2r   weights of tile row r, elements 0-15 / 16-31
;   zmm(4 + 2 TR) + i * TR + r  accumulator of (x row i, weight row r), to zmm31

%include "macros.inc"
%include "quant.inc"

default rel

%define W_BASE          4               ; zmm4 + 2r / zmm5 + 2r: weights of tile row r
%define ACC_BASE        (W_BASE + 2 * TILE_R)   ; accumulators follow the tile's weights
%define NUM_ZMM         32
%define ZMM_X_HALF      64              ; bytes of x in one zmm (16 floats)
%define PASS_MAX_ROWS   12
%define PASS_SPLIT_ROWS 8

section .rodata
align CACHE_LINE
c_q4_1_levels:  dd 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0   ; lane q: float(q)
c_q4_0_levels:  dd -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0   ; lane q: float(q - Q4_BIAS)
c_q5_0_levels:  dd -16.0, -15.0, -14.0, -13.0, -12.0, -11.0, -10.0, -9.0, -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0   ; lane q: float(q - Q5_BIAS), q < 16 (q >= 16: c_q4_1_levels)
c_nibble_mask:  dd NIBBLE_MASK              ; broadcast ({1to16})
c_q5_high_bit:  dd Q5_HIGH_BIT              ; broadcast ({1to16})

section .text

; TILE_ROWS_FOR M: %assign TR (weight rows per tile): TR * M accumulators and
; 2 * TR weight registers fit beside zmm0-3, i.e. TR * (M + 2) <= 28.
%macro TILE_ROWS_FOR 1
%if %1 == 1
%assign TR 8
%elif %1 == 2
%assign TR 7
%elif %1 == 3
%assign TR 5
%elif %1 <= 5
%assign TR 4
%elif %1 <= 7
%assign TR 3
%else
%assign TR 2
%endif
%if W_BASE + TR * (%1 + 2) > NUM_ZMM || TR > MAX_TILE_W_ROWS
%error tile too large
%endif
%endmacro

; ISA_SETUP fmt: zmm2 = the Q4 table's q values (float q - bias, lane q); Q5_0: zmm2,
; zmm3 = its 32 (float q - 16, q = 0..15 and 16..31).
%macro ISA_SETUP 1
%ifidn %1, Q4_0
    vmovups         zmm2, [c_q4_0_levels]
%elifidn %1, Q4_1
    vmovups         zmm2, [c_q4_1_levels]
%elifidn %1, Q4_KR
    vmovups         zmm2, [c_q4_1_levels]
%elifidn %1, Q5_0
    vmovups         zmm2, [c_q5_0_levels]           ; float(q - 16), q = 0..15
    vmovups         zmm3, [c_q4_1_levels]           ; float(q - 16), q = 16..31
%endif
%endmacro

%macro ACC_ZERO 1
%assign acz ACC_BASE + %1
    vpxord          zmm %+ acz, zmm %+ acz, zmm %+ acz
%endmacro

; ACC_FOLD a: xmm0[0] = the 16 lanes of accumulator a, folded in the fixed order.
; The first two steps are EVEX (the accumulator may be zmm16-31: VEX cannot name
; it, EVEX on ymm would need VL); the rest is VEX on xmm0/xmm1.
%macro ACC_FOLD 1
%assign acf ACC_BASE + %1
    vextractf64x4   ymm1, zmm %+ acf, HIGH_HALF
    vaddps          zmm0, zmm1, zmm %+ acf          ; lanes 0-7: l + (l + 8)
    vextractf128    xmm1, ymm0, HIGH_HALF
    vaddps          xmm0, xmm0, xmm1
    vmovhlps        xmm1, xmm0, xmm0
    vaddps          xmm0, xmm0, xmm1
    vmovshdup       xmm1, xmm0
    vaddss          xmm0, xmm0, xmm1
%endmacro

; SCALES_TO_SLOT addr, lo, load: the fp16 scale word(s) at [addr] (one word: d; a
; dword: d and m) as float32 in the stack slot of the tile row whose weights go to
; zmm lo, which SLOT then names. The DEQ macros take d and m from the slot as
; memory broadcasts ({1to16}, vbroadcastss m32): on Zen 4 those are load-port work,
; where a register broadcast (vbroadcastss zmm, xmm) takes a vector pipe a block.
; xmm0 is the temporary; load is vmovd for a dword (Q4_1's d and m), vpbroadcastw
; for a word (d alone, then both floats of the slot are d).
%macro SCALES_TO_SLOT 3
%xdefine SLOT rsp + FRAME_SCALES + ((%2 - W_BASE) / 2) * SCALE_SLOT_BYTES
    %3              xmm0, [%1]
    vcvtph2ps       xmm0, xmm0
    vmovq           [SLOT], xmm0
%endmacro

; DEQ_<fmt> addr, lo, hi: zmm lo = w[0..15], zmm hi = w[16..31] of the block at
; [addr]; zmm0 (and zmm1) hold d (and m) meanwhile.
%macro DEQ_Q8_0 3
    SCALES_TO_SLOT  %1 + Q8_0_D, %2, vpbroadcastw
    vpmovsxbd       zmm%2, [%1 + Q8_0_QS]
    vpmovsxbd       zmm%3, [%1 + Q8_0_QS + 16]
    vcvtdq2ps       zmm%2, zmm%2
    vcvtdq2ps       zmm%3, zmm%3
    vmulps          zmm%2, zmm%2, [SLOT]{1to16}
    vmulps          zmm%3, zmm%3, [SLOT]{1to16}
%endmacro

; Q4: the 16 weights a block can hold are formed once, T[q] = d * (q - 8) (Q4_0)
; or fma(d, q, m) (Q4_1) for q = 0..15 from zmm2 = float(q - bias) (ISA_SETUP),
; and each element looks its weight up: vpermps uses the low 4 bits of an index
; dword, i.e. the low nibble of byte b as it stands and the high one after >> 4.
%macro DEQ_Q4_0 3
    SCALES_TO_SLOT  %1 + Q4_0_D, %2, vpbroadcastw
    vpmovzxbd       zmm%2, [%1 + Q4_0_QS]           ; byte b: q[b] | q[b + 16] << 4
    vpsrld          zmm%3, zmm%2, NIBBLE_BITS       ; q[b + 16] (index bits 0-3)
    vmulps          zmm0, zmm2, [SLOT]{1to16}       ; T[q] = d * (q - 8), exact
    vpermps         zmm%2, zmm%2, zmm0              ; w[b] = T[q[b]] (bits 4-7 ignored)
    vpermps         zmm%3, zmm%3, zmm0
%endmacro

; Q5_0: the 32 weights a block can hold, T[q] = d * (q - 16) (exact), as two zmm (zmm0:
; q < 16, zmm1: q >= 16) from zmm2 / zmm3 (ISA_SETUP); element e's 5-bit index is its
; nibble, with bit 4 set where bit e of qh is (k1: elements 0-15, k2: 16-31), and
; vpermi2ps reads bits 0-4 of it (bit 4 picks zmm1).
%if Q5_0_QS + QK / 2 != Q5_0_BYTES
%error DEQ_Q5_0's 16-byte nibble load must end where the block does
%endif
%macro DEQ_Q5_0 3
    SCALES_TO_SLOT  %1 + Q5_0_D, %2, vpbroadcastw
    vpmovzxbd       zmm%2, [%1 + Q5_0_QS]           ; byte b: nibbles of elements b, b + 16
    kmovw           k1, [%1 + Q5_0_QH]              ; qh bits 0-15
    kmovw           k2, [%1 + Q5_0_QH + 2]          ; qh bits 16-31
    vpsrld          zmm%3, zmm%2, NIBBLE_BITS       ; nibble of element b + 16 (bits 4+ zero)
    vpandd          zmm%2, zmm%2, [c_nibble_mask]{1to16}    ; nibble of element b
    vpord           zmm%2{k1}, zmm%2, [c_q5_high_bit]{1to16}    ; q = nibble | bit << 4
    vpord           zmm%3{k2}, zmm%3, [c_q5_high_bit]{1to16}
    vmulps          zmm1, zmm3, [SLOT]{1to16}       ; T[16..31] = d * (0..15)
    vmulps          zmm0, zmm2, [SLOT]{1to16}       ; T[0..15] = d * (-16..-1)
    vpermi2ps       zmm%2, zmm0, zmm1               ; w[e] = T[q[e]]
    vpermi2ps       zmm%3, zmm0, zmm1
%endmacro

%if Q4_1_M != Q4_1_D + 2
%error DEQ_Q4_1 loads d and m as one dword
%endif
%macro DEQ_Q4_1 3
    SCALES_TO_SLOT  %1 + Q4_1_D, %2, vmovd          ; fp16 d, m (Q4_1_M = Q4_1_D + 2)
    vpmovzxbd       zmm%2, [%1 + Q4_1_QS]
    vpsrld          zmm%3, zmm%2, NIBBLE_BITS
    vbroadcastss    zmm0, [SLOT]                    ; d
    vfmadd213ps     zmm0, zmm2, [SLOT + FLOAT_BYTES]{1to16}    ; T[q] = fma(d, q, m)
    vpermps         zmm%2, zmm%2, zmm0
    vpermps         zmm%3, zmm%3, zmm0
%endmacro

%macro DEQ_Q4_KR 3
    vpmovzxbd       zmm%2, [%1 + Q4_KR_QS]
    vbroadcastss    zmm0, [%1 + Q4_KR_D]
    vbroadcastss    zmm1, [%1 + Q4_KR_M]
    vpsrld          zmm%3, zmm%2, NIBBLE_BITS
    Q4_LOOKUP       %2, %3
%endmacro

; Q4_LOOKUP lo, hi: from the scale in zmm0 and the min in zmm1, the 16 levels T[q] =
; fma(d, q, m) (d * q exact: one rounding), then each element's weight by its nibble.
%macro Q4_LOOKUP 2
    vfmadd132ps     zmm0, zmm1, zmm2
    vpermps         zmm%1, zmm%1, zmm0
    vpermps         zmm%2, zmm%2, zmm0
%endmacro

; Q6_KR: two float32 scales (one a 16-half, each a zmm), broadcast from memory.
%macro DEQ_Q6_KR 3
    vpmovsxbd       zmm%2, [%1 + Q6_KR_QS]
    vpmovsxbd       zmm%3, [%1 + Q6_KR_QS + 16]
    vcvtdq2ps       zmm%2, zmm%2
    vcvtdq2ps       zmm%3, zmm%3
    vmulps          zmm%2, zmm%2, [%1 + Q6_KR_D]{1to16}
    vmulps          zmm%3, zmm%3, [%1 + Q6_KR_D + KR_SCALE_BYTES]{1to16}
%endmacro

; BLOCK_TILE fmt, R, M: dequantize the current block of the R weight rows into
; zmm4.. (two registers a row), then for each x row load its block's two halves
; once (zmm0 / zmm1) and FMA them into the R accumulators of that row (a single
; weight row FMAs x from memory). Accumulator (i, r) adds, per block, w[0..15] *
; x[0..15] and then w[16..31] * x[16..31]: the same two FMAs in every tile shape.
%macro BLOCK_TILE 3
%assign r 0
%rep %2
%assign wl W_BASE + 2 * r
%assign wh wl + 1
    DEQ_%1          W_ROW %+ r, wl, wh
%assign r r + 1
%endrep
%assign xi 0
%rep %3
%if %2 == 1
%assign acn ACC_BASE + xi
    vfmadd231ps     zmm %+ acn, zmm %+ W_BASE, [X_ROW %+ xi]
%assign wh W_BASE + 1
    vfmadd231ps     zmm %+ acn, zmm %+ wh, [X_ROW %+ xi + ZMM_X_HALF]
%else
    vmovups         zmm0, [X_ROW %+ xi]
    vmovups         zmm1, [X_ROW %+ xi + ZMM_X_HALF]
%assign r 0
%rep %2
%assign acn ACC_BASE + xi * %2 + r
%assign wl W_BASE + 2 * r
    vfmadd231ps     zmm %+ acn, zmm %+ wl, zmm0
%assign r r + 1
%endrep
%assign r 0
%rep %2
%assign acn ACC_BASE + xi * %2 + r
%assign wh W_BASE + 2 * r + 1
    vfmadd231ps     zmm %+ acn, zmm %+ wh, zmm1
%assign r r + 1
%endrep
%endif
%assign xi xi + 1
%endrep
%endmacro

QMM_KERNEL Q4_0, fs_qmm_q4_0_avx512
QMM_KERNEL Q4_1, fs_qmm_q4_1_avx512
QMM_KERNEL Q8_0, fs_qmm_q8_0_avx512
QMM_KERNEL Q5_0, fs_qmm_q5_0_avx512
QMM_KERNEL Q4_KR, fs_qmm_q4_kr_avx512
QMM_KERNEL Q6_KR, fs_qmm_q6_kr_avx512

; fs_fma_probe_avx512(rounds  rdi): the float32 multiply-add peak of one core (quant.inc's
; FMA_PROBE): 16 chains, more than FMA latency x FMA ports on any core that runs AVX-512;
; zmm16-31 (EVEX only: vzeroupper leaves them alone, none is callee-saved).
%define FMA_PROBE_CHAINS 16             ; ext/quant.h FS_FMA_PROBE_CHAINS_AVX512
FMA_PROBE fs_fma_probe_avx512, zmm, vpxord, 16, FMA_PROBE_CHAINS

section .note.GNU-stack noalloc noexec nowrite progbits
