/* safetensors.h: the JSON header is parsed by a small recursive-descent reader that accepts exactly
 * what the format uses (objects, strings, arrays of non-negative integers) and nothing else. */
#include "safetensors.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *start, *p, *end;
    char *err;
    size_t err_size;
    const char *path;
} reader;

static int fail(reader *r, const char *fmt, ...) {
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(r->err, r->err_size, "%s: not a valid safetensors file: %s", r->path, what);
    return -1;
}

static void skip_space(reader *r) {
    while (r->p < r->end && (*r->p == ' ' || *r->p == '\n' || *r->p == '\r' || *r->p == '\t')) r->p++;
}

static int expect(reader *r, char c) {
    skip_space(r);
    if (r->p >= r->end || *r->p != c) return fail(r, "expected '%c' at header byte %ld", c, (long)(r->p - r->start));
    r->p++;
    return 0;
}

static int peek(reader *r, char c) {
    skip_space(r);
    return r->p < r->end && *r->p == c;
}

/* A JSON string without \u escapes (names and dtypes are ASCII); malloc'd into *out. */
static int read_string(reader *r, char **out) {
    if (expect(r, '"')) return -1;
    const char *start = r->p;
    while (r->p < r->end && *r->p != '"') {
        if (*r->p == '\\' || (unsigned char)*r->p < 0x20) return fail(r, "escapes and control characters are not supported");
        r->p++;
    }
    if (r->p >= r->end) return fail(r, "unterminated string");
    size_t n = (size_t)(r->p - start);
    r->p++;
    *out = malloc(n + 1);
    if (!*out) return fail(r, "out of memory");
    memcpy(*out, start, n), (*out)[n] = '\0';
    return 0;
}

static int read_uint(reader *r, uint64_t *out) {
    skip_space(r);
    if (r->p >= r->end || *r->p < '0' || *r->p > '9') return fail(r, "expected a non-negative integer");
    uint64_t v = 0;
    while (r->p < r->end && *r->p >= '0' && *r->p <= '9') {
        if (v > (UINT64_MAX - 9) / 10) return fail(r, "integer too large");
        v = v * 10 + (uint64_t)(*r->p++ - '0');
    }
    *out = v;
    return 0;
}

/* [n, n, ...] into out (at most max); *count set. */
static int read_uints(reader *r, uint64_t *out, int max, int *count) {
    *count = 0;
    if (expect(r, '[')) return -1;
    if (peek(r, ']')) return r->p++, 0;
    do {
        if (*count == max) return fail(r, "more than %d entries in an array", max);
        if (read_uint(r, &out[(*count)++])) return -1;
    } while (peek(r, ',') && r->p++);
    return expect(r, ']');
}

static size_t dtype_size(const char *dtype) {
    if (!strcmp(dtype, "F32") || !strcmp(dtype, "I32")) return 4;
    if (!strcmp(dtype, "F16") || !strcmp(dtype, "BF16") || !strcmp(dtype, "I16")) return 2;
    if (!strcmp(dtype, "I8") || !strcmp(dtype, "U8") || !strcmp(dtype, "BOOL")) return 1;
    if (!strcmp(dtype, "F64") || !strcmp(dtype, "I64")) return 8;
    return 0;
}

static int read_tensor(reader *r, st_tensor *t, size_t data_bytes, const uint8_t *data) {
    int seen_dtype = 0, seen_shape = 0, seen_offsets = 0;
    uint64_t offsets[2] = {0, 0}, shape[ST_MAX_DIMS];
    if (expect(r, '{')) return -1;
    do {
        char *key;
        if (read_string(r, &key) || expect(r, ':')) return -1;
        int rc = 0, n = 0;
        if (!strcmp(key, "dtype") && !seen_dtype) {
            char *dtype;
            if (!(rc = read_string(r, &dtype))) {
                if (strlen(dtype) >= sizeof t->dtype || !dtype_size(dtype)) rc = fail(r, "%s: unknown dtype %s", t->name, dtype);
                else strcpy(t->dtype, dtype);
                free(dtype);
            }
            seen_dtype = 1;
        } else if (!strcmp(key, "shape") && !seen_shape) {
            rc = read_uints(r, shape, ST_MAX_DIMS, &n);
            t->ndim = n, seen_shape = 1;
        } else if (!strcmp(key, "data_offsets") && !seen_offsets) {
            rc = read_uints(r, offsets, 2, &n);
            if (!rc && n != 2) rc = fail(r, "%s: data_offsets must be [BEGIN, END]", t->name);
            seen_offsets = 1;
        } else {
            rc = fail(r, "%s: unexpected or repeated key \"%s\"", t->name, key);
        }
        free(key);
        if (rc) return -1;
    } while (peek(r, ',') && r->p++);
    if (expect(r, '}')) return -1;
    if (!seen_dtype || !seen_shape || !seen_offsets) return fail(r, "%s: needs dtype, shape and data_offsets", t->name);
    size_t count = 1;
    for (int i = 0; i < t->ndim; i++) t->shape[i] = (size_t)shape[i], count *= (size_t)shape[i];
    if (offsets[0] > offsets[1] || offsets[1] > data_bytes)
        return fail(r, "%s: bytes %llu..%llu lie outside the %zu bytes of data (a truncated file?)", t->name,
                    (unsigned long long)offsets[0], (unsigned long long)offsets[1], data_bytes);
    t->bytes = (size_t)(offsets[1] - offsets[0]);
    if (t->bytes != count * dtype_size(t->dtype))
        return fail(r, "%s: %zu bytes for %zu %s values", t->name, t->bytes, count, t->dtype);
    t->data = data + offsets[0];
    return 0;
}

