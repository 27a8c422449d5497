/* A wall-clock step for one process tree, for tests: LD_PRELOAD this and set
 * CLOCKSHIFT_FILE to a file holding a signed number of seconds; CLOCK_REALTIME (and
 * gettimeofday, time) read that much later, re-read at most every 100 ms. Monotonic
 * clocks and sleeps are untouched (libfaketime 0.9.10 with its monotonic clock left
 * alone fails Python's time.sleep with EINVAL). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

typedef int (*gettime_fn)(clockid_t, struct timespec *);
static gettime_fn real_gettime;
static long long shift_ns, checked_ns;

static long long shift(void) {
    struct timespec now;
    if (!real_gettime) real_gettime = (gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
    real_gettime(CLOCK_MONOTONIC, &now);
    long long mono = now.tv_sec * 1000000000LL + now.tv_nsec;
    if (checked_ns == 0 || mono - checked_ns > 100000000LL) {
        const char *path = getenv("CLOCKSHIFT_FILE");
        FILE *f = path ? fopen(path, "r") : NULL;
        double s = 0;
        if (f) {
            if (fscanf(f, "%lf", &s) == 1) shift_ns = (long long)(s * 1e9);
            fclose(f);
        }
        checked_ns = mono;
    }
    return shift_ns;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    if (!real_gettime) real_gettime = (gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real_gettime(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        long long t = ts->tv_sec * 1000000000LL + ts->tv_nsec + shift();
        ts->tv_sec = t / 1000000000LL;
        ts->tv_nsec = t % 1000000000LL;
    }
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return -1;
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
