/* Engine contract v1's C helper (tb_engine.h): request.args in, status.json and timings.json out. */
#define _POSIX_C_SOURCE 200809L
#include "tb_engine.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "harness.h"

struct tb_request {
    int n;
    char **keys, **values;
    char **config; /* tb_req_model_config's strings, made on first use */
};

static char *copy(const char *s, size_t n) {
    char *c = malloc(n + 1);
    if (!c) {
        fputs("error: out of memory reading request.args\n", stderr);
        exit(2);
    }
    memcpy(c, s, n);
    c[n] = '\0';
    return c;
}

tb_request *tb_request_load(const char *request_dir) {
    char path[4096], line[65536];
    snprintf(path, sizeof path, "%s/request.args", request_dir);
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "error: cannot read %s: %s\n", path, strerror(errno));
        return NULL;
    }
    tb_request *req = calloc(1, sizeof *req);
    int cap = 0;
    while (req && fgets(line, sizeof line, f)) {
        size_t len = strcspn(line, "\r\n");
        if (len == sizeof line - 1) {
            fprintf(stderr, "error: %s: a line longer than %zu bytes\n", path, sizeof line - 2);
            fclose(f);
            tb_request_free(req);
            return NULL;
        }
        if (!len || line[0] == '#') continue;
        char *eq = memchr(line, '=', len);
        if (!eq) {
            fprintf(stderr, "error: %s: line %.60s is not key=value\n", path, line);
            fclose(f);
            tb_request_free(req);
            return NULL;
        }
        if (req->n == cap) {
            cap = cap ? 2 * cap : 32;
            req->keys = realloc(req->keys, sizeof(char *) * (size_t)cap);
            req->values = realloc(req->values, sizeof(char *) * (size_t)cap);
            if (!req->keys || !req->values) {
                fputs("error: out of memory reading request.args\n", stderr);
                exit(2);
            }
        }
        req->keys[req->n] = copy(line, (size_t)(eq - line));
        req->values[req->n] = copy(eq + 1, len - (size_t)(eq - line) - 1);
        req->n++;
    }
    fclose(f);
    if (!req) return NULL;
    long version = tb_req_int(req, "contract", -1);
    if (version != TB_ENGINE_CONTRACT) {
        fprintf(stderr, "error: %s: contract=%ld, this engine speaks contract %d\n", path, version,
                TB_ENGINE_CONTRACT);
        tb_request_free(req);
        return NULL;
    }
    return req;
}

const char *tb_req_str(const tb_request *req, const char *key, const char *dflt) {
    for (int i = 0; req && i < req->n; i++)
        if (!strcmp(req->keys[i], key)) return req->values[i];
    return dflt;
}

long tb_req_int(const tb_request *req, const char *key, long dflt) {
    const char *s = tb_req_str(req, key, NULL);
    if (!s) return dflt;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end || errno) {
        fprintf(stderr, "error: request.args: %s=%s is not an integer\n", key, s);
        exit(2);
    }
    return v;
}

int tb_req_ints(const tb_request *req, const char *key, long *out, int max) {
    const char *s = tb_req_str(req, key, NULL);
    if (!s) return -1;
    int n = 0;
    while (*s) {
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || (*end && *end != ',')) {
            fprintf(stderr, "error: request.args: %s=%s is not a comma-separated list of integers\n", key,
                    tb_req_str(req, key, ""));
            exit(2);
        }
        if (n == max) return -1;
        out[n++] = v;
        s = *end ? end + 1 : end;
    }
    return n;
}

const char *const *tb_req_model_config(tb_request *req) {
    static const char prefix[] = "model.config.";
    if (req->config) return (const char *const *)req->config;
    int n = 0;
    if (!(req->config = calloc((size_t)req->n + 1, sizeof(char *)))) {
        fputs("error: out of memory reading request.args\n", stderr);
        exit(2);
    }
    for (int i = 0; i < req->n; i++) {
        if (strncmp(req->keys[i], prefix, sizeof prefix - 1)) continue;
        const char *key = req->keys[i] + sizeof prefix - 1;
        size_t len = strlen(key) + strlen(req->values[i]) + 2;
        if (!(req->config[n] = malloc(len))) {
            fputs("error: out of memory reading request.args\n", stderr);
            exit(2);
        }
        snprintf(req->config[n++], len, "%s=%s", key, req->values[i]);
    }
    return (const char *const *)req->config;
}

void tb_request_free(tb_request *req) {
    if (!req) return;
    for (int i = 0; i < req->n; i++) free(req->keys[i]), free(req->values[i]);
    for (int i = 0; req->config && req->config[i]; i++) free(req->config[i]);
    free(req->keys), free(req->values), free(req->config), free(req);
}

/* --- state_in -------------------------------------------------------------------------------------- */

