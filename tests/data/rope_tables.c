/* The engine's RoPE tables (kernels/model.c's rope_tables, included as it is: the code under test, not
 * a copy) for positions 0..ROWS-1 over head sizes, bases and linear scalings, each table's float32 bits
 * hashed (FNV-1a, 64 bit) and printed one line per table. rope_tables is the one place the kernels take
 * a libm result that differs between libms (double pow, cos, sin, rounded to float32): built against
 * glibc and against musl, for every target, the lines must agree.
 *
 *   rope_tables [ROWS]        prints "hd base scaling table hash" lines */
#include "model.c"

#include <stdio.h>
#include <stdlib.h>

static uint64_t fnv1a(const void *p, size_t n, uint64_t h) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

int main(int argc, char **argv) {
    const int rows = argc > 1 ? atoi(argv[1]) : 4096;
    const int hds[] = {16, 64, 128, 256};
    const double bases[] = {10000.0, 1000000.0}, scalings[] = {1.0, 8.0};
    float *c = malloc(sizeof(float) * (size_t)rows * 256), *s = malloc(sizeof(float) * (size_t)rows * 256);
    if (!c || !s || rows < 1) return 2;
    for (int i = 0; i < 4; i++)
        for (int b = 0; b < 2; b++)
            for (int k = 0; k < 2; k++) {
                rope_tables(0, rows, hds[i], bases[b], scalings[k], c, s);
                const size_t n = sizeof(float) * (size_t)rows * (size_t)hds[i];
                printf("%d %g %g cos %016llx\n", hds[i], bases[b], scalings[k],
                       (unsigned long long)fnv1a(c, n, 1469598103934665603ull));
                printf("%d %g %g sin %016llx\n", hds[i], bases[b], scalings[k],
                       (unsigned long long)fnv1a(s, n, 1469598103934665603ull));
            }
    return 0;
}
