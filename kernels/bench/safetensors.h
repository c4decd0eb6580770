/* A minimal, strict safetensors reader (https://huggingface.co/docs/safetensors): an 8-byte
 * little-endian header length N, N bytes of JSON {"NAME": {"dtype": "F32", "shape": [..],
 * "data_offsets": [BEGIN, END]}, ..., "__metadata__": {"KEY": "VALUE", ...}}, then the data, every
 * tensor's bytes at BEGIN..END of it. Anything else (other JSON, offsets outside the data, a size that
 * disagrees with the shape, bytes left over, a file shorter than its header says) is an error. */
#ifndef TB_SAFETENSORS_H
#define TB_SAFETENSORS_H

#include <stddef.h>

#define ST_MAX_DIMS 4

typedef struct {
    char *name;
    char dtype[8]; /* "F32", "F16", "I8", ... as written */
    int ndim;
    size_t shape[ST_MAX_DIMS];
    const void *data;
    size_t bytes;
} st_tensor;

typedef struct {
    void *file; /* the whole file */
    size_t n_tensors;
    st_tensor *tensors;
    size_t n_meta;
    char **meta_keys, **meta_values;
} st_file;

/* Reads and checks PATH; on any problem writes why into err (a sentence naming the file) and
 * returns nonzero. */
int st_open(const char *path, st_file *f, char *err, size_t err_size);
const st_tensor *st_find(const st_file *f, const char *name);
const char *st_meta(const st_file *f, const char *key);
void st_close(st_file *f);

#endif
