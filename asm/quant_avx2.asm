; quant_avx2.asm - AVX2 kernels for exact GGUF quantized matmuls (see ext/quant.h).
;
; Build: nasm -f elf64 -I asm/ asm/quant_avx2.asm -o quant_avx2.o
;
;   void fs_qmm_q4_0_avx2(const fs_qjob *job  rdi)
;   void fs_qmm_q4_1_avx2(const fs_qjob *job  rdi)
;   void fs_qmm_q8_0_avx2(const fs_qjob *job  rdi)
;   void fs_qmm_q5_0_avx2(const fs_qjob *job  rdi)
;   void fs_qmm_q4_kr_avx2(const fs_qjob *job  rdi)
;   void fs_qmm_q6_kr_avx2(const fs_qjob *job  rdi)
;   void fs_fma_probe_avx2(uint64_t rounds  rdi)
;
;   y[i * ldy + j] = sum_k x[i * ldx + k] * W[j, k]   for i < m, j < n
;
; ISA: AVX2 + FMA + F16C (VEX only, ymm0-15): vpmovzxbd/vpmovsxbd/vpbroadcastw/
; vpbroadcastd (AVX2), vfmadd (FMA3), vcvtph2ps (F16C). The dispatcher must check all three.
;
; ABI: System V AMD64. rbx, rbp, r12-r15 are saved and restored (the register plan
; needs every GPR); a 104-byte frame (quant.inc: the pass state, then scale slots
; the AVX-512 kernels use) is reserved. No alignment is assumed
; for any pointer. Reads stay inside x rows [0, kb * 32) and the n * kb weight
; blocks (fp16 words d / m, Q5_0's qh dword, the repacked layouts' float32 scale
; dwords and 8-byte loads of quants, all inside the block's 18/20/34/22/24/40
; bytes: Q5_0's last load, of bytes 14-21, ends where its block does), so the last
; block may end a mapping. Writes go only to
; y[i * ldy + j]. Ends with vzeroupper. MXCSR is not touched.
; Software prefetches (prefetcht0) run one tile ahead of the weight rows being
; read and may name addresses past the last row: a prefetch never faults.
;
; Exactness: each weight is formed in a register as gguf-py's float32 value:
;   Q8_0  w = float(q) * d                 (exact)
;   Q4_0  w = float(q - 8) * d             (exact; integer subtract first)
;   Q5_0  w = float(q - 16) * d            (exact; q = nibble | qh bit << 4, the
;                                           bias subtracted as integers first)
;   Q4_1  w = fma(float(q), d, m)          (d * q exact, one rounding like d*q + m)
;   Q4_KR w = fma(float(q), D, M)          (the same, float32 D and M)
;   Q6_KR w = float(q) * D_h               (one rounding, as gguf-py's)
; with d and m widened by vcvtph2ps (exact); D, M are read as they are. x is never quantized.
;
; Accumulation and determinism: one ymm accumulator per (x row i, weight row j).
; Per block b, lane l adds, in this order (e = element of the block):
;   Q4_0/Q4_1  e = l, l + 16, l + 8, l + 24    (low/high nibbles of bytes 0-7, 8-15)
;   Q5_0       e = l, l + 16, l + 8, l + 24    (as Q4_0; qh's bit e joins element e)
;   Q4_KR      e = l, l + 16, l + 8, l + 24    (as Q4_1)
;   Q8_0/Q6_KR e = l, l + 8, l + 16, l + 24
; After the last block the 8 lanes are folded in one fixed order: l + (l + 4),
; then 2 + 2, then 1 + 1. Every accumulator runs the same instruction sequence
; whatever the tile shape or pass split, so y[i, j] depends on x row i and weight
; row j only (not on m, n or alignment).
;
; Tiles: TR weight rows x M x rows; m <= 12 is one pass, a larger m runs passes
; of 8 x rows (m = 13..16: 8 + the rest), each dequantizing the weights again;
; n % TR rows run as single-row tiles. Two block schemes (same FMAs, same order):
;   stream  M 1: 8 rows, 6: 2, 7-12: 1 (TR * M <= 12 accumulators): a weight
;           row's block is dequantized 16 weights at a time into ymm2/ymm3 and
;           used by the M x rows, the FMAs taking x from memory;
;   tile    M 2: 3 rows, 3-5: 2 (TR * (M + 2) <= 14): 16 weights of all TR rows
;           are dequantized into ymm2.. (the scales read again for the second
;           half), then each 8 floats of an x row are loaded once (ymm0) for TR
;           FMAs, so the loads do not bound the FMAs (Zen 4: 2 loads, 2 FMAs a
;           cycle).
;
; Register plan (GPRs: see also quant.inc):
;   rdi  job                  rax  blocks left, then the y store pointer
;   rsi  weight row 0 of the tile, current block    rdx  weight row 5 (TR > 5)
;   rcx  row_bytes            r8   3 * row_bytes
;   r9 / r10 / r11            x rows 0 / 4 / 8 of the pass, current block
;   rbx (TR > 5) / rdx (TR <= 5)  prefetch pointer into the next tile
;   rbp  ldx * 4              r12  3 * ldx * 4
;   r13  weight rows left     r14  &y[pass row 0, j0]   r15  weight row j0, block 0
;   ymm0, ymm1  d / m broadcast (fp16 -> float32); Q5_0: ymm1 = qh's bits while a
;               half is dequantized; in the tile scheme ymm0 then holds 8 floats
;               of x; fold temporaries (xmm0 = the output)
;   ymm2 + 2h, ymm3 + 2h  dequantized weights (8 each, order above) of held row h
;               (stream: h = 0 only; tile: h < TR)
;   ymm(2 + 2 HELD) + i * TR + r  accumulator of (x row i, weight row r), to ymm15
;   nibble mask, Q4_0 bias, Q5_0 bit masks and bias: memory operands (no register
;               left for them)

%include "macros.inc"
%include "quant.inc"

default rel

%define W_BASE          2               ; ymm2 + 2r / ymm3 + 2r: weights of tile row r
%define ACC_BASE        (W_BASE + 2 * HELD_R)   ; accumulators follow the held weights
%define NUM_YMM         16
%define YMM_X           32              ; bytes of x in one ymm (8 floats)
%define PASS_MAX_ROWS   12
%define PASS_SPLIT_ROWS 8

section .rodata
align 32
c_nibble_mask:  times 8 dd NIBBLE_MASK
c_q4_bias:      times 8 dd Q4_BIAS
c_q5_clear:     times 8 dd -Q5_BIAS         ; added to q's nibble where its qh bit is clear
c_q5_bits:                                  ; dword e: 1 << e (element e's bit of qh)
%assign e 0
%rep QK
                dd 1 << e
%assign e e + 1
%endrep

section .text

; Two block schemes, the same FMAs in the same order for every accumulator:
;   tile    (M = 2..5): the block's half of all TR rows is dequantized into
;           registers, then each 8 floats of x is loaded once for TR FMAs;
;   stream  (M = 1 and M >= 6): one weight row at a time is dequantized into
;           ymm2/ymm3 and its FMAs take x from memory (with few x rows the loads
;           are cheap; with many, the accumulators need the registers).
; TILE_ROWS_FOR M: %assign TR (weight rows per tile):
;   tile:   TR * M accumulators + 2 * TR weights + ymm0-1:  TR * (M + 2) <= 14
;   stream: TR * M accumulators + ymm0-3:                   TR * M <= 12
%macro TILE_ROWS_FOR 1
%if %1 == 1
%assign TR 8
%elif %1 == 2
%assign TR 3
%elif %1 <= 6
%assign TR 2
%else
%assign TR 1
%endif
%if W_BASE + TR * (%1 + 2) > NUM_YMM && (%1 >= 2 && %1 <= 5)
%error tile too large
%endif
%if W_BASE + 2 + TR * %1 > NUM_YMM
%error tile too large
%endif
%endmacro

; HELD_ROWS: %assign HELD_R to the weight rows whose registers the current tile
; (TILE_R x TILE_M) holds at once: TILE_R in the tile scheme, 1 when streaming.
%macro HELD_ROWS 0
%if TILE_R > 1 && TILE_M >= 2 && TILE_M <= 5
%assign HELD_R TILE_R
%else
%assign HELD_R 1
%endif
%endmacro

%macro ISA_SETUP 1
%endmacro

%macro ACC_ZERO 1
    HELD_ROWS
%assign acz ACC_BASE + %1
    vxorps          xmm %+ acz, xmm %+ acz, xmm %+ acz  ; VEX: clears the whole ymm
%endmacro

; ACC_FOLD a: xmm0[0] = the 8 lanes of accumulator a, folded in the fixed order.
%macro ACC_FOLD 1
    HELD_ROWS
%assign acf ACC_BASE + %1
    vextractf128    xmm0, ymm %+ acf, HIGH_HALF
    vaddps          xmm0, xmm0, xmm %+ acf          ; l + (l + 4)
    vmovhlps        xmm1, xmm0, xmm0
    vaddps          xmm0, xmm0, xmm1
    vmovshdup       xmm1, xmm0
    vaddss          xmm0, xmm0, xmm1
%endmacro

; SCALE_<fmt> addr: ymm0 = d (and ymm1 = m) of the block at [addr].
%macro SCALE_Q8_0 1
    vpbroadcastw    xmm0, [%1 + Q8_0_D]
    vcvtph2ps       ymm0, xmm0
%endmacro
%macro SCALE_Q4_0 1
    vpbroadcastw    xmm0, [%1 + Q4_0_D]
    vcvtph2ps       ymm0, xmm0
%endmacro
%macro SCALE_Q5_0 1
    vpbroadcastw    xmm0, [%1 + Q5_0_D]
    vcvtph2ps       ymm0, xmm0
%endmacro
%macro SCALE_Q4_1 1
    vpbroadcastw    xmm0, [%1 + Q4_1_D]
    vpbroadcastw    xmm1, [%1 + Q4_1_M]
    vcvtph2ps       ymm0, xmm0
    vcvtph2ps       ymm1, xmm1
%endmacro
%macro SCALE_Q4_KR 1
    vbroadcastss    ymm0, [%1 + Q4_KR_D]
    vbroadcastss    ymm1, [%1 + Q4_KR_M]
%endmacro
%macro SCALE_Q6_KR 1                            ; a scale a half: read by HALF_Q6_KR
%endmacro

; HALF_<fmt> addr, h, lo, hi: ymm lo / ymm hi = 8 weights each of half h of the
; block (scales in ymm0 / ymm1), and %assign XD0 / XD1 to the byte offsets in the
; block's x of their elements.
%macro HALF_Q8_0 4
    HALF_INT8       %1 + Q8_0_QS, %2, %3, %4
%endmacro

; HALF_INT8 quants, h, lo, hi: the 16 int8 weights of half h at [quants], times the
; scale in ymm0 (Q8_0 and Q6_KR differ only in where the scale comes from).
%macro HALF_INT8 4
    vpmovsxbd       ymm%3, [%1 + %2 * 16]
    vpmovsxbd       ymm%4, [%1 + %2 * 16 + 8]
    vcvtdq2ps       ymm%3, ymm%3
    vcvtdq2ps       ymm%4, ymm%4
    vmulps          ymm%3, ymm%3, ymm0
    vmulps          ymm%4, ymm%4, ymm0
%assign XD0 (%2 * 2) * YMM_X
%assign XD1 (%2 * 2 + 1) * YMM_X
%endmacro

; SCALED_HALVES a, b, g: ymm a, ymm b hold integer levels (elements 8g + l, 16 + 8g + l);
; both become floats times d (ymm0), exact (11 x 5 bits at most); XD0/XD1 name their x.
%macro SCALED_HALVES 3
    vcvtdq2ps       ymm%2, ymm%2
    vcvtdq2ps       ymm%1, ymm%1
    vmulps          ymm%2, ymm%2, ymm0
    vmulps          ymm%1, ymm%1, ymm0
%assign XD0 %3 * YMM_X
%assign XD1 (%3 + 2) * YMM_X
%endmacro

%macro HALF_Q4_0 4
    vpmovzxbd       ymm%3, [%1 + Q4_0_QS + %2 * 8]  ; byte b: q[b] | q[b + 16] << 4
    vpsrld          ymm%4, ymm%3, NIBBLE_BITS
    vpand           ymm%3, ymm%3, [c_nibble_mask]
    vpsubd          ymm%4, ymm%4, [c_q4_bias]
    vpsubd          ymm%3, ymm%3, [c_q4_bias]
    SCALED_HALVES   %3, %4, %2
%endmacro

; Q5_0: Q4_0's nibbles, then each element's qh bit: q - 16 = nibble + (bit ? 0 : -16),
; an integer, converted exactly and times d (exact: 11 x 5 bits).
%macro HALF_Q5_0 4
    vpmovzxbd       ymm%3, [%1 + Q5_0_QS + %2 * 8]  ; byte b: nibbles of elements b, b + 16
    vpsrld          ymm%4, ymm%3, NIBBLE_BITS
    vpand           ymm%3, ymm%3, [c_nibble_mask]
    Q5_HIGH_BITS    %1, %3, %2                      ; elements 8h + l
    Q5_HIGH_BITS    %1, %4, %2 + 2                  ; elements 16 + 8h + l
    SCALED_HALVES   %3, %4, %2
%endmacro

; Q5_HIGH_BITS addr, r, g: ymm r holds the nibbles of elements 8g + l (lane l); add
; Q5_HIGH_BIT - Q5_BIAS where bit 8g + l of the block's qh is set, -Q5_BIAS where it is
; clear: ymm r = q - 16. Clobbers ymm1.
%macro Q5_HIGH_BITS 3
    vpbroadcastd    ymm1, [%1 + Q5_0_QH]
    vpand           ymm1, ymm1, [c_q5_bits + (%3) * YMM_X]
    vpcmpeqd        ymm1, ymm1, [c_q5_bits + (%3) * YMM_X]  ; all ones where the bit is set
    vpandn          ymm1, ymm1, [c_q5_clear]        ; -16 where it is clear, else 0
    vpaddd          ymm%2, ymm%2, ymm1
%endmacro

%macro HALF_Q4_1 4
    HALF_Q4_MIN     %1 + Q4_1_QS, %2, %3, %4
%endmacro
%macro HALF_Q4_KR 4
    HALF_Q4_MIN     %1 + Q4_KR_QS, %2, %3, %4
%endmacro

%macro HALF_Q6_KR 4
    vbroadcastss    ymm0, [%1 + Q6_KR_D + %2 * KR_SCALE_BYTES]
    HALF_INT8       %1 + Q6_KR_QS, %2, %3, %4
%endmacro

; HALF_Q4_MIN quants, h, lo, hi: Q4_1's half from nibbles at [quants], d in ymm0
; and m in ymm1 (Q4_1 and Q4_KR differ only in where these come from).
%macro HALF_Q4_MIN 4
    vpmovzxbd       ymm%3, [%1 + %2 * 8]
    vpsrld          ymm%4, ymm%3, NIBBLE_BITS
    vpand           ymm%3, ymm%3, [c_nibble_mask]
    vcvtdq2ps       ymm%4, ymm%4
    vcvtdq2ps       ymm%3, ymm%3
    vfmadd132ps     ymm%4, ymm1, ymm0               ; q * d + m, one rounding
    vfmadd132ps     ymm%3, ymm1, ymm0
%assign XD0 %2 * YMM_X
%assign XD1 (%2 + 2) * YMM_X
%endmacro

; BLOCK_TILE fmt, R, M: for each half h of the block (16 weights), dequantize it
; for the R weight rows into ymm2.. (two registers a row; the scales are read
; again for each half), then for each x row load each of its two 8-float pieces
; once (ymm0) and FMA it into the R accumulators of that row (a single weight row
; FMAs x from memory). Accumulator (i, r) adds, per block, in every tile shape:
; lo(h = 0), hi(h = 0), lo(h = 1), hi(h = 1) (element order in the header).
%macro BLOCK_TILE 3
    HELD_ROWS
%if HELD_R == 1
%assign r 0
%rep %2
    SCALE_%1        W_ROW %+ r
%assign hh 0
%rep 2
%assign wh W_BASE + 1
    HALF_%1         W_ROW %+ r, hh, W_BASE, wh
%assign xi 0
%rep %3
%assign acn ACC_BASE + xi * %2 + r
    vfmadd231ps     ymm %+ acn, ymm %+ W_BASE, [X_ROW %+ xi + XD0]
    vfmadd231ps     ymm %+ acn, ymm %+ wh, [X_ROW %+ xi + XD1]
%assign xi xi + 1
%endrep
%assign hh hh + 1
%endrep
%assign r r + 1
%endrep
%else
%assign hh 0
%rep 2
%assign r 0
%rep %2
%assign wl W_BASE + 2 * r
%assign wh wl + 1
    SCALE_%1        W_ROW %+ r
    HALF_%1         W_ROW %+ r, hh, wl, wh
%assign r r + 1
%endrep
%assign xi 0
%rep %3
    vmovups         ymm0, [X_ROW %+ xi + XD0]
%assign r 0
%rep %2
%assign acn ACC_BASE + xi * %2 + r
%assign wl W_BASE + 2 * r
    vfmadd231ps     ymm %+ acn, ymm %+ wl, ymm0
%assign r r + 1
%endrep
    vmovups         ymm0, [X_ROW %+ xi + XD1]
%assign r 0
%rep %2
%assign acn ACC_BASE + xi * %2 + r
%assign wh W_BASE + 2 * r + 1
    vfmadd231ps     ymm %+ acn, ymm %+ wh, ymm0
%assign r r + 1
%endrep
%assign xi xi + 1
%endrep
%assign hh hh + 1
%endrep
%endif
%endmacro

QMM_KERNEL Q4_0, fs_qmm_q4_0_avx2
QMM_KERNEL Q4_1, fs_qmm_q4_1_avx2
QMM_KERNEL Q8_0, fs_qmm_q8_0_avx2
QMM_KERNEL Q5_0, fs_qmm_q5_0_avx2
QMM_KERNEL Q4_KR, fs_qmm_q4_kr_avx2
QMM_KERNEL Q6_KR, fs_qmm_q6_kr_avx2

; fs_fma_probe_avx2(rounds  rdi): one core's float32 multiply-add peak (quant.inc's
; FMA_PROBE): 12 chains in ymm2-13.
%define FMA_PROBE_CHAINS 12             ; ext/quant.h FS_FMA_PROBE_CHAINS_AVX2
FMA_PROBE fs_fma_probe_avx2, ymm, vxorps, 2, FMA_PROBE_CHAINS

section .note.GNU-stack noalloc noexec nowrite progbits