int tb_state_in_find(const tb_request *req, const char *request_dir, tb_state_in *s) {
    memset(s, 0, sizeof *s);
    const char *file = tb_req_str(req, "state_in.file", NULL);
    if (!file) return 0;
    /* a plain name inside the request folder: never a path out of it, never a symlink */
    if (!*file || strchr(file, '/') || !strcmp(file, ".") || !strcmp(file, "..")) {
        fprintf(stderr, "error: request.args: state_in.file=%s is not a file name in the request folder\n", file);
        return -1;
    }
    long n_tokens = tb_req_int(req, "n_tokens", -1);
    s->positions = tb_req_int(req, "state_in.positions", -1);
    if (s->positions < 1 || s->positions >= n_tokens) {
        fprintf(stderr, "error: request.args: state_in.positions=%ld is outside 1 .. n_tokens - 1 = %ld\n", s->positions,
                n_tokens - 1);
        return -1;
    }
    int n = snprintf(s->path, sizeof s->path, "%s/%s", request_dir, file);
    struct stat st;
    if (n < 0 || (size_t)n >= sizeof s->path || lstat(s->path, &st) != 0 || !S_ISREG(st.st_mode)) {
        fprintf(stderr, "error: state_in: %s is not a regular file\n", s->path);
        return -1;
    }
    s->bytes = (size_t)st.st_size;
    return 1;
}

unsigned char *tb_state_in_read(const tb_state_in *s, size_t max_bytes) {
    if (s->bytes > max_bytes) {
        fprintf(stderr, "error: state_in: %s holds %zu bytes, more than this engine's caches hold (%zu)\n", s->path,
                s->bytes, max_bytes);
        return NULL;
    }
    unsigned char *buf = malloc(s->bytes ? s->bytes : 1);
    FILE *f = buf ? fopen(s->path, "rb") : NULL;
    if (!f || fread(buf, 1, s->bytes, f) != s->bytes || fgetc(f) != EOF) {
        fprintf(stderr, "error: state_in: cannot read %zu bytes of %s\n", s->bytes, s->path);
        if (f) fclose(f);
        free(buf);
        return NULL;
    }
    fclose(f);
    return buf;
}

/* `s` as a JSON string's contents: quotes, backslashes and control characters escaped. */
static void json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

static int write_status(const char *response_dir, const char *status, const char *reason) {
    char path[4096];
    snprintf(path, sizeof path, "%s/status.json", response_dir);
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "error: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    fprintf(f, "{\"contract\": %d, \"status\": \"%s\"", TB_ENGINE_CONTRACT, status);
    if (reason) {
        fputs(", \"reason\": ", f);
        json_string(f, reason);
    }
    fputs("}\n", f);
    return fclose(f) ? -1 : 0;
}

int tb_respond_ok(const char *response_dir) { return write_status(response_dir, "ok", NULL); }

int tb_respond_refused(const char *response_dir, const char *reason) {
    return write_status(response_dir, "refused", reason ? reason : "not supported");
}

/* --- timings ------------------------------------------------------------------------------------- */

typedef struct {
    char name[32];
    int rows, counted;
    double wall_s, cpu_s;
} call_timing;

static call_timing *g_calls;
static int g_n_calls, g_cap_calls;
static double g_begin_wall, g_begin_cpu;

static void add(const char *name, int rows, double wall_s, double cpu_s, int counted) {
    if (g_n_calls == g_cap_calls) {
        g_cap_calls = g_cap_calls ? 2 * g_cap_calls : 64;
        g_calls = realloc(g_calls, sizeof *g_calls * (size_t)g_cap_calls);
        if (!g_calls) {
            fputs("error: out of memory recording timings\n", stderr);
            exit(2);
        }
    }
    call_timing *c = &g_calls[g_n_calls++];
    snprintf(c->name, sizeof c->name, "%s", name);
    c->rows = rows, c->counted = counted, c->wall_s = wall_s, c->cpu_s = cpu_s;
}

void tb_timing_add(const char *name, int rows, double wall_s, double cpu_s) { add(name, rows, wall_s, cpu_s, 0); }

void tb_call_begin(void) {
    g_begin_cpu = cpu_seconds();
    g_begin_wall = now_seconds();
    tb_count_begin();
}

void tb_call_end(const char *name, int rows) {
    tb_count_end();
    double wall = now_seconds() - g_begin_wall, cpu = cpu_seconds() - g_begin_cpu;
    add(name, rows, wall, cpu, 1);
}

int tb_timings_write(const char *response_dir, const char *engine_name, const char *version,
                     const char *source_hash) {
    char path[4096], stamp[32];
    time_t now = time(NULL);
    struct tm utc;
    gmtime_r(&now, &utc);
    strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &utc);
    snprintf(path, sizeof path, "%s/timings.json", response_dir);
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "error: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    fprintf(f, "{\"contract\": %d, \"calls\": [", TB_ENGINE_CONTRACT);
    for (int i = 0; i < g_n_calls; i++) {
        fputs(i ? ", {\"name\": " : "{\"name\": ", f);
        json_string(f, g_calls[i].name);
        fprintf(f, ", \"rows\": %d, \"wall_s\": %.9g, \"cpu_s\": %.9g, \"counted\": %s}", g_calls[i].rows,
                g_calls[i].wall_s, g_calls[i].cpu_s, g_calls[i].counted ? "true" : "false");
    }
    fputs("], \"marks\": [", f);
    for (int i = 0, k = 0; i < g_n_calls; i++)
        if (g_calls[i].counted) {
            if (k++) fputs(", ", f);
            json_string(f, g_calls[i].name);
        }
    fprintf(f, "], \"reps\": 1, \"device_time\": \"%s\", \"engine\": {\"name\": ", stamp);
    json_string(f, engine_name);
    fputs(", \"version\": ", f);
    json_string(f, version);
    fputs(", \"source_hash\": ", f);
    json_string(f, source_hash);
    fputs("}}\n", f);
    return fclose(f) ? -1 : 0;
}
