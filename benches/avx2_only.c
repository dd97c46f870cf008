// avx2_only.so: a process that loads this library first (LD_PRELOAD) sees a CPU without
// AVX-512 and AMX, as a Zen 3 is, on a CPU that has them. benches/vs_jax.sh --isa avx2 uses
// it for both sides, because the peer cannot be limited otherwise: XLA_FLAGS=
// --xla_cpu_max_isa=AVX2 limits the code XLA generates, but XLA's matrix products run in
// YNNPACK, which picks its kernels from CPUID at run time (on an AVX-512 CPU under that flag,
// `perf report` shows ynn::dot_fp32_..._avx512 doing the work).
//
// How: Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID, where /proc/cpuinfo lists
// cpuid_fault) makes every CPUID instruction of the process raise SIGSEGV; the handler runs
// the real CPUID with faulting briefly off, clears the feature bits of AVX-512 and AMX (leaf 7)
// and steps over the instruction. The setting passes to every thread and child process (the
// library is loaded again after an exec). Code that reads the features before this library's
// constructor runs (the dynamic loader's, glibc's string functions) still sees them, and any
// other fault is left to the default action, so the process dies of it as it would have.
//
// Build: gcc -O2 -shared -fPIC benches/avx2_only.c -o avx2_only.so
// Check: LD_PRELOAD=./avx2_only.so grep -c avx512 /proc/cpuinfo reads the kernel's view (still
// there); LD_PRELOAD=./avx2_only.so python3 -c '...' with a CPUID reader shows it gone.
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

// Leaf 7, subleaf 0. EBX: AVX512F 16, DQ 17, IFMA 21, PF 26, ER 27, CD 28, BW 30, VL 31.
#define LEAF7_EBX_AVX512 \
    ((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) | (1u << 28) | (1u << 30) | (1u << 31))
// ECX: VBMI 1, VBMI2 6, VNNI 11, BITALG 12, VPOPCNTDQ 14.
#define LEAF7_ECX_AVX512 ((1u << 1) | (1u << 6) | (1u << 11) | (1u << 12) | (1u << 14))
// EDX: 4VNNIW 2, 4FMAPS 3, VP2INTERSECT 8, AMX-BF16 22, AVX512-FP16 23, AMX-TILE 24, AMX-INT8 25.
#define LEAF7_EDX_AVX512_AMX \
    ((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | (1u << 24) | (1u << 25))
// Leaf 7, subleaf 1. EAX: AVX-VNNI 4, AVX512-BF16 5 (a Zen 3 has neither).
#define LEAF7_1_EAX_MASKED ((1u << 4) | (1u << 5))

static long set_cpuid_enabled(int enabled) {
    return syscall(SYS_arch_prctl, ARCH_SET_CPUID, enabled);
}

static void masked_cpuid(uint32_t leaf, uint32_t subleaf, uint32_t out[4]) {
    set_cpuid_enabled(1);
    __cpuid_count(leaf, subleaf, out[0], out[1], out[2], out[3]);
    set_cpuid_enabled(0);
    if (leaf == 7 && subleaf == 0) {
        out[1] &= ~LEAF7_EBX_AVX512;
        out[2] &= ~LEAF7_ECX_AVX512;
        out[3] &= ~LEAF7_EDX_AVX512_AMX;
    } else if (leaf == 7 && subleaf == 1) {
        out[0] &= ~LEAF7_1_EAX_MASKED;
    }
}

static void on_segv(int sig, siginfo_t *info, void *context) {
    (void)info;
    ucontext_t *uc = context;
    greg_t *regs = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)regs[REG_RIP];
    // The reads: RIP is where the faulting instruction starts, so its first byte is mapped; a
    // 0F there begins an instruction of two or more bytes. Were its second byte unmapped (the
    // fault a fetch's), this read faults in turn, and the default action ends the process.
    if (ip[0] != 0x0f || ip[1] != 0xa2) {
        // Not ours: the default action, when the instruction runs again.
        signal(sig, SIG_DFL);
        return;
    }
    uint32_t out[4];
    masked_cpuid((uint32_t)regs[REG_RAX], (uint32_t)regs[REG_RCX], out);
    regs[REG_RAX] = out[0];
    regs[REG_RBX] = out[1];
    regs[REG_RCX] = out[2];
    regs[REG_RDX] = out[3];
    regs[REG_RIP] += 2;
}

__attribute__((constructor)) static void hide_avx512(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_segv;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGSEGV, &action, NULL) != 0 || set_cpuid_enabled(0) != 0) {
        fprintf(stderr, "avx2_only.so: cannot make CPUID fault here (needs cpuid_fault in /proc/cpuinfo)\n");
        exit(70);
    }
    // The process's own view, through the handler: a mask that did not take must not pass for one.
    unsigned int eax, ebx, ecx, edx;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    if (ebx & LEAF7_EBX_AVX512) {
        fprintf(stderr, "avx2_only.so: CPUID still reports AVX-512 after masking\n");
        exit(70);
    }
}
