/* The CPU backend's threads: one OpenMP team for everything (our kernels, row ops, attention,
 * and OpenBLAS's jobs for the heads' GEMMs), sized once from what this process may use.
 *
 * Default count: FASTTRAN_NUM_THREADS, else OMP_NUM_THREADS, else the CPUs in this process's
 * affinity mask capped by the cgroup CPU quota (v2 cpu.max, v1 cfs_quota_us / cfs_period_us),
 * not the host's core count: a container given 2 CPUs of a 64-core host runs 2 threads.
 * Every parallel region names ft_num_threads() explicitly, so set_num_threads() holds for every
 * calling thread (OpenMP's own setting is per thread: a prefetch thread would not see it).
 *
 * Fork: GNU OpenMP's team cannot cross fork() -- a child that enters a parallel region after
 * its parent ran one waits forever for threads that were not copied. A child forked after the
 * parent ran a parallel region therefore runs fasttran on one thread (set_num_threads cannot
 * raise it; the spawn and forkserver start methods give a fresh process that can).
 *
 * Waiting: fasttran/__init__.py sets OMP_WAIT_POLICY=passive before the OpenMP runtime loads
 * (unless the user set it): a worker that finishes early sleeps instead of spinning, so on a
 * machine shared with a busy process the core goes to the thread that still has work. */
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/blas.h"
#include "fasttran.h"

/* OpenBLAS (pthreads build) keeps its own thread pool; a callback lets us run its parallel jobs
 * on the OpenMP team instead, so there is one pool. Level-3 jobs synchronise with each other,
 * so they must run concurrently: one thread per job. */
static void blas_jobs_on_openmp(int sync, openblas_dojob_callback dojob, int numjobs, size_t elsize,
                                void *jobdata, int dojob_data) {
    (void)sync;
#pragma omp parallel for num_threads(numjobs) schedule(static, 1)
    for (int i = 0; i < numjobs; i++) dojob(i, (char *)jobdata + (size_t)i * elsize, dojob_data);
}

static atomic_int g_threads;
static atomic_int g_team_used;        /* a parallel region of more than one thread may have run */
static atomic_int g_forked_single;    /* this process was forked after that: one thread only */

static void after_fork_in_child(void) {
    if (atomic_load(&g_team_used)) {
        atomic_store(&g_forked_single, 1);
        atomic_store(&g_threads, 1);
        ft_blas_set_threads(1);
    }
}

/* CPUs allowed by a cgroup quota file holding "quota period" (v2 cpu.max) or by two v1 files;
 * 0 when there is no limit or nothing to read */
static int cgroup_v2_limit(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char q[32] = "";
    long long period = 0;
    int n = fscanf(f, "%31s %lld", q, &period);
    fclose(f);
    if (n != 2 || strcmp(q, "max") == 0 || period <= 0) return 0;
    long long quota = atoll(q);
    return quota > 0 ? (int)((quota + period - 1) / period) : 0;
}

static long long read_ll(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    long long v = -1;
    if (fscanf(f, "%lld", &v) != 1) v = -1;
    fclose(f);
    return v;
}

static int cgroup_limit(void) {
    int best = 0;
    /* v2: the namespace root, then this process's own group (/proc/self/cgroup "0::/path") */
    int lim = cgroup_v2_limit("/sys/fs/cgroup/cpu.max");
    if (lim > 0) best = lim;
    FILE *f = fopen("/proc/self/cgroup", "r");
    if (f) {
        char line[512];
        while (fgets(line, sizeof line, f)) {
            if (strncmp(line, "0::", 3) != 0) continue;
            line[strcspn(line, "\n")] = '\0';
            char path[600];
            snprintf(path, sizeof path, "/sys/fs/cgroup%s/cpu.max", line + 3);
            lim = cgroup_v2_limit(path);
            if (lim > 0 && (best == 0 || lim < best)) best = lim;
        }
        fclose(f);
    }
    /* v1 */
    static const char *v1[][2] = {{"/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"},
                                  {"/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us"}};
    for (int k = 0; k < 2; k++) {
        long long quota = read_ll(v1[k][0]), period = read_ll(v1[k][1]);
        if (quota > 0 && period > 0) {
            lim = (int)((quota + period - 1) / period);
            if (best == 0 || lim < best) best = lim;
        }
    }
    return best;
}

static int env_threads(const char *name) {
    const char *v = getenv(name);
    if (!v || !*v) return 0;
    char *end;
    long n = strtol(v, &end, 10);   /* OMP_NUM_THREADS may be a list: its first entry */
    if (end == v || n < 1 || n > 4096) {
        fprintf(stderr, "fasttran: ignoring %s=%s (expected a positive integer)\n", name, v);
        return 0;
    }
    return (int)n;
}

int ft_default_threads(void) {
    int n = env_threads("FASTTRAN_NUM_THREADS");
    if (!n) n = env_threads("OMP_NUM_THREADS");
    return n ? n : ft_cpu_count();
}

int ft_cpu_count(void) {
    cpu_set_t set;
    int n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
    if (n < 1) n = omp_get_num_procs();
    int lim = cgroup_limit();
    if (lim > 0 && lim < n) n = lim;
    return n < 1 ? 1 : n;
}

static pthread_once_t threads_once = PTHREAD_ONCE_INIT;
static void threads_init(void) {
    pthread_atfork(NULL, NULL, after_fork_in_child);
    ft_blas_set_threads_callback(blas_jobs_on_openmp);
    int n = ft_default_threads();
    atomic_store(&g_threads, n);
    ft_blas_set_threads(n);
}
void ft_blas_use_openmp(void) { pthread_once(&threads_once, threads_init); }

int ft_num_threads(void) {
    pthread_once(&threads_once, threads_init);
    const int n = atomic_load(&g_threads);
    if (n > 1 && !atomic_load(&g_team_used)) atomic_store(&g_team_used, 1);   /* every region asks first */
    return n;
}

int ft_forked_single_thread(void) { return atomic_load(&g_forked_single); }

void ft_set_num_threads(int n) {
    pthread_once(&threads_once, threads_init);
    if (n < 1) n = 1;
    if (atomic_load(&g_forked_single)) n = 1;   /* see "Fork" above */
    atomic_store(&g_threads, n);
    omp_set_num_threads(n);   /* this thread's OpenMP default too, for code outside fasttran's regions */
    ft_blas_set_threads(n);
}

const char *ft_blas_name(void) {
    static char buf[256];
    snprintf(buf, sizeof buf, "%s (core %s)", ft_blas_config(), ft_blas_corename());
    return buf;
}
