; trampoline.asm - call a kernel under test and check that it kept the ABI.
;
; Build: nasm -f elf64 tests/kernels/abi/trampoline.asm -o trampoline.o
;
; C sees four prototypes for the same code (see checkasm.c): the function under
; test first, then its own integer/pointer arguments, which this code shifts down
; one register (rsi->rdi, rdx->rsi, rcx->rdx, r8->rcx, r9->r8). Vector
; arguments are already where the callee wants them (xmm0) and are left alone.
; At most five integer arguments can be passed through, enough for kernels.h.
;
; Before the call:
;   - rbx, rbp, r12-r15 get the canaries from checkasm_canary[0..5] (C picks
;     them from its seeded RNG), rax/r9-r11 get checkasm_canary[6];
;   - xmm0 keeps its low checkasm_xmm0_live bytes (0, 4 or 8: the float or
;     double argument) and the rest of it, xmm1-15, and (when
;     checkasm_have_avx512) zmm16-31 and k1-k7 are filled with a NaN pattern, so
;     a kernel that relies on a register it did not set (say an accumulator it
;     forgot to zero) returns NaN instead of passing by luck;
;   - vzeroupper, so the upper-state check below sees only what the callee left.
; After the call, bits are ORed into checkasm_fail (CHECKASM_* in checkasm.c):
;   0-5 rbx rbp r12 r13 r14 r15 changed, 6 rsp changed, 7 direction flag set,
;   8 upper ymm/zmm state of registers 0-15 still in use (no vzeroupper; only
;   when checkasm_check_xinuse, i.e. XGETBV with ECX=1 exists), 9 MXCSR changed.
; rax and xmm0 (the return registers) come back as the callee left them.
;
; ABI of the trampoline itself: System V AMD64; it saves and restores the
; caller's rbx, rbp, r12-r15 (it needs them for the canaries) and keeps the
; stack 16-byte aligned at the call.

default rel

%define N_SAVED          6              ; rbx rbp r12 r13 r14 r15
%define SCRATCH_CANARY   N_SAVED        ; canary index for rax, r9, r10, r11
%define QWORD_BYTES      8
%define ALIGN_PAD        8              ; 6 pushes + return address = 56 bytes

%define FAIL_RSP         (1 << 6)
%define FAIL_DF          (1 << 7)
%define FAIL_UPPER       (1 << 8)
%define FAIL_MXCSR       (1 << 9)

%define RFLAGS_DF        (1 << 10)
%define XGETBV_XINUSE    1              ; ECX for XGETBV: the in-use bitmap
; XINUSE bits that vzeroupper clears: AVX (upper ymm0-15) and ZMM_Hi256 (upper
; 256 of zmm0-15). Hi16_ZMM (zmm16-31) is not touched by vzeroupper, by design.
%define XINUSE_UPPER_0_15 ((1 << 2) | (1 << 6))
%define N_OPMASKS        7              ; k1-k7 (k0 is not an operand mask)

section .data
align 64
global checkasm_canary, checkasm_fail, checkasm_xmm0_live
global checkasm_check_xinuse, checkasm_have_avx512, checkasm_fn
checkasm_canary:        times N_SAVED + 1 dq 0
checkasm_fn:            dq 0
checkasm_fail:          dd 0
checkasm_xmm0_live:     dd 0
checkasm_check_xinuse:  dd 0
checkasm_have_avx512:   dd 0

section .rodata
align 64
nan_pattern:            times 16 dd 0xFFF1DEAD  ; a quiet NaN, any sign works

section .bss
align 16
saved_rsp:              resq 1
mxcsr_before:           resd 1
mxcsr_after:            resd 1
xmm0_live:              resq 1

section .text

