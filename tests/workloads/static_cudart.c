/* A CUDA program that carries the runtime inside: linked against libcudart_static.a
 * (the nvidia-cuda-runtime-cu12 wheel's), so it maps no libcudart.so, as programs
 * built by nvcc (whose default is the static runtime) do. Plain C, no nvcc needed:
 *
 *   cc -O1 -o static_cudart static_cudart.c CUDART_LIB/libcudart_static.a \
 *      -lpthread -ldl -lrt
 *
 *   ./static_cudart STEPS LAUNCHES MEMCPYS [GO_FILE]
 *
 * Per step: LAUNCHES cudaLaunchKernel, MEMCPYS cudaMemcpy (host to device) and one
 * cudaDeviceSynchronize. Without a GPU each call fails fast (35: no driver, 100: no
 * device) and the probes still fire. With GO_FILE it waits for that file before the
 * first call; without, it calls at once. Prints one JSON line of the calls it made.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct { unsigned x, y, z; } dim3_t;
int cudaLaunchKernel(const void *func, dim3_t grid, dim3_t block, void **args,
                     size_t shared_mem, void *stream);
int cudaMemcpy(void *dst, const void *src, size_t count, int kind);
int cudaDeviceSynchronize(void);

static void kernel_stub(void) {}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: %s STEPS LAUNCHES MEMCPYS [GO_FILE]\n", argv[0]);
        return 2;
    }
    long steps = atol(argv[1]), launches = atol(argv[2]), memcpys = atol(argv[3]);
    if (argc > 4)
        while (access(argv[4], F_OK) != 0)
            usleep(2000);
    dim3_t grid = {64, 2, 1}, block = {128, 1, 1};
    char host[64] = {0}, dev[64];
    long n_launch = 0, n_copy = 0, n_sync = 0, last_rc = 0;
    for (long s = 0; s < steps; s++) {
        for (long i = 0; i < launches; i++, n_launch++)
            last_rc = cudaLaunchKernel((const void *)kernel_stub, grid, block, NULL, 0, NULL);
        for (long i = 0; i < memcpys; i++, n_copy++)
            cudaMemcpy(dev, host, sizeof(host), 1);
        cudaDeviceSynchronize();
        n_sync++;
    }
    printf("{\"pid\": %d, \"calls\": {\"cudaLaunchKernel\": %ld, \"cudaMemcpy\": %ld, "
           "\"cudaDeviceSynchronize\": %ld}, \"last_rc\": %ld}\n",
           (int)getpid(), n_launch, n_copy, n_sync, last_rc);
    return 0;
}
