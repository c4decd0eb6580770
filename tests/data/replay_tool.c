/* Stands in for one of llama.cpp's tools on the loopback phone, which has no llama.cpp build: a real
   program for the phone's ABI (so the run's evidence names an ELF of its machine, as a real tool's does)
   that replays outputs recorded from the real tools, kept beside it:
     TOOL perf ...   prints perf.out   (test-backend-ops perf mode)
     TOOL test ...   prints test.out   (test-backend-ops test mode)
     TOOL ...        prints bench.json (llama-bench -o json)
   and exits with EXIT_CODE (a crashed tool: 134). */
#include <stdio.h>
#include <string.h>

#ifndef EXIT_CODE
#define EXIT_CODE 0
#endif

int main(int argc, char **argv) {
    const char *name = argc > 1 && strcmp(argv[1], "perf") == 0 ? "perf.out"
                     : argc > 1 && strcmp(argv[1], "test") == 0 ? "test.out" : "bench.json";
    char path[4096];
    const char *slash = strrchr(argv[0], '/');
    int dir = slash ? (int)(slash - argv[0]) + 1 : 0;
    if (snprintf(path, sizeof path, "%.*s%s", dir, argv[0], name) >= (int)sizeof path) return 2;
    FILE *f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "cannot open %s\n", path); return 2; }
    char buf[8192];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) fwrite(buf, 1, n, stdout);
    fclose(f);
    fflush(stdout);
    return EXIT_CODE;
}