global checkasm_call_store:function, checkasm_call_sum:function
global checkasm_call_scale:function, checkasm_call_scan:function
checkasm_call_store:
checkasm_call_sum:
checkasm_call_scale:
checkasm_call_scan:
    push            rbx
    push            rbp
    push            r12
    push            r13
    push            r14
    push            r15
    sub             rsp, ALIGN_PAD
    mov             [checkasm_fn], rdi
    mov             rdi, rsi
    mov             rsi, rdx
    mov             rdx, rcx
    mov             rcx, r8
    mov             r8, r9

    ; Poison the vector registers, keeping the live part of xmm0.
    vmovq           [xmm0_live], xmm0
    vzeroupper
    vmovdqu         xmm1, [nan_pattern]
    vmovdqa         xmm0, xmm1
    vmovq           xmm2, [xmm0_live]
    mov             eax, [checkasm_xmm0_live]
    cmp             eax, 4
    jne             .not_float
    vmovss          xmm0, xmm1, xmm2            ; low 4 bytes live, rest NaN
.not_float:
    cmp             eax, 8
    jne             .xmm0_done
    vmovsd          xmm0, xmm1, xmm2            ; low 8 bytes live, rest NaN
.xmm0_done:
%assign r 2
%rep 14
    vmovdqa         xmm %+ r, xmm1
%assign r r + 1
%endrep
    cmp             dword [checkasm_have_avx512], 0
    je              .poisoned
    vmovdqu32       zmm16, [nan_pattern]
%assign r 17
%rep 15
    vmovdqa32       zmm %+ r, zmm16
%assign r r + 1
%endrep
    mov             eax, [nan_pattern]
%assign r 1
%rep N_OPMASKS
    kmovw           k %+ r, eax
%assign r r + 1
%endrep
    vzeroupper                                  ; zmm16-31 stay poisoned
.poisoned:

    mov             rbx, [checkasm_canary + 0 * QWORD_BYTES]
    mov             rbp, [checkasm_canary + 1 * QWORD_BYTES]
    mov             r12, [checkasm_canary + 2 * QWORD_BYTES]
    mov             r13, [checkasm_canary + 3 * QWORD_BYTES]
    mov             r14, [checkasm_canary + 4 * QWORD_BYTES]
    mov             r15, [checkasm_canary + 5 * QWORD_BYTES]
    mov             rax, [checkasm_canary + SCRATCH_CANARY * QWORD_BYTES]
    mov             r9, rax
    mov             r10, rax
    mov             r11, rax
    stmxcsr         [mxcsr_before]
    mov             [saved_rsp], rsp
    call            [checkasm_fn]

    xor             r11d, r11d
%macro CHECK_CANARY 2                           ; register, canary index
    cmp             %1, [checkasm_canary + %2 * QWORD_BYTES]
    je              %%ok
    or              r11d, 1 << %2
%%ok:
%endmacro
    CHECK_CANARY    rbx, 0
    CHECK_CANARY    rbp, 1
    CHECK_CANARY    r12, 2
    CHECK_CANARY    r13, 3
    CHECK_CANARY    r14, 4
    CHECK_CANARY    r15, 5
    cmp             rsp, [saved_rsp]
    je              .rsp_ok
    or              r11d, FAIL_RSP
    mov             rsp, [saved_rsp]            ; so that the pops below work
.rsp_ok:
    pushfq
    pop             r10
    test            r10d, RFLAGS_DF
    jz              .df_ok
    or              r11d, FAIL_DF
    cld
.df_ok:
    stmxcsr         [mxcsr_after]
    mov             r10d, [mxcsr_after]
    cmp             r10d, [mxcsr_before]
    je              .mxcsr_ok
    or              r11d, FAIL_MXCSR
    ldmxcsr         [mxcsr_before]
.mxcsr_ok:
    cmp             dword [checkasm_check_xinuse], 0
    je              .done
    mov             r10, rax                    ; xgetbv writes edx:eax
    mov             ecx, XGETBV_XINUSE
    xgetbv
    test            eax, XINUSE_UPPER_0_15
    jz              .upper_ok
    or              r11d, FAIL_UPPER
.upper_ok:
    mov             rax, r10
.done:
    or              [checkasm_fail], r11d
    add             rsp, ALIGN_PAD
    pop             r15
    pop             r14
    pop             r13
    pop             r12
    pop             rbp
    pop             rbx
    ret

section .note.GNU-stack noalloc noexec nowrite progbits
