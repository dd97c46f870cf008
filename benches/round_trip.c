// The round trip of one cache line between two CPUs, in ns: two threads, each pinned to one CPU,
// hand a flag back and forth 200,000 times; prints the mean of one round trip. benches/vs_jax.sh runs it
// around each side of each round: on the 2-vCPU VMs here it reads 55–100 ns while the vCPUs share a cache
// and 260–390 ns while they do not (the slow spells of docs/benchmarks.md), which no load figure shows.
//
//   gcc -O2 -pthread benches/round_trip.c -o round_trip && ./round_trip [CPU_A CPU_B]   (default 0 1)
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { ROUNDS = 200000 };

static _Alignas(64) atomic_int flag;

static int pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *answer(void *cpu) {
    if (pin(*(int *)cpu) != 0) {
        fprintf(stderr, "round_trip: cannot run on CPU %d\n", *(int *)cpu);
        exit(1);
    }
    for (int i = 0; i < ROUNDS; i++) {
        while (atomic_load_explicit(&flag, memory_order_acquire) != 1) {}
        atomic_store_explicit(&flag, 0, memory_order_release);
    }
    return NULL;
}

int main(int argc, char **argv) {
    int cpus[2] = {0, 1};
    if (argc == 3) {
        cpus[0] = atoi(argv[1]);
        cpus[1] = atoi(argv[2]);
    } else if (argc != 1) {
        fprintf(stderr, "usage: round_trip [CPU_A CPU_B]\n");
        return 64;
    }
    if (pin(cpus[0]) != 0) {
        fprintf(stderr, "round_trip: cannot run on CPU %d\n", cpus[0]);
        return 1;
    }
    pthread_t other;
    if (pthread_create(&other, NULL, answer, &cpus[1]) != 0) {
        fprintf(stderr, "round_trip: cannot start a thread\n");
        return 1;
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < ROUNDS; i++) {
        atomic_store_explicit(&flag, 1, memory_order_release);
        while (atomic_load_explicit(&flag, memory_order_acquire) != 0) {}
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    pthread_join(other, NULL);
    printf("%.0f\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / ROUNDS);
    return 0;
}