static int read_metadata(reader *r, st_file *f) {
    if (expect(r, '{')) return -1;
    if (peek(r, '}')) return r->p++, 0;
    do {
        char **k = realloc(f->meta_keys, sizeof(char *) * (f->n_meta + 1));
        char **v = k ? realloc(f->meta_values, sizeof(char *) * (f->n_meta + 1)) : NULL;
        if (k) f->meta_keys = k;
        if (v) f->meta_values = v;
        if (!k || !v) return fail(r, "out of memory");
        f->meta_keys[f->n_meta] = f->meta_values[f->n_meta] = NULL;
        f->n_meta++;
        if (read_string(r, &f->meta_keys[f->n_meta - 1]) || expect(r, ':') ||
            read_string(r, &f->meta_values[f->n_meta - 1]))
            return -1;
    } while (peek(r, ',') && r->p++);
    return expect(r, '}');
}

int st_open(const char *path, st_file *f, char *err, size_t err_size) {
    memset(f, 0, sizeof *f);
    reader r = {NULL, NULL, NULL, err, err_size, path};
    FILE *fp = fopen(path, "rb");
    if (!fp) return snprintf(err, err_size, "cannot open weights file %s", path), -1;
    long size = fseek(fp, 0, SEEK_END) == 0 ? ftell(fp) : -1;
    if (size < 8 || fseek(fp, 0, SEEK_SET) != 0) {
        fclose(fp);
        return fail(&r, "%ld bytes is shorter than the 8-byte header length", size);
    }
    f->file = malloc((size_t)size);
    if (!f->file || fread(f->file, 1, (size_t)size, fp) != (size_t)size) {
        fclose(fp);
        st_close(f);
        return fail(&r, "cannot read %ld bytes", size);
    }
    fclose(fp);
    const uint8_t *bytes = f->file;
    uint64_t header = 0;
    for (int i = 7; i >= 0; i--) header = header << 8 | bytes[i];
    if (header > (uint64_t)size - 8) {
        st_close(f);
        return fail(&r, "the header says %llu bytes, the file has %ld after the length", (unsigned long long)header, size - 8);
    }
    const uint8_t *data = bytes + 8 + header;
    const size_t data_bytes = (size_t)size - 8 - (size_t)header;
    r.start = r.p = (const char *)bytes + 8, r.end = (const char *)data;
    size_t used = 0;
    int rc = expect(&r, '{');
    if (!rc && !peek(&r, '}')) {
        do {
            char *name;
            if ((rc = read_string(&r, &name)) || (rc = expect(&r, ':'))) {
                if (!rc) free(name);
                break;
            }
            if (!strcmp(name, "__metadata__")) {
                free(name);
                if ((rc = read_metadata(&r, f))) break;
                continue;
            }
            st_tensor *grown = realloc(f->tensors, sizeof(st_tensor) * (f->n_tensors + 1));
            if (!grown) {
                free(name);
                rc = fail(&r, "out of memory");
                break;
            }
            f->tensors = grown;
            st_tensor *t = &f->tensors[f->n_tensors++];
            memset(t, 0, sizeof *t);
            t->name = name;
            if (st_find(f, name) != t) {
                rc = fail(&r, "tensor %s appears twice", name);
                break;
            }
            if ((rc = read_tensor(&r, t, data_bytes, data))) break;
            used += t->bytes;
        } while (peek(&r, ',') && r.p++);
    }
    if (!rc) rc = expect(&r, '}');
    if (!rc) {
        skip_space(&r); /* the header may be padded with spaces */
        if (r.p != r.end) rc = fail(&r, "bytes after the header's JSON object");
    }
    if (!rc && used != data_bytes)
        rc = fail(&r, "the tensors cover %zu of the %zu data bytes", used, data_bytes);
    if (rc) st_close(f);
    return rc;
}

const st_tensor *st_find(const st_file *f, const char *name) {
    for (size_t i = 0; i < f->n_tensors; i++)
        if (f->tensors[i].name && !strcmp(f->tensors[i].name, name)) return &f->tensors[i];
    return NULL;
}

const char *st_meta(const st_file *f, const char *key) {
    for (size_t i = 0; i < f->n_meta; i++)
        if (f->meta_keys[i] && !strcmp(f->meta_keys[i], key)) return f->meta_values[i];
    return NULL;
}

void st_close(st_file *f) {
    for (size_t i = 0; i < f->n_tensors; i++) free(f->tensors[i].name);
    for (size_t i = 0; i < f->n_meta; i++) free(f->meta_keys[i]), free(f->meta_values[i]);
    free(f->tensors), free(f->meta_keys), free(f->meta_values), free(f->file);
    memset(f, 0, sizeof *f);
}
