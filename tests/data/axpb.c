/* A tiny benchmark-and-dump program following testbed.runners.native's contract, for the runner's
   tests until the real kernels arrive: y = a * x + b over a float32 vector.
     ./axpb A B REPS     reads x.npy, writes y.npy and timings.json in the current folder
   Built with -DPLANTED_BUG it skips the last element (a tail-handling bug the oracle must catch). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static float *read_npy(const char *path, long *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    unsigned char pre[10];
    if (fread(pre, 1, 10, f) != 10 || memcmp(pre, "\x93NUMPY", 6) != 0 || pre[6] != 1) { fclose(f); return NULL; }
    unsigned hlen = pre[8] | (pre[9] << 8);
    char *header = calloc(hlen + 1, 1);
    if (fread(header, 1, hlen, f) != hlen || !strstr(header, "'<f4'") || strstr(header, "True")) { fclose(f); return NULL; }
    free(header);
    long start = ftell(f);
    fseek(f, 0, SEEK_END);
    *n = (ftell(f) - start) / 4;
    fseek(f, start, SEEK_SET);
    float *x = malloc(*n * 4 + 4);
    if (fread(x, 4, *n, f) != (size_t)*n) { fclose(f); return NULL; }
    fclose(f);
    return x;
}

static int write_npy(const char *path, const float *y, long n) {
    char header[128];
    int len = snprintf(header, sizeof header, "{'descr': '<f4', 'fortran_order': False, 'shape': (%ld,), }", n);
    while ((10 + len + 1) % 64) header[len++] = ' ';
    header[len++] = '\n';
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, len & 0xff, len >> 8};
    fwrite(pre, 1, 10, f);
    fwrite(header, 1, len, f);
    fwrite(y, 4, n, f);
    return fclose(f);
}

int main(int argc, char **argv) {
    if (argc != 4) { fprintf(stderr, "usage: %s A B REPS\n", argv[0]); return 2; }
    float a = strtof(argv[1], NULL), b = strtof(argv[2], NULL);
    int reps = atoi(argv[3]);
    long n;
    float *x = read_npy("x.npy", &n);
    if (!x) { fprintf(stderr, "cannot read x.npy as a float32 vector\n"); return 3; }
    float *y = calloc(n, 4);
    FILE *t = fopen("timings.json", "w");
    fprintf(t, "{\"what\": \"y = a*x + b over %ld floats\", \"seconds\": [", n);
    for (int r = 0; r < reps; r++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
#ifdef PLANTED_BUG
        for (long i = 0; i < n - 1; i++) y[i] = a * x[i] + b;
#else
        for (long i = 0; i < n; i++) y[i] = a * x[i] + b;
#endif
        clock_gettime(CLOCK_MONOTONIC, &t1);
        fprintf(t, "%s%.9f", r ? ", " : "", (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec));
    }
    fprintf(t, "]}\n");
    fclose(t);
    return write_npy("y.npy", y, n) ? 4 : 0;
}
