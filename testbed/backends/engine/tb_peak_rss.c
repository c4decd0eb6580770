/* tb_peak_rss OUT PROGRAM [ARG...]: runs PROGRAM with its arguments, waits for it, and writes to OUT its
 * peak resident set size as JSON ({"peak_rss_kb": N}); exits with PROGRAM's status (128 + N when a signal N
 * ended it). The figure is the kernel's high-water mark of the process's resident memory (VmHWM in
 * /proc/PID/status), which Linux hands to the parent that reaps it as wait4's ru_maxrss (kilobytes; the
 * largest of the process and of the children it reaped): read at exit, so nothing is sampled or missed.
 * Plain C99 + POSIX, built static per device ABI by testbed.backends.engine.peak_rss. */
#define _DEFAULT_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile pid_t child;

static void forward(int sig) { /* a stop asked of the wrapper is asked of the engine */
    if (child > 0) kill(child, sig);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: tb_peak_rss OUT PROGRAM [ARG...]\n");
        return 2;
    }
    signal(SIGTERM, forward);
    signal(SIGINT, forward);
    signal(SIGHUP, forward);
    child = fork();
    if (child < 0) {
        fprintf(stderr, "tb_peak_rss: fork: %s\n", strerror(errno));
        return 4;
    }
    if (child == 0) {
        execvp(argv[2], argv + 2);
        fprintf(stderr, "tb_peak_rss: cannot run %s: %s\n", argv[2], strerror(errno));
        _exit(127);
    }
    int status = 0;
    struct rusage usage;
    memset(&usage, 0, sizeof usage);
    while (wait4(child, &status, 0, &usage) < 0) {
        if (errno != EINTR) {
            fprintf(stderr, "tb_peak_rss: wait4: %s\n", strerror(errno));
            return 4;
        }
    }
    FILE *out = fopen(argv[1], "w");
    if (out) {
        fprintf(out, "{\"peak_rss_kb\": %ld}\n", (long)usage.ru_maxrss);
        fclose(out);
    } else {
        fprintf(stderr, "tb_peak_rss: cannot write %s: %s\n", argv[1], strerror(errno));
    }
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return 4;
}
