/* Two native threads and one pthread mutex, the feeding one calling the real CUDA runtime.
 *
 * The "holder" thread takes the mutex and computes for HOLD_US while holding it, then
 * lets go for a moment, again and again. The main thread ("feeder") takes the same
 * mutex before every step, then calls cudaLaunchKernel and cudaStreamSynchronize from
 * the libcudart given on the command line (without a GPU they fail fast and the probes
 * fire all the same). So the feeder spends its time waiting on the mutex's futex word,
 * woken by the holder: the case fleetd's lock_contention rule must name, with the
 * mutex's address, which this program prints first (one JSON line).
 *
 *   cc -O1 -pthread -o lock_pair lock_pair.c -ldl
 *   ./lock_pair LIBCUDART SECONDS [GO_FILE]
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define HOLD_US 2000
#define GAP_US 50
#define WORK_US 200 /* the feeder's own host work per step, outside the lock */

static pthread_mutex_t shared = PTHREAD_MUTEX_INITIALIZER;
static volatile int running = 1;

typedef int (*launch_fn)(const void *, unsigned long long, unsigned, unsigned long long,
                         unsigned, void **, size_t, void *);
typedef int (*sync_fn)(void *);

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void spin_us(int us)
{
    double end = now_s() + us / 1e6;
    while (now_s() < end)
        ;
}

static void *holder(void *arg)
{
    (void)arg;
    pthread_setname_np(pthread_self(), "holder");
    while (running) {
        pthread_mutex_lock(&shared);
        spin_us(HOLD_US);
        pthread_mutex_unlock(&shared);
        spin_us(GAP_US);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s LIBCUDART SECONDS [GO_FILE]\n", argv[0]);
        return 2;
    }
    void *rt = dlopen(argv[1], RTLD_NOW);
    if (!rt) {
        fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
        return 1;
    }
    /* cudaLaunchKernel(func, dim3 grid, dim3 block, args, shmem, stream): dim3 is 12
     * bytes, passed in two registers each on x86_64: (x | y << 32), z. */
    launch_fn launch = (launch_fn)dlsym(rt, "cudaLaunchKernel");
    sync_fn sync = (sync_fn)dlsym(rt, "cudaStreamSynchronize");
    if (!launch || !sync) {
        fprintf(stderr, "libcudart without cudaLaunchKernel/cudaStreamSynchronize\n");
        return 1;
    }
    printf("{\"pid\": %d, \"mutex\": \"%p\"}\n", getpid(), (void *)&shared);
    fflush(stdout);
    if (argc > 3)
        while (access(argv[3], F_OK) != 0)
            usleep(5000);
    pthread_t t;
    pthread_create(&t, NULL, holder, NULL);
    double end = now_s() + atof(argv[2]);
    long steps = 0;
    while (now_s() < end) {
        pthread_mutex_lock(&shared);
        pthread_mutex_unlock(&shared);
        for (int i = 0; i < 4; i++)
            launch((const void *)&shared, 1ull | 1ull << 32, 1, 32ull | 1ull << 32, 1, NULL,
                   0, NULL);
        sync(NULL);
        /* Host work between steps: without it the feeder would retake the mutex before
         * the woken holder runs (glibc mutexes are not fair) and never wait at all. */
        spin_us(WORK_US);
        steps++;
    }
    running = 0;
    pthread_join(t, NULL);
    fprintf(stderr, "%ld steps\n", steps);
    return 0;
}
